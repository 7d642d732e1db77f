"""Calibration token shards: windows cut once, written as parquet, one file per Ray task.

Each capture task reads only its own shard, so the driver never ships token tensors
through the object store, and a retried task re-reads exactly the same tokens.
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from lorp.atomic import atomic_file
from lorp.data import (
    Corpus,
    calibration_fingerprint,
    calibration_windows,
    prepend_bos,
    resolve_bos,
    tokenize_documents,
)
from pipeline.evaluation.corpora import load_any_corpus
from pipeline.spec import CalibrationSpec


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
    corpus = load_any_corpus(spec.dataset, spec.split, spec.text_field)
    bos = resolve_bos(tokenizer, spec.bos)
    fp = calibration_fingerprint(corpus, spec.samples, spec.seq_len, spec.seed, bos_id=bos)
    tok_id = hashlib.sha256(
        (getattr(tokenizer, "name_or_path", "") + str(len(tokenizer))).encode()
    ).hexdigest()[:8]
    key = hashlib.sha256(f"{fp}:{tok_id}:{spec.shards}".encode()).hexdigest()[:16]
    shard_dir = out_dir / key
    paths = tuple(shard_dir / f"shard-{i:04d}.parquet" for i in range(spec.shards))
    if not all(p.is_file() for p in paths):
        windows = calibration_windows(
            token_documents(tokenizer, corpus),
            spec.samples,
            spec.seq_len,
            spec.seed,
            name=f"corpus {spec.dataset!r} ({corpus.split})",
        )
        if bos is not None:
            windows = prepend_bos(windows, bos)
        shard_dir.mkdir(parents=True, exist_ok=True)
        for path, part in zip(paths, np.array_split(windows.numpy(), spec.shards), strict=True):
            _write_parquet(path, part)
    return CalibrationShards(fp, paths, spec.samples * spec.seq_len, bos)


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


def heldout_windows(tokenizer: Any, spec: CalibrationSpec) -> tuple[np.ndarray, str]:
    """`spec.loss_samples` windows from the calibration split, drawn with `seed + 1`, for the
    losses of loss-guided methods (never part of S), and their fingerprint."""
    corpus = load_any_corpus(spec.dataset, spec.split, spec.text_field)
    bos = resolve_bos(tokenizer, spec.bos)
    seed = spec.seed + 1
    windows = calibration_windows(
        token_documents(tokenizer, corpus),
        spec.loss_samples,
        spec.seq_len,
        seed,
        name=f"corpus {spec.dataset!r} ({corpus.split})",
    )
    if bos is not None:
        windows = prepend_bos(windows, bos)
    fp = calibration_fingerprint(corpus, spec.loss_samples, spec.seq_len, seed, bos_id=bos)
    return windows.numpy(), f"heldout:{fp}"


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
