"""Evaluation backends behind one interface: perplexity of token windows and zero-shot
accuracy, with a context manager that really frees the engine.

- `TransformersBackend` scores the model already in memory (the grid point's pruned model).
- `VLLMBackend` starts one vLLM engine over a saved checkpoint and serves both perplexity
  (prompt log-probabilities) and zero-shot (lm-eval's `VLLM` wraps that same engine), so a
  point starts one engine, not two; with `evaluation.serving` the same engine then serves
  synthetic requests for throughput (`pipeline.evaluation.serving`). Pitfalls: engines
  start only in a subprocess or a Ray actor (vLLM re-imports `__main__`); see
  `pipeline.evaluation.vllm_engine`.

`evaluate` is the one per-corpus loop both backends share.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from pipeline.spec.evaluation import EvaluationSpec, ServingSpec

BACKEND_NAMES = ("transformers", "vllm")


class Backend(Protocol):
    name: str

    def perplexity(self, windows: torch.Tensor) -> float:
        """exp(mean NLL) over non-overlapping windows [n, T] (position 0 is not scored)."""
        ...

    def window_losses(self, windows: torch.Tensor) -> list[float]:
        """The mean NLL of each window [n, T], in order (perplexity: exp of their mean)."""
        ...

    def zero_shot(self, tasks: list[str], limit: int | None) -> dict[str, Any]:
        """`acc_<task>` (percent), `n_<task>` (items scored), `acc_avg`, and under
        `zero_shot_items` each task's items right (1) or wrong (0), in item order."""
        ...

    def close(self) -> None:
        """Free the engine and its memory; the backend is unusable afterwards."""
        ...


class TransformersBackend:
    name = "transformers"

    def __init__(self, model: Any, tokenizer: Any, batch_size: int = 4) -> None:
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size

    def perplexity(self, windows: torch.Tensor) -> float:
        from lorp.models.perplexity import perplexity

        return perplexity(self.model, windows, batch_size=self.batch_size)

    def window_losses(self, windows: torch.Tensor) -> list[float]:
        from lorp.models.perplexity import window_losses

        return window_losses(self.model, windows, batch_size=self.batch_size)

    def zero_shot(self, tasks: list[str], limit: int | None) -> dict[str, Any]:
        from pipeline.evaluation.zero_shot import hf_zero_shot

        return hf_zero_shot(
            self.model, self.tokenizer, tasks, limit=limit, batch_size=self.batch_size, items=True
        )

    def close(self) -> None:
        self.model = self.tokenizer = None  # the caller owns the model; drop our references


class VLLMBackend:
    name = "vllm"

    def __init__(
        self,
        model_dir: str,
        dtype: str,
        max_model_len: int,
        tp: int = 1,
        trust_remote_code: bool = False,
    ) -> None:
        """`trust_remote_code` as the model's spec allows (a custom-code checkpoint fails
        in vLLM without it)."""
        from pipeline.evaluation.vllm_engine import prepare_vllm

        prepare_vllm()  # before lm-eval's vllm module: it asks for vLLM's version on import
        from lm_eval.models.vllm_causallms import VLLM

        # lm-eval's wrapper owns the engine (`.model`); perplexity reuses that engine.
        self._lm: Any = VLLM(
            pretrained=model_dir,
            dtype=dtype,
            enforce_eager=True,
            max_model_len=max_model_len,
            tensor_parallel_size=tp,
            trust_remote_code=trust_remote_code,
        )

    def perplexity(self, windows: torch.Tensor) -> float:
        from pipeline.evaluation.vllm_engine import perplexity_vllm

        return perplexity_vllm(self._lm.model, windows.tolist())

    def window_losses(self, windows: torch.Tensor) -> list[float]:
        from pipeline.evaluation.vllm_engine import window_losses_vllm

        return window_losses_vllm(self._lm.model, windows.tolist())

    def zero_shot(self, tasks: list[str], limit: int | None) -> dict[str, Any]:
        from pipeline.evaluation.zero_shot import evaluate_zero_shot

        return evaluate_zero_shot(self._lm, tasks, limit=limit, items=True)

    def serving(self, spec: ServingSpec) -> dict[str, Any]:
        """Serving throughput of this engine (`pipeline.evaluation.serving`)."""
        from pipeline.evaluation.serving import measure_serving

        llm = self._lm.model
        return measure_serving(llm, spec, llm.llm_engine.model_config.get_vocab_size())

    def close(self) -> None:
        from pipeline.evaluation.vllm_engine import free_memory

        self._lm = None  # the only reference: the engine goes with it
        free_memory()


@contextmanager
def open_backend(backend: Backend) -> Iterator[Backend]:
    try:
        yield backend
    finally:
        backend.close()


def evaluate(backend: Backend, tokenizer: Any, spec: EvaluationSpec) -> dict[str, Any]:
    """Perplexity on every configured corpus (each window's mean NLL under `window_nll`,
    per corpus: a paired comparison of two variants resamples them), then the zero-shot
    tasks, then (vLLM only) serving: its medians as metrics, its rounds under `serving`."""
    from pipeline.evaluation.corpora import corpus_windows, metric_name
    from pipeline.evaluation.peak_memory import mark_phase

    metrics: dict[str, Any] = {}
    per_window = {}
    for corpus in spec.perplexity:
        mark_phase(f"perplexity {corpus}")
        losses = backend.window_losses(corpus_windows(tokenizer, corpus, spec))
        name = metric_name(corpus)
        metrics[name] = math.exp(math.fsum(losses) / len(losses))  # windows of one length
        per_window[name.removeprefix("ppl_")] = [round(x, 6) for x in losses]
    if per_window:
        metrics["window_nll"] = per_window
    if spec.zero_shot:
        mark_phase("zero-shot")
        metrics |= backend.zero_shot(list(spec.zero_shot), spec.zero_shot_limit)
    if spec.serving is not None and isinstance(backend, VLLMBackend):
        metrics |= backend.serving(spec.serving)
    return metrics
