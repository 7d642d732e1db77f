"""Section 6 of `benchmarks/gpu.py`: the llama-8b shape saved as a checkpoint, measured
held whole in memory, then streamed a module at a time from its files
(`lorp.models.streaming`) with the process's device memory capped below the model's
size: time, peak memory, and S and perplexity against the in-memory figures."""

from __future__ import annotations

import argparse
import functools
import gc
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_device import build, cuda, peak_gib, sync, timed
from benchmarks.inputs import batches_of
from lorp.locality.capture import capture_stats

STREAM_WINDOWS = 8
"""Windows of section 6 (in 2 forwards): a streamed forward costs a read of the whole
checkpoint whatever its batch, so a few forwards say what streaming costs."""


def _held_whole(
    args: argparse.Namespace, shape: str, dtype: torch.dtype, out: Path, r: dict[str, Any]
) -> tuple[list[torch.Tensor], Any]:
    """Section 6's reference: the random model saved to `out` and freed, then loaded
    back from the files (`from_pretrained`, as the pipeline does: its computed buffers
    such as the rotary frequencies stay fp32) and measured held whole. Returns the
    batches and S; figures go into `r`. Every copy is freed before it returns."""
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
    batches = batches_of(ids, max(1, n // 2))
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
    if cuda(device):
        torch.cuda.empty_cache()
    return batches, held


def measure_streamed(args: argparse.Namespace) -> dict[str, Any]:
    """Section 6: the llama-8b shape held whole, then streamed under a memory cap below
    its size, on the same tokens; S and perplexity must agree."""
    on_cuda = cuda(args.device)
    dtype = torch.bfloat16 if on_cuda else torch.float32
    r: dict[str, Any] = {"shape": "llama-8b", "dtype": str(dtype).removeprefix("torch.")}
    out = Path(tempfile.mkdtemp(prefix="lorp-stream-", dir=args.scratch))
    try:
        _streamed(args, dtype, out, r)
    except Exception as exc:  # noqa: BLE001 - one device call: keep the other sections
        r["error"] = f"{type(exc).__name__}: {exc}"
        say(r["error"])
    finally:
        if on_cuda:
            torch.cuda.set_per_process_memory_fraction(1.0)
        shutil.rmtree(out, ignore_errors=True)
    return r


def say(msg: str) -> None:
    print(f"[streamed] {msg}", flush=True)


def _streamed(args: argparse.Namespace, dtype: torch.dtype, out: Path, r: dict[str, Any]) -> None:
    """The figures of `measure_streamed`, into `r`: held whole, then streamed from `out`."""
    from lorp.models.memory import weight_size
    from lorp.models.perplexity import perplexity
    from lorp.models.safetensors_index import tensor_index
    from lorp.models.streaming import build_streamed

    device = args.device
    batches, held = _held_whole(args, r["shape"], dtype, out, r)
    size = weight_size(tensor_index(out), dtype)
    r["model_gib"], r["largest_unit_gib"] = size.total / 2**30, size.largest_unit / 2**30
    say(f"{r['model_gib']:.1f} GiB model; held whole {r['memory_s']:.1f} s")
    if cuda(device):
        r["cap_gib"] = _cap(0.75 * size.total)  # below the model: held whole it cannot load
    streamed = build_streamed(out, dtype=dtype, device=device)
    r["streamed_s"], got = timed(
        lambda: capture_stats(streamed, batches, progress=False), device, 1, warmup=0
    )
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
    say(
        f"streamed {r['streamed_s']:.1f} s ({r['streamed_over_memory']:.1f}x), peak "
        f"{gib(r['streamed_peak_gib'])}; |dS| {r['s_max_abs_diff']:.1e}, "
        f"ppl rel diff {r['ppl_rel_diff']:.1e}"
    )


def _cap(cap: float) -> float:
    """This process's device memory capped at `cap` bytes; the cap in GiB."""
    reserved = torch.cuda.memory_reserved()
    if reserved > 0.25 * cap:
        raise RuntimeError(f"{reserved / 2**30:.1f} GiB still reserved before the cap")
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(cap / total)
    return cap / 2**30


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
