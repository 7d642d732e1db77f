"""Section 5 of `benchmarks/gpu.py`: the 8B Llama shape in bf16, dense and with blocks
removed, each served by its own vLLM engine (`pipeline.evaluation.serving`: a closed loop
of fixed synthetic prompts, EOS ignored): output tokens/s, TTFT, TPOT, and the speed-up
over dense with its 95% interval beside N/(N-k). Where vLLM is not installed the section
says so instead of a figure."""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_device import build, cuda
from benchmarks.pages import row, rule
from benchmarks.timing import deep_blocks
from lorp.models.surgery import drop_layers

SERVE_REMOVED = (8, 12)
"""Blocks removed from the 8B shape for the serving figures (NVIDIA's Minitron guide
kept 22 of 36 layers of Qwen3-8B: 1.66x at concurrency 64 on one H200)."""


def serving_spec(args: argparse.Namespace) -> Any:
    """The `--serve-*` options as the pipeline's `ServingSpec` (sections 5 and 7)."""
    from pipeline.spec.evaluation import ServingSpec

    return ServingSpec(
        concurrency=args.serve_concurrency,
        prompt_len=args.serve_prompt_len,
        output_len=args.serve_output_len,
        requests=args.serve_requests,
        rounds=args.serve_rounds,
    )


def measure_serving_8b(args: argparse.Namespace) -> dict[str, Any]:
    """Section 5: vLLM serving of the llama-8b shape, dense and 8 / 12 blocks removed."""
    import copy
    import dataclasses
    import gc
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vllm is not installed on this machine (no serving figures)"}
    from pipeline.evaluation.serving import serving_speedup

    spec = serving_spec(args)
    dense = build("llama-8b", args.tiny, args.device).to(torch.bfloat16).cpu()
    n = int(dense.config.num_hidden_layers)
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="lorp-serve-"))
    out: dict[str, Any] = {"settings": dataclasses.asdict(spec), "variants": []}
    for k in (0, *[k for k in SERVE_REMOVED if k < n - 1]):
        model = copy.deepcopy(dense) if k else dense
        if k:  # the deepest blocks but the last: shapes are what serving costs, not quality
            drop_layers(model, deep_blocks(n, k))
        where = scratch / f"serve-{k}"
        model.save_pretrained(where)
        del model
        gc.collect()
        figures = _serve_dir(str(where), spec, args.device)
        shutil.rmtree(where, ignore_errors=True)
        print(
            f"serving {k} of {n} removed: {figures['serve_output_tps']:,.0f} output tok/s",
            flush=True,
        )
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
        enforce_eager=not cuda(device),  # CUDA graphs where there are any
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
    head = ("blocks removed", "output tok/s", "TTFT ms", "TPOT ms", "speed-up [95% interval]")
    lines = [
        f"serving (vLLM, concurrency {s['concurrency']}, {s['prompt_len']} in / "
        f"{s['output_len']} out, {s['requests']} requests x {s['rounds']} rounds)",
        row((*head, "N/(N-k)")),
        rule(6),
    ]
    for v in section["variants"]:
        lines.append(
            f"| {v['removed']} | {v['serve_output_tps']:,.0f} | {v['serve_ttft_ms']:.1f} | "
            f"{v['serve_tpot_ms']:.2f} | {_speedup(v)} | {v['bound']:.3f} |"
        )
    return "\n".join(lines)


def _speedup(v: dict[str, Any]) -> str:
    """A variant's serving speed-up over dense, with its interval ("1" for dense)."""
    if not v["removed"]:
        return "1"
    got = v["serve_speedup"] if v["serve_resolved"] else None
    ratio = (
        f"{got:.3f}"
        if got is not None
        else f"not resolved ({v['serve_speedup_measured']:.3f} measured)"
    )
    return ratio + f" [{v['serve_speedup_low']:.3f}, {v['serve_speedup_high']:.3f}]"
