"""Section 7 of `benchmarks/gpu.py`: expert pruning served by vLLM. A random Qwen3-MoE of
a real model's layer shape (Qwen3-30B-A3B's: d 2048, experts of 768 routed top-8, 32 / 4
heads of 128, vocab 151936) with 48 experts in each of 16 blocks, saved in bf16; 25% and
50% of every layer's experts removed on files (`lorp.models.file_surgery`, seeded random
experts: which ones does not change what they cost); dense and each variant served by its
own vLLM engine: prefill tokens/s (a batch of `--serve-requests` prompts, one output token
each), closed-loop decode (`pipeline.evaluation.serving`: output tokens/s, TTFT, TPOT),
the checkpoint's size and the tokens of KV cache the engine made room for.

The bounds beside the figures. A token is still routed to top-k experts, so the active
FLOPs per token do not change: prefill, compute-bound, stays at 1x (bound 1). What
shrinks is the weights: the memory they hold (a bigger KV cache at the same memory
utilisation) and the bytes a decode step reads, every weight a step touches once. At
concurrency B a step touches E (1 - (1 - k/E)^B) of a layer's E experts (routing spread
evenly, as load-balanced routers aim for); the decode speed-up cannot pass the ratio of
those bytes (attention, router and lm_head weights included, the embedding's gathered
rows and the KV cache left out, which only lowers the true ratio).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_device import cuda
from benchmarks.gpu_serving import serving_spec
from benchmarks.inputs import random_model
from benchmarks.pages import row, rule

MOE_SHAPE: dict[str, Any] = {
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 48,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}
TINY_MOE = MOE_SHAPE | {
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,  # vLLM's CPU attention takes 32, 64, 80, ...
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
}
"""The same family at a size vLLM serves on a CPU in seconds (the test's run)."""


def measure_experts(args: argparse.Namespace) -> dict[str, Any]:
    """Section 7: the MoE shape dense and without each `--expert-fractions` of its experts,
    each served by its own vLLM engine."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vllm is not installed on this machine (no expert figures)"}
    from pipeline.evaluation.serving import serving_speedup

    spec = serving_spec(args)
    scratch = Path(tempfile.mkdtemp(prefix="lorp-experts-", dir=args.scratch))
    try:
        dense, shape = _saved_dense(args, scratch / "dense")
        out: dict[str, Any] = {"shape": shape, "settings": dataclasses.asdict(spec)}
        out["dtype"] = _dtype(args.device)
        out["variants"] = [_variant(dense, 0.0, shape, spec, args)]
        for fraction in args.expert_fractions:
            out["variants"].append(_variant(dense, fraction, shape, spec, args))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    base = out["variants"][0]
    for v in out["variants"][1:]:
        v |= serving_speedup(_tps(v), _tps(base), v["decode_bound"], 0.02)
        v["prefill_speedup"] = v["prefill_tps"] / base["prefill_tps"]
    return out


def _saved_dense(args: argparse.Namespace, where: Path) -> tuple[Path, dict[str, Any]]:
    """The random MoE model saved to `where` in bf16 (made on the device, then freed), and
    its shape: the config's figures and the parameters a decode step's bytes count."""
    fields = TINY_MOE if args.tiny else MOE_SHAPE
    model = random_model("qwen3_moe", args.device, **fields).to(torch.bfloat16)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    embedding = model.get_input_embeddings().weight.numel()
    total = sum(p.numel() for p in model.parameters())
    layers, n = fields["num_hidden_layers"], fields["num_experts"]
    shape = {
        "blocks": layers,
        "hidden": fields["hidden_size"],
        "experts": n,
        "top_k": fields["num_experts_per_tok"],
        "params_b": total / 1e9,
        "expert_params": experts // (layers * n),  # one expert of one layer
        "read_params": total - experts - embedding,  # read every step besides the experts
    }
    model.save_pretrained(where)
    del model
    gc.collect()
    if cuda(args.device):
        torch.cuda.empty_cache()
    return where, shape


def step_params(shape: dict[str, Any], kept: int, concurrency: int) -> float:
    """Weights a decode step at `concurrency` reads when each layer keeps `kept` experts:
    the expected experts touched (module docstring) and the other read weights."""
    touched = kept * (1 - (1 - shape["top_k"] / kept) ** concurrency)
    return shape["read_params"] + shape["blocks"] * touched * shape["expert_params"]


def _variant(
    dense: Path, fraction: float, shape: dict[str, Any], spec: Any, args: argparse.Namespace
) -> dict[str, Any]:
    """One engine's figures: `dense`, or its files without `fraction` of every layer's
    experts (written beside it, removed after)."""
    from lorp.experts.selection import resolve_expert_budget, select_experts
    from lorp.experts.stats import ExpertStats
    from lorp.models.file_surgery import write_pruned_files

    n, k = shape["experts"], shape["top_k"]
    where, removed = dense, 0
    if fraction:
        removed = resolve_expert_budget(fraction, n, k)
        stats = ExpertStats(range(shape["blocks"]), n)
        cut = select_experts(stats, removed, "random", seed=0).removed
        where = dense.parent / f"experts-{removed}"
        write_pruned_files(dense, where, [], {"experts": "random"}, experts=cut)
    try:
        r = {"fraction": fraction, "kept": n - removed, "checkpoint_gib": _gib(where)}
        r |= _serve(str(where), spec, args.device)
    finally:
        if fraction:
            shutil.rmtree(where, ignore_errors=True)
    dense_step = step_params(shape, n, spec.concurrency)
    r["decode_bound"] = dense_step / step_params(shape, n - removed, spec.concurrency)
    r["flop_bound"] = 1.0  # top-k unchanged: the same active FLOPs per token
    print(
        f"experts kept {r['kept']} of {n}: prefill {r['prefill_tps']:,.0f} tok/s, decode "
        f"{r['serve_output_tps']:,.0f} tok/s (bound {r['decode_bound']:.3f}), "
        f"{r['checkpoint_gib']:.2f} GiB, KV cache {r['kv_tokens']:,} tokens",
        flush=True,
    )
    return r


def _dtype(device: str) -> str:
    """The engine's dtype: the checkpoint's bf16 on a GPU; float32 on a CPU."""
    return "bfloat16" if cuda(device) else "float32"


def _gib(where: Path) -> float:
    return sum(f.stat().st_size for f in where.glob("*.safetensors")) / 2**30


def _serve(model_dir: str, spec: Any, device: str) -> dict[str, Any]:
    """Prefill, then closed-loop serving, on one engine; its KV cache in tokens."""
    from pipeline.evaluation.serving import measure_serving
    from pipeline.evaluation.vllm_engine import free_memory, make_engine

    llm = make_engine(
        model_dir,
        dtype=_dtype(device),
        max_model_len=spec.prompt_len + spec.output_len + 8,
        enforce_eager=not cuda(device),  # CUDA graphs where there are any
        max_num_seqs=spec.concurrency,
        enable_prefix_caching=False,
    )
    try:
        vocab = llm.llm_engine.model_config.get_vocab_size()
        cache = llm.llm_engine.vllm_config.cache_config
        figures = {"kv_tokens": int(cache.num_gpu_blocks * cache.block_size)}
        figures["prefill_tps"] = _prefill_tps(llm, spec, vocab)
        return figures | measure_serving(llm, spec, vocab)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        free_memory()


def _prefill_tps(llm: Any, spec: Any, vocab: int) -> float:
    """Prompt tokens/s of `requests` prompts submitted at once, one output token each:
    the median of `rounds` timed batches (new prompts each) after an untimed one."""
    from vllm import SamplingParams, TokensPrompt

    from pipeline.evaluation.serving import synthetic_prompts

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    rates = []
    for seed in range(spec.rounds + 1):
        prompts = [TokensPrompt(prompt_token_ids=p) for p in synthetic_prompts(spec, vocab, seed)]
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        rates.append(spec.requests * spec.prompt_len / (time.perf_counter() - start))
    return statistics.median(rates[1:])


def _tps(v: dict[str, Any]) -> list[float]:
    return [r["output_tps"] for r in v["serving"]["rounds"]]


def render_experts(section: dict[str, Any]) -> str:
    if "skipped" in section:
        return f"experts: skipped, {section['skipped']}"
    s, m = section["settings"], section["shape"]
    head = ("experts kept", "checkpoint GiB", "KV cache tokens", "prefill tok/s")
    head += ("prefill speed-up (FLOP bound)", "output tok/s", "TPOT ms")
    head += ("decode speed-up [95% interval]", "decode bound (bytes read)")
    lines = [
        f"experts (vLLM; Qwen3-MoE, {m['blocks']} blocks of d {m['hidden']}, {m['experts']} "
        f"experts routed top-{m['top_k']}, {m['params_b']:.1f}B params, {section['dtype']}; "
        f"concurrency {s['concurrency']}, {s['prompt_len']} in / {s['output_len']} out, "
        f"{s['requests']} requests x {s['rounds']} rounds)",
        row(head),
        rule(len(head)),
    ]
    for v in section["variants"]:
        prefill = f"{v['prefill_speedup']:.3f}" if v["fraction"] else "1"
        lines.append(
            f"| {v['kept']} of {m['experts']} | {v['checkpoint_gib']:.2f} | "
            f"{v['kv_tokens']:,} | {v['prefill_tps']:,.0f} | {prefill} ({v['flop_bound']:.0f}) | "
            f"{v['serve_output_tps']:,.0f} | {v['serve_tpot_ms']:.2f} | {_decode(v)} | "
            f"{v['decode_bound']:.3f} |"
        )
    return "\n".join(lines)


def _decode(v: dict[str, Any]) -> str:
    """A variant's decode speed-up over dense, with its interval ("1" for dense)."""
    if not v["fraction"]:
        return "1"
    got = v["serve_speedup"] if v["serve_resolved"] else None
    ratio = f"{got:.3f}" if got is not None else f"not resolved ({v['serve_speedup_measured']:.3f})"
    return ratio + f" [{v['serve_speedup_low']:.3f}, {v['serve_speedup_high']:.3f}]"
