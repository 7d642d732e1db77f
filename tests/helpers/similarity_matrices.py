"""Similarity matrices the selection tests build or draw: a random cosine Gram, S with
planted contiguous clusters, S that decays with depth to edit pair by pair, and
hypothesis-drawn allocation problems (rounded, so exact ties are common)."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st


def random_S(n: int, seed: int) -> np.ndarray:
    """[n, n] cosines of n random unit vectors, mostly positive (mean shifted by 1.5)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 16)) + 1.5
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x @ x.T


def locality_matrix(sizes: tuple[int, ...]) -> np.ndarray:
    """S with contiguous clusters of the given sizes: high within, low across."""
    n = sum(sizes)
    cluster = np.repeat(np.arange(len(sizes)), sizes)
    i, j = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    S = np.where(cluster[i] == cluster[j], 0.9 - 0.02 * np.abs(i - j), 0.1 + 0.001 * (i + j))
    np.fill_diagonal(S, 1.0)
    return S


def chain(n_states: int, rho: float = 0.8) -> np.ndarray:
    """S_ij = rho^|i-j|: a symmetric matrix with depth decay to edit by hand."""
    idx = np.arange(n_states)
    return rho ** np.abs(idx[:, None] - idx[None, :])


def set_sym(M: np.ndarray, i: int, j: int, value: float) -> None:
    """Set S_ij and S_ji alike."""
    M[i, j] = M[j, i] = value


@st.composite
def problems(draw):  # type: ignore[no-untyped-def]
    """(S, labels, budget): any n in 4..24, any labelling into up to 6 clusters, any
    budget that leaves the boundary blocks."""
    n = draw(st.integers(4, 24))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, draw(st.integers(2, 12)))) + draw(st.floats(0.2, 3.0))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    S = np.round(x @ x.T, 2)  # rounding makes exact ties common
    np.fill_diagonal(S, 1.0)
    k = draw(st.integers(1, min(6, n)))
    labels = draw(st.lists(st.integers(0, k - 1), min_size=n, max_size=n))
    budget = draw(st.integers(1, n - 2))
    return S, labels, budget
