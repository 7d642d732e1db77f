"""Sub-layers as units of pruning: a block's attention and its MLP, removed one at a time.

A pre-norm block adds two things to the residual stream: its token mixing's output (an
attention, or a Mamba or linear-attention mixer in a hybrid), then its channel mixing's
(an MLP, or a mixture of experts): the block's two stages (`lorp.models.blocks.Stage`).
Removing one of them leaves the block, its other half and every weight of the rest as
they were. Units index the 2N sub-layers of an N-block model in depth order:

    unit 2i     block i's token mixing    (label "attn.i")
    unit 2i + 1 block i's channel mixing  (label "mlp.i")

A model splits only where every block is one token mixer then one channel mixer, run one
after the other (`check_splittable`: not a Nemotron-H block, which holds one mixer, nor
a Cohere 2 one, whose attention and MLP read the same input).

Boundary state j (0..2N) is the residual stream entering unit j: boundary 2i is block i's
input, 2i + 1 the stream between its attention and its MLP, 2N the last block's output.
Every block-level quantity has its unit form: S over the 2N + 1 boundaries
(`lorp.locality.capture.capture_stats(sublayers=True)`), whose even rows and columns are
the block S (`lorp.methods.sublayer_selection.block_similarity`), and a repair run of
consecutive units (`lorp.repair.sublayer_repair`).

A granularity says which units a budget counts: ``block`` (whole blocks), ``attention``
(attention sub-layers only), ``mlp`` (MLP sub-layers only) or ``mixed`` (both, ranked
together). A removed attention also removes its block's KV cache.

In memory a removed sub-layer is replaced by a module that adds nothing (`Removed`, which
returns what the module it stands for returns: an attention's output and no weights, a
gpt-oss mixture's output and no router scores): the block's code runs as it is, its norms
see zeros (a post-norm of zeros is zeros), and the KV cache of that block is never
written. A removed attention's block still owns a cache
slot that `generate` never fills, so a block whose attention goes must not be block 0
(transformers reads the cache's length from layer 0): `check_units` refuses it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lorp.models.architectures import architecture_of, decoder_blocks, unit_stage
from lorp.models.blocks import Branch, Removed

GRANULARITIES = ("block", "attention", "mlp", "mixed")
KINDS = ("attention", "mlp")


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


def removed_for(branch: Branch, module: nn.Module) -> Removed:
    """The stand-in of one branch: an attention returns (output, weights); a channel mixer
    returns what one call on a zero token shows (gpt-oss's and Llama 4's mixtures return
    their router's output too); any other mixer, its output."""
    if branch.kind == "attention":
        return Removed(branch.kind, True)
    if branch.mixes_tokens:
        return Removed(branch.kind, False)
    with torch.no_grad():
        weight = next(module.parameters())
        probe = torch.zeros(1, 1, _width(module), dtype=weight.dtype, device=weight.device)
        out = module(probe)
    return Removed(branch.kind, isinstance(out, tuple))


def _width(module: nn.Module) -> int:
    config = getattr(module, "config", None)
    width = getattr(config, "hidden_size", None)
    if width is None:
        raise ValueError(f"{type(module).__name__}: no hidden_size to probe it with")
    return int(width)


def check_splittable(model: nn.Module) -> None:
    """ValueError (one line) unless every block of `model` splits into its two stages."""
    arch = architecture_of(model)
    why = arch.repair_refusal
    for i, block in enumerate(decoder_blocks(model)):
        why = why or arch.layout(block).splittable()
        if why is not None:
            raise ValueError(f"{arch.family} cannot lose sub-layers: block {i}: {why}")


def unit_sites(
    model: nn.Module, unit: int, blocks: Sequence[nn.Module] | None = None
) -> list[tuple[nn.Module, float]]:
    """(module, scale): the modules whose outputs, times their scales, unit `unit` adds to
    the residual stream (a branch, or its post-norm where the family has one)."""
    return unit_stage(model, unit, blocks).sites()  # type: ignore[arg-type]


def map_sites(model: nn.Module, unit: int, normed: bool) -> list[nn.Module]:
    """The modules whose outputs a map of a run after unit `unit` replaces: the unit's
    sites, or for a `normed` map its post-norm (whose input the map reads)."""
    stage = unit_stage(model, unit)
    if normed:
        assert stage.post_norm is not None
        return [stage.post_norm]
    return [site for site, _ in stage.sites()]


def _replace(model: nn.Module, units: list[int]) -> list[tuple[nn.Module, str, nn.Module]]:
    """Each unit's branches swapped for their stand-ins; (block, name, module) of each."""
    blocks = decoder_blocks(model)
    saved = []
    for u in units:
        stage = unit_stage(model, u, blocks)
        for b in stage.branches:
            module = stage.module(b)
            saved.append((stage.block, b.name, module))
            setattr(stage.block, b.name, removed_for(b, module))
    return saved


@contextmanager
def sublayers_removed(model: nn.Module, units: Iterable[int]) -> Iterator[list[int]]:
    """Inside the block, `model` runs without sub-layers `units`; on exit it is restored
    (nothing is copied: the sub-layer modules are swapped for `Removed` and back)."""
    check_splittable(model)
    wanted = check_units(units, len(decoder_blocks(model)))
    saved: list[tuple[nn.Module, str, nn.Module]] = []
    try:
        saved = _replace(model, wanted)
        yield wanted
    finally:
        for block, name, module in reversed(saved):
            setattr(block, name, module)


def remove_sublayers(model: nn.Module, units: Iterable[int]) -> list[int]:
    """Remove sub-layers `units` from `model` in place (their weights are freed)."""
    check_splittable(model)
    wanted = check_units(units, len(decoder_blocks(model)))
    _replace(model, wanted)
    return wanted


def sublayer_parameters(model: nn.Module, units: Iterable[int]) -> int:
    """The parameters of sub-layers `units` (their branches' modules; the norms around
    them, d weights each, are not counted)."""
    blocks = decoder_blocks(model)
    total = 0
    for u in units:
        stage = unit_stage(model, u, blocks)
        for b in stage.branches:
            total += sum(p.numel() for p in stage.module(b).parameters())
    return total
