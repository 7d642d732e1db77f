"""The scores the repair-aware `window` method ranks contiguous windows by: the residual
each window's validated linear map leaves (`window_scores`, from the sums alone, of block
or of sub-layer unit runs alike), or the calibration loss of the model with the window
removed and its map applied by hooks (`window_losses`): nothing copied, the model left as
it was, a streamed one included.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from lorp.models.perplexity import calibration_loss
from lorp.models.surgery import blocks_dropped
from lorp.repair.distill import applied_maps, sublayer_cut
from lorp.repair.fit import fit_runs, held_sums, validated
from lorp.repair.fold import applied_by_hooks
from lorp.repair.maps import DEFAULT_RIDGE, RIDGES, fit_full
from lorp.repair.stats import RepairStats, Run
from lorp.repair.sublayer_repair import fit_unit_runs


def window_scores(stats: RepairStats, *, ridge: float = DEFAULT_RIDGE) -> dict[Run, float]:
    """For every run of `stats`: ||Y + X T - H_e||^2 / ||H_e||^2, the error its fitted
    map leaves relative to the state it aims at, so runs at different depths compare.

    No model needed: T0 comes from the statistics (`RepairStats.base`). The map is the
    unconstrained one (one Cholesky solve per run), on post-MLP-norm families too, where
    it is a lower bound of the foldable map's residual (a ranking, not a fit to apply).
    With held-out sums (`stats.held_domains`) the error is the one left on the held-out
    windows by the validated map (ridge chosen there, or the unrepaired map where no fit
    beats it), on the worst domain, so a window is chosen for how well its repair
    generalises to every kind of text, not how well it fits."""
    out = {}
    for run in stats.runs:
        A = stats.gram[run[0]].double()
        if stats.forms[run] == "normed":
            if run[0] not in stats.base:
                raise ValueError(f"run {run[0]}-{run[1]}: the statistics lack the norm's scale")
            T0 = torch.diag(stats.base[run[0]].double())
        else:
            T0 = torch.eye(A.shape[0], dtype=torch.float64)
        T0, B = T0.to(A.device), stats.cross[run].double()
        if not stats.held_domains:
            fit = fit_full(A, B, stats.energy[run], T0, ridge=ridge, run=run)
            residual, energy, scale = fit.residual, stats.energy[run], stats.state_energy[run]
            out[run] = float(residual) * energy / scale if scale > 0 else float("inf")
            continue
        held = stats.held_domains
        sums = {d: held_sums(h, run, A.device) for d, h in held.items()}
        fit = validated("full", (A, B, stats.energy[run]), sums, T0, RIDGES, run, 0)
        left = fit.held_domains or {d: (fit.held_residual, 0.0) for d in held}
        out[run] = max(  # the worst domain's error, relative to the state aimed at there
            float(left[d][0]) * h.energy[run] / h.state_energy[run]
            if h.state_energy[run] > 0
            else float("inf")
            for d, h in held.items()
        )
    return out


def window_losses(
    model: nn.Module,
    stats: RepairStats,
    windows: torch.Tensor,
    *,
    ridge: float | None = None,
    batch_size: int = 8,
    runs: Sequence[Run] | None = None,
    units: bool = False,
) -> dict[Run, float]:
    """For every run of `stats` (or `runs`): the mean calibration NLL on `windows` of the
    dense `model` with that run's blocks removed and its fitted map applied, each run on
    its own (`fit_runs` with `ridge`: None validates it on `stats.held`, as a repaired
    point's fit is). The map is applied by hooks and the blocks dropped in memory, so
    the model is left as it was found, a streamed one included. `units`: runs of
    sub-layer units (`stats` from `lorp.repair.sublayer_repair.unit_stats`), each run's
    units removed and its map (`fit_unit_runs`, the repaired point's fit) applied by a
    hook on unit s-1's output (`lorp.repair.distill.applied_maps`), as the fold into its
    output projection would.

    The loss ranks windows by what the repaired variant predicts, where `window_scores`
    ranks them by the state the map reaches: measured on SmolLM2-135M and
    Qwen2.5-Coder-0.5B (docs: Linear repair), a few outlier tokens dominate that
    state's error, and the residual chose windows 6-7% worse on held-out news."""
    out = {}
    for run in runs if runs is not None else stats.runs:
        with _repaired(model, stats.subset([run]), run, ridge, units):
            out[run] = calibration_loss(model, windows, batch_size)
    return out


@contextmanager
def _repaired(
    model: nn.Module, stats: RepairStats, run: Run, ridge: float | None, units: bool
) -> Iterator[None]:
    """Inside the block, `model` runs without `run` and with its fitted map."""
    removed = range(run[0], run[1] + 1)
    if units:
        fits = fit_unit_runs(model, stats, ridge=ridge)
        with applied_maps(model, fits, sublayer_cut(model, list(removed))):
            yield
        return
    fits = fit_runs(model, stats, ridge=ridge)
    with blocks_dropped(model, removed) as kept, applied_by_hooks(model, fits, kept):
        yield
