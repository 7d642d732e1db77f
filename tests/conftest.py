"""Shared fixtures: random residual-stream-like states with real depth structure."""

from __future__ import annotations

import numpy as np
import pytest

# `make test` shares whole files among two processes (pytest-xdist, `--dist loadfile`,
# files handed out in collection order). The files that take minutes (real Ray jobs, two
# nodes, real models, measured under xdist) go out first and the quick ones fill in behind
# them, so neither process is left alone with a long file at the end.
SLOW_FILES = (
    "test_pipeline.py",
    "test_faults.py",
    "test_two_nodes.py",
    "test_shared_catalog.py",
    "test_connect.py",
    "test_pipeline_streamed.py",
    "test_evaluation.py",
    "test_pipeline_repair.py",
    "test_fleet.py",
    "test_dashboard.py",
    "test_model_registry.py",
    "test_real_model.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow files first, in `SLOW_FILES` order; every other file and every file's own
    tests keep pytest's order."""
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def make_states(
    n_states: int, tokens: int, d: int, seed: int = 0, drift: float = 0.35
) -> np.ndarray:
    """[L, T, d] states shaped like a residual stream: each layer adds a small update to the
    previous one, so neighbours are similar and similarity decays with depth."""
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(tokens, d)) + 1.0
    out = np.empty((n_states, tokens, d))
    for layer in range(n_states):
        out[layer] = h
        h = h + drift * rng.normal(size=(tokens, d)) * (1.0 + (layer % 5 == 0))
    return out


def brute_force_S(
    states: np.ndarray, mask: np.ndarray | None = None, eps: float = 1e-8
) -> np.ndarray:
    """Eq. 3-4 written out token by token, pair by pair: no Gram trick."""
    n_states, tokens, _ = states.shape
    keep = [t for t in range(tokens) if mask is None or mask[t]]
    S = np.zeros((n_states, n_states))
    for i in range(n_states):
        for j in range(n_states):
            total = 0.0
            for t in keep:
                a, b = states[i, t], states[j, t]
                total += float(np.dot(a / (np.linalg.norm(a) + eps), b / (np.linalg.norm(b) + eps)))
            S[i, j] = total / len(keep)
    return S


@pytest.fixture
def states() -> np.ndarray:
    return make_states(n_states=9, tokens=40, d=32, seed=1)
