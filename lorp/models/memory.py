"""What a checkpoint costs in memory, read from its files before any weight is.

A safetensors file starts with an 8-byte length and a JSON header naming every tensor's
dtype, shape and byte range (`lorp.models.safetensors_index`), so the exact bytes of each
block, of the embeddings and of the LM head at the dtype a stage loads them in are known
from a few kilobytes of each shard. With the job's batch and sequence length that gives
each stage's need; the pipeline's policy (`pipeline.plan.decisions`) then holds the
model whole, streams it a module at a time (`lorp.models.streaming`) or refuses it.

The activation figures are upper bounds of the eager code path (attention scores
materialised, the logits and one chunk's float32 scoring), not measurements: a stage that
fits under them fits. Loading a file stored in another dtype than the load's holds the
file's copy too, measured (`WeightSize.load_peak`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from lorp.models.perplexity import NLL_CHUNK
from lorp.models.safetensors_index import DTYPE_NAMES, FLOATS, TensorEntry, block_of

if TYPE_CHECKING:
    from lorp.models.disk_names import DiskLayout
from lorp.models.shape import ModelShape

GIB = 1024**3

Stage = Literal["capture", "repair", "evaluate"]


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
    """The most matrix bytes one module owns (a projection, the embeddings, the head, a
    mixture's expert banks), and, for banks built from their experts' tensors, those
    tensors while one is built: what a streamed model holds at once
    (`lorp.models.streaming`, `unit_peak`)."""
    converted: int = 0
    """File bytes of the floating tensors stored in another dtype than the load's (a
    float32 file loaded as bfloat16): a whole load holds them, read from the file, beside
    the converted weights until it ends (`load_peak`)."""

    @property
    def total(self) -> int:
        return sum(self.blocks) + self.embeddings + self.head + self.other

    @property
    def largest_block(self) -> int:
        return max(self.blocks, default=0)

    @property
    def load_peak(self) -> int:
        """What loading the model whole holds at its end: the weights at the load dtype
        and the file's copy of every tensor it converted (measured: SmolLM2-135M's float32
        file loaded as bfloat16 peaks at 0.77 GiB for 0.25 GiB of weights)."""
        return self.total + self.converted

    @property
    def resident(self) -> int:
        """What a streamed model keeps between forwards: the vectors."""
        return self.vectors


def weight_size(
    index: Mapping[str, TensorEntry],
    dtype: torch.dtype,
    layout: DiskLayout | None = None,
    model: nn.Module | None = None,
) -> WeightSize:
    """Bytes per part of the checkpoint `index` (see `tensor_index`) loaded as `dtype`.
    `layout`: where the files keep the text blocks (`lorp.models.disk_names`; default: any
    `layers.<i>.`), so another tower's blocks count as the model's other tensors. `model`:
    the model the files load into, on the meta device (`disk_names.model_of`), whose
    modules are the streamed units (`unit_peak`); without it the files' modules are (as
    they are where the files name the model's tensors: not a mixture's per-expert files)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_block: dict[int, int] = {}
    per_module: dict[str, int] = {}
    embeddings = head = other = vectors = converted = 0
    load_name = DTYPE_NAMES.get(dtype)
    for key, entry in index.items():
        nbytes = entry.nbytes_as(itemsize)
        if entry.dtype in FLOATS and entry.dtype != load_name:
            converted += entry.end - entry.start
        if len(entry.shape) < 2:
            vectors += nbytes
        else:
            module = key.rpartition(".")[0]
            per_module[module] = per_module.get(module, 0) + nbytes
        b = layout.block_of(key) if layout is not None else block_of(key)
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
    if model is not None:
        largest = unit_peak(model, index, itemsize)
    blocks = tuple(per_block[i] for i in range(n))
    return WeightSize(blocks, embeddings, head, other, vectors, largest, converted)


def unit_peak(model: nn.Module, index: Mapping[str, TensorEntry], itemsize: int) -> int:
    """The most bytes one streamed unit of `model` (`lorp.models.streaming`) holds while
    it loads, its matrices at `itemsize` bytes a value: every matrix of the module, and
    while a bank is built from its experts' tensors (`lorp.models.conversions`), those
    tensors beside it. transformers' converter reads them all, stacks them (the parts
    and their stack held), then joins gate and up (the stacks and the bank held): the
    bank's bytes once more at most, measured in `tests/lorp/models/test_conversions.py`.
    A bank the files keep whole (gpt-oss) is read as a matrix is."""
    from lorp.models.conversions import FusedEntry, model_entries

    held: dict[str, int] = {}
    building: dict[str, int] = {}
    for name, entry in model_entries(model, index).items():
        if len(entry.shape) < 2:
            continue  # a vector: resident, counted apart
        module = name.rpartition(".")[0]
        held[module] = held.get(module, 0) + entry.nbytes_as(itemsize)
        if isinstance(entry, FusedEntry):
            parts = sum(p.nbytes_as(itemsize) for _, p in entry.parts)
            building[module] = max(building.get(module, 0), parts)
    return max((n + building.get(m, 0) for m, n in held.items()), default=0)


def block_activations(shape: ModelShape, batch: int, seq_len: int, itemsize: int) -> int:
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


def stage_activations(
    stage: Stage,
    shape: ModelShape,
    batch: int,
    seq_len: int,
    itemsize: int,
    states: int | None = None,
) -> int:
    """Activation bytes of a stage's batch on top of the weights: one block's forward,
    plus what the stage keeps across blocks. Capture keeps every block's normalised
    input (fp32 [N + 1, tokens, d], Eq. 3; `states`: 2N + 1 for the sub-layer S);
    evaluation keeps the logits in the model's dtype and scores them a window's chunk of
    rows at a time (`lorp.models.perplexity.nll_rows`: logsumexp's shifted copy of at
    most `NLL_CHUNK` logits, and their float32 copy where the model's are not); the
    repair's capture keeps two states per run, bounded apart (`repair_memory_gib`)."""
    work = block_activations(shape, batch, seq_len, itemsize)
    tokens = batch * seq_len
    if stage == "capture":
        kept = shape.n_blocks + 1 if states is None else states
        return work + 4 * kept * tokens * shape.hidden
    if stage == "evaluate":
        rows = min(seq_len, max(1, NLL_CHUNK // max(shape.vocab, 1)))  # one window's
        copies = 1 if itemsize == 4 else 2  # float32 logits are scored in place
        return work + itemsize * tokens * shape.vocab + copies * 4 * rows * shape.vocab
    return work + 2 * 4 * tokens * shape.hidden


def gib(n: int) -> str:
    """Bytes as GiB with three significant figures (a tiny test model reads 0.0005)."""
    return f"{n / GIB:.3g} GiB"


Mode = Literal["memory", "streamed"]


@dataclass(frozen=True)
class Decision:
    """Whether one stage holds the model whole or streams it, and why."""

    stage: Stage
    mode: Mode
    need_bytes: int
    """Peak the chosen mode plans for, in the worker's own (anonymous) memory: the weights
    held plus activations and what is kept. A point that keeps nothing (no repair) needs
    `kept_bytes` less."""
    memory_bytes: int
    """What the in-memory path would need of the worker: its copies, activations and
    what is kept, or the load's peak (the file's pages mapped beside the weights) where
    that is more."""
    worker_bytes: int
    batch: int = 1
    """Windows per forward: the job's batch held whole; streamed, as many as fit (every
    forward of a streamed model reads every block once, so fewer, larger batches read
    the files fewer times)."""
    kept_bytes: int = 0
    """What the stage may hold besides weights and activations (repair sums)."""
    copies: int = 1
    """Whole copies of the model a worker may hold (held whole; see `decide`)."""
    source: str = ""
    """Where `worker_bytes` came from: the spec's `memory_gib`, or the node's figures."""

    def line(self, label: str) -> str:
        return (
            f"{label}: {self.stage} {self.mode} (held whole it needs {gib(self.memory_bytes)}, "
            f"a worker has {gib(self.worker_bytes)}; streamed {gib(self.need_bytes)}, "
            f"{self.batch} windows per pass)" + (f" [{self.source}]" if self.source else "")
        )

    def record(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "need_gib": round(self.need_bytes / GIB, 3),
            "memory_gib": round(self.memory_bytes / GIB, 3),
            "worker_gib": round(self.worker_bytes / GIB, 3),
            "batch": self.batch,
            "kept_gib": round(self.kept_bytes / GIB, 3),
            **({"source": self.source} if self.source else {}),
        }
