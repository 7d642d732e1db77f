"""Evaluation of a (pruned or dense) model: perplexity on the configured corpora.

Perplexity follows the paper: non-overlapping `seq_len` windows of the test split,
exp(mean NLL) over all predicted tokens (`lorp.perplexity`). Metric names are the catalog
columns: `ppl_<corpus>`.
"""

from __future__ import annotations

import re
from typing import Any

from lorp.data import eval_windows, tokenize_documents
from lorp.perplexity import perplexity
from pipeline.calibration import load_any_corpus
from pipeline.spec import EvaluationSpec

EVAL_SPLITS = {"ptb": "test", "wikitext2": "test", "wikitext": "test", "c4": "validation"}


def metric_name(corpus: str) -> str:
    stem = re.sub(r"[^a-z0-9]+", "_", corpus.lower().rsplit("/", 1)[-1].rsplit(".", 1)[0])
    return f"ppl_{stem.strip('_')}"


def corpus_windows(tokenizer: Any, corpus: str, spec: EvaluationSpec) -> Any:
    name = "wikitext" if corpus == "wikitext2" else corpus
    docs = load_any_corpus(name, EVAL_SPLITS.get(corpus, "test"))
    ids = tokenize_documents(tokenizer, docs)
    joined = [t for d in ids for t in d.tolist()]
    return eval_windows(joined, spec.seq_len, spec.max_windows)


def resolve_backend(spec: EvaluationSpec, num_gpus: float) -> str:
    """auto: vLLM where there is a GPU for it and vllm imports; transformers otherwise."""
    if spec.backend != "auto":
        return spec.backend
    import importlib.util

    return "vllm" if num_gpus > 0 and importlib.util.find_spec("vllm") else "transformers"


def evaluate_model(model: Any, tokenizer: Any, spec: EvaluationSpec) -> dict[str, float]:
    """The transformers backend: perplexity per corpus, then the zero-shot tasks."""
    metrics = {}
    for corpus in spec.perplexity:
        windows = corpus_windows(tokenizer, corpus, spec)
        metrics[metric_name(corpus)] = perplexity(model, windows, batch_size=spec.batch_size)
    if spec.zero_shot:
        from pipeline.zero_shot import hf_zero_shot

        metrics |= hf_zero_shot(
            model,
            tokenizer,
            list(spec.zero_shot),
            limit=spec.zero_shot_limit,
            batch_size=spec.batch_size,
        )
    return metrics
