"""The closed-form `full` map against least squares solved directly: the sums give the
same T, the same residual, and a ridge that pulls towards the unrepaired map, not zero."""

from __future__ import annotations

import pytest
import torch

from lorp.repair.maps import fit_full, residual_of


def problem(d: int = 12, n: int = 600, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g, dtype=torch.float64)
    D = X @ torch.randn(d, d, generator=g, dtype=torch.float64) + 0.1 * torch.randn(
        n, d, generator=g, dtype=torch.float64
    )
    return X, D, X.T @ X, X.T @ D, float((D * D).sum())


def test_the_full_map_is_the_ridge_least_squares_solution() -> None:
    X, D, A, B, c = problem()
    T0 = torch.eye(12, dtype=torch.float64)
    fit = fit_full(A, B, c, T0, ridge=1e-2)
    lam = 1e-2 * float(torch.trace(A)) / 12
    # argmin ||X T - D||^2 + lam ||T - T0||^2, as one stacked least-squares problem
    stacked = torch.cat([X, lam**0.5 * torch.eye(12, dtype=torch.float64)])
    target = torch.cat([D, lam**0.5 * T0])
    expected = torch.linalg.lstsq(stacked, target).solution
    torch.testing.assert_close(fit.matrix, expected, rtol=1e-8, atol=1e-10)
    assert fit.ridge == pytest.approx(lam)
    direct = float(((X @ fit.matrix - D) ** 2).sum()) / c
    assert fit.residual == pytest.approx(direct, rel=1e-9)
    assert fit.unrepaired == pytest.approx(float(((X - D) ** 2).sum()) / c, rel=1e-9)
    assert fit.residual < fit.unrepaired


def test_a_large_ridge_falls_back_to_the_unrepaired_map_not_to_zero() -> None:
    _, _, A, B, c = problem(seed=1)
    T0 = torch.eye(12, dtype=torch.float64)
    fit = fit_full(A, B, c, T0, ridge=1e8)
    torch.testing.assert_close(fit.matrix, T0, rtol=0, atol=1e-5)
    assert residual_of(A, B, c, fit.matrix) == pytest.approx(fit.unrepaired, rel=1e-4)


def test_no_gap_leaves_no_residual_and_no_signal_is_refused() -> None:
    _, _, A, B, _ = problem()
    assert residual_of(A, B, 0.0, torch.eye(12, dtype=torch.float64)) == 0.0
    zero = torch.zeros(12, 12, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"tr\(A\) = 0"):
        fit_full(zero, zero, 1.0, torch.eye(12, dtype=torch.float64))
