"""Benchmarks: what the product exists for, measured side by side in one run.

    python benchmarks/run.py --quick --json OUT.json [--page docs/results/benchmarks.md]
    python benchmarks/run.py --quick --skip capture memory select eval --tokens 16x512
    python benchmarks/run.py --tiny --json OUT.json   # the same code on a tiny model, seconds

Targets (ratios, each measured in this run; medians of >= 5 repetitions after a warm-up):
1. capture_overhead   S over T tokens / bare decoder-stack forward (no hooks, no lm_head)
                      over the same tokens: <= 1.05 (smollm2-135m, and a random d=2048 model)
2. vs_usual_speedup   the usual way (full causal LM, output_hidden_states, normalise in the
                      activation dtype, stack, one einsum) / capture_stats: >= 1.15, equal S
3. memory_ratio       peak RSS capturing 128 samples / 32 samples: <= 1.10
4. ray_ratio          S through the pipeline's Ray actors (2 shards, 1 thread each) / one
                      process with 2 threads, model load excluded: <= 1.15
5. select_ms          every registered method at N = 32, 64, 128: LoRP at 128 < 50 ms
5b. repair_ratio      the linear repair's sums for every run that LoRP, ShortGPT and
                      Streamline select at 4 and 8 blocks (deduplicated: one pass) / the
                      capture pass over the same tokens: <= 1.5 (smollm2-135m)
6. evaluation         perplexity tokens/s, vLLM vs transformers, one pruned checkpoint; and
                      pruned vs dense prefill latency against the fraction of blocks removed

`--tiny` runs every section on a random 10-block model over the PTB vocabulary (d = 64; the
"wide" model d = 128, 2 blocks), 4 x 32 calibration tokens, one repetition, one torch
thread, and no vLLM: the test suite's check that the script runs, not a result.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lorp import SimilarityStats, available_methods, get_method, select_layers  # noqa: E402
from lorp.locality.capture import capture_stats  # noqa: E402
from lorp.locality.clustering import cluster_layers  # noqa: E402
from lorp.models.architectures import decoder_stack  # noqa: E402

MODEL = "smollm2-135m"
TINY_BLOCKS = 10


def median_time(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def calibration_tokens(tokenizer: Any, samples: int, seq_len: int) -> torch.Tensor:
    from lorp.data.corpora import load_corpus, tokenize_documents
    from lorp.data.windows import calibration_windows

    docs = tokenize_documents(tokenizer, load_corpus("ptb", "train"))
    return calibration_windows(docs, samples, seq_len, seed=0)


def batches_of(windows: torch.Tensor, batch: int) -> list[torch.Tensor]:
    return [windows[i : i + batch] for i in range(0, len(windows), batch)]


# -- 1 and 2: capture cost -------------------------------------------------------------------


def bare_forward(model: Any, batches: list[torch.Tensor]) -> None:
    stack = decoder_stack(model)
    with torch.inference_mode():
        for b in batches:
            stack(input_ids=b, use_cache=False)


def usual_way(model: Any, batches: list[torch.Tensor], n_blocks: int) -> np.ndarray:
    """How S is usually computed: full LM with lm_head, all hidden states kept, normalised
    in the activation dtype, stacked, one einsum."""
    total, count = None, 0
    with torch.inference_mode():
        for b in batches:
            hs = model(input_ids=b, output_hidden_states=True, use_cache=False).hidden_states
            states = torch.stack(hs[:n_blocks])  # block inputs: [N, B, T, d]
            states = states / states.norm(dim=-1, keepdim=True)
            g = torch.einsum("ibtd,jbtd->ij", states, states).double()
            total = g if total is None else total + g
            count += b.numel()
    return (total / count).numpy()


def capture_benchmarks(
    model: Any, batches: list[torch.Tensor], repeats: int, label: str
) -> dict[str, float]:
    n = int(model.config.num_hidden_layers)
    t_bare = median_time(lambda: bare_forward(model, batches), repeats)
    t_capture = median_time(lambda: capture_stats(model, batches, progress=False), repeats)
    t_usual = median_time(lambda: usual_way(model, batches, n), repeats)
    ours = capture_stats(model, batches, progress=False).matrix()
    usual = usual_way(model, batches, n)
    return {
        f"{label}.bare_s": t_bare,
        f"{label}.capture_s": t_capture,
        f"{label}.usual_s": t_usual,
        f"{label}.capture_overhead": t_capture / t_bare,
        f"{label}.vs_usual_speedup": t_usual / t_capture,
        f"{label}.s_max_abs_diff_vs_usual": float(np.abs(ours - usual).max()),
    }


def wide_random_model(d: int = 2048, layers: int = 4) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama", hidden_size=d, intermediate_size=4 * d, num_hidden_layers=layers,
        num_attention_heads=d // 128, num_key_value_heads=d // 128, head_dim=128,
        vocab_size=32000, max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


# -- 5b: the linear repair's statistics pass -----------------------------------------------


def repair_benchmarks(model: Any, batches: list[torch.Tensor], repeats: int) -> dict[str, float]:
    """One pass of repair sums for every run the grid's selections need, against the S
    capture over the same tokens; the sums' memory at this width and at d = 4096."""
    from lorp.repair.capture import capture_repair_stats
    from lorp.repair.stats import bytes_per_pass, contiguous_runs

    stats = capture_stats(model, batches, progress=False)
    n = stats.n_blocks
    runs = sorted(
        {
            run
            for method in ("lorp", "shortgpt", "streamline")
            for budget in (4, 8)
            for run in contiguous_runs(select_layers(stats, budget, method).layers, n)
        }
    )
    d = int(model.config.hidden_size)
    t_capture = median_time(lambda: capture_stats(model, batches, progress=False), repeats)
    t_repair = median_time(
        lambda: capture_repair_stats(model, batches, runs, progress=False), repeats
    )
    return {
        "repair_runs": len(runs),
        "repair_starts": len({s for s, _ in runs}),
        "repair_capture_s": t_capture,
        "repair_pass_s": t_repair,
        "repair_ratio": t_repair / t_capture,
        "repair_sums_mib": bytes_per_pass(runs, d) / 2**20,
        "repair_sums_gib_at_d4096": bytes_per_pass(runs, 4096) / 2**30,
    }


def tiny_model(folder: Path) -> str:
    """`--tiny`'s model: a random Llama over the PTB vocabulary, with its tokenizer (the
    tests' builder), saved under `folder`."""
    from tests.helpers.tiny_models import save_tiny_ptb

    return str(save_tiny_ptb("llama", folder / "tiny", n_blocks=TINY_BLOCKS))


# -- 3: memory does not grow with the calibration set -----------------------------------------

MEMORY_CHILD = """
import resource, sys, torch
sys.path.insert(0, {root!r})
from lorp.models.loading import load_model
from lorp.locality.capture import capture_stats
from benchmarks.run import calibration_tokens, batches_of
torch.set_num_threads(2)
lm = load_model({model!r})
w = calibration_tokens(lm.tokenizer, {samples}, {seq_len})
capture_stats(lm.model, batches_of(w, 4), progress=False)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def peak_rss_kib(samples: int, seq_len: int, model: str = MODEL) -> int:
    code = MEMORY_CHILD.format(root=str(ROOT), model=model, samples=samples, seq_len=seq_len)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


# -- 4: Ray costs little ------------------------------------------------------------------------


def ray_benchmark(model_path: str, windows: torch.Tensor, repeats: int) -> dict[str, float]:
    import ray

    from pipeline.cluster.model_source import ModelSource
    from pipeline.messages import CaptureTask
    from pipeline.spec.resources import Resources
    from pipeline.stages.capture import CaptureWorker, tree_reduce

    # A fresh local Ray of 2 CPUs, never a cluster this machine already runs.
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        start = time.perf_counter()
        model = ModelSource(model_path, "dir")
        task = CaptureTask(model, "cal", Resources(num_cpus=1), batch_size=4)
        workers = [CaptureWorker.options(num_cpus=1).remote(task) for _ in range(2)]
        ray.get([w.ready.remote() for w in workers])
        load_s = time.perf_counter() - start
        shards = [ray.put(part) for part in np.array_split(windows.numpy(), 2)]

        def run() -> None:
            pairs = zip(workers, shards, strict=True)
            tree_reduce([w.capture.remote(s, f"shard-{i}") for i, (w, s) in enumerate(pairs)])

        t_ray = median_time(run, repeats)
    finally:
        ray.shutdown()
    return {"ray_load_s": load_s, "ray_capture_s": t_ray}


# -- 5: selection is free -----------------------------------------------------------------------


def selection_benchmarks(repeats: int) -> dict[str, float]:
    out = {}
    rng = np.random.default_rng(0)
    for n in (32, 64, 128):
        s = SimilarityStats(n)
        x = np.cumsum(rng.normal(size=(n + 1, 64, 96)) * 0.3, axis=0) + 1.0
        s.update(x)
        budget = n // 4
        for method in available_methods():
            registered = get_method(method)
            # Scoring models (loss-guided) or repairs (`window`) is not a selection cost.
            if registered.needs_evaluator or registered.needs_repair:
                continue
            t = median_time(lambda m=method, s=s, b=budget: select_layers(s, b, m), repeats)
            out[f"select_ms.{method}.n{n}"] = t * 1000
        S = s.matrix()
        out[f"select_ms.spectral_clustering_k4.n{n}"] = (
            median_time(lambda S=S: cluster_layers(S, 4), repeats) * 1000
        )
    return out


# -- 6: evaluation throughput and speed-up ----------------------------------------------------


VLLM_CHILD = """
import json, sys, time
sys.path.insert(0, {root!r})
if __name__ == "__main__":
    from pipeline.evaluation.vllm_engine import make_engine, perplexity_vllm
    windows = json.load(open({windows!r}))
    engine = make_engine({ckpt!r}, max_model_len={seq_len} + 8)
    perplexity_vllm(engine, windows[:2])
    t = time.perf_counter(); ppl = perplexity_vllm(engine, windows); dt = time.perf_counter() - t
    print(json.dumps({{"ppl": ppl, "seconds": dt}}))
"""


def evaluation_benchmarks(quick: bool, model: str = MODEL, tiny: bool = False) -> dict[str, float]:
    """Prefill speed-ups at 10, 20 and 30% of the blocks removed; perplexity throughput of
    one pruned checkpoint (3 blocks removed), transformers and (unless `tiny`) vLLM."""
    from lorp.data.corpora import load_corpus, tokenize_documents
    from lorp.data.windows import eval_windows
    from lorp.models.loading import load_model
    from lorp.models.perplexity import perplexity
    from lorp.models.surgery import drop_layers, save_pruned
    from pipeline.evaluation.speed import interleaved_speedup

    out: dict[str, float] = {}
    lm = load_model(model)
    n = lm.n_blocks
    seq = 32 if tiny else 256 if quick else 512
    for frac in (0.1, 0.2, 0.3):  # dense and pruned interleaved in this one process
        k = round(frac * n)
        m = load_model(model).model
        drop_layers(m, list(range(n - 1 - k, n - 1)))
        # a tiny model's 2 ms forwards take more pairs for as steady a median
        timing = interleaved_speedup(lm.model, m, seq, pairs=25 if tiny else 7)
        out[f"prefill_speedup.removed_{k}_of_{n}"] = timing["speedup"]
        out[f"prefill_speedup_std.removed_{k}_of_{n}"] = timing["speedup_std"]
        del m
    drop_layers(lm.model, list(range(n - 4, n - 1)) if tiny else [20, 21, 22])
    with tempfile.TemporaryDirectory(prefix="lorp-bench-") as tmp:
        ckpt = save_pruned(lm.model, lm.tokenizer, Path(tmp) / "pruned", {})
        ids = tokenize_documents(lm.tokenizer, load_corpus("ptb", "test"))[0]
        windows = eval_windows(ids, seq, max_windows=2 if tiny else 8 if quick else 32)
        tokens = windows.numel()
        perplexity(lm.model, windows[:1])
        t = time.perf_counter()
        ppl_hf = perplexity(lm.model, windows, batch_size=4)
        out["hf_tokens_per_s"] = tokens / (time.perf_counter() - t)
        out["hf_ppl"] = ppl_hf
        if not tiny:
            out |= vllm_throughput(Path(tmp), ckpt, windows, seq)
    return out


def vllm_throughput(tmp: Path, ckpt: Path, windows: torch.Tensor, seq: int) -> dict[str, Any]:
    """Perplexity tokens/s of the pruned checkpoint under vLLM, in a child process."""
    out: dict[str, Any] = {}
    tokens = windows.numel()
    try:
        import vllm  # noqa: F401

        (tmp / "w.json").write_text(json.dumps(windows.tolist()))
        code = VLLM_CHILD.format(
            root=str(ROOT), windows=str(tmp / "w.json"), ckpt=str(ckpt), seq_len=seq
        )
        script = tmp / "vllm_child.py"
        script.write_text(code)
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="ERROR")
        res = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900
        )
        r = json.loads(res.stdout.strip().splitlines()[-1])
        out["vllm_tokens_per_s"] = tokens / r["seconds"]
        out["vllm_ppl"] = r["ppl"]
    except (ImportError, subprocess.SubprocessError, ValueError, IndexError, KeyError) as exc:
        out["vllm_error"] = str(exc)[:200]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="under 5 minutes on 2 cores")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="a tiny random model, 4x32 tokens, one repetition, no vLLM: the test suite's run",
    )
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--page", help="rewrite the benchmark table in this results page")
    parser.add_argument(
        "--skip",
        nargs="*",
        default=[],
        help="sections to skip: capture memory ray select repair eval",
    )
    parser.add_argument(
        "--tokens",
        help="calibration SAMPLESxSEQ_LEN (default 16x256 with --quick, 4x32 with --tiny, "
        "else 32x512)",
    )
    args = parser.parse_args(argv)
    samples, seq_len = (4, 32) if args.tiny else (16, 256) if args.quick else (32, 512)
    if args.tokens:
        try:
            samples, seq_len = (int(v) for v in args.tokens.lower().split("x"))
        except ValueError:
            parser.error(f"--tokens: expected SAMPLESxSEQ_LEN such as 16x512, got {args.tokens!r}")
    torch.set_num_threads(1 if args.tiny else 2)  # a tiny model's ops are too small to share
    figures: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        + ("CUDA " + torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"),
        "quick": args.quick,
        "tokens": samples * seq_len,
    }
    if args.tiny:
        figures["tiny"] = True
    with tempfile.TemporaryDirectory(prefix="lorp-bench-model-") as tmp:
        model = tiny_model(Path(tmp)) if args.tiny else MODEL
        figures |= measure(args, model, samples, seq_len)
    table = render_table(figures)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2, sort_keys=True))
    violations = speedup_violations(figures)
    for line in violations:
        print(f"check failed: {line}", file=sys.stderr)
    if args.page and not violations:
        write_page(Path(args.page), table, args)
    return 1 if violations else 0


def measure(args: argparse.Namespace, model: str, samples: int, seq_len: int) -> dict[str, Any]:
    """Every section not in `args.skip`, on `model` (an alias or a checkpoint directory)."""
    from lorp.models.loading import load_model

    repeats = 1 if args.tiny else 5
    figures: dict[str, Any] = {}
    lm = load_model(model)
    windows = calibration_tokens(lm.tokenizer, samples, seq_len)
    batches = batches_of(windows, 4)
    if "capture" not in args.skip:
        label = "tiny" if args.tiny else "smollm2"
        figures |= capture_benchmarks(lm.model, batches, repeats, label)
        # d = 2048 as the target asks; fewer blocks and tokens in --quick keep it in budget.
        d = 128 if args.tiny else 2048
        wide = wide_random_model(d, layers=2 if args.quick or args.tiny else 4)
        wide_tokens = (2, seq_len) if args.tiny else (2, 128) if args.quick else (4, seq_len)
        small = args.quick or args.tiny
        wide_batches = batches_of(torch.randint(0, 32000, wide_tokens), 1 if small else 2)
        figures |= capture_benchmarks(wide, wide_batches, repeats, f"wide_d{d}")
        del wide
        both = (label, f"wide_d{d}")
        figures["capture_overhead"] = max(figures[f"{x}.capture_overhead"] for x in both)
        figures["vs_usual_speedup"] = min(figures[f"{x}.vs_usual_speedup"] for x in both)
        figures["s_max_abs_diff_vs_usual"] = max(
            figures[f"{x}.s_max_abs_diff_vs_usual"] for x in both
        )
    if "memory" not in args.skip:
        small_kib, large_kib = peak_rss_kib(32, seq_len, model), peak_rss_kib(128, seq_len, model)
        figures |= {
            "peak_rss_mib_32": small_kib / 1024,
            "peak_rss_mib_128": large_kib / 1024,
            "memory_ratio": large_kib / small_kib,
        }
    if "ray" not in args.skip:
        t_local = median_time(lambda: capture_stats(lm.model, batches, progress=False), repeats)
        figures |= ray_benchmark(str(lm.path), windows, repeats)
        figures["local_capture_s"] = t_local
        figures["ray_ratio"] = figures["ray_capture_s"] / t_local
    if "select" not in args.skip:
        figures |= selection_benchmarks(repeats)
        figures["select_ms_lorp_n128"] = figures["select_ms.lorp.n128"]
    if "repair" not in args.skip:
        figures |= repair_benchmarks(lm.model, batches, repeats)
    if "eval" not in args.skip:
        figures |= evaluation_benchmarks(args.quick, model, args.tiny)
    return figures


TARGETS = [
    (
        "capture_overhead",
        "capture / bare decoder forward (worst of smollm2, d=2048)",
        "<= 1.05",
        lambda v: v <= 1.05,
    ),
    (
        "vs_usual_speedup",
        "usual way / capture_stats (worst of the two)",
        ">= 1.15",
        lambda v: v >= 1.15,
    ),
    (
        "s_max_abs_diff_vs_usual",
        "max abs difference of S vs the usual way",
        "<= 1e-5",
        lambda v: v <= 1e-5,
    ),
    ("memory_ratio", "peak RSS 128 samples / 32 samples", "<= 1.10", lambda v: v <= 1.10),
    (
        "ray_ratio",
        "Ray actors (2 x 1 thread) / one process (2 threads)",
        "<= 1.15",
        lambda v: v <= 1.15,
    ),
    ("select_ms_lorp_n128", "LoRP selection at N = 128 (ms, median)", "< 50", lambda v: v < 50),
    (
        "repair_ratio",
        "repair sums for every selected run (one pass) / capture pass",
        "<= 1.5",
        lambda v: v <= 1.5,
    ),
    ("repair_sums_mib", "memory of those sums at smollm2's d = 576 (MiB)", "-", None),
    ("repair_sums_gib_at_d4096", "the same runs' sums at d = 4096 (GiB)", "-", None),
    ("hf_tokens_per_s", "perplexity tokens/s, transformers", "-", None),
    ("vllm_tokens_per_s", "perplexity tokens/s, vLLM", "-", None),
]


SPEEDUP_SLACK = 1.05  # a measured speed-up more than 5% above N/(N-k) is a broken timing


def speedup_blocks(what: str) -> tuple[int, int]:
    """'removed_3_of_30' -> (3, 30)."""
    parts = what.split("_")
    return int(parts[1]), int(parts[3])


def speedup_violations(f: dict[str, Any]) -> list[str]:
    """Measured speed-ups above what removing k of N blocks allows (plus 5%)."""
    bad = []
    for key in sorted(k for k in f if k.startswith("prefill_speedup.")):
        k, n = speedup_blocks(key.split(".", 1)[1])
        if f[key] > n / (n - k) * SPEEDUP_SLACK:
            bad.append(f"{key} = {f[key]:.3f}x exceeds N/(N-k) = {n / (n - k):.3f}x by > 5%")
    return bad


def render_table(f: dict[str, Any]) -> str:
    lines = ["| figure | value | target | met |", "| --- | --- | --- | --- |"]
    for key, label, target, ok in TARGETS:
        if key not in f:
            continue
        v = f[key]
        met = "-" if ok is None else ("yes" if ok(v) else "**no**")
        lines.append(f"| {label} (`{key}`) | {v:.4g} | {target} | {met} |")
    for key in sorted(k for k in f if k.startswith("prefill_speedup.")):
        what = key.split(".", 1)[1]
        k, n = speedup_blocks(what)
        bound = n / (n - k)
        std = f.get(f"prefill_speedup_std.{what}", 0.0)
        met = "yes" if f[key] <= bound * SPEEDUP_SLACK else "**no: above the bound**"
        lines.append(
            f"| pruned vs dense prefill, {what.replace('_', ' ')} (interleaved, median) "
            f"| {f[key]:.3f}x ± {std:.3f} | <= N/(N-k) = {bound:.3f}x | {met} |"
        )
    tiny = " (tiny random model: the suite's check, not a result)" if f.get("tiny") else ""
    lines.append(f"\nMeasured on {f['machine']}; {f['tokens']} calibration tokens{tiny}.")
    return "\n".join(lines)


def write_page(path: Path, table: str, args: argparse.Namespace) -> None:
    begin, end = "<!-- benchmarks:begin -->", "<!-- benchmarks:end -->"
    cmd = (
        "python benchmarks/run.py"
        + (" --quick" if args.quick else "")
        + (" --tiny" if args.tiny else "")
        + " --json bench.json --page docs/results/benchmarks.md"
    )
    replace_section(path, begin, end, f"Reproduce: `{cmd}`\n\n{table}", "Benchmarks")


def replace_section(path: Path, begin: str, end: str, body: str, heading: str) -> None:
    """Put `body` between the `begin`/`end` markers of `path`, or append it under `heading`."""
    text = path.read_text()
    block = f"{begin}\n{body}\n{end}"
    if begin in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :]
    else:
        text += f"\n## {heading}\n\n{block}\n"
    path.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
