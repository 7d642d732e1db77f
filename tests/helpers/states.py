"""Residual-stream-like states and the brute-force oracles of the paper's S (Eq. 3-4) and
of the last-token sums, written out pair by pair, token by token: no Gram trick."""

from __future__ import annotations

import math

import numpy as np


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


def brute_last_token(states: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean over sequences of the cosine and of arccos(cos)/pi between every pair of
    states at each sequence's last real token; states [L, B, T, d], mask [B, T]."""
    L, B = states.shape[:2]
    cos, ang, n = np.zeros((L, L)), np.zeros((L, L)), 0
    for b in range(B):
        real = np.flatnonzero(mask[b])
        if real.size == 0:
            continue
        n += 1
        for i in range(L):
            for j in range(L):
                u, v = states[i, b, real[-1]], states[j, b, real[-1]]
                c = float(np.dot(u, v) / (np.linalg.norm(u) * np.linalg.norm(v)))
                cos[i, j] += c
                ang[i, j] += math.acos(min(1.0, max(-1.0, c))) / math.pi
    return cos / n, ang / n


def last_positions(last: list[int], T: int) -> np.ndarray:
    """A [B, T] mask whose real tokens end at `last` (right padding after)."""
    mask = np.zeros((len(last), T), dtype=bool)
    for b, t in enumerate(last):
        mask[b, : t + 1] = True
    return mask
