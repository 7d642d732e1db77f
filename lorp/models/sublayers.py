"""Sub-layers as units of pruning: a block's attention and its MLP, removed one at a time.

A pre-norm block adds two things to the residual stream: its attention's output, then its
MLP's. Removing one of them leaves the block, its other half and every weight of the rest
as they were. Units index the 2N sub-layers of an N-block model in depth order:

    unit 2i     block i's attention      (label "attn.i")
    unit 2i + 1 block i's MLP            (label "mlp.i")

Boundary state j (0..2N) is the residual stream entering unit j: boundary 2i is block i's
input, 2i + 1 the stream between its attention and its MLP, 2N the last block's output.
Every block-level quantity has its unit form: S over the 2N + 1 boundaries
(`lorp.locality.capture.capture_stats(sublayers=True)`), whose even rows and columns are
the block S (`lorp.methods.sublayer_selection.block_similarity`), and a repair run of
consecutive units (`lorp.repair.sublayer_repair`).

A granularity says which units a budget counts: ``block`` (whole blocks), ``attention``
(attention sub-layers only), ``mlp`` (MLP sub-layers only) or ``mixed`` (both, ranked
together). A removed attention also removes its block's KV cache.

In memory a removed sub-layer is replaced by a module that adds nothing (`Removed`): the
block's code runs as it is, its norms see zeros (a post-norm of zeros is zeros), and the
KV cache of that block is never written. A removed attention's block still owns a cache
slot that `generate` never fills, so a block whose attention goes must not be block 0
(transformers reads the cache's length from layer 0): `check_units` refuses it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lorp.models.architectures import architecture_of, decoder_blocks

GRANULARITIES = ("block", "attention", "mlp", "mixed")
KINDS = ("attention", "mlp")
ATTENTION, MLP = "self_attn", "mlp"
"""The attribute names of a block's two sub-layers in every supported family."""


def check_granularity(value: Any, field: str = "granularity") -> str:
    if value not in GRANULARITIES:
        raise ValueError(f"{field}: must be one of {list(GRANULARITIES)}, got {value!r}")
    return str(value)


def unit_kind(unit: int) -> str:
    return KINDS[unit % 2]


def unit_label(unit: int) -> str:
    """ "attn.i" or "mlp.i": what the catalog and the provenance name a unit by."""
    return f"{'attn' if unit % 2 == 0 else 'mlp'}.{unit // 2}"


def parse_unit_label(label: str) -> int:
    kind, _, block = str(label).partition(".")
    if kind not in ("attn", "mlp") or not block.isdigit():
        raise ValueError(f"sub-layer {label!r}: expected attn.<block> or mlp.<block>")
    return 2 * int(block) + (kind == "mlp")


def candidate_units(granularity: str, n_blocks: int) -> list[int]:
    """The units a budget of `granularity` may spend on: every attention (even units),
    every MLP (odd), or both (`mixed`). `block` has no units: its candidates are blocks."""
    check_granularity(granularity)
    if granularity == "block":
        raise ValueError("granularity 'block' counts blocks, not sub-layer units")
    units = range(2 * n_blocks)
    if granularity == "mixed":
        return list(units)
    return [u for u in units if unit_kind(u) == granularity]


def eligible_units(granularity: str, n_blocks: int) -> list[int]:
    """The units of `granularity` a budget may remove: all but the first and last block's
    (as for whole blocks, those two stay)."""
    return [u for u in candidate_units(granularity, n_blocks) if 0 < u // 2 < n_blocks - 1]


def budget_limit(granularity: str, n_blocks: int) -> int:
    """The most units (or blocks) of `granularity` a budget may remove."""
    return n_blocks - 2 if granularity == "block" else len(eligible_units(granularity, n_blocks))


def check_units(units: Iterable[int], n_blocks: int) -> list[int]:
    """Sorted distinct units in [0, 2N), none of block 0's attention (its KV cache sets
    the positions `generate` reads) and not every unit."""
    out = sorted({int(u) for u in units})
    bad = [u for u in out if not 0 <= u < 2 * n_blocks]
    if bad:
        raise ValueError(f"sub-layer units must be in [0, {2 * n_blocks - 1}], got {bad}")
    if not out:
        raise ValueError("sub-layers to remove are empty")
    if 0 in out:
        raise ValueError("attn.0 cannot be removed: generation reads positions from its cache")
    if len(out) >= 2 * n_blocks:
        raise ValueError(f"cannot remove all {2 * n_blocks} sub-layers")
    return out


def kept_attention_blocks(n_blocks: int, units: Iterable[int]) -> list[int]:
    """The blocks that keep their attention (and so their KV cache)."""
    gone = {u // 2 for u in units if u % 2 == 0}
    return [b for b in range(n_blocks) if b not in gone]


def kept_mlp_blocks(n_blocks: int, units: Iterable[int]) -> list[int]:
    gone = {u // 2 for u in units if u % 2 == 1}
    return [b for b in range(n_blocks) if b not in gone]


def block_units(blocks: Iterable[int]) -> list[int]:
    """The units of whole blocks: what removing those blocks removes."""
    return sorted(u for b in blocks for u in (2 * b, 2 * b + 1))


class Removed(nn.Module):
    """A sub-layer that adds nothing to the residual stream: zeros of its input's shape
    (an attention's call also returns no weights, as the decoder layer unpacks two)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        x = args[0] if args else kwargs["hidden_states"]
        zeros = torch.zeros_like(x)
        return (zeros, None) if self.kind == "attention" else zeros

    def extra_repr(self) -> str:
        return f"removed {self.kind}"


def attention_site(block: nn.Module, post_attn_norm: str | None) -> nn.Module:
    """The module whose output block's attention adds to the residual stream: the post-
    attention norm where the family has one, else `self_attn` (its output is o_proj's)."""
    return getattr(block, post_attn_norm) if post_attn_norm else getattr(block, ATTENTION)


def unit_site(model: nn.Module, unit: int, blocks: Sequence[nn.Module] | None = None) -> nn.Module:
    """The module whose output unit `unit` adds to the residual stream (its post-norm where
    the family has one)."""
    arch = architecture_of(model)
    block = (blocks if blocks is not None else decoder_blocks(model))[unit // 2]
    if unit % 2 == 0:
        return attention_site(block, arch.post_attn_norm)
    return getattr(block, arch.post_mlp_norm) if arch.post_mlp_norm else getattr(block, MLP)


@contextmanager
def sublayers_removed(model: nn.Module, units: Iterable[int]) -> Iterator[list[int]]:
    """Inside the block, `model` runs without sub-layers `units`; on exit it is restored
    (nothing is copied: the sub-layer modules are swapped for `Removed` and back)."""
    blocks = decoder_blocks(model)
    wanted = check_units(units, len(blocks))
    saved = []
    try:
        for u in wanted:
            attr = ATTENTION if u % 2 == 0 else MLP
            block = blocks[u // 2]
            saved.append((block, attr, getattr(block, attr)))
            setattr(block, attr, Removed(unit_kind(u)))
        yield wanted
    finally:
        for block, attr, module in reversed(saved):
            setattr(block, attr, module)


def remove_sublayers(model: nn.Module, units: Iterable[int]) -> list[int]:
    """Remove sub-layers `units` from `model` in place (their weights are freed)."""
    blocks = decoder_blocks(model)
    wanted = check_units(units, len(blocks))
    for u in wanted:
        setattr(blocks[u // 2], ATTENTION if u % 2 == 0 else MLP, Removed(unit_kind(u)))
    return wanted


def sublayer_parameters(model: nn.Module, units: Iterable[int]) -> int:
    """The parameters of sub-layers `units` (their attention or MLP modules; the norms
    around them, d weights each, are not counted)."""
    blocks = decoder_blocks(model)
    total = 0
    for u in units:
        module = getattr(blocks[u // 2], ATTENTION if u % 2 == 0 else MLP)
        total += sum(p.numel() for p in module.parameters())
    return total
