"""The GPU path of `lorp/`, measured in one call on a lent device (one H200 here).

    python3 benchmarks/gpu.py --json "$OUT/gpu.json"          # on the device: ~5 min
    python benchmarks/gpu.py --device cpu --tiny --json f.json # the same code, seconds
    python benchmarks/gpu.py --from-json gpu.json --page docs/results/gpu.md  # the page

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
import functools
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lorp.locality.capture import capture_stats  # noqa: E402
from lorp.methods import select_layers  # noqa: E402
from lorp.models.architectures import decoder_stack  # noqa: E402
from lorp.models.surgery import drop_layers  # noqa: E402
from lorp.repair.capture import capture_repair_stats  # noqa: E402
from lorp.repair.fit import check_repairable, fit_runs  # noqa: E402
from lorp.repair.fold import fold  # noqa: E402
from lorp.repair.stats import bytes_per_pass  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "llama-8b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    },
    "gemma3-4b": {
        "model_type": "gemma3_text",
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 34,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "vocab_size": 262144,
        "max_position_embeddings": 8192,
        "sliding_window": 1024,
        "query_pre_attn_scalar": 256,
        "tie_word_embeddings": True,
    },
}
# The same families at a size the test suite runs on CPU in seconds.
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 12,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 512,
        "sliding_window": 16, "query_pre_attn_scalar": 32}  # fmt: skip


def build(shape: str, tiny: bool, device: str) -> Any:
    """Random-init fp32 model of `shape` on `device` (weights made there, not copied)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(SHAPES[shape])
    model_type = fields.pop("model_type")
    if tiny:
        fields |= {k: v for k, v in TINY.items() if k in fields or model_type == "gemma3_text"}
        fields["max_position_embeddings"] = 256
    if model_type == "gemma3_text":
        n = fields["num_hidden_layers"]
        # Gemma 3's pattern: five sliding-window blocks, then one global.
        fields["layer_types"] = [
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)
        ]
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if tiny:  # random init is near the identity per block at this size; give S structure
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.ndim == 2 and "embed" not in name:
                    p.mul_(8.0)
    return model.eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str, repeats: int) -> tuple[float, Any]:
    """Median seconds of `repeats` calls after one warm-up, and the last call's result."""
    out = fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def peak_gib(device: str, fn: Callable[[], Any]) -> tuple[float | None, Any]:
    """Peak GPU memory allocated while `fn` runs (None on CPU), and its result."""
    if not device.startswith("cuda"):
        return None, fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30, out


def bare_forward(model: Any, batches: list[torch.Tensor]) -> None:
    stack = decoder_stack(model)
    with torch.inference_mode():
        for b in batches:
            stack(input_ids=b, use_cache=False)


def measure_shape(shape: str, args: argparse.Namespace) -> dict[str, Any]:
    device, r = args.device, {"shape": shape}
    say = lambda msg: print(f"[{shape}] {msg}", flush=True)  # noqa: E731
    start = time.perf_counter()
    model = build(shape, args.tiny, device)
    n, d = int(model.config.num_hidden_layers), int(model.config.hidden_size)
    r |= {"blocks": n, "hidden": d, "params_b": sum(p.numel() for p in model.parameters()) / 1e9}
    r["build_s"] = time.perf_counter() - start
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, int(model.config.vocab_size), (args.samples, args.seq_len), generator=g)
    ids = ids.to(device)
    batches = [ids[i : i + args.batch] for i in range(0, len(ids), args.batch)]
    compare = batches[: max(1, args.compare // args.batch)]
    say(f"built {r['params_b']:.2f}B params in {r['build_s']:.1f} s")

    # 2 (first half): S from the fp32 weights, before they are cast.
    s32 = capture_stats(model, compare, progress=False)
    model.to(torch.bfloat16)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    s16 = capture_stats(model, compare, progress=False)
    r["s_max_abs_diff_bf16_fp32"] = float(abs(s16.matrix() - s32.matrix()).max())
    for k in (4, 8):
        a = list(select_layers(s32, k, "lorp").layers)
        b = list(select_layers(s16, k, "lorp").layers)
        r[f"lorp_{k}_fp32"], r[f"lorp_{k}_bf16"], r[f"lorp_{k}_same"] = a, b, a == b
    say(f"S bf16 vs fp32: max |dS| {r['s_max_abs_diff_bf16_fp32']:.2e}; same at 4/8: "
        f"{r['lorp_4_same']}/{r['lorp_8_same']}")  # fmt: skip

    # 1: capture against a bare forward, bf16, all tokens.
    tokens = ids.numel()
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
    say(f"capture {r['capture_s']:.2f} s vs bare {r['bare_s']:.2f} s: overhead "
        f"{r['capture_overhead']:.3f}; {r['capture_tok_s']:,.0f} tok/s")  # fmt: skip

    # 3: the repair statistics of LoRP's 8-block selection, and their solves.
    t0 = time.perf_counter()
    selection = select_layers(stats, args.prune, "lorp")
    r["select_s"] = time.perf_counter() - t0
    layers = list(selection.layers)
    r["pruned_layers"] = layers
    runs = check_repairable(model, layers)
    r["runs"] = [list(x) for x in runs]
    r["repair_sums_gib"] = bytes_per_pass(runs, d) / 2**30
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
    say(f"repair pass {r['repair_s']:.2f} s = {r['repair_ratio']:.2f} x capture; runs {runs}; "
        f"sums {r['repair_sums_gib']:.2f} GiB; solves {r['solve_s']:.2f} s")  # fmt: skip

    # 4: fold + surgery + save, and the pruned forward against dense.
    t0 = time.perf_counter()
    fold(model, fits)
    drop_layers(model, layers)
    sync(device)
    r["fold_surgery_s"] = time.perf_counter() - t0
    out = Path(tempfile.mkdtemp(prefix="lorp-gpu-", dir=args.scratch))
    try:
        t0 = time.perf_counter()
        model.save_pretrained(out, safe_serialization=True)
        r["save_s"] = time.perf_counter() - t0
        r["saved_gib"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 2**30
        saved = json.loads((out / "config.json").read_text())
        r["saved_blocks"] = saved["num_hidden_layers"]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    r["pruned_bare_s"], _ = timed(lambda: bare_forward(model, batches), device, args.repeats)
    r["pruned_speedup"] = r["bare_s"] / r["pruned_bare_s"]
    r["speedup_bound"] = n / (n - len(layers))
    # Removing k of N blocks cannot speed a forward up by more than N/(N-k): a figure more
    # than 5% above it is timing noise (a shared or throttled device), not a speed-up.
    r["speedup_resolved"] = r["pruned_speedup"] <= 1.05 * r["speedup_bound"]
    say(f"fold+surgery {r['fold_surgery_s']:.2f} s, save {r['save_s']:.1f} s "
        f"({r['saved_gib']:.1f} GiB); pruned forward {r['pruned_speedup']:.3f}x dense "
        f"(bound N/(N-k) = {r['speedup_bound']:.3f})")  # fmt: skip
    return r


STREAM_WINDOWS = 8
"""Windows of section 6 (in 2 forwards): a streamed forward costs a read of the whole
checkpoint whatever its batch, so a few forwards say what streaming costs."""


def _held_whole(args: argparse.Namespace, shape: str, dtype: torch.dtype, out: Path,
                r: dict[str, Any]) -> tuple[list[torch.Tensor], Any]:  # fmt: skip
    """Section 6's reference: the random model saved to `out` and freed, then loaded
    back from the files (`from_pretrained`, as the pipeline does: its computed buffers
    such as the rotary frequencies stay fp32) and measured held whole. Returns the
    batches and S; figures go into `r`. Every copy is freed before it returns."""
    import gc

    from transformers import AutoModelForCausalLM

    from lorp.models.perplexity import perplexity

    device = args.device
    model = build(shape, args.tiny, device).to(dtype)
    vocab = int(model.config.vocab_size)
    t0 = time.perf_counter()
    model.save_pretrained(out, safe_serialization=True)
    r["save_s"] = time.perf_counter() - t0
    del model
    gc.collect()  # a transformers model sits in reference cycles
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=dtype).to(device).eval()
    g = torch.Generator(device="cpu").manual_seed(2)
    n = min(args.samples, STREAM_WINDOWS)
    ids = torch.randint(0, vocab, (n, args.seq_len), generator=g).to(device)
    half = max(1, n // 2)
    batches = [ids[i : i + half] for i in range(0, n, half)]
    sync(device)
    t0 = time.perf_counter()
    held = capture_stats(model, batches, progress=False)
    sync(device)
    r["memory_s"] = time.perf_counter() - t0
    once = functools.partial(capture_stats, model, batches[:1], progress=False)
    r["memory_peak_gib"], _ = peak_gib(device, once)
    r["memory_ppl"] = perplexity(model, ids, batch_size=1)
    del once
    r["tokens"] = int(ids.numel())
    del model
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return batches, held


def measure_streamed(args: argparse.Namespace) -> dict[str, Any]:
    """Section 6: the llama-8b shape held whole, then streamed under a memory cap below
    its size, on the same tokens; S and perplexity must agree."""
    from lorp.models.memory import weight_size
    from lorp.models.perplexity import perplexity
    from lorp.models.safetensors_index import tensor_index
    from lorp.models.streaming import build_streamed

    device, shape = args.device, "llama-8b"
    cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    say = lambda msg: print(f"[streamed] {msg}", flush=True)  # noqa: E731
    r: dict[str, Any] = {"shape": shape, "dtype": str(dtype).removeprefix("torch.")}
    out = Path(tempfile.mkdtemp(prefix="lorp-stream-", dir=args.scratch))
    try:
        batches, held = _held_whole(args, shape, dtype, out, r)
        size = weight_size(tensor_index(out), dtype)
        r["model_gib"], r["largest_unit_gib"] = size.total / 2**30, size.largest_unit / 2**30
        say(f"{r['model_gib']:.1f} GiB model; held whole {r['memory_s']:.1f} s")
        if cuda:
            cap = 0.75 * size.total  # below the model: held whole it cannot load
            reserved = torch.cuda.memory_reserved()
            if reserved > 0.25 * cap:
                raise RuntimeError(f"{reserved / 2**30:.1f} GiB still reserved before the cap")
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(cap / total)
            r["cap_gib"] = cap / 2**30
        streamed = build_streamed(out, dtype=dtype, device=device)
        sync(device)
        t0 = time.perf_counter()
        got = capture_stats(streamed, batches, progress=False)
        sync(device)
        r["streamed_s"] = time.perf_counter() - t0
        r["streamed_peak_gib"], _ = peak_gib(
            device, lambda: capture_stats(streamed, batches[:1], progress=False)
        )
        ids = torch.cat(batches)
        # 2 windows per forward: at a vocabulary of 128k their logits and log-softmax
        # (about 5 GiB) stay under the cap beside one module.
        r["streamed_ppl"] = perplexity(streamed, ids, batch_size=2)
        r["s_max_abs_diff"] = float(abs(got.matrix() - held.matrix()).max())
        r["ppl_rel_diff"] = abs(r["streamed_ppl"] / r["memory_ppl"] - 1)
        r["streamed_over_memory"] = r["streamed_s"] / r["memory_s"]
        say(f"streamed {r['streamed_s']:.1f} s ({r['streamed_over_memory']:.1f}x), peak "
            f"{gib(r['streamed_peak_gib'])}; |dS| {r['s_max_abs_diff']:.1e}, "
            f"ppl rel diff {r['ppl_rel_diff']:.1e}")  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - one device call: keep the other sections
        r["error"] = f"{type(exc).__name__}: {exc}"
        say(r["error"])
    finally:
        if cuda:
            torch.cuda.set_per_process_memory_fraction(1.0)
        shutil.rmtree(out, ignore_errors=True)
    return r


def gib(x: float | None) -> str:
    return "n/a (CPU)" if x is None else f"{x:.1f} GiB"


def render_streamed(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"streamed ({r['shape']}): failed, {r['error']}"
    cap = f"{r['cap_gib']:.1f} GiB cap" if r.get("cap_gib") else "no cap (CPU)"
    return (
        f"streamed ({r['shape']}, {r['dtype']}, {r['model_gib']:.2f} GiB, {cap}): capture "
        f"{r['streamed_s']:.2f} s vs {r['memory_s']:.2f} s held whole "
        f"({r['streamed_over_memory']:.1f}x) over {r['tokens']:,} tokens; peak "
        f"{gib(r['streamed_peak_gib'])} vs {gib(r['memory_peak_gib'])}; max |dS| "
        f"{r['s_max_abs_diff']:.1e}; perplexity rel diff {r['ppl_rel_diff']:.1e}"
    )


SERVE_REMOVED = (8, 12)
"""Blocks removed from the 8B shape for the serving figures (NVIDIA's Minitron guide
kept 22 of 36 layers of Qwen3-8B: 1.66x at concurrency 64 on one H200)."""


def measure_serving_8b(args: argparse.Namespace) -> dict[str, Any]:
    """Section 5: vLLM serving of the llama-8b shape, dense and 8 / 12 blocks removed."""
    import copy
    import dataclasses
    import gc
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vllm is not installed on this machine (no serving figures)"}
    from pipeline.evaluation.serving import serving_speedup
    from pipeline.spec.evaluation import ServingSpec

    spec = ServingSpec(
        concurrency=args.serve_concurrency,
        prompt_len=args.serve_prompt_len,
        output_len=args.serve_output_len,
        requests=args.serve_requests,
        rounds=args.serve_rounds,
    )
    dense = build("llama-8b", args.tiny, args.device).to(torch.bfloat16).cpu()
    n = int(dense.config.num_hidden_layers)
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="lorp-serve-"))
    out: dict[str, Any] = {"settings": dataclasses.asdict(spec), "variants": []}
    for k in (0, *[k for k in SERVE_REMOVED if k < n - 1]):
        model = copy.deepcopy(dense) if k else dense
        if k:  # the deepest blocks but the last: shapes are what serving costs, not quality
            drop_layers(model, list(range(n - 1 - k, n - 1)))
        where = scratch / f"serve-{k}"
        model.save_pretrained(where)
        del model
        gc.collect()
        figures = _serve_dir(str(where), spec, args.device)
        shutil.rmtree(where, ignore_errors=True)
        print(f"serving {k} of {n} removed: {figures['serve_output_tps']:,.0f} output tok/s",
              flush=True)  # fmt: skip
        out["variants"].append({"removed": k, "bound": n / (n - k), **figures})
    dense_tps = [r["output_tps"] for r in out["variants"][0]["serving"]["rounds"]]
    for v in out["variants"][1:]:
        tps = [r["output_tps"] for r in v["serving"]["rounds"]]
        v |= serving_speedup(tps, dense_tps, v["bound"], 0.02)
    return out


def _serve_dir(model_dir: str, spec: Any, device: str) -> dict[str, Any]:
    from pipeline.evaluation.serving import measure_serving
    from pipeline.evaluation.vllm_engine import free_memory, make_engine

    llm = make_engine(
        model_dir,
        dtype="bfloat16",
        max_model_len=spec.prompt_len + spec.output_len + 8,
        enforce_eager=not device.startswith("cuda"),  # CUDA graphs where there are any
        max_num_seqs=spec.concurrency,
        enable_prefix_caching=False,
    )
    try:
        return measure_serving(llm, spec, llm.llm_engine.model_config.get_vocab_size())
    finally:
        del llm
        free_memory()


def render_serving(section: dict[str, Any]) -> str:
    if "skipped" in section:
        return f"serving: skipped, {section['skipped']}"
    s = section["settings"]
    lines = [
        f"serving (vLLM, concurrency {s['concurrency']}, {s['prompt_len']} in / "
        f"{s['output_len']} out, {s['requests']} requests x {s['rounds']} rounds)",
        "| blocks removed | output tok/s | TTFT ms | TPOT ms | speed-up [95% interval] | N/(N-k) |",
        "|" + " --- |" * 6,
    ]
    for v in section["variants"]:
        if v["removed"]:
            got = v["serve_speedup"] if v["serve_resolved"] else None
            ratio = (
                f"{got:.3f}"
                if got is not None
                else f"not resolved ({v['serve_speedup_measured']:.3f} measured)"
            ) + f" [{v['serve_speedup_low']:.3f}, {v['serve_speedup_high']:.3f}]"
        else:
            ratio = "1"
        lines.append(
            f"| {v['removed']} | {v['serve_output_tps']:,.0f} | {v['serve_ttft_ms']:.1f} | "
            f"{v['serve_tpot_ms']:.2f} | {ratio} | {v['bound']:.3f} |"
        )
    return "\n".join(lines)


def speedup(r: dict[str, Any]) -> str:
    if r["speedup_resolved"]:
        return f"{r['pruned_speedup']:.3f}"
    return f"not resolved ({r['pruned_speedup']:.2f} measured)"


def render(rows: list[dict[str, Any]]) -> str:
    def f(x: Any, spec: str = ".3f") -> str:
        return "n/a" if x is None else format(x, spec)

    lines = [
        "| shape | capture_overhead | capture tok/s | peak GiB (bare / capture / repair) | "
        "max dS bf16-fp32 | LoRP same 4 / 8 | repair_ratio | sums GiB | solves s | "
        "fold+surgery s | save s | pruned speed-up (bound) |",
        "|" + " --- |" * 12,
    ]
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


BEGIN, END = "<!-- gpu:begin -->", "<!-- gpu:end -->"


def page(report: dict[str, Any]) -> str:
    """The results page's block: the environment, every section's table, the total."""
    env = report["env"]
    lines = [
        f"Measured {env['date']} on {env['device']} (torch {env['torch']}, Python "
        f"{env['python']}), {env['tokens']} random token ids per shape"
        + (" (tiny shapes: the CPU check, not a result)" if env.get("tiny") else "")
        + f"; the whole call took {env['total_s']:.0f} s.",
        "",
        render(report["shapes"]),
    ]
    if "streamed" in report:
        lines += ["", render_streamed(report["streamed"])]
    if "serving" in report:
        lines += ["", render_serving(report["serving"])]
    return "\n".join(lines)


def write_page(path: Path, report: dict[str, Any]) -> None:
    from benchmarks.run import replace_section

    replace_section(path, BEGIN, END, page(report), "The latest device run")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--tiny", action="store_true", help="tiny shapes: the test suite's CPU run")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
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
    args = p.parse_args(argv)
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
    if args.device.startswith("cuda") and not torch.cuda.is_available() and not args.from_json:
        raise SystemExit("gpu.py: --device cuda but torch sees no GPU (use --device cpu --tiny)")
    if args.serving is None:
        args.serving = args.device.startswith("cuda")
    if args.json is None and os.environ.get("OUT"):
        args.json = Path(os.environ["OUT"]) / "gpu.json"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        report = json.loads(args.from_json.read_text())
        print(page(report))
        if args.page:
            write_page(args.page, report)
        return 0
    started = time.perf_counter()
    env = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "tokens": f"{args.samples} x {args.seq_len}",
        "tiny": args.tiny,
    }
    print(f"gpu.py on {env['device']}, torch {env['torch']}, {env['tokens']} tokens", flush=True)
    rows = []
    for shape in args.shapes:
        rows.append(measure_shape(shape, args))
        if args.device.startswith("cuda"):  # the last shape's weights are garbage now
            torch.cuda.empty_cache()
    report: dict[str, Any] = {"env": env, "shapes": rows}
    print(render(rows), flush=True)
    if args.streamed:
        report["streamed"] = measure_streamed(args)
        print(render_streamed(report["streamed"]), flush=True)
    if args.serving:
        report["serving"] = measure_serving_8b(args)
        print(render_serving(report["serving"]))
    env["total_s"] = time.perf_counter() - started
    print(f"total {env['total_s']:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    if args.page:
        write_page(args.page, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
