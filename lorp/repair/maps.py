"""The repair's maps: what a fitted run is (`RunFit`), the unrepaired map it falls back to,
and the closed-form `full` fit.

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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lorp.models.architectures import block_stage, text_config
from lorp.models.architectures import tied_embeddings as ties_embeddings
from lorp.repair.stats import Form, Run

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
    "distilled" (`lorp.repair.distill`)."""
    validation: dict[float, float] | None = None
    """Relative ridge -> held-out residual of the unconstrained map, every candidate (with
    held-out windows of several domains: its worst ratio to the unrepaired map's)."""
    held_domains: dict[str, tuple[float, float]] | None = None
    """Domain -> (the kept map's, the unrepaired map's) held-out residual, where the
    held-out windows have several domains; `held_residual` is the worst domain's."""
    distilled: dict[str, Any] | None = None
    """`lorp.repair.distill`'s record (held-out KL per epoch, the epoch kept) when the map went
    through distillation; `kept` is then "distilled" where an epoch beat the fit. The
    residuals stay the least-squares fit's."""

    gate: dict[str, Any] | None = None
    """`lorp.repair.domain_gate`'s record of the point's whole repair (on its first map)."""

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
            if self.held_domains:
                out["held_by_domain"] = {
                    d: {"residual": round(r, 6), "unrepaired": round(u, 6)}
                    for d, (r, u) in self.held_domains.items()
                }
        if self.distilled is not None:
            out["kept"] = self.kept
            out["distilled"] = self.distilled
        if self.gate is not None:
            out["gate"] = self.gate
        return out


def tied_embeddings(model: nn.Module) -> bool:
    from lorp.models.streaming import streamer_of

    streamer = streamer_of(model)
    if streamer is not None:  # between forwards its matrices are all on the meta device
        return streamer.tied
    return ties_embeddings(model)


def unrepaired_map(model: nn.Module, run: Run, form: Form) -> torch.Tensor:
    """T0: what the pruned model applies to X now (I, or the post-MLP norm's scale)."""
    d = int(text_config(model.config).hidden_size)
    if form == "full":
        return torch.eye(d, dtype=torch.float64)
    stage = block_stage(model, run[0] - 1)
    norm = stage.post_norm
    assert norm is not None
    return torch.diag(norm.weight.detach().double().cpu() + stage.norm_offset)


def unrepaired_matrices(T0: torch.Tensor, form: Form) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(matrix, scale) of a fit that applies T0, the map the pruned model applies already:
    T0 itself (full), or the identity and T0's diagonal (normed). Folding it changes no
    weight."""
    if form == "full":
        return T0, None
    eye = torch.eye(T0.shape[0], dtype=T0.dtype, device=T0.device)
    return eye, torch.diagonal(T0).clone()


def regularised(A: torch.Tensor, B: torch.Tensor, T0: torch.Tensor, ridge: float):  # type: ignore[no-untyped-def]
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
    Ar, Br, lam = regularised(A, B, T0, ridge)
    L, info = torch.linalg.cholesky_ex(Ar)
    if int(info) != 0:
        raise ValueError(f"run {run[0]}-{run[1]}: A + lambda I is not positive definite")
    T = torch.cholesky_solve(Br, L)
    check_finite(T, run)
    return RunFit(
        run, "full", T, None, lam, residual_of(A, B, energy, T), residual_of(A, B, energy, T0)
    )


def check_finite(T: torch.Tensor, run: Run) -> None:
    if not bool(torch.isfinite(T).all()):
        raise ValueError(f"run {run[0]}-{run[1]}: the fitted map is not finite")
