"""The `normed` fit, for runs whose map must pass the RMSNorm that follows the MLP:

- `normed` (Gemma 2/3, OLMo 2/3: an RMSNorm follows the MLP): a full map cannot pass the
  norm, but an orthogonal one can, since rms(m Q) = rms(m). With u the normalised MLP
  output (before the norm's weight), the map is u -> (u Q) diag(g): `down_proj` takes
  W <- Q^T W and the norm's weight becomes g (minus Gemma's 1 + w offset). Q and g are
  fitted by block-coordinate descent: g exactly per channel, Q by a majorise-minimise
  Procrustes step with backtracking, so the objective never rises.
"""

from __future__ import annotations

import torch

from lorp.repair.maps import (
    DEFAULT_RIDGE,
    MAX_ROUNDS,
    RunFit,
    check_finite,
    fit_full,
    regularised,
    residual_of,
)
from lorp.repair.stats import Run


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
    Ar, Br, lam = regularised(A, B, T0, ridge)
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
    check_finite(Q * g, run)
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
