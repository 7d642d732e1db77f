"""The last check of a repair: the repaired variant against its unrepaired twin, by the
language-model loss on the held-out calibration windows of every domain.

Each map is validated by the state error it leaves (`lorp.repair.fit`), but what a user
meets is the next-token loss, and a map that leaves less error at its cut can still cost
a domain further on (measured: a repair fitted on prose made SmolLM2-135M's code 6-36%
worse than no repair at all). So before a repaired point is folded, its candidates, best
first (every map as fitted, distilled where the job distils; the least-squares maps
without distillation; the runs' maps without followers), are scored by the mean loss per
held-out token of each domain, with the blocks dropped and the maps applied by hooks
(nothing copied, the model left as it was). The first candidate no worse than the
unrepaired variant on any domain, and better by `MIN_GAIN` on their mean, is kept; where
none is, every map becomes its run's
unrepaired map (folding it changes no weight) and the variant equals its unrepaired twin.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from lorp.models.perplexity import calibration_loss
from lorp.models.surgery import blocks_dropped
from lorp.repair.distill import Cut, applied_maps
from lorp.repair.fold import applied_by_hooks
from lorp.repair.maps import RunFit, unrepaired_map, unrepaired_matrices

UNREPAIRED = "unrepaired"
MIN_GAIN = 0.005
"""The least mean relative fall of the held-out loss over the domains a kept repair
must bring (`passes`)."""


@dataclass(frozen=True)
class GateResult:
    kept: str
    """The candidate kept, or "unrepaired"."""
    fits: list[RunFit]
    """The maps to fold."""
    losses: dict[str, dict[str, float]] = field(default_factory=dict)
    """Candidate (and "unrepaired") -> domain -> mean held-out loss per token, for those
    scored (the candidates up to the one kept)."""
    tried: tuple[str, ...] = ()
    """Every candidate, best first."""

    def record(self) -> dict[str, Any]:
        """What the row keeps: the candidate kept, each candidate's loss per domain, and
        the kept variant's worst ratio to the unrepaired twin over the domains."""
        base = self.losses.get(UNREPAIRED, {})
        mine = self.losses.get(self.kept, base)
        ratio = max((mine[d] / base[d] for d in base if base[d] > 0), default=1.0)
        return {
            "kept": self.kept,
            "tried": list(self.tried),
            "worst_loss_ratio": round(ratio, 6),
            "losses": {c: {d: round(v, 6) for d, v in ls.items()} for c, ls in self.losses.items()},
        }


def domain_losses(
    model: nn.Module,
    layers: Sequence[int] | Cut,
    fits: Sequence[RunFit],
    held: Mapping[str, torch.Tensor],
    batch_size: int = 8,
) -> dict[str, float]:
    """Domain -> the mean loss per token of its held-out windows of `model` with `layers`
    dropped (or what a `Cut` removes, e.g. sub-layers) and `fits` applied by hooks (none:
    the unrepaired variant)."""
    if isinstance(layers, Cut):
        with torch.no_grad(), applied_maps(model, fits, layers):
            return {d: calibration_loss(model, w, batch_size) for d, w in held.items()}
    with blocks_dropped(model, layers) as kept, applied_by_hooks(model, list(fits), kept):
        return {d: calibration_loss(model, w, batch_size) for d, w in held.items()}


def gate_repair(
    model: nn.Module,
    layers: Sequence[int] | Cut,
    candidates: Sequence[tuple[str, list[RunFit]]],
    held: Mapping[str, torch.Tensor],
    batch_size: int = 8,
    unrepaired: Callable[[RunFit], torch.Tensor] | None = None,
) -> GateResult:
    """The first of `candidates` ((name, maps), best first) that `passes` against the
    unrepaired variant on the domains of `held`, or every map unrepaired (module
    docstring). `layers`: the blocks dropped, or a `Cut` (sub-layers, whose maps'
    unrepaired T0 `unrepaired` gives: `lorp.repair.sublayer_repair.unit_T0`)."""
    losses = {UNREPAIRED: domain_losses(model, layers, [], held, batch_size)}
    base, tried = losses[UNREPAIRED], tuple(name for name, _ in candidates)
    for name, fits in candidates:
        losses[name] = domain_losses(model, layers, fits, held, batch_size)
        if passes(losses[name], base):
            return GateResult(name, fits, losses, tried)
    last = candidates[-1][1] if candidates else []
    fallback = [as_unrepaired(model, f, unrepaired) for f in last]
    return GateResult(UNREPAIRED, fallback, losses, tried)


def passes(mine: Mapping[str, float], base: Mapping[str, float]) -> bool:
    """No domain's loss above the unrepaired variant's, and the mean over the domains at
    least `MIN_GAIN` below its mean: a gain smaller than that on a few held-out windows
    is their noise, not the repair's (the demo's 8 windows of 256 tokens passed a map at
    0.998 of the unrepaired loss that was 8-12% worse on the test windows)."""
    if any(mine[d] > base[d] for d in base):
        return False
    ratio = sum(mine[d] / base[d] for d in base) / len(base)
    return ratio <= 1 - MIN_GAIN


def as_unrepaired(
    model: nn.Module, fit: RunFit, unrepaired: Callable[[RunFit], torch.Tensor] | None = None
) -> RunFit:
    """`fit` with the map the pruned model applies already (T0, a block run's unless
    `unrepaired` gives it): folding it changes no weight, and the record says `kept:
    unrepaired`."""
    T0 = unrepaired(fit) if unrepaired else unrepaired_map(model, fit.run, fit.form)
    matrix, scale = unrepaired_matrices(T0, fit.form)
    held = fit.held_unrepaired if fit.held_residual is not None else None
    return replace(
        fit,
        matrix=matrix,
        scale=scale,
        kept=UNREPAIRED,
        distilled=None,
        residual=fit.unrepaired,
        held_residual=held,
    )
