"""The matrix S of the paper's Eq. 3-4 and the arithmetic its sums are built from.

S_ij is the mean, over every calibration token, of the cosine similarity between the
residual-stream states entering blocks i and j (Eq. 4), each state first normalised as
h / (||h|| + eps) (Eq. 3). Because it is a mean of per-token dot products, it is a sum of
Gram matrices divided by a token count, so shards of the calibration set can be processed
anywhere (a Ray task, another GPU, another day) and merged by adding the sums: those sums
are `lorp.locality.similarity_stats.SimilarityStats` (L = N + 1 states for an N-block
model: the inputs of blocks 0..N-1 and the output of block N-1 before the final norm; the
paper's S is the leading N x N block).

Here: `LayerSimilarity`, S as a matrix when only block inputs are known (a bare matrix
loaded from .npy); Eq. 3's normalisation (`normalize_states`); which tokens count
(`token_selection`: padding and a BOS prefix left out); and the per-sequence sums at each
sequence's last real token (`last_token_sums`): the cosine and the angular distance
arccos(cos) / pi between every pair of states, which the angular-distance method
(Gromov et al., 2024) averages over sequences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

EPS = 1e-8  # Eq. 3's epsilon: keeps an all-zero state from dividing by zero.


class NonFiniteActivationError(ValueError):
    """A NaN or Inf reached the statistics; names the offending state index."""

    def __init__(self, layer: int, n_blocks: int) -> None:
        where = (
            f"the output of block {layer - 1} (final state)"
            if layer == n_blocks
            else f"the input of block {layer}"
        )
        super().__init__(
            f"non-finite activations at layer {layer} ({where}); fp16 overflow is the usual "
            "cause: capture in float32 or bfloat16"
        )
        self.layer = layer


@dataclass(frozen=True)
class LayerSimilarity:
    """A similarity matrix together with the number of blocks it describes.

    `matrix` is (N + 1) x (N + 1) when the final block's output is included, or N x N when
    only block inputs are known (a bare matrix loaded from .npy).
    """

    matrix: np.ndarray
    n_blocks: int
    # (N + 1) x (N + 1) means over sequences at each sequence's last real token: the cosine
    # and the angular distance arccos(cos) / pi. None when not captured (a bare matrix).
    last_token: np.ndarray | None = None
    last_token_angular: np.ndarray | None = None

    def __post_init__(self) -> None:
        check_similarity_matrix(self.matrix)
        if self.matrix.shape[0] not in (self.n_blocks, self.n_blocks + 1):
            raise ValueError(
                f"matrix of size {self.matrix.shape[0]} does not describe n_blocks={self.n_blocks}"
            )
        for name in ("last_token", "last_token_angular"):
            value = getattr(self, name)
            if value is not None:
                check_similarity_matrix(value, name)
                if value.shape[0] != self.n_blocks + 1:
                    raise ValueError(
                        f"{name} must be {self.n_blocks + 1} x {self.n_blocks + 1} for "
                        f"n_blocks={self.n_blocks}, got {value.shape}"
                    )
        if (self.last_token is None) != (self.last_token_angular is None):
            raise ValueError("last_token and last_token_angular come together or not at all")

    @property
    def has_last_token(self) -> bool:
        """True when the last-token matrices were captured."""
        return self.last_token is not None

    @property
    def has_output(self) -> bool:
        """True when the output of the last block is row/column N."""
        return self.matrix.shape[0] == self.n_blocks + 1

    @property
    def blocks(self) -> np.ndarray:
        """The paper's S: similarities between the inputs of blocks 0..N-1."""
        return self.matrix[: self.n_blocks, : self.n_blocks]

    @classmethod
    def from_matrix(cls, matrix: np.ndarray) -> LayerSimilarity:
        """Wrap a bare N x N matrix of block-input similarities."""
        matrix = np.asarray(matrix, dtype=np.float64)
        check_similarity_matrix(matrix)
        return cls(matrix=matrix, n_blocks=matrix.shape[0])


def check_similarity_matrix(S: np.ndarray, name: str = "S") -> None:
    """Raise ValueError unless S is a finite, square, symmetric matrix of size >= 2."""
    if S.ndim != 2 or S.shape[0] != S.shape[1]:
        raise ValueError(f"{name} must be square, got shape {tuple(S.shape)}")
    if S.shape[0] < 2:
        raise ValueError(f"{name} must describe at least 2 layers, got {S.shape[0]}")
    if not np.all(np.isfinite(S)):
        bad = np.argwhere(~np.isfinite(S))[0]
        raise ValueError(
            f"{name} must be finite, got {S[tuple(bad)]} at {tuple(int(i) for i in bad)}"
        )
    asym = float(np.max(np.abs(S - S.T)))
    if asym > 1e-6:
        raise ValueError(f"{name} must be symmetric, max |S - S.T| = {asym:.3g}")


def normalize_states(x: torch.Tensor) -> torch.Tensor:
    """Eq. 3 in float32 (float64 for float64 input): fp16/bf16 norms lose the digits S is
    made of."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    x = x.to(work)
    return x / (torch.linalg.vector_norm(x, dim=-1, keepdim=True) + EPS)


def token_selection(
    shape: tuple[int, ...],
    mask: Any = None,
    skip_prefix: int = 0,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Which tokens of a [*batch, T] layout count, flattened: (keep, last).

    `keep` is a bool mask over the flattened tokens that enter S (None: all of them):
    the real tokens (`mask` true, padding false) less the first `skip_prefix` real tokens
    of each sequence (a BOS, whose state is an attention sink with a huge norm). `last`
    holds the flat index of each sequence's last real token, whatever `skip_prefix` says;
    a sequence with no real token has none.
    """
    if isinstance(skip_prefix, bool) or not isinstance(skip_prefix, int) or skip_prefix < 0:
        raise ValueError(f"skip_prefix must be a non-negative integer, got {skip_prefix!r}")
    n_tok, T = math.prod(shape), shape[-1]
    if mask is None:
        valid = torch.ones(n_tok // T, T, dtype=torch.bool, device=device)
    else:
        m = torch.as_tensor(mask, device=device).reshape(-1).to(torch.bool)
        if m.numel() != n_tok:
            raise ValueError(f"mask has {m.numel()} tokens, states have {n_tok}")
        valid = m.reshape(-1, T)
    keep = valid & (valid.cumsum(dim=1) > skip_prefix) if skip_prefix else valid
    rows = valid.any(dim=1).nonzero().reshape(-1)
    last_col = T - 1 - valid.flip(1).to(torch.uint8).argmax(dim=1)
    last = rows * T + last_col[rows]
    keep_flat = keep.reshape(-1)
    return (None if bool(keep_flat.all()) else keep_flat), last


def last_token_sums(last: torch.Tensor, n_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence cosine matrices of the last-token states [L, B, d], summed over B, and
    the same for arccos(cos) / pi. In float64 and rescaled by the exact norms, so the
    diagonal is 1 (angle 0) and the arccos of a cosine near 1 keeps its digits."""
    x = last.to(torch.float64)
    G = torch.einsum("lbd,mbd->blm", x, x)
    diag = G.diagonal(dim1=1, dim2=2)
    finite = torch.isfinite(diag).all(dim=0)
    if not bool(finite.all()):
        raise NonFiniteActivationError(int((~finite).nonzero()[0, 0]), n_blocks)
    norms = diag.clamp_min(1e-300).sqrt()
    cos = (G / (norms[:, :, None] * norms[:, None, :])).clamp(-1.0, 1.0)
    cos.diagonal(dim1=1, dim2=2).fill_(1.0)
    return cos.sum(dim=0), (torch.arccos(cos) / math.pi).sum(dim=0)
