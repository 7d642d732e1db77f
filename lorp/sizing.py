"""What a checkpoint costs in memory, read from its files before any weight is.

A safetensors file starts with an 8-byte length and a JSON header naming every tensor's
dtype, shape and byte range, so the exact bytes of each block, of the embeddings and of
the LM head at the dtype a stage loads them in are known from a few kilobytes of each
shard. With the job's batch and sequence length that gives each stage's need, and
`decide` picks, per stage, whether the model is held whole in memory (the fastest way,
when it fits) or streamed a module at a time (`lorp.streaming`), or refuses it in one line
when even the largest module's matrices do not fit the worker.

The activation figures are upper bounds of the eager code path (attention scores
materialised, fp32 logits), not measurements: a stage that fits under them fits.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

GIB = 1024**3
# safetensors dtype names and their sizes in bytes.
DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
}  # fmt: skip
FLOATS = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip
"""torch dtypes by their safetensors names (and `TORCH_DTYPES` the other way)."""
TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
_BLOCK_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# Share of a worker's memory a stage may plan to use: the rest is the process itself
# (Python, torch, the tokenizer) and the allocator's slack.
HEADROOM = 0.8

Stage = Literal["capture", "repair", "evaluate"]
Mode = Literal["memory", "streamed"]


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint, as its file's header describes it."""

    key: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    """Absolute byte offset of the data in `file`."""
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def nbytes_as(self, itemsize: int) -> int:
        """Bytes once loaded: floating tensors at the load dtype, others as they are."""
        if self.dtype in FLOATS:
            return self.numel * itemsize
        return self.end - self.start


def read_header(file: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (tensor entries; `__metadata__` dropped) and the byte
    offset where its data starts. Reads the header only."""
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{str(file)!r} is not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{str(file)!r} has no readable safetensors header: {exc}") from None
    header.pop("__metadata__", None)
    return header, 8 + n


def weight_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index names, else `model.safetensors`,
    else every one (hub repositories may ship another format's file beside the shards,
    such as Mistral's `consolidated.safetensors`)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    return sorted(path.glob("*.safetensors"))


def tensor_index(path: Path) -> dict[str, TensorEntry]:
    """Every tensor of the checkpoint directory `path`, over all its shards."""
    files = weight_files(path)
    if not files:
        raise ValueError(f"model directory {str(path)!r} has no .safetensors weights to size")
    out: dict[str, TensorEntry] = {}
    for file in files:
        header, base = read_header(file)
        for key, e in header.items():
            start, end = e["data_offsets"]
            out[key] = TensorEntry(
                key, file, e["dtype"], tuple(e["shape"]), base + start, base + end
            )
    return out


def block_of(key: str) -> int | None:
    """The block index a tensor belongs to (`...layers.<i>.`), None outside the blocks."""
    m = _BLOCK_KEY.search(key)
    return int(m.group(1)) if m else None


def split_block_key(key: str) -> tuple[str, int, str] | None:
    """(prefix up to `layers.`, block index, the name inside the block), None outside the
    blocks: from the same match as `block_of`, so a name that repeats `layers.<i>.`
    inside a block is split where the block's index is."""
    m = _BLOCK_KEY.search(key)
    if m is None:
        return None
    return key[: m.start(1)], int(m.group(1)), key[m.end() :]


@dataclass(frozen=True)
class WeightSize:
    """A checkpoint's weight bytes at one load dtype, by part."""

    blocks: tuple[int, ...]
    embeddings: int
    head: int
    """0 when the LM head is tied to the embeddings (or absent)."""
    other: int
    """Final norm and anything else outside the blocks."""
    vectors: int
    """Bytes of every tensor under 2 dimensions (norms, biases): what a streamed model
    keeps resident."""
    largest_unit: int
    """The most matrix bytes one module owns (a projection, the embeddings, the head):
    what a streamed model reads at once (`lorp.streaming`)."""

    @property
    def total(self) -> int:
        return sum(self.blocks) + self.embeddings + self.head + self.other

    @property
    def largest_block(self) -> int:
        return max(self.blocks, default=0)

    @property
    def resident(self) -> int:
        """What a streamed model keeps between forwards: the vectors."""
        return self.vectors


def weight_size(index: Mapping[str, TensorEntry], dtype: torch.dtype) -> WeightSize:
    """Bytes per part of the checkpoint `index` (see `tensor_index`) loaded as `dtype`."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_block: dict[int, int] = {}
    per_module: dict[str, int] = {}
    embeddings = head = other = vectors = 0
    for key, entry in index.items():
        nbytes = entry.nbytes_as(itemsize)
        if len(entry.shape) < 2:
            vectors += nbytes
        else:
            module = key.rpartition(".")[0]
            per_module[module] = per_module.get(module, 0) + nbytes
        b = block_of(key)
        if b is not None:
            per_block[b] = per_block.get(b, 0) + nbytes
        elif "embed_tokens" in key:
            embeddings += nbytes
        elif key.startswith("lm_head."):
            head += nbytes
        else:
            other += nbytes
    n = max(per_block, default=-1) + 1
    missing = [i for i in range(n) if i not in per_block]
    if missing:
        raise ValueError(f"checkpoint has no tensors for blocks {missing}")
    largest = max(per_module.values(), default=0)
    blocks = tuple(per_block[i] for i in range(n))
    return WeightSize(blocks, embeddings, head, other, vectors, largest)


@dataclass(frozen=True)
class Shape:
    """The config figures activation memory depends on."""

    hidden: int
    intermediate: int
    heads: int
    head_dim: int
    kv_heads: int
    vocab: int
    n_blocks: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Shape:
        c = config.get("text_config") or config
        d = int(c["hidden_size"])
        heads = int(c.get("num_attention_heads") or 1)
        return cls(
            hidden=d,
            intermediate=int(c.get("intermediate_size") or 4 * d),
            heads=heads,
            head_dim=int(c.get("head_dim") or d // heads),
            kv_heads=int(c.get("num_key_value_heads") or heads),
            vocab=int(c.get("vocab_size") or 0),
            n_blocks=int(c["num_hidden_layers"]),
        )


def block_activations(shape: Shape, batch: int, seq_len: int, itemsize: int) -> int:
    """Upper bound of one block's forward on a [batch, seq_len] batch: the residual in
    and out, q/k/v/o, the MLP's three intermediate tensors and the attention scores
    (eager: fp32 [batch, heads, T, T], twice for the softmax)."""
    t = batch * seq_len
    qkvo = t * (2 * shape.heads + 2 * shape.kv_heads) * shape.head_dim
    return (
        itemsize * t * (4 * shape.hidden + 3 * shape.intermediate)
        + itemsize * qkvo
        + (2 * 4 * batch * shape.heads * seq_len * seq_len)
    )


def stage_activations(stage: Stage, shape: Shape, batch: int, seq_len: int, itemsize: int) -> int:
    """Activation bytes of a stage's batch on top of the weights: one block's forward,
    plus what the stage keeps across blocks. Capture keeps every block's normalised
    input (fp32 [N + 1, tokens, d], Eq. 3); evaluation keeps the logits (fp32, and the
    model dtype's copy); the repair's capture keeps two states per run, bounded apart
    (`repair_memory_gib`)."""
    work = block_activations(shape, batch, seq_len, itemsize)
    tokens = batch * seq_len
    if stage == "capture":
        return work + 4 * (shape.n_blocks + 1) * tokens * shape.hidden
    if stage == "evaluate":
        return work + (4 + itemsize) * tokens * shape.vocab
    return work + 2 * 4 * tokens * shape.hidden


@dataclass(frozen=True)
class Decision:
    """Whether one stage holds the model whole or streams it, and why."""

    stage: Stage
    mode: Mode
    need_bytes: int
    """Peak the chosen mode plans for (weights held plus activations)."""
    memory_bytes: int
    """Weights whole plus activations: what the in-memory path would need."""
    worker_bytes: int
    batch: int = 1
    """Windows per forward: the job's batch held whole; streamed, as many as fit (every
    forward of a streamed model reads every block once, so fewer, larger batches read
    the files fewer times)."""
    kept_bytes: int = 0
    """What the stage may hold besides weights and activations (repair sums)."""
    copies: int = 1
    """Whole copies of the model a worker may hold (held whole; see `decide`)."""

    def line(self, label: str) -> str:
        return (
            f"{label}: {self.stage} {self.mode} (held whole it needs {gib(self.memory_bytes)}, "
            f"a worker has {gib(self.worker_bytes)}; streamed {gib(self.need_bytes)}, "
            f"{self.batch} windows per pass)"
        )

    def record(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "need_gib": round(self.need_bytes / GIB, 3),
            "memory_gib": round(self.memory_bytes / GIB, 3),
            "worker_gib": round(self.worker_bytes / GIB, 3),
            "batch": self.batch,
            "kept_gib": round(self.kept_bytes / GIB, 3),
        }


def gib(n: int) -> str:
    """Bytes as GiB with three significant figures (a tiny test model reads 0.0005)."""
    return f"{n / GIB:.3g} GiB"


class TooLargeError(ValueError):
    """Even one module's matrices at a time do not fit the largest worker."""


def decide(
    stage: Stage,
    size: WeightSize,
    shape: Shape,
    *,
    worker_bytes: int,
    batch: int,
    seq_len: int,
    itemsize: int,
    label: str = "model",
    max_batch: int | None = None,
    kept_bytes: tuple[int, int] = (0, 0),
    copies: int = 1,
) -> Decision:
    """In memory when the whole model and the stage's activations fit `HEADROOM` of the
    worker; else streamed, when the resident vectors, the largest module twice and the
    activations fit, with as many windows per forward as fit (up to `max_batch`); else
    `TooLargeError` naming the model, the need and the worker.

    `kept_bytes` (most, least): what the stage holds besides, as much as it may and at
    least what it must (a capture worker's repair sums: more runs per pass, or one run's
    sums and more passes). The decision's `kept_bytes` is what it gets. `copies`: how
    many copies of the whole model the in-memory path would like to hold (a CPU grid
    worker keeps the model it loaded and works on a copy); held whole with fewer where
    only those fit (the decision's `copies`)."""
    most, least = kept_bytes
    max_batch = batch if max_batch is None else max(batch, max_batch)
    acts = stage_activations(stage, shape, batch, seq_len, itemsize)
    budget = int(worker_bytes * HEADROOM)
    for n in range(copies, 0, -1):  # the copies asked for, else fewer, else streamed
        whole = n * size.total + acts
        if whole + most <= budget:
            return Decision(
                stage, "memory", whole + most, whole + most, worker_bytes, batch, most, n
            )
    # The largest module's matrices twice: the ones in use and, while they are read, the
    # file's copy before its conversion to the load dtype (or a fold's override).
    weights = size.resident + 2 * size.largest_unit
    streamed = weights + acts
    if streamed + least <= budget:
        # Activations grow linearly with the batch: the largest that fits beside the
        # least kept, up to `max_batch` (a worker's shard; more would only be padding),
        # since every batch reads the files once; then as much kept as is left.
        per_window = stage_activations(stage, shape, 1, seq_len, itemsize)
        room = budget - weights - least
        larger = int(max(batch, min(max_batch, room // max(per_window, 1))))
        acts = stage_activations(stage, shape, larger, seq_len, itemsize)
        kept = min(most, budget - weights - acts)
        need = weights + acts + kept
        return Decision(stage, "streamed", need, whole + most, worker_bytes, larger, kept)
    raise TooLargeError(
        f"model {label!r} cannot run its {stage} even streamed a module at a time: it needs "
        f"{gib(streamed + least)} (resident {gib(size.resident)}, largest module's "
        f"matrices {gib(size.largest_unit)} twice, activations {gib(acts)}"
        + (f", repair sums {gib(least)}" if least else "")
        + f") and the largest worker has {gib(worker_bytes)} ({HEADROOM:.0%} usable)"
    )
