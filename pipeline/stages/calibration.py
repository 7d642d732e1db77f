"""Calibration token shards: windows cut once, written as parquet, one file per Ray task.

Each capture task reads only its own shard, so the driver never ships token tensors
through the object store, and a retried task re-reads exactly the same tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from lorp.atomic import atomic_file
from lorp.data.corpora import Corpus, tokenize_documents
from lorp.data.windows import (
    by_label,
    calibration_fingerprint,
    calibration_windows,
    cut,
    interleave,
    mixed_windows,
    mixture_counts,
    prepend_bos,
    resolve_bos,
    window_offsets,
)
from pipeline.evaluation.corpora import load_any_corpus
from pipeline.spec.calibration import CalibrationSpec


@dataclass(frozen=True)
class CalibrationShards:
    fingerprint: str
    paths: tuple[Path, ...]
    tokens: int
    bos: int | None = None
    """The BOS id every window starts with (None: no BOS)."""


def write_shards(tokenizer: Any, spec: CalibrationSpec, out_dir: Path) -> CalibrationShards:
    """Tokenize, cut `spec.samples` windows and split them into `spec.shards` parquet files.
    Reuses existing shards with the same fingerprint."""
    bos = resolve_bos(tokenizer, spec.bos)
    cut, fp = _windows(tokenizer, spec, spec.samples, spec.seed, bos)
    tok_id = hashlib.sha256(
        (getattr(tokenizer, "name_or_path", "") + str(len(tokenizer))).encode()
    ).hexdigest()[:8]
    key = hashlib.sha256(f"{fp}:{tok_id}:{spec.shards}".encode()).hexdigest()[:16]
    shard_dir = out_dir / key
    paths = tuple(shard_dir / f"shard-{i:04d}.parquet" for i in range(spec.shards))
    if not all(p.is_file() for p in paths):
        windows = cut()
        shard_dir.mkdir(parents=True, exist_ok=True)
        for path, part in zip(paths, np.array_split(windows.numpy(), spec.shards), strict=True):
            _write_parquet(path, part)
    return CalibrationShards(fp, paths, spec.samples * spec.seq_len, bos)


def _windows(tokenizer: Any, spec: CalibrationSpec, n: int, seed: int, bos: int | None):  # type: ignore[no-untyped-def]
    """(a function cutting `n` windows with `seed`, BOS first where it goes; their
    fingerprint). One corpus: `calibration_windows`, its fingerprint as before mixes
    existed; a mix: `mixed_windows`, the fingerprint of every part's and its weight."""
    corpora = [load_any_corpus(c, spec.split, spec.text_field) for c in spec.corpora]
    fps = [calibration_fingerprint(c, n, spec.seq_len, seed, bos_id=bos) for c in corpora]
    named = [
        f"corpus {c!r} ({corpus.split})" for c, corpus in zip(spec.corpora, corpora, strict=True)
    ]

    def cut() -> torch.Tensor:
        docs = [token_documents(tokenizer, c) for c in corpora]
        if isinstance(spec.dataset, str):
            windows = calibration_windows(docs[0], n, spec.seq_len, seed, name=named[0])
        else:
            weights = [w for _, w in spec.parts]
            parts = list(zip(docs, weights, named, strict=True))
            windows = mixed_windows(parts, n, spec.seq_len, seed)
        return prepend_bos(windows, bos) if bos is not None else windows

    if isinstance(spec.dataset, str):
        return cut, fps[0]
    mix = json.dumps([[fp, w] for fp, (_, w) in zip(fps, spec.parts, strict=True)])
    return cut, "mix-" + hashlib.sha256(mix.encode()).hexdigest()[:16]


_TOKENIZED: dict[tuple[str, str, str, int], list[np.ndarray]] = {}
_TOKENIZED_LOCK = threading.Lock()


def token_documents(tokenizer: Any, corpus: Corpus) -> list[np.ndarray]:
    """`tokenize_documents`, remembered in the driver per tokenizer content and corpus:
    a fleet's models often share a tokenizer (a base model's finetunes), and each model
    cuts both its calibration and its held-out windows from the same tokens."""
    key = (_tokenizer_key(tokenizer), corpus.name, corpus.split, len(corpus.documents))
    with _TOKENIZED_LOCK:
        if key not in _TOKENIZED:
            if len(_TOKENIZED) >= 4:
                _TOKENIZED.pop(next(iter(_TOKENIZED)))
            _TOKENIZED[key] = tokenize_documents(tokenizer, corpus)
        return _TOKENIZED[key]


def _tokenizer_key(tokenizer: Any) -> str:
    """What the tokens depend on: the fast tokenizer's whole definition (vocabulary,
    normaliser, pre-tokenizer); a slow tokenizer counts by its path and size."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else ""
    text = text or f"{getattr(tokenizer, 'name_or_path', '')}:{len(tokenizer)}"
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class HeldOutWindows:
    """The held-out calibration windows: int [n, T] (BOS first where the policy puts one),
    the domain of each window's corpus, and the set's fingerprint."""

    windows: np.ndarray
    domains: tuple[str, ...]
    fingerprint: str

    def by_domain(self) -> dict[str, np.ndarray]:
        """Domain -> its windows, domains in the order first met."""
        return by_label(self.windows, self.domains)


def heldout_windows(
    tokenizer: Any, spec: CalibrationSpec, domains: Mapping[str, str] | None = None
) -> HeldOutWindows:
    """`spec.loss_samples` windows from the calibration split (of every corpus of a mix,
    in its share, so every calibration domain has some), for the losses of loss-guided
    methods and the repair's validation. Drawn with `seed + 1` apart from every window
    the fit and S are computed on: no held-out token is a calibration token, by
    construction (`lorp.data.windows.window_offsets(avoid=...)`). `domains`: the job's
    corpus -> domain tags."""
    from pipeline.spec.domains import domain_of

    bos = resolve_bos(tokenizer, spec.bos)
    corpora = [load_any_corpus(c, spec.split, spec.text_field) for c in spec.corpora]
    docs = [token_documents(tokenizer, c) for c in corpora]
    weights = [w for _, w in spec.parts]
    fit_counts = mixture_counts(weights, spec.samples)
    held_counts = mixture_counts(weights, spec.loss_samples)
    mix = len(corpora) > 1
    blocks = []
    for i, (d, name) in enumerate(zip(docs, spec.corpora, strict=True)):
        label = f"corpus {name!r} ({corpora[i].split})"
        fit = window_offsets(d, fit_counts[i], spec.seq_len, spec.seed + i * mix, label)
        held = window_offsets(
            d, held_counts[i], spec.seq_len, spec.seed + 1 + i, f"{label}'s held-out part", fit
        )
        blocks.append(cut(d, held, spec.seq_len))
    windows, source = (
        interleave(blocks, spec.seed + 1)
        if mix
        else (blocks[0], np.zeros(len(blocks[0]), dtype=int))
    )
    windows = prepend_bos(windows, bos) if bos is not None else windows
    fps = [
        calibration_fingerprint(c, spec.loss_samples, spec.seq_len, spec.seed + 1, bos_id=bos)
        for c in corpora
    ]
    key = json.dumps([fps, weights, spec.samples, spec.seed])
    fp = "heldout-apart:" + hashlib.sha256(key.encode()).hexdigest()[:16]
    labels = tuple(domain_of(spec.corpora[int(i)], domains or {}) for i in source)
    return HeldOutWindows(windows.numpy(), labels, fp)


def _write_parquet(path: Path, windows: np.ndarray) -> None:
    arr = pa.FixedSizeListArray.from_arrays(
        pa.array(windows.astype(np.int32).reshape(-1)), windows.shape[1]
    )
    with atomic_file(path) as tmp:
        pq.write_table(pa.table({"input_ids": arr}), tmp)


def read_shard(path: str | os.PathLike[str]) -> torch.Tensor:
    column = pq.read_table(path).column("input_ids").combine_chunks()
    width = column.type.list_size
    flat = column.flatten().to_numpy(zero_copy_only=False)
    return torch.from_numpy(flat.astype(np.int64).reshape(-1, width))
