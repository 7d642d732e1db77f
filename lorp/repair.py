"""Training-free linear repair of a pruned model, folded into weights it already has.

After blocks s..e are removed, block s-1's output is Y + M where the dense model had H_e.
One linear map per run closes most of that gap (ReplaceMe, Shopkhoev et al., NeurIPS
2025): M is replaced by X T, fitted in closed form from `RepairStats` and folded into a
weight, so the repaired checkpoint has the architecture, parameter count and config of
its unrepaired twin and loads anywhere the twin does.

Two forms, by where the map can fold exactly:

- `full` (Llama, Mistral, Qwen2/3, Phi3: the MLP output is added as it is; and any run
  from block 0, whose X is the embedding output): T is any d x d matrix. M = a W^T + b
  (`down_proj`), so M T = a (T^T W)^T + b T: `down_proj` takes W <- T^T W, b <- b T. From
  block 0 the embedding matrix takes E <- E T (refused when it is tied to the LM head,
  which would change the logits too).
- `normed` (Gemma 2/3, OLMo 2/3: an RMSNorm follows the MLP): a full map cannot pass the
  norm, but an orthogonal one can, since rms(m Q) = rms(m). With u the normalised MLP
  output (before the norm's weight), the map is u -> (u Q) diag(g): `down_proj` takes
  W <- Q^T W and the norm's weight becomes g (minus Gemma's 1 + w offset). Q and g are
  fitted by block-coordinate descent: g exactly per channel, Q by a majorise-minimise
  Procrustes step with backtracking, so the objective never rises.

The ridge term pulls the map towards the unrepaired one (T0 = I, or Q = I with the
norm's own weight), not towards zero: where the calibration data says little, the
repaired model falls back to the pruned model instead of dropping the MLP's output along
those directions. lambda = `ridge` x tr(A) / d, scaled to the statistics; every solve
is a Cholesky solve of A + lambda I, which the ridge makes positive definite.

Validated (`fit_runs` with statistics that carry `held` sums, over calibration windows the
fit never saw): the ridge is chosen per run from `RIDGES` by the residual it leaves on
the held-out windows (the unconstrained map's, for a `normed` run too: one solve per
candidate), and the fitted map is kept only where it leaves less there than the
unrepaired map does. Otherwise the run keeps its unrepaired map (`kept: unrepaired`),
so a repaired variant is never worse than its unrepaired twin on held-out windows. A
d x d map fitted on a few thousand tokens of one corpus learns that corpus; a larger
ridge pulls it towards the unrepaired map, and the held-out windows say how far.

Followers (`fit_followers`): one map cannot replace what several blocks did, and the
blocks kept after the cut see a stream they were not trained on. The first `count` kept
blocks after each run can take a map of their own, folded the same way into their
`down_proj` (a run of no blocks, (k + 1, k), in `lorp.repair_stats`): fitted in depth
order on the states the model pruned and repaired so far gives block k, towards the
dense model's state after block k, validated on the held-out windows as every run is.
Measured on SmolLM2-135M (window 12-19 of 30, PTB + wiki 32k, `lee` news 32 x 512): one
follower took the repaired variant from 2.32x to 2.20x dense on held-out news (PTB 1.76x
to 1.52x); a map on the last block instead, aimed at the final state, made news worse
(2.70x) although it left less on the held-out windows, which is why followers stop at the
blocks right after each cut.

Runs are fitted on dense inputs in one pass (mergeable, what a fleet computes once per
model), or in depth order, each on the inputs the model repaired so far gives it
(`prune_and_repair(sequential=True)`): an earlier run's leftover error is then part of
what the later map corrects.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from lorp.architectures import architecture_of, decoder_blocks, decoder_stack
from lorp.loss import calibration_loss
from lorp.repair_stats import (
    Form,
    RepairStats,
    Run,
    capture_repair_stats,
    contiguous_runs,
    mlp_site,
    rms_unit,
    run_form,
)
from lorp.surgery import blocks_dropped, check_layers, drop_layers

log = logging.getLogger(__name__)

DEFAULT_RIDGE = 1e-3
RIDGES = (1e-4, 1e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0)
"""The relative ridges a validated fit chooses among (lambda = ridge x tr(A) / d)."""
MAX_ROUNDS = 100


class RepairRefused(ValueError):
    """A pruned set this model cannot be repaired for, with the reason in one line."""


@dataclass(frozen=True)
class RunFit:
    """The fitted map of one run, and how well it closes the gap on calibration tokens.

    `residual` and `unrepaired` are ||X T - D||^2 / ||D||^2 for the fitted map and for
    the map the pruned model already applies (T0): the fraction of the gap left."""

    run: Run
    form: Form
    matrix: torch.Tensor  # T (full), or Q (normed): d x d float64
    scale: torch.Tensor | None  # g (normed), d float64
    ridge: float  # the absolute lambda
    residual: float
    unrepaired: float
    rounds: int = 0
    relative_ridge: float | None = None
    """The ridge as chosen (lambda / (tr(A) / d))."""
    held_residual: float | None = None
    """The same residuals on the held-out windows (validated fits only)."""
    held_unrepaired: float | None = None
    kept: str = "fit"
    """"fit", or "unrepaired": the fitted map did no better on held-out windows; or
    "distilled" (`lorp.distill`)."""
    validation: dict[float, float] | None = None
    """Relative ridge -> held-out residual of the unconstrained map, every candidate."""
    distilled: dict[str, Any] | None = None
    """`lorp.distill`'s record (held-out KL per epoch, the epoch kept) when the map went
    through distillation; `kept` is then "distilled" where an epoch beat the fit. The
    residuals stay the least-squares fit's."""

    def record(self) -> dict[str, Any]:
        """What provenance keeps: the run, the form, lambda and the fit's residuals, and
        for a validated fit the held-out residuals, the ridges tried and what was kept."""
        out: dict[str, Any] = {
            "run": list(self.run),
            **({"follower": self.run[1]} if self.run[0] == self.run[1] + 1 else {}),
            "form": self.form,
            "lambda": self.ridge,
            "residual": round(self.residual, 6),
            "unrepaired_residual": round(self.unrepaired, 6),
            "rounds": self.rounds,
        }
        if self.held_residual is not None:
            out |= {
                "ridge": self.relative_ridge,
                "held_residual": round(self.held_residual, 6),
                "held_unrepaired_residual": round(float(self.held_unrepaired or 0.0), 6),
                "kept": self.kept,
                "ridges_tried": {f"{k:g}": round(v, 6) for k, v in (self.validation or {}).items()},
            }
        if self.distilled is not None:
            out["kept"] = self.kept
            out["distilled"] = self.distilled
        return out


def check_repairable(model: nn.Module, layers: Sequence[int]) -> list[Run]:
    """The runs of `layers`, or RepairRefused naming why this model cannot fold one."""
    n = len(decoder_blocks(model))
    runs = contiguous_runs(check_layers(layers, n), n)
    if runs[0][0] == 0 and _tied(model):
        s, e = runs[0]
        raise RepairRefused(
            f"run {s}-{e} starts at block 0 and the model ties its embeddings to the LM head: "
            "no weight takes the map without changing the logits; keep block 0 or use repair: none"
        )
    for s, _ in runs:
        if s > 0:
            _check_site(model, s - 1)
    return runs


def _check_site(model: nn.Module, k: int) -> None:
    """RepairRefused unless block k has the weights a map folds into."""
    block = decoder_blocks(model)[k]
    down = getattr(getattr(block, "mlp", None), "down_proj", None)
    if not isinstance(down, nn.Linear):
        raise RepairRefused(f"block {k} has no mlp.down_proj Linear to fold into")
    post = architecture_of(model).post_mlp_norm
    if post and not hasattr(block, post):
        raise RepairRefused(f"block {k} lacks {post}")


def _tied(model: nn.Module) -> bool:
    from lorp.streaming import streamer_of

    streamer = streamer_of(model)
    if streamer is not None:  # between forwards its matrices are all on the meta device
        return streamer.tied
    head = getattr(model, "lm_head", None)
    embed = decoder_stack(model).embed_tokens
    return head is not None and head.weight.data_ptr() == embed.weight.data_ptr()


def _unrepaired_map(model: nn.Module, run: Run, form: Form) -> torch.Tensor:
    """T0: what the pruned model applies to X now (I, or the post-MLP norm's scale)."""
    d = int(model.config.hidden_size)
    if form == "full":
        return torch.eye(d, dtype=torch.float64)
    arch = architecture_of(model)
    norm = getattr(decoder_blocks(model)[run[0] - 1], arch.post_mlp_norm)
    return torch.diag(norm.weight.detach().double().cpu() + arch.norm_offset)


def fit_runs(
    model: nn.Module,
    stats: RepairStats,
    *,
    ridge: float | None = DEFAULT_RIDGE,
    rounds: int = MAX_ROUNDS,
    ridges: Sequence[float] = RIDGES,
) -> list[RunFit]:
    """Fit every run of `stats` (the model is the dense one the stats came from);
    `rounds` caps the descent of a `normed` fit (each round is one d x d SVD). With
    held-out sums (`stats.held`) each fit is validated (module docstring): `ridge=None`
    chooses it among `ridges`, a number fixes it; either way a map that does no better
    than the unrepaired one on held-out windows is not kept."""
    if ridge is not None and not ridge > 0:
        raise ValueError(f"ridge must be > 0 (it makes every solve well posed), got {ridge!r}")
    if ridge is None and stats.held is None:
        raise ValueError("choosing the ridge (ridge=None) needs held-out sums (stats.held)")
    fits = []
    for run in stats.runs:
        form = stats.forms[run]
        A, B = stats.gram[run[0]].double(), stats.cross[run].double()
        T0 = _unrepaired_map(model, run, form).to(A.device)
        if stats.held is None:
            fits.append(_fit(form, A, B, stats.energy[run], T0, ridge, run, rounds))  # type: ignore[arg-type]
            continue
        fits.append(
            _validated(form, (A, B, stats.energy[run]), _held_sums(stats.held, run, A.device),
                       T0, [ridge] if ridge is not None else list(ridges), run, rounds)
        )  # fmt: skip
    return fits


def _held_sums(held: RepairStats, run: Run, device: torch.device):  # type: ignore[no-untyped-def]
    """(A, B, energy) of `run` over the held-out windows, float64 on `device`."""
    A, B = held.gram[run[0]].double().to(device), held.cross[run].double().to(device)
    return A, B, held.energy[run]


def _fit(
    form: Form, A: torch.Tensor, B: torch.Tensor, energy: float, T0: torch.Tensor,
    ridge: float, run: Run, rounds: int,
) -> RunFit:  # fmt: skip
    if form == "full":
        return fit_full(A, B, energy, T0, ridge=ridge, run=run)
    return fit_normed(A, B, energy, T0, ridge=ridge, run=run, rounds=rounds)


def _validated(
    form: Form,
    fit: tuple[torch.Tensor, torch.Tensor, float],
    held: tuple[torch.Tensor, torch.Tensor, float],
    T0: torch.Tensor,
    ridges: Sequence[float],
    run: Run,
    rounds: int,
) -> RunFit:
    """The run's map with the ridge the held-out windows prefer, or its unrepaired map
    when even that one leaves more error on them than T0 does."""
    A, B, energy = fit
    scores: dict[float, float] = {}
    chosen, best = ridges[0], None
    for r in ridges:  # one candidate map held at a time (d x d float64 each)
        candidate = fit_full(A, B, energy, T0, ridge=r, run=run)
        scores[r] = residual_of(*held, candidate.matrix)
        if best is None or (scores[r], -r) < (scores[chosen], -chosen):  # ties: larger ridge
            chosen, best = r, candidate
        del candidate
    assert best is not None
    if form == "full":
        out = best
    else:  # the candidate goes before the normed fit's own matrices come
        del best
        out = _fit(form, A, B, energy, T0, chosen, run, rounds)
    T = out.matrix if out.scale is None else out.matrix * out.scale
    held_fit, held_t0 = residual_of(*held, T), residual_of(*held, T0)
    kept = "fit"
    if not held_fit < held_t0:
        kept = "unrepaired"
        d = T0.shape[0]
        eye = torch.eye(d, dtype=T0.dtype, device=T0.device)
        matrix, scale = (T0, None) if form == "full" else (eye, torch.diagonal(T0).clone())
        unrepaired = residual_of(A, B, energy, T0)
        out = replace(out, matrix=matrix, scale=scale, residual=unrepaired)
    return replace(
        out,
        relative_ridge=chosen,
        held_residual=min(held_fit, held_t0),  # the kept map's
        held_unrepaired=held_t0,
        kept=kept,
        validation=scores,
    )


def _regularised(A: torch.Tensor, B: torch.Tensor, T0: torch.Tensor, ridge: float):  # type: ignore[no-untyped-def]
    """A + lambda I, B + lambda T0 and lambda: the ridge towards T0 as plain least squares."""
    d = A.shape[0]
    lam = ridge * float(torch.trace(A)) / d
    if not lam > 0:
        raise ValueError("the repair statistics hold no signal (tr(A) = 0): no tokens?")
    Ar = A.clone()
    Ar.diagonal().add_(lam)  # A + lambda I, without a d x d identity
    return Ar, B + lam * T0, lam


def residual_of(A: torch.Tensor, B: torch.Tensor, energy: float, T: torch.Tensor) -> float:
    """||X T - D||^2 / ||D||^2 from the sums: (c - 2 tr(T^T B) + tr(T^T A T)) / c."""
    if not energy > 0:  # no gap to close: the blocks changed nothing on these tokens
        return 0.0
    value = energy - 2 * float((T * B).sum()) + float((T * (A @ T)).sum())
    return max(value, 0.0) / energy


def window_scores(stats: RepairStats, *, ridge: float = DEFAULT_RIDGE) -> dict[Run, float]:
    """For every run of `stats`: ||Y + X T - H_e||^2 / ||H_e||^2, the error its fitted
    map leaves relative to the state it aims at, so runs at different depths compare.

    No model needed: T0 comes from the statistics (`RepairStats.base`). The map is the
    unconstrained one (one Cholesky solve per run), on post-MLP-norm families too, where
    it is a lower bound of the foldable map's residual (a ranking, not a fit to apply).
    With held-out sums (`stats.held`) the error is the one left on the held-out windows
    by the validated map (ridge chosen there, or the unrepaired map where no fit beats
    it), so a window is chosen for how well its repair generalises, not how well it fits."""
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
        if stats.held is None:
            fit = fit_full(A, B, stats.energy[run], T0, ridge=ridge, run=run)
            residual, energy, scale = fit.residual, stats.energy[run], stats.state_energy[run]
        else:
            held = stats.held
            sums = _held_sums(held, run, A.device)
            fit = _validated("full", (A, B, stats.energy[run]), sums, T0, RIDGES, run, 0)
            residual, energy, scale = fit.held_residual, held.energy[run], held.state_energy[run]
        out[run] = float(residual) * energy / scale if scale > 0 else float("inf")
    return out


def window_losses(
    model: nn.Module,
    stats: RepairStats,
    windows: torch.Tensor,
    *,
    ridge: float | None = None,
    batch_size: int = 8,
    runs: Sequence[Run] | None = None,
) -> dict[Run, float]:
    """For every run of `stats` (or `runs`): the mean calibration NLL on `windows` of the
    dense `model` with that run's blocks removed and its fitted map applied, each run on
    its own (`fit_runs` with `ridge`: None validates it on `stats.held`, as a repaired
    point's fit is). The map is applied by hooks and the blocks dropped in memory, so
    the model is left as it was found, a streamed one included.

    The loss ranks windows by what the repaired variant predicts, where `window_scores`
    ranks them by the state the map reaches: measured on SmolLM2-135M and
    Qwen2.5-Coder-0.5B (README, Linear repair), a few outlier tokens dominate that
    state's error, and the residual chose windows 6-7% worse on held-out news."""
    out = {}
    for run in runs if runs is not None else stats.runs:
        fits = fit_runs(model, stats.subset([run]), ridge=ridge)
        with (
            blocks_dropped(model, range(run[0], run[1] + 1)) as kept,
            applied_by_hooks(model, fits, kept),
        ):
            out[run] = calibration_loss(model, windows, batch_size)
    return out


def follower_blocks(n_blocks: int, layers: Sequence[int], count: int) -> list[int]:
    """The first `count` kept blocks after each run of `layers`, in depth order: those a
    follower map goes into. A block that already carries a later run's map (the block
    before it) is not one, nor any block past it: followers stop at the next cut."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count!r}")
    runs = contiguous_runs(check_layers(layers, n_blocks), n_blocks)
    carriers = {s - 1 for s, _ in runs}
    out = []
    for _, e in runs:
        for k in range(e + 1, min(e + 1 + count, n_blocks)):
            if k in carriers:
                break
            out.append(k)
    return out


def fit_followers(
    model: nn.Module,
    fits: Sequence[RunFit],
    layers: Sequence[int],
    windows: torch.Tensor,
    held: torch.Tensor,
    count: int,
    *,
    ridge: float | None = None,
    rounds: int = MAX_ROUNDS,
    batch_size: int = 8,
    skip_prefix: int = 0,
    progress: bool = False,
) -> list[RunFit]:
    """The follower maps (module docstring) of the dense `model` pruned of `layers` and
    repaired by `fits` (not folded yet: applied here by hooks, the blocks dropped in
    memory, so the model is left as it was found, a streamed one included). Each is
    fitted on `windows`, validated on `held` (`fit_runs`, `ridge` None: chosen there)
    and applied while the next one is captured. Returns them in depth order, to fold
    with `fits`; each costs a dense and a repaired forward of the windows, up to it."""
    from lorp.repair_stats import capture_follower_stats

    followers: list[RunFit] = []

    def split(w: torch.Tensor) -> list[torch.Tensor]:
        return [w[i : i + batch_size] for i in range(0, len(w), batch_size)]

    @contextmanager
    def repaired() -> Iterator[None]:
        maps = [*fits, *followers]
        with blocks_dropped(model, layers) as kept, applied_by_hooks(model, maps, kept):
            yield

    kw: dict[str, Any] = {"skip_prefix": skip_prefix, "progress": progress}
    for k in follower_blocks(len(decoder_blocks(model)), layers, count):
        _check_site(model, k)
        stats = capture_follower_stats(model, split(windows), [(k + 1, k)], repaired, **kw)
        stats.held = capture_follower_stats(model, split(held), [(k + 1, k)], repaired, **kw)
        followers += fit_runs(model, stats, ridge=ridge, rounds=rounds)
    return followers


def fit_full(
    A: torch.Tensor,
    B: torch.Tensor,
    energy: float,
    T0: torch.Tensor,
    *,
    ridge: float = DEFAULT_RIDGE,
    run: Run = (0, 0),
) -> RunFit:
    """T = argmin ||X T - D||^2 + lambda ||T - T0||^2 = (A + lambda I)^-1 (B + lambda T0)."""
    Ar, Br, lam = _regularised(A, B, T0, ridge)
    L, info = torch.linalg.cholesky_ex(Ar)
    if int(info) != 0:
        raise ValueError(f"run {run[0]}-{run[1]}: A + lambda I is not positive definite")
    T = torch.cholesky_solve(Br, L)
    _check_finite(T, run)
    return RunFit(
        run, "full", T, None, lam, residual_of(A, B, energy, T), residual_of(A, B, energy, T0)
    )


def fit_normed(
    A: torch.Tensor,
    B: torch.Tensor,
    energy: float,
    T0: torch.Tensor,
    *,
    ridge: float = DEFAULT_RIDGE,
    run: Run = (0, 0),
    rounds: int = MAX_ROUNDS,
    tol: float = 1e-6,
) -> RunFit:
    """argmin over orthogonal Q and diagonal G of ||u Q G - D||^2 + lambda ||Q G - T0||^2.

    With A' = A + lambda I, B' = B + lambda T0 the objective is, up to a constant,
    f = sum_j g_j^2 (Q^T A' Q)_jj - 2 g_j (Q^T B')_jj. Given Q, each g_j is exact:
    (Q^T B')_jj / (Q^T A' Q)_jj, whose denominator is at least lambda > 0. Given G, the
    quadratic in X = Q G is majorised by its tangent plus c ||X - X_k||^2 (c >= the top
    eigenvalue of A' guarantees it; ||Q G|| does not depend on Q), whose minimiser over
    orthogonal Q is the Procrustes solution U V^T of C = (B' + (c I - A') Q_k G) G. c
    starts small and doubles until f falls, so each round descends, and halves after
    every round. Starts from the better of T0 and the polar factor of the full solution.
    """
    Ar, Br, lam = _regularised(A, B, T0, ridge)
    d = A.shape[0]
    eye = torch.eye(d, dtype=A.dtype, device=A.device)

    def fitted(Q: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The exact scale for Q and the objective there, from one diag(Q^T A' Q)."""
        quad, cross = _diag_quad(Q, Ar), (Q * Br).sum(0)
        g = cross / quad
        return g, float((g * g * quad - 2 * g * cross).sum())

    full = fit_full(A, B, energy, T0, ridge=ridge, run=run).matrix
    U, _, Vh = torch.linalg.svd(full)
    Q, (g, f) = min(((q, fitted(q)) for q in (eye, U @ Vh)), key=lambda s: s[1][1])
    top = float(torch.linalg.eigvalsh(Ar)[-1])
    c = top / 64
    done = 0
    for done in range(1, rounds + 1):  # noqa: B007
        while True:
            C = (Br + (c * eye - Ar) @ (Q * g)) * g
            U, _, Vh = torch.linalg.svd(C)
            Q_new = U @ Vh
            g_new, f_new = fitted(Q_new)
            if f_new <= f or c >= top:
                break
            c = min(2 * c, top)
        gain = f - f_new
        Q, g, f = (Q_new, g_new, f_new) if f_new <= f else (Q, g, f)
        # Halving only after a first-try success would save a quarter of the SVDs (the
        # try at c / 2 mostly fails) but changes the iterates where it succeeds, and on a
        # Gemma 3 run it met `tol` 72 rounds early (a small gain at the larger c).
        c = max(c / 2, top / 4096)
        if gain <= tol * abs(f) or gain <= 0:
            break
    _check_finite(Q * g, run)
    T = Q * g
    return RunFit(
        run,
        "normed",
        Q,
        g,
        lam,
        residual_of(A, B, energy, T),
        residual_of(A, B, energy, T0),
        done,
    )


def _diag_quad(Q: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """diag(Q^T A Q) without forming the product's off-diagonal."""
    return (Q * (A @ Q)).sum(0)


def _check_finite(T: torch.Tensor, run: Run) -> None:
    if not bool(torch.isfinite(T).all()):
        raise ValueError(f"run {run[0]}-{run[1]}: the fitted map is not finite")


# -- folding -------------------------------------------------------------------------------


@torch.no_grad()
def fold(model: nn.Module, fits: Sequence[RunFit]) -> None:
    """Fold every fit into the dense (not yet pruned) `model`, in place. A streamed
    model's matrix gets an override its streamer serves (`lorp.streaming`), folded from
    the file's tensor in the file's dtype: what `lorp.file_surgery` writes into the
    variant's checkpoint, so the figures are the checkpoint's."""
    from lorp.streaming import streamer_of

    streamer = streamer_of(model)  # a streamed model: its matrices are overrides
    arch = architecture_of(model)
    blocks = decoder_blocks(model)
    for fit in fits:
        s = fit.run[0]
        if s == 0:
            if _tied(model):
                raise RepairRefused("a run from block 0 cannot fold into tied embeddings")
            embedding = decoder_stack(model).embed_tokens
            if streamer is not None:  # folded as the variant's file will hold it
                weight = streamer.stored(embedding, "weight")
                folded = folded_embeddings(weight, fit).to(streamer.dtype)
                streamer.override(embedding, "weight", folded)
            else:
                embedding.weight.copy_(folded_embeddings(embedding.weight, fit))
            continue
        down = blocks[s - 1].mlp.down_proj
        if streamer is not None:  # folded as the variant's file will hold it
            weight = streamer.stored(down, "weight")
            streamer.override(down, "weight", folded_down_weight(weight, fit).to(streamer.dtype))
        else:
            down.weight.copy_(folded_down_weight(down.weight, fit))
        if down.bias is not None:
            down.bias.copy_(folded_down_bias(_as_stored(streamer, down, "bias"), fit))
        if fit.form == "normed":
            norm = getattr(blocks[s - 1], arch.post_mlp_norm)
            weight = _as_stored(streamer, norm, "weight")
            norm.weight.copy_(folded_norm_weight(weight, fit, arch.norm_offset))


def _as_stored(streamer: Any, module: nn.Module, attr: str) -> torch.Tensor:
    """A resident vector as the fold starts from it: a streamed model's at the dtype its
    file stores it in (the resident copy holds the file's values exactly), so the fold
    rounds where the variant's file will; a model held whole's as it is."""
    t = getattr(module, attr)
    dtype = streamer.stored_dtype(module, attr) if streamer is not None else None
    return t if dtype is None else t.to(dtype)


# The fold's arithmetic, one function per tensor it changes: the in-memory fold above and
# the fold on a checkpoint's files (`lorp.file_surgery`) share it, so both write the same
# values for the same fit (float64, cast back to the tensor's dtype).


FOLD_SLICE = 1 << 24
"""Float64 elements of one slice of a fold's product (128 MiB): a matrix is folded
slice by slice, so the fold holds the result and one slice, not float64 copies of a
[d, intermediate] matrix (1.1 GiB at d = 8192 each)."""


def folded_embeddings(embed: torch.Tensor, fit: RunFit) -> torch.Tensor:
    """E T: the embeddings of a run from block 0 (rows in slices)."""
    T = fit.matrix.to(embed.device)
    out = torch.empty_like(embed)
    step = max(1, FOLD_SLICE // T.shape[0])
    for i in range(0, embed.shape[0], step):
        out[i : i + step] = (embed[i : i + step].double() @ T).to(embed.dtype)
    return out


def folded_down_weight(weight: torch.Tensor, fit: RunFit) -> torch.Tensor:
    """T^T W (Q^T W): block s-1's `down_proj` weight [d, intermediate] (columns in slices)."""
    Qt = fit.matrix.to(weight.device).T
    out = torch.empty_like(weight)
    step = max(1, FOLD_SLICE // Qt.shape[0])
    for j in range(0, weight.shape[1], step):
        out[:, j : j + step] = (Qt @ weight[:, j : j + step].double()).to(weight.dtype)
    return out


def folded_down_bias(bias: torch.Tensor, fit: RunFit) -> torch.Tensor:
    return (bias.double() @ fit.matrix.to(bias.device)).to(bias.dtype)


def folded_norm_weight(weight: torch.Tensor, fit: RunFit, offset: float) -> torch.Tensor:
    """g (less the norm's offset): the post-MLP norm's weight of a `normed` run."""
    return (fit.scale.to(weight.device) - offset).to(weight.dtype)


@contextmanager
def applied_by_hooks(
    model: nn.Module, fits: Sequence[RunFit], kept: Sequence[int] | None = None
) -> Iterator[None]:
    """Inside the block, `model` applies each fitted map by a forward hook instead of
    through its weights: the reference a fold must equal, and the way to apply a map that
    does not fold (a full map after a norm). `kept`: the original indices of a pruned
    model's blocks (`drop_layers` returns them); None for the dense model."""
    current = decoder_blocks(model)
    position = {b: i for i, b in enumerate(kept if kept is not None else range(len(current)))}
    blocks = {b: current[i] for b, i in position.items()}
    handles = []

    def replace(T: torch.Tensor, normed: bool):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            x = rms_unit(module, args[0]).double() if normed else output.double()
            return (x @ T.to(x.device)).to(output.dtype)

        return hook

    try:
        for fit in fits:
            T = fit.matrix if fit.scale is None else fit.matrix * fit.scale
            site = map_site(model, blocks, fit)
            handles.append(site.register_forward_hook(replace(T, fit.form == "normed")))
        yield
    finally:
        for h in handles:
            h.remove()


def map_site(model: nn.Module, blocks: Any, fit: RunFit) -> nn.Module:
    """The module whose output `fit`'s map replaces: the embeddings for a run from block
    0, else block s-1's MLP (its post-MLP norm for a `normed` fit). `blocks`: the
    original index -> block (a pruned model's kept blocks by their original indices)."""
    s = fit.run[0]
    if s == 0:
        return decoder_stack(model).embed_tokens
    normed = fit.form == "normed"
    return mlp_site(blocks[s - 1], architecture_of(model).post_mlp_norm if normed else None)


def full_fits(
    model: nn.Module, stats: RepairStats, *, ridge: float = DEFAULT_RIDGE
) -> list[RunFit]:
    """Every run fitted as an unconstrained map, whatever the family: on a post-MLP-norm
    family these do not fold and serve, through `applied_by_hooks`, as the upper bound
    the `normed` fold is measured against."""
    out = []
    for run in stats.runs:
        T0 = _unrepaired_map(model, run, stats.forms[run])
        out.append(
            fit_full(
                stats.gram[run[0]], stats.cross[run], stats.energy[run], T0, ridge=ridge, run=run
            )
        )
    return [
        RunFit(f.run, stats.forms[f.run], f.matrix, None, f.ridge, f.residual, f.unrepaired)
        for f in out
    ]


def prune_and_repair(
    model: nn.Module,
    windows: torch.Tensor,
    layers: Sequence[int],
    *,
    ridge: float = DEFAULT_RIDGE,
    batch_size: int = 8,
    skip_prefix: int = 0,
    sequential: bool = True,
    progress: bool = False,
) -> list[RunFit]:
    """Drop `layers` from the loaded `model` and repair every run, in place.

    `windows` [n, T] are calibration token ids (a BOS first when the tokenizer wants one,
    with `skip_prefix=1` to keep it out of the sums, as for S). `sequential` (default)
    fits the runs in depth order, each on the inputs the model repaired so far gives it
    and towards the dense model's state (one partial pass per run, and a copy of the
    model as the reference); False fits every run on dense inputs in one pass. Returns
    the fits; their `record()`s belong in the checkpoint's provenance.
    """
    runs = check_repairable(model, layers)
    start = time.perf_counter()
    batches = [windows[i : i + batch_size] for i in range(0, len(windows), batch_size)]
    kw: dict[str, Any] = {"skip_prefix": skip_prefix, "progress": progress}
    if sequential and len(runs) > 1:
        from lorp.streaming import streamer_of

        if streamer_of(model) is not None:
            raise ValueError(
                "sequential=True copies the model, and a streamed model cannot be copied "
                "(its hooks read through its own streamer): use sequential=False"
            )
        reference = copy.deepcopy(model)
        fits: list[RunFit] = []
        for j, run in enumerate(runs):
            earlier = [i for s, e in runs[:j] for i in range(s, e + 1)]
            stats = capture_repair_stats(
                model, batches, [run], reference=reference, dropped=earlier, **kw
            )
            fits += fit_runs(model, stats, ridge=ridge)
            fold(model, fits[-1:])
        del reference
    else:
        fits = fit_runs(model, capture_repair_stats(model, batches, runs, **kw), ridge=ridge)
        fold(model, fits)
    drop_layers(model, layers)
    log.info(
        "repaired %d run(s) in %.1f s: %s",
        len(fits),
        time.perf_counter() - start,
        ", ".join(f"{f.run[0]}-{f.run[1]} {f.unrepaired:.3f}->{f.residual:.3f}" for f in fits),
    )
    return fits


__all__ = [
    "DEFAULT_RIDGE",
    "RepairRefused",
    "RepairStats",
    "RunFit",
    "applied_by_hooks",
    "capture_repair_stats",
    "check_repairable",
    "contiguous_runs",
    "fit_full",
    "fit_normed",
    "fit_followers",
    "fit_runs",
    "fold",
    "follower_blocks",
    "window_losses",
    "window_scores",
    "full_fits",
    "prune_and_repair",
    "run_form",
]
