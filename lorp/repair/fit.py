"""Fitting every run's map from `RepairStats`: one solve per run, validated where the
statistics carry held-out sums.

Validated (`fit_runs` with statistics that carry held-out sums, over calibration windows
the fit never saw): the ridge is chosen per run from `RIDGES` by the residual it leaves on
the held-out windows (the unconstrained map's, for a `normed` run too: one solve per
candidate), and the fitted map is kept only where it leaves less there than the
unrepaired map does. Otherwise the run keeps its unrepaired map (`kept: unrepaired`),
so a repaired variant is never worse than its unrepaired twin on held-out windows. A
d x d map fitted on a few thousand tokens of one corpus learns that corpus; a larger
ridge pulls it towards the unrepaired map, and the held-out windows say how far.

With held-out windows of several domains (`RepairStats.held_domains`: prose and code),
the ridge is chosen on the worst domain, not the mean: each candidate's residual on a
domain over the unrepaired map's there, the largest of those ratios least. The map is
kept only where it leaves less than the unrepaired map on every domain: a map fitted on
prose and code that helps prose and costs code is not kept (`kept: unrepaired`).

Runs are fitted on dense inputs in one pass (mergeable, what a fleet computes once per
model), or in depth order, each on the inputs the model repaired so far gives it
(`prune_and_repair(sequential=True)`): an earlier run's leftover error is then part of
what the later map corrects.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import torch
from torch import nn

from lorp.models.architectures import architecture_of, block_stage, decoder_blocks
from lorp.models.surgery import check_layers
from lorp.repair.maps import (
    DEFAULT_RIDGE,
    MAX_ROUNDS,
    RIDGES,
    RepairRefused,
    RunFit,
    fit_full,
    residual_of,
    tied_embeddings,
    unrepaired_map,
    unrepaired_matrices,
)
from lorp.repair.normed import fit_normed
from lorp.repair.stats import Form, RepairStats, Run, contiguous_runs

log = logging.getLogger(__name__)


def check_repairable(model: nn.Module, layers: Sequence[int]) -> list[Run]:
    """The runs of `layers`, or RepairRefused naming why this model cannot fold one."""
    n = len(decoder_blocks(model))
    runs = contiguous_runs(check_layers(layers, n), n)
    if runs[0][0] == 0 and tied_embeddings(model):
        s, e = runs[0]
        raise RepairRefused(
            f"run {s}-{e} starts at block 0 and the model ties its embeddings to the LM head: "
            "no weight takes the map without changing the logits; keep block 0 or use repair: none"
        )
    for s, _ in runs:
        if s > 0:
            check_stage(model, s - 1)
    return runs


def check_stage(model: nn.Module, k: int) -> None:
    """RepairRefused unless a map on block k's last stage folds exactly
    (`lorp.models.blocks.Stage`)."""
    arch = architecture_of(model)
    layout = arch.layout(decoder_blocks(model)[k])
    refused = arch.repair_refusal or layout.unreadable() or block_stage(model, k).refusal()
    if refused is not None:
        raise RepairRefused(f"block {k}: {refused}")


def fit_runs(
    model: nn.Module,
    stats: RepairStats,
    *,
    ridge: float | None = DEFAULT_RIDGE,
    rounds: int = MAX_ROUNDS,
    ridges: Sequence[float] = RIDGES,
    unrepaired: Callable[[Run, Form], torch.Tensor] | None = None,
) -> list[RunFit]:
    """Fit every run of `stats` (the model is the dense one the stats came from);
    `rounds` caps the descent of a `normed` fit (each round is one d x d SVD). With
    held-out sums (`stats.held_domains`) each fit is validated (module docstring):
    `ridge=None` chooses it among `ridges`, a number fixes it; either way a map that does
    no better than the unrepaired one on held-out windows of every domain is not kept.
    `unrepaired(run, form)`: the map the pruned model applies now, T0 (default: a block
    run's, `unrepaired_map`; sub-layer runs give theirs)."""
    if ridge is not None and not ridge > 0:
        raise ValueError(f"ridge must be > 0 (it makes every solve well posed), got {ridge!r}")
    if ridge is None and not stats.held_domains:
        raise ValueError("choosing the ridge (ridge=None) needs held-out sums (stats.held)")
    fits = []
    for run in stats.runs:
        form = stats.forms[run]
        A, B = stats.gram[run[0]].double(), stats.cross[run].double()
        T0 = (unrepaired or (lambda r, f: unrepaired_map(model, r, f)))(run, form).to(A.device)
        if not stats.held_domains:
            fits.append(fit_form(form, A, B, stats.energy[run], T0, ridge, run, rounds))  # type: ignore[arg-type]
            continue
        held = {d: held_sums(h, run, A.device) for d, h in stats.held_domains.items()}
        fits.append(
            validated(
                form,
                (A, B, stats.energy[run]),
                held,
                T0,
                [ridge] if ridge is not None else list(ridges),
                run,
                rounds,
            )
        )
    return fits


def held_sums(held: RepairStats, run: Run, device: torch.device):  # type: ignore[no-untyped-def]
    """(A, B, energy) of `run` over the held-out windows, float64 on `device`."""
    A, B = held.gram[run[0]].double().to(device), held.cross[run].double().to(device)
    return A, B, held.energy[run]


def fit_form(
    form: Form,
    A: torch.Tensor,
    B: torch.Tensor,
    energy: float,
    T0: torch.Tensor,
    ridge: float,
    run: Run,
    rounds: int,
) -> RunFit:
    if form == "full":
        return fit_full(A, B, energy, T0, ridge=ridge, run=run)
    return fit_normed(A, B, energy, T0, ridge=ridge, run=run, rounds=rounds)


def validated(
    form: Form,
    fit: tuple[torch.Tensor, torch.Tensor, float],
    held: Mapping[str, tuple[torch.Tensor, torch.Tensor, float]],
    T0: torch.Tensor,
    ridges: Sequence[float],
    run: Run,
    rounds: int,
) -> RunFit:
    """The run's map with the ridge the held-out windows prefer (`held`: domain -> their
    sums), or its unrepaired map when even that one leaves more error than T0 on any
    domain. One domain: the ridge leaving least there. Several: the ridge whose worst
    ratio to T0's residual over the domains is least (`validation` then holds those
    ratios, not residuals)."""
    A, B, energy = fit
    base = {d: residual_of(*h, T0) for d, h in held.items()}

    def score(T: torch.Tensor) -> float:
        if len(held) == 1:
            return residual_of(*next(iter(held.values())), T)
        return max(_over(residual_of(*h, T), base[d]) for d, h in held.items())

    scores: dict[float, float] = {}
    chosen, best = ridges[0], None
    for r in ridges:  # one candidate map held at a time (d x d float64 each)
        candidate = fit_full(A, B, energy, T0, ridge=r, run=run)
        scores[r] = score(candidate.matrix)
        if best is None or (scores[r], -r) < (scores[chosen], -chosen):  # ties: larger ridge
            chosen, best = r, candidate
        del candidate
    assert best is not None
    if form == "full":
        out = best
    else:  # the candidate goes before the normed fit's own matrices come
        del best
        out = fit_form(form, A, B, energy, T0, chosen, run, rounds)
    T = out.matrix if out.scale is None else out.matrix * out.scale
    per_domain = {d: residual_of(*h, T) for d, h in held.items()}
    kept = "fit"
    signal = [d for d, h in held.items() if h[2] > 0]  # a domain the blocks changed
    if not signal or any(not per_domain[d] < base[d] for d in signal):
        kept = "unrepaired"
        matrix, scale = unrepaired_matrices(T0, form)
        unrepaired = residual_of(A, B, energy, T0)
        out = replace(out, matrix=matrix, scale=scale, residual=unrepaired)
        per_domain = dict(base)
    worst = max(held, key=lambda d: (_over(per_domain[d], base[d]), d))
    return replace(
        out,
        relative_ridge=chosen,
        held_residual=per_domain[worst],  # the kept map's, on its worst domain
        held_unrepaired=base[worst],
        kept=kept,
        validation=scores,
        held_domains=({d: (per_domain[d], base[d]) for d in held} if len(held) > 1 else None),
    )


def _over(residual: float, unrepaired: float) -> float:
    """A residual over the unrepaired map's on the same windows (1: no change; where the
    unrepaired map leaves nothing, any residual is infinitely worse)."""
    if unrepaired > 0:
        return residual / unrepaired
    return 1.0 if residual <= 0 else float("inf")
