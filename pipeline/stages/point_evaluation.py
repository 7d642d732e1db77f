"""A grid point's figures on its worker: perplexity, zero-shot and serving, from the
variant in memory (transformers) or from its checkpoint (a vLLM engine), whether the
point removed blocks (`pipeline.stages.points`) or sub-layers
(`pipeline.stages.sublayer_points`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.messages import PointTask
from pipeline.spec.evaluation import EvaluationSpec


def evaluate_point(
    task: PointTask, lm: Any, model_dir: Path, scratch: Path, backend: str | None = None
) -> dict[str, Any]:
    """The point's figures: from the model in memory (transformers), or from `model_dir`,
    the local checkpoint (or the dense model's directory on this node) for vLLM (with
    its serving rounds under `serving` when the spec asks for them). `backend`: the
    task's unless given (a sub-layer variant vLLM cannot serve is judged in memory)."""
    from pipeline.evaluation.backends import (
        TransformersBackend,
        VLLMBackend,
        evaluate,
        open_backend,
    )

    ev, backend = task.evaluation, backend or task.backend
    if backend == "none":
        return {}
    if backend == "transformers":
        with open_backend(TransformersBackend(lm.model, lm.tokenizer, ev.batch_size)) as be:
            return evaluate(be, lm.tokenizer, ev)
    tokenizer = lm.tokenizer
    lm.model = None  # the transformers copy goes before the engine comes
    from lorp.models.variant_manifest import is_manifest, materialize_variant

    if is_manifest(model_dir):  # vLLM reads a standard checkpoint: written to scratch
        model_dir = materialize_variant(model_dir, scratch / "materialized", base_dir=lm.path)
    from pipeline.evaluation.vllm_engine import free_memory

    free_memory()
    max_len = ev.seq_len + 8
    if ev.serving is not None:
        max_len = max(max_len, ev.serving.prompt_len + ev.serving.output_len + 8)
    # a sub-layer checkpoint carries its own code (`lorp.models.nemotron_nas`)
    trust = task.model.trust_remote_code or bool(task.units)
    engine = VLLMBackend(str(model_dir), task.model.dtype, max_len, ev.tensor_parallel_size, trust)
    with open_backend(engine) as be:
        return evaluate(be, tokenizer, ev)


def split_records(
    metrics: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, list[float]], dict[str, str]]:
    """`evaluate`'s result as (its figures, each corpus's per-window mean NLL, each
    task's items right or wrong): the two records go to catalog columns, not figures."""
    rest = dict(metrics)
    return rest, rest.pop("window_nll", None) or {}, rest.pop("zero_shot_items", None) or {}


def zero_shot_info(
    ev: EvaluationSpec, metrics: dict[str, Any], items: dict[str, str] | None = None
) -> dict[str, dict[str, Any]]:
    """Per task: its split, the items scored and (`correct`) each item right (1) or wrong
    (0), in item order, where the backend gave them."""
    from pipeline.evaluation.zero_shot import task_split

    items = items or {}
    return {
        t: {"split": task_split(t), "n": int(metrics[f"n_{t}"])}
        | ({"correct": items[t]} if t in items else {})
        for t in ev.zero_shot
        if f"n_{t}" in metrics
    }
