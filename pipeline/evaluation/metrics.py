"""Evaluation corpora: perplexity windows and metric names, shared by every backend.

Perplexity follows the paper: non-overlapping `seq_len` windows of the test split,
exp(mean NLL) over all predicted tokens (`lorp.models.perplexity`). With a BOS policy that adds
one (`evaluation.bos`, see `lorp.data`), every window is BOS + `seq_len` text tokens, so
each text token is predicted exactly once. Metric names are the catalog columns:
`ppl_<corpus>`.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from lorp.data.corpora import tokenize_documents
from lorp.data.windows import eval_windows, prepend_bos, resolve_bos
from pipeline.evaluation.corpora import HUB_CORPORA, load_any_corpus
from pipeline.spec.evaluation import EvaluationSpec

# The split perplexity reads, per corpus name; anything else (ptb, local files): "test".
EVAL_SPLITS = {"ptb": "test"} | {name: c.eval_split for name, c in HUB_CORPORA.items()}


def metric_name(corpus: str) -> str:
    stem = re.sub(r"[^a-z0-9]+", "_", corpus.lower().rsplit("/", 1)[-1].rsplit(".", 1)[0])
    return f"ppl_{stem.strip('_')}"


def corpus_windows(tokenizer: Any, corpus: str, spec: EvaluationSpec) -> torch.Tensor:
    """The corpus's evaluation windows [n, seq_len (+1 with BOS)]."""
    docs = load_any_corpus(corpus, EVAL_SPLITS.get(corpus, "test"))
    ids = tokenize_documents(tokenizer, docs)
    joined = [t for d in ids for t in d.tolist()]
    windows = eval_windows(joined, spec.seq_len, spec.max_windows)
    bos = resolve_bos(tokenizer, spec.bos)
    return prepend_bos(windows, bos) if bos is not None else windows
