"""A checkpoint larger than this machine's memory, through `lorp run` with no memory setting.

    python benchmarks/big_model.py --json big.json [--page docs/results/big-model.md] [--shape 13b]
    python benchmarks/big_model.py --shape small --dir /tmp/big   # a 2-minute rehearsal

1. Writes a random-init Llama checkpoint block by block (one safetensors shard per block,
   bf16, std 0.02; the embeddings, final norm and head in their own shard): `13b` is
   Llama-2-13B's shape (40 blocks, d = 5120, MLP 13824, vocabulary 32000), about 26 GB,
   more than this machine's 23 GiB of RAM. Peak memory while writing: one block.
2. Runs `lorp run` on it in a subprocess (embedded local Ray, sqlite MLflow): calibration
   2 windows of 128 PTB tokens, ShortGPT and LoRP at 8 blocks, repair none and linear,
   perplexity on 2 windows of the held-out lee corpus, the speed pass on (the plan skips
   it for a streamed model and says why in every row), no checkpoints kept (four 21 GB
   variants do not fit this disk). The job decides by itself to stream: nothing in the
   spec mentions memory.
3. Reports the wall time of each stage from the job's own events, every row's perplexity
   and memory plan, and the peak anonymous memory of the job: RssAnon summed over the
   `lorp run` process and all its descendants (Ray's GCS, raylet, workers), sampled every
   0.25 s. File pages of the memory-mapped safetensors are not anonymous memory: the
   kernel can drop them, and does (the checkpoint is larger than RAM).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # lorp, pipeline and the tests' tiny-model builders

from benchmarks.pages import markers, replace_section, rule  # noqa: E402

SHAPES = {
    "13b": {
        "hidden_size": 5120,
        "intermediate_size": 13824,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "num_key_value_heads": 40,
        "vocab_size": 32000,
    },
    "small": {
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 12,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 12000,
    },
}
BEGIN, END = markers("bigmodel")
GIB = 1024**3


class Draw:
    """The checkpoint's bf16 tensors, drawn from one seeded generator in the order asked
    for: weights of std 0.02, and norm weights (ones) of width `d`."""

    def __init__(self, seed: int, d: int) -> None:
        self.g, self.d = torch.Generator().manual_seed(seed), d

    def w(self, *size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=self.g) * 0.02).to(torch.bfloat16)

    def ones(self) -> torch.Tensor:
        return torch.ones(self.d, dtype=torch.bfloat16)


def shard_tensors(i: int, shape: dict[str, int], draw: Draw) -> dict[str, torch.Tensor]:
    """Shard `i`: block `i`'s tensors, or past the last block the embeddings, the final
    norm and the head."""
    d, m = shape["hidden_size"], shape["intermediate_size"]
    if i == shape["num_hidden_layers"]:
        v = shape["vocab_size"]
        return {
            "model.embed_tokens.weight": draw.w(v, d),
            "model.norm.weight": draw.ones(),
            "lm_head.weight": draw.w(v, d),
        }
    p = f"model.layers.{i}."
    return {
        p + "self_attn.q_proj.weight": draw.w(d, d),
        p + "self_attn.k_proj.weight": draw.w(d, d),
        p + "self_attn.v_proj.weight": draw.w(d, d),
        p + "self_attn.o_proj.weight": draw.w(d, d),
        p + "mlp.gate_proj.weight": draw.w(m, d),
        p + "mlp.up_proj.weight": draw.w(m, d),
        p + "mlp.down_proj.weight": draw.w(d, m),
        p + "input_layernorm.weight": draw.ones(),
        p + "post_attention_layernorm.weight": draw.ones(),
    }


def write_checkpoint(out: Path, shape: dict[str, int], seed: int = 0) -> float:
    """A random-init bf16 Llama checkpoint, one shard per block; returns its bytes."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from tests.helpers.tiny_models import ptb_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.for_model(
        "llama",
        **shape,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        dtype="bfloat16",
    )
    n, draw = shape["num_hidden_layers"], Draw(seed, shape["hidden_size"])
    weight_map, total = {}, 0
    for i in range(n + 1):
        name = f"model-{i + 1:05d}-of-{n + 1:05d}.safetensors"
        tensors = shard_tensors(i, shape, draw)
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map |= dict.fromkeys(tensors, name)
        del tensors
        print(f"wrote shard {i + 1}/{n + 1}", file=sys.stderr, flush=True)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.save_pretrained(out)
    ptb_tokenizer().save_pretrained(out)
    return float(total)


def job_spec(root: Path, model: Path, memory_gib: float | None) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if memory_gib is not None:  # a rehearsal on a small shape: force the streamed path
        worker = {"memory_gib": memory_gib}
        extra = {"resources": {"capture": worker, "grid": worker}}
    return extra | {
        "name": "big",
        "output_dir": str(root / "run"),
        "cache_dir": str(root / "cache"),
        "models": [{"ref": str(model), "name": "llama-random"}],
        "budgets": [8],
        "methods": [{"name": "shortgpt"}, {"name": "lorp"}],
        "repair": ["none", "linear"],
        "calibration": {
            "dataset": "ptb",
            "samples": 2,
            "seq_len": 128,
            "shards": 1,
            "batch_size": 2,
        },
        "evaluation": {
            "perplexity": ["lee"],
            "seq_len": 128,
            "max_windows": 2,
            "batch_size": 2,
            "speed": True,
        },
        "checkpoints": "none",
        "ray": {"num_cpus": 2},
    }


def rss_anon(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class TreeSampler(threading.Thread):
    """Peak of RssAnon summed over a process and its descendants, and what each process
    held at that moment (by its title: Ray names a busy worker after its task)."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.done = pid, 0, threading.Event()
        self.at_peak: list[tuple[str, int]] = []

    def run(self) -> None:
        import psutil

        root = psutil.Process(self.pid)
        while not self.done.is_set():
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            sizes = [(p, rss_anon(p.pid)) for p in procs]
            total = sum(n for _, n in sizes)
            if total > self.peak:
                self.peak = total
                self.at_peak = sorted(
                    ((_title(p), n) for p, n in sizes if n > 64 * 1024**2), key=lambda x: -x[1]
                )
            time.sleep(0.25)


def _title(p: Any) -> str:
    try:
        cmd = p.cmdline()
    except Exception:  # noqa: BLE001 - gone between listing and reading
        return "?"
    first = cmd[0] if cmd else p.name()
    if first.startswith("ray::"):
        return first.split()[0]
    return "lorp run (driver)" if "lorp" in " ".join(cmd[:2]) else Path(first).name


def run_job(spec_path: Path) -> tuple[float, TreeSampler, str]:
    lorp = shutil.which("lorp") or str(Path(sys.executable).parent / "lorp")
    start = time.time()
    proc = subprocess.Popen([lorp, "run", str(spec_path)], stderr=subprocess.PIPE, text=True)
    sampler = TreeSampler(proc.pid)
    sampler.start()
    lines = []
    assert proc.stderr is not None
    for line in proc.stderr:
        lines.append(line)
        if "Loading weights" not in line:
            print(line, end="", file=sys.stderr, flush=True)
    proc.wait()
    sampler.done.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"lorp run failed ({proc.returncode}):\n{''.join(lines[-30:])}")
    return time.time() - start, sampler, "".join(lines)


def stage_times(run_dir: Path) -> dict[str, float]:
    from pipeline.events.timeline import spans_of

    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x]
    out: dict[str, float] = {}
    for s in spans_of(events):
        out[s["stage"]] = out.get(s["stage"], 0.0) + float(s["end"]) - float(s["start"])
    return {k: round(v, 1) for k, v in sorted(out.items())}


def measure(root: Path, shape_name: str, memory_gib: float | None) -> dict[str, Any]:
    from pipeline.catalog.table import read_catalog

    model = root / "model"
    t0 = time.time()
    if not (model / "config.json").is_file():
        size = write_checkpoint(model, SHAPES[shape_name])
        write_s = time.time() - t0
    else:  # written by an earlier run (--keep): its time from the shards' mtimes
        shards = sorted(model.glob("*.safetensors"), key=lambda f: f.stat().st_mtime)
        size = float(sum(f.stat().st_size for f in shards))
        per = (shards[-1].stat().st_mtime - shards[0].stat().st_mtime) / (len(shards) - 1)
        write_s = shards[-1].stat().st_mtime - shards[0].stat().st_mtime + per
    spec_path = root / "big.yaml"
    spec_path.write_text(yaml.safe_dump(job_spec(root, model, memory_gib)))
    wall, sampler, _ = run_job(spec_path)
    rows = read_catalog(root / "run" / "catalog")
    mem_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "shape": shape_name,
        "checkpoint_gb": round(size / 1e9, 2),
        "machine_ram_gib": round(mem_total / GIB, 1),
        "write_s": round(write_s, 1),
        "job_s": round(wall, 1),
        "peak_rss_anon_gib": round(sampler.peak / GIB, 2),
        "at_peak_gib": [[title, round(n / GIB, 2)] for title, n in sampler.at_peak],
        "stages_s": stage_times(root / "run"),
        "rows": [
            {
                "variant": r["method_label"] if r["method"] != "dense" else "dense",
                "ppl_lee": r.get("ppl_lee"),
                "memory_plan": json.loads(r["memory_plan"]) if r.get("memory_plan") else None,
                "speed_skipped": r.get("speed_skipped"),
                "seconds": r.get("point_s") or r.get("seconds"),
            }
            for r in rows
        ],
    }


def table(result: dict[str, Any]) -> str:
    plan = next((r["memory_plan"] for r in result["rows"] if r["memory_plan"]), {}) or {}
    modes = ", ".join(
        f"{k} {v['mode']} ({v['worker_gib']:.1f} GiB per worker)" for k, v in plan.items()
    )
    lines = [
        f"Random-init Llama, `{result['shape']}` shape: {result['checkpoint_gb']} GB of bf16 "
        f"safetensors on a machine with {result['machine_ram_gib']} GiB of RAM "
        f"(`python benchmarks/big_model.py`). Plan: {modes}.",
        "",
        "| measure | value |",
        rule(2, tight=True),
        f"| writing the checkpoint (block by block) | {result['write_s']:.0f} s |",
        f"| `lorp run`, end to end | {result['job_s']:.0f} s |",
        f"| peak anonymous memory of the job (RssAnon, all its processes) | "
        f"{result['peak_rss_anon_gib']:.2f} GiB |",
    ]
    held = ", ".join(f"{t} {g:.2f}" for t, g in result.get("at_peak_gib", []))
    lines.append(f"| at the peak, by process (GiB) | {held} |")
    for stage, s in result["stages_s"].items():
        lines.append(f"| stage `{stage}` (summed over its spans) | {s:.0f} s |")
    lines += ["", "| variant | ppl on lee (2 windows) |", rule(2, tight=True)]
    for r in result["rows"]:
        lines.append(f"| {r['variant']} | {r['ppl_lee']:.4g} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="13b")
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/lorp-big-model"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--page", type=Path)
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    ap.add_argument("--memory-gib", type=float, help="worker memory (rehearsals only)")
    args = ap.parse_args()
    root = args.dir / args.shape
    for part in ("run", "cache"):  # a fresh job: nothing from an earlier run's cache
        shutil.rmtree(root / part, ignore_errors=True)
    try:
        result = measure(root, args.shape, args.memory_gib)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if args.page:
        replace_section(args.page, BEGIN, END, table(result), "Measured")


if __name__ == "__main__":
    main()
