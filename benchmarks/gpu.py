"""The GPU path of `lorp/`, measured in one call on a lent device (one H200 here).

    python3 benchmarks/gpu.py --json "$OUT/gpu.json"          # on the device: ~5 min
    python benchmarks/gpu.py --device cpu --tiny --json f.json # the same code, seconds
    python benchmarks/gpu.py --from-json gpu.json --page docs/results/gpu.md  # the page
    python3 benchmarks/gpu.py --shapes --no-streamed --no-serving --experts  # 7 alone

For each model shape, with random weights built on the spot (no download; nothing but
torch, transformers and `lorp/`, which is all the device image has of ours):
1. capture_overhead  `capture_stats` / a bare decoder-stack forward over the same tokens
                     (bf16, 64 x 2048 random ids); tokens/s and peak GPU memory of each.
2. bf16 vs fp32      S captured from the bf16 model against S from the fp32 weights it was
                     cast from, on the first `--compare` windows: max |dS|, and whether
                     LoRP selects the same blocks at 4 and 8.
3. repair pass       `capture_repair_stats` for the runs of LoRP's 8-block selection over
                     the same tokens / the capture pass (target <= 1.5), its peak memory,
                     the memory of its d x d float64 sums, and the time of the solves
                     (a normed fit capped at --normed-rounds, each one d x d SVD).
4. prune             selection, fold + surgery, and `save_pretrained` of the pruned
                     model, timed; its forward tokens/s against dense, beside N/(N-k).
6. streamed          (`--streamed`, on by default) the llama-8b shape saved as a bf16
                     checkpoint, S and perplexity in memory, then with the process's device
                     memory capped below the model's size (`set_per_process_memory_fraction`)
                     streamed a module at a time from the files (`lorp.models.streaming`): time,
                     peak memory, and |dS|, |d ppl| against the in-memory figures.
5. serving           (where vLLM is installed; `--serving`, on by default on CUDA) the
                     8B Llama shape in bf16, dense and with 8 and 12 blocks removed, each
                     served by its own vLLM engine with `pipeline.evaluation.serving`
                     (closed loop at --serve-concurrency, fixed synthetic prompts, EOS
                     ignored): output tokens/s, TTFT, TPOT, and the speed-up over dense
                     with its 95% interval, beside N/(N-k). The H200 image lent here has no
                     vLLM: the report then says so instead of a figure.
7. experts           (where vLLM is installed; `--experts`, on by default on CUDA) a random
                     Qwen3-MoE (Qwen3-30B-A3B's layer shape, 48 experts top-8, 16 blocks)
                     in bf16, dense and without 25% / 50% of every layer's experts
                     (`--expert-fractions`, cut on files by `lorp`), each served by its own
                     vLLM engine (`benchmarks/gpu_experts.py`): prefill and decode tokens/s,
                     TPOT, checkpoint size and KV cache tokens, beside the bounds (the
                     active FLOPs per token do not change: prefill 1x; decode at most the
                     ratio of the weight bytes a step reads).

Shapes: an 8B Llama (d 4096, 32 blocks, 32 / 8 heads, 14336, vocab 128256) and a Gemma 3
4B (d 2560, 34 blocks, 8 / 4 heads of 256, 10240, vocab 262144). Gemma 3 because it is the
other code path of everything here: sliding-window layers, the scaled embedding, norms
around the MLP (so the repair's orthogonal-diagonal fold and its iterative fit) and the
(1 + w) norm weights in bf16; a Qwen3 shape would repeat Llama's paths.

Random weights make S less structured than a trained model's, so selections are a check
of agreement, not of quality; the costs are those of the real shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_device import SHAPES, build, cuda, peak_gib, sync, timed  # noqa: E402
from benchmarks.gpu_experts import measure_experts, render_experts  # noqa: E402
from benchmarks.gpu_serving import measure_serving_8b, render_serving  # noqa: E402
from benchmarks.gpu_streamed import measure_streamed, render_streamed  # noqa: E402
from benchmarks.inputs import batches_of  # noqa: E402
from benchmarks.pages import markers, replace_section, row, rule  # noqa: E402
from benchmarks.timing import bare_forward  # noqa: E402
from lorp.locality.capture import capture_stats  # noqa: E402
from lorp.methods import select_layers  # noqa: E402
from lorp.models.surgery import drop_layers  # noqa: E402
from lorp.repair.capture import capture_repair_stats  # noqa: E402
from lorp.repair.fit import check_repairable, fit_runs  # noqa: E402
from lorp.repair.fold import fold  # noqa: E402
from lorp.repair.stats import bytes_per_pass  # noqa: E402

BEGIN, END = markers("gpu")


def say(r: dict[str, Any], msg: str) -> None:
    print(f"[{r['shape']}] {msg}", flush=True)


def measure_shape(shape: str, args: argparse.Namespace) -> dict[str, Any]:
    """Sections 1 to 4 on a random model of `shape`: its figures."""
    r: dict[str, Any] = {"shape": shape}
    model, batches, compare = _built(shape, args, r)
    _precision(model, compare, args.device, r)
    stats = _capture(model, batches, args, r)
    layers, fits = _repair(model, stats, batches, args, r)
    _prune(model, layers, fits, batches, args, r)
    return r


def _built(
    shape: str, args: argparse.Namespace, r: dict[str, Any]
) -> tuple[Any, list[torch.Tensor], list[torch.Tensor]]:
    """The random model of `shape` on the device, and its batches of random token ids:
    all of them, and the first `--compare` windows'. Its size and build time go into `r`."""
    start = time.perf_counter()
    model = build(shape, args.tiny, args.device)
    n, d = int(model.config.num_hidden_layers), int(model.config.hidden_size)
    r |= {"blocks": n, "hidden": d, "params_b": sum(p.numel() for p in model.parameters()) / 1e9}
    r["build_s"] = time.perf_counter() - start
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, int(model.config.vocab_size), (args.samples, args.seq_len), generator=g)
    batches = batches_of(ids.to(args.device), args.batch)
    compare = batches[: max(1, args.compare // args.batch)]
    say(r, f"built {r['params_b']:.2f}B params in {r['build_s']:.1f} s")
    return model, batches, compare


def _precision(model: Any, compare: list[torch.Tensor], device: str, r: dict[str, Any]) -> None:
    """2: S from the fp32 weights, then from the bf16 model they are cast to (the model
    stays bf16), and LoRP's selections from each at 4 and 8 blocks."""
    s32 = capture_stats(model, compare, progress=False)
    model.to(torch.bfloat16)
    if cuda(device):
        torch.cuda.empty_cache()
    s16 = capture_stats(model, compare, progress=False)
    r["s_max_abs_diff_bf16_fp32"] = float(abs(s16.matrix() - s32.matrix()).max())
    for k in (4, 8):
        a = list(select_layers(s32, k, "lorp").layers)
        b = list(select_layers(s16, k, "lorp").layers)
        r[f"lorp_{k}_fp32"], r[f"lorp_{k}_bf16"], r[f"lorp_{k}_same"] = a, b, a == b
    say(
        r,
        f"S bf16 vs fp32: max |dS| {r['s_max_abs_diff_bf16_fp32']:.2e}; same at 4/8: "
        f"{r['lorp_4_same']}/{r['lorp_8_same']}",
    )


def _capture(
    model: Any, batches: list[torch.Tensor], args: argparse.Namespace, r: dict[str, Any]
) -> Any:
    """1: the capture against a bare forward, bf16, all tokens: time, tokens/s and peak
    memory of each. Returns S."""
    device, tokens = args.device, sum(b.numel() for b in batches)
    r["tokens"] = tokens
    r["bare_s"], _ = timed(lambda: bare_forward(model, batches), device, args.repeats)
    r["capture_s"], stats = timed(
        lambda: capture_stats(model, batches, progress=False), device, args.repeats
    )
    r["capture_overhead"] = r["capture_s"] / r["bare_s"]
    r["bare_tok_s"], r["capture_tok_s"] = tokens / r["bare_s"], tokens / r["capture_s"]
    r["bare_peak_gib"], _ = peak_gib(device, lambda: bare_forward(model, batches))
    r["capture_peak_gib"], _ = peak_gib(
        device, lambda: capture_stats(model, batches, progress=False)
    )
    say(
        r,
        f"capture {r['capture_s']:.2f} s vs bare {r['bare_s']:.2f} s: overhead "
        f"{r['capture_overhead']:.3f}; {r['capture_tok_s']:,.0f} tok/s",
    )
    return stats


def _repair(
    model: Any, stats: Any, batches: list[torch.Tensor], args: argparse.Namespace, r: dict
) -> tuple[list[int], list[Any]]:
    """3: the repair statistics of LoRP's `--prune`-block selection, and their solves.
    Returns the blocks selected and the fits."""
    device = args.device
    t0 = time.perf_counter()
    selection = select_layers(stats, args.prune, "lorp")
    r["select_s"] = time.perf_counter() - t0
    layers = list(selection.layers)
    r["pruned_layers"] = layers
    runs = check_repairable(model, layers)
    r["runs"] = [list(x) for x in runs]
    r["repair_sums_gib"] = bytes_per_pass(runs, r["hidden"]) / 2**30
    r["repair_s"], rstats = timed(
        lambda: capture_repair_stats(model, batches, runs, progress=False), device, 1
    )
    r["repair_ratio"] = r["repair_s"] / r["capture_s"]
    r["repair_peak_gib"], _ = peak_gib(
        device, lambda: capture_repair_stats(model, batches, runs, progress=False)
    )
    t0 = time.perf_counter()
    fits = fit_runs(model, rstats, rounds=args.normed_rounds)
    sync(device)
    r["solve_s"] = time.perf_counter() - t0
    r["fits"] = [f.record() for f in fits]
    say(
        r,
        f"repair pass {r['repair_s']:.2f} s = {r['repair_ratio']:.2f} x capture; runs {runs}; "
        f"sums {r['repair_sums_gib']:.2f} GiB; solves {r['solve_s']:.2f} s",
    )
    return layers, fits


def _prune(
    model: Any,
    layers: list[int],
    fits: list[Any],
    batches: list[torch.Tensor],
    args: argparse.Namespace,
    r: dict[str, Any],
) -> None:
    """4: fold + surgery + save, and the pruned forward against dense."""
    device = args.device
    t0 = time.perf_counter()
    fold(model, fits)
    drop_layers(model, layers)
    sync(device)
    r["fold_surgery_s"] = time.perf_counter() - t0
    _save(model, args.scratch, r)
    r["pruned_bare_s"], _ = timed(lambda: bare_forward(model, batches), device, args.repeats)
    r["pruned_speedup"] = r["bare_s"] / r["pruned_bare_s"]
    r["speedup_bound"] = r["blocks"] / (r["blocks"] - len(layers))
    # Removing k of N blocks cannot speed a forward up by more than N/(N-k): a figure more
    # than 5% above it is timing noise (a shared or throttled device), not a speed-up.
    r["speedup_resolved"] = r["pruned_speedup"] <= 1.05 * r["speedup_bound"]
    say(
        r,
        f"fold+surgery {r['fold_surgery_s']:.2f} s, save {r['save_s']:.1f} s "
        f"({r['saved_gib']:.1f} GiB); pruned forward {r['pruned_speedup']:.3f}x dense "
        f"(bound N/(N-k) = {r['speedup_bound']:.3f})",
    )


def _save(model: Any, scratch: str | None, r: dict[str, Any]) -> None:
    """The pruned model saved under `scratch` (timed, sized, its blocks read back), then
    removed."""
    out = Path(tempfile.mkdtemp(prefix="lorp-gpu-", dir=scratch))
    try:
        t0 = time.perf_counter()
        model.save_pretrained(out, safe_serialization=True)
        r["save_s"] = time.perf_counter() - t0
        r["saved_gib"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 2**30
        saved = json.loads((out / "config.json").read_text())
        r["saved_blocks"] = saved["num_hidden_layers"]
    finally:
        shutil.rmtree(out, ignore_errors=True)


def speedup(r: dict[str, Any]) -> str:
    if r["speedup_resolved"]:
        return f"{r['pruned_speedup']:.3f}"
    return f"not resolved ({r['pruned_speedup']:.2f} measured)"


HEAD = (
    "shape",
    "capture_overhead",
    "capture tok/s",
    "peak GiB (bare / capture / repair)",
    "max dS bf16-fp32",
    "LoRP same 4 / 8",
    "repair_ratio",
    "sums GiB",
    "solves s",
    "fold+surgery s",
    "save s",
    "pruned speed-up (bound)",
)
"""The columns of the shapes' table."""


def render(rows: list[dict[str, Any]]) -> str:
    def f(x: Any, spec: str = ".3f") -> str:
        return "n/a" if x is None else format(x, spec)

    lines = [row(HEAD), rule(len(HEAD))]
    for r in rows:
        lines.append(
            f"| {r['shape']} ({r['params_b']:.1f}B) | {f(r['capture_overhead'])} | "
            f"{r['capture_tok_s']:,.0f} | {f(r['bare_peak_gib'], '.1f')} / "
            f"{f(r['capture_peak_gib'], '.1f')} / {f(r['repair_peak_gib'], '.1f')} | "
            f"{r['s_max_abs_diff_bf16_fp32']:.1e} | {r['lorp_4_same']} / {r['lorp_8_same']} | "
            f"{f(r['repair_ratio'], '.2f')} | {r['repair_sums_gib']:.2f} | {r['solve_s']:.2f} | "
            f"{r['fold_surgery_s']:.2f} | {r['save_s']:.1f} | {speedup(r)} "
            f"({r['speedup_bound']:.3f}) |"
        )
    return "\n".join(lines)


def page(report: dict[str, Any]) -> str:
    """The results page's block: the environment, every section's table, the total."""
    env = report["env"]
    lines = [
        f"Measured {env['date']} on {env['device']} (torch {env['torch']}, Python "
        f"{env['python']}), {env['tokens']} random token ids per shape"
        + (" (tiny shapes: the CPU check, not a result)" if env.get("tiny") else "")
        + f"; the whole call took {env['total_s']:.0f} s.",
    ]
    if report["shapes"]:
        lines += ["", render(report["shapes"])]
    if "streamed" in report:
        lines += ["", render_streamed(report["streamed"])]
    if "serving" in report:
        lines += ["", render_serving(report["serving"])]
    if "experts" in report:
        lines += ["", render_experts(report["experts"])]
    return "\n".join(lines)


def write_page(path: Path, report: dict[str, Any]) -> None:
    replace_section(path, BEGIN, END, page(report), "The latest device run")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--tiny", action="store_true", help="tiny shapes: the test suite's CPU run")
    p.add_argument(
        "--shapes",
        nargs="*",
        default=list(SHAPES),
        choices=list(SHAPES),
        help="sections 1 to 4 for these shapes (default all; none: skip them)",
    )
    p.add_argument("--samples", type=int, help="calibration windows (default 64; tiny 8)")
    p.add_argument("--seq-len", type=int, help="tokens per window (default 2048; tiny 32)")
    p.add_argument("--batch", type=int, help="windows per forward (default 8; tiny 4)")
    p.add_argument("--compare", type=int, help="windows for bf16 vs fp32 (default 16; tiny 4)")
    p.add_argument("--prune", type=int, default=8, help="blocks removed (default 8)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats, median (default 3)")
    p.add_argument(
        "--normed-rounds",
        type=int,
        default=25,
        help="cap on a normed (Gemma) fit's rounds, one d x d SVD each (default 25)",
    )
    p.add_argument("--scratch", default=None, help="where the pruned checkpoint is saved")
    p.add_argument(
        "--serving",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="section 5, vLLM serving of the 8B shape (default: on for cuda, off for cpu)",
    )
    p.add_argument(
        "--streamed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="section 6, the 8B shape streamed under a memory cap below its size (default on)",
    )
    add_experts(p)
    add_outputs(p)
    return p


def add_experts(p: argparse.ArgumentParser) -> None:
    """Section 7's switch and its variants."""
    p.add_argument(
        "--experts",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="section 7, vLLM serving of an expert-pruned MoE (default: on for cuda, off for cpu)",
    )
    p.add_argument(
        "--expert-fractions",
        nargs="+",
        type=float,
        default=[0.25, 0.5],
        help="section 7: fractions of every layer's experts removed (default 0.25 0.5)",
    )


def add_outputs(p: argparse.ArgumentParser) -> None:
    """The serving section's settings, and where the figures go."""
    p.add_argument("--serve-concurrency", type=int, default=64)
    p.add_argument("--serve-prompt-len", type=int, default=512)
    p.add_argument("--serve-output-len", type=int, default=256)
    p.add_argument("--serve-requests", type=int, default=256)
    p.add_argument("--serve-rounds", type=int, default=5)
    p.add_argument("--json", type=Path, help="write the figures here (default $OUT/gpu.json)")
    p.add_argument(
        "--page",
        type=Path,
        help="write the figures into this results page (docs/results/gpu.md) between its "
        "gpu:begin/end markers",
    )
    p.add_argument(
        "--from-json",
        type=Path,
        help="measure nothing: render a report a device wrote (its --json) into --page",
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    args = parser().parse_args(argv)
    small = {"samples": 8, "seq_len": 32, "batch": 4, "compare": 4}
    big = {"samples": 64, "seq_len": 2048, "batch": 8, "compare": 16}
    for key, value in (small if args.tiny else big).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("samples", "seq_len", "batch", "compare", "prune", "repeats", "normed_rounds"):
        if getattr(args, key) < 1:
            raise SystemExit(
                f"gpu.py: --{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}"
            )
    if args.from_json is not None and not args.from_json.is_file():
        raise SystemExit(f"gpu.py: --from-json {args.from_json}: no such file")
    if cuda(args.device) and not torch.cuda.is_available() and not args.from_json:
        raise SystemExit("gpu.py: --device cuda but torch sees no GPU (use --device cpu --tiny)")
    if args.serving is None:
        args.serving = cuda(args.device)
    if args.experts is None:
        args.experts = cuda(args.device)
    bad = [f for f in args.expert_fractions if not 0 < f < 1]
    if bad:
        raise SystemExit(f"gpu.py: --expert-fractions must be in (0, 1), got {bad}")
    if args.json is None and os.environ.get("OUT"):
        args.json = Path(os.environ["OUT"]) / "gpu.json"
    return args


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every section `args` asks for: the report."""
    started = time.perf_counter()
    env = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if cuda(args.device) else "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "tokens": f"{args.samples} x {args.seq_len}",
        "tiny": args.tiny,
    }
    print(f"gpu.py on {env['device']}, torch {env['torch']}, {env['tokens']} tokens", flush=True)
    rows = []
    for shape in args.shapes:
        rows.append(measure_shape(shape, args))
        if cuda(args.device):  # the last shape's weights are garbage now
            torch.cuda.empty_cache()
    report: dict[str, Any] = {"env": env, "shapes": rows}
    if rows:
        print(render(rows), flush=True)
    if args.streamed:
        report["streamed"] = measure_streamed(args)
        print(render_streamed(report["streamed"]), flush=True)
    if args.serving:
        report["serving"] = measure_serving_8b(args)
        print(render_serving(report["serving"]))
    if args.experts:
        report["experts"] = measure_experts(args)
        print(render_experts(report["experts"]), flush=True)
    env["total_s"] = time.perf_counter() - started
    print(f"total {env['total_s']:.0f} s")
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        report = json.loads(args.from_json.read_text())
        print(page(report))
        if args.page:
            write_page(args.page, report)
        return 0
    report = measure(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    if args.page:
        write_page(args.page, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
