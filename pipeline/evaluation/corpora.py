"""Corpora by name: packaged aliases and local files (`lorp.data`), and hub corpora by short
name: the repository, config and files each split reads (`load_any_corpus` loads any).

The pruning literature does not read all of C4 (~300 GB in `en` alone): SparseGPT, Wanda
and ShortGPT take calibration text from the first `en` train shard and C4 perplexity from
the first `en` validation shard, through `datasets.load_dataset("allenai/c4",
data_files={split: file}, split=split)`. WikiText-2 is the raw v1 config, perplexity on
its test split. A split with no pinned file is refused rather than fetched whole.

Perplexity reads each corpus's `eval_split` (`EVAL_SPLITS`); calibration reads the split
its spec names. Perplexity follows the paper: non-overlapping `seq_len` windows of the
test split (`corpus_windows`), exp(mean NLL) over all predicted tokens
(`lorp.models.perplexity`). With a BOS policy that adds one (`evaluation.bos`, see
`lorp.data`), every window is BOS + `seq_len` text tokens, so each text token is
predicted exactly once. A corpus's figure is the catalog column `ppl_<corpus>`
(`metric_name`).
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lorp.data.corpora import CORPUS_ALIASES, Corpus, load_corpus, tokenize_documents
from lorp.data.windows import eval_windows, prepend_bos, resolve_bos
from pipeline.spec.evaluation import EvaluationSpec


@dataclass(frozen=True)
class HubCorpus:
    repo: str
    """Dataset repository on the Hugging Face hub."""
    config: str | None = None
    """Config (subset) name; None when `data_files` pins the files instead."""
    data_files: Mapping[str, str] = field(default_factory=dict)
    """split -> file in the repository. When set, only these splits exist."""
    eval_split: str = "test"
    """The split perplexity is measured on."""

    def load_args(self, split: str) -> dict[str, Any]:
        """Keyword arguments of `datasets.load_dataset` for `split`."""
        args: dict[str, Any] = {"path": self.repo, "split": split}
        if self.config is not None:
            args["name"] = self.config
        if self.data_files:
            if split not in self.data_files:
                known = ", ".join(self.data_files)
                raise ValueError(f"{self.repo} has no split {split!r} here (splits: {known})")
            args["data_files"] = {split: self.data_files[split]}
        return args


C4 = HubCorpus(
    "allenai/c4",
    data_files={
        "train": "en/c4-train.00000-of-01024.json.gz",
        "validation": "en/c4-validation.00000-of-00008.json.gz",
    },
    eval_split="validation",
)
WIKITEXT2 = HubCorpus("Salesforce/wikitext", "wikitext-2-raw-v1")

# Every name a job spec may use for a hub corpus; other hub ids load as they are.
HUB_CORPORA: dict[str, HubCorpus] = {
    "c4": C4,
    "allenai/c4": C4,
    "wikitext2": WIKITEXT2,
    "wikitext": WIKITEXT2,
}


def hub_corpus(name: str) -> HubCorpus | None:
    """The table entry for a short name or hub id, None for anything else."""
    return HUB_CORPORA.get(name)


def load_any_corpus(name: str, split: str, text_field: str = "text") -> Corpus:
    """A local file or packaged alias (lorp.data), else a hub dataset through `datasets`:
    a short name of `HUB_CORPORA` (c4, wikitext2) or any hub id as it is."""
    if name in CORPUS_ALIASES or Path(name).expanduser().exists():
        return load_corpus(name, split)
    hub = hub_corpus(name)
    if hub is None and "/" not in name:
        return load_corpus(name, split)  # the one-line "unknown corpus" error
    try:
        args = hub.load_args(split) if hub else {"path": name, "split": split}
        import datasets

        ds = datasets.load_dataset(**args)
    except Exception as exc:  # offline or unknown: one line, the library's reason
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise ValueError(f"dataset {name!r} ({split}) cannot be loaded: {reason}") from None
    if text_field not in ds.column_names:
        raise ValueError(f"dataset {name!r} has no column {text_field!r} ({ds.column_names})")
    docs = tuple(t for t in ds[text_field] if t and t.strip())
    if not docs:
        raise ValueError(f"dataset {name!r} ({split}) is empty")
    return Corpus(name, split, docs)


# The split perplexity reads, per corpus name; anything else (ptb, local files): "test".
EVAL_SPLITS = {"ptb": "test"} | {name: c.eval_split for name, c in HUB_CORPORA.items()}


def metric_name(corpus: str) -> str:
    stem = re.sub(r"[^a-z0-9]+", "_", corpus.lower().rsplit("/", 1)[-1].rsplit(".", 1)[0])
    return f"ppl_{stem.strip('_')}"


_WINDOWS: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)
"""Tokenizer -> (corpus, seq_len, max_windows, bos) -> its windows, cut once per process."""


def corpus_windows(tokenizer: Any, corpus: str, spec: EvaluationSpec) -> torch.Tensor:
    """The corpus's evaluation windows [n, seq_len (+1 with BOS)], cut once per tokenizer
    in a process: every point of a worker scores the same few windows, and cutting them
    tokenises the whole corpus (seconds, and tens of MB held meanwhile)."""
    key = (corpus, spec.seq_len, spec.max_windows, spec.bos)
    cached = _WINDOWS.setdefault(tokenizer, {})
    if key not in cached:
        cached[key] = _cut_windows(tokenizer, corpus, spec)
    return cached[key]


def _cut_windows(tokenizer: Any, corpus: str, spec: EvaluationSpec) -> torch.Tensor:
    docs = load_any_corpus(corpus, EVAL_SPLITS.get(corpus, "test"))
    ids = tokenize_documents(tokenizer, docs)
    joined = [t for d in ids for t in d.tolist()]
    windows = eval_windows(joined, spec.seq_len, spec.max_windows)
    bos = resolve_bos(tokenizer, spec.bos)
    return prepend_bos(windows, bos) if bos is not None else windows
