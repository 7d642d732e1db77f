"""Mergeable inter-layer similarity statistics: the S of the paper's Eq. 3-4.

S_ij is the mean, over every calibration token, of the cosine similarity between the
residual-stream states entering blocks i and j (Eq. 4), each state first normalised as
h / (||h|| + eps) (Eq. 3). Because it is a mean of per-token dot products, it is a sum of
Gram matrices divided by a token count, so shards of the calibration set can be processed
anywhere (a Ray task, another GPU, another day) and merged by adding the sums.

`SimilarityStats` holds L = N + 1 states for an N-block model: the inputs of blocks 0..N-1
(index 0 is the embedding output) and the output of block N-1 before the final norm. The
paper's S is the leading N x N block; the extra row is what ShortGPT and the window
methods need to score the last block.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT_VERSION = 1
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

    def __post_init__(self) -> None:
        check_similarity_matrix(self.matrix)
        if self.matrix.shape[0] not in (self.n_blocks, self.n_blocks + 1):
            raise ValueError(
                f"matrix of size {self.matrix.shape[0]} does not describe n_blocks={self.n_blocks}"
            )

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


class SimilarityStats:
    """Running sum of per-token normalised Gram matrices over L = N + 1 residual states.

    The sum is accumulated in float64 on the device of the first batch, so a GPU capture
    never copies activations back to the host; `gram`, `matrix()` and pickling bring the
    L x L sum to the CPU.
    """

    def __init__(
        self,
        n_blocks: int,
        *,
        model_fingerprint: str | None = None,
        calibration_fingerprint: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(n_blocks, int) or n_blocks < 2:
            raise ValueError(f"n_blocks must be an integer >= 2, got {n_blocks!r}")
        self.n_blocks = n_blocks
        self.model_fingerprint = model_fingerprint
        self.calibration_fingerprint = calibration_fingerprint
        self.extra: dict[str, Any] = dict(extra or {})
        self.tokens = 0
        self._sum: torch.Tensor = torch.zeros(n_blocks + 1, n_blocks + 1, dtype=torch.float64)

    @property
    def n_states(self) -> int:
        return self.n_blocks + 1

    # -- accumulation ---------------------------------------------------------------------

    def update(self, states: torch.Tensor | np.ndarray, mask: Any = None) -> None:
        """Add one batch of states, shaped [L, *tokens, d]; `mask` (shape `tokens`) drops
        the tokens where it is False (padding).

        One GEMM per batch: F = normalised states as [L, T*d], sum += F @ F.T. Nothing of
        the batch is kept afterwards.
        """
        x = torch.as_tensor(states)
        if x.ndim < 3 or x.shape[0] != self.n_states:
            raise ValueError(
                f"states must be shaped [L={self.n_states}, tokens..., d], got {tuple(x.shape)}"
            )
        if not x.is_floating_point():
            raise ValueError(f"states must be floating point, got {x.dtype}")
        x = x.reshape(self.n_states, -1, x.shape[-1])
        if mask is not None:
            m = torch.as_tensor(mask, device=x.device).reshape(-1).to(torch.bool)
            if m.numel() != x.shape[1]:
                raise ValueError(f"mask has {m.numel()} tokens, states have {x.shape[1]}")
            x = x[:, m]
        if x.shape[1] == 0:
            return
        self.add_normalized(normalize_states(x))

    def add_normalized(self, f: torch.Tensor) -> None:
        """Add states already normalised by `normalize_states`, shaped [L, T, d]: the
        capture hooks fill such a buffer block by block, so no raw activation outlives
        its block."""
        if f.ndim != 3 or f.shape[0] != self.n_states:
            raise ValueError(
                f"normalised states must be [L={self.n_states}, T, d], got {tuple(f.shape)}"
            )
        n_tok = f.shape[1]
        flat = f.reshape(self.n_states, -1)
        gram = (flat @ flat.T).to(torch.float64)
        diag_ok = torch.isfinite(gram.diagonal())
        if not bool(diag_ok.all()):
            raise NonFiniteActivationError(int((~diag_ok).nonzero()[0, 0]), self.n_blocks)
        if self._sum.device != gram.device:
            self._sum = self._sum.to(gram.device)
        self._sum += gram
        self.tokens += int(n_tok)

    def merge(self, other: SimilarityStats) -> SimilarityStats:
        """Return the statistics of both calibration shards together (commutative, and
        associative up to float64 rounding)."""
        if not isinstance(other, SimilarityStats):
            raise TypeError(f"can only merge SimilarityStats, got {type(other).__name__}")
        if other.n_blocks != self.n_blocks:
            raise ValueError(f"cannot merge n_blocks={self.n_blocks} with {other.n_blocks}")
        model = _same("model_fingerprint", self.model_fingerprint, other.model_fingerprint)
        calib = _same(
            "calibration_fingerprint", self.calibration_fingerprint, other.calibration_fingerprint
        )
        out = SimilarityStats(
            self.n_blocks,
            model_fingerprint=model,
            calibration_fingerprint=calib,
            extra={**other.extra, **self.extra},
        )
        out._sum = self.gram_tensor().cpu() + other.gram_tensor().cpu()
        out.tokens = self.tokens + other.tokens
        return out

    @classmethod
    def merge_all(cls, parts: Iterable[SimilarityStats]) -> SimilarityStats:
        """Merge any number of partial statistics (at least one)."""
        it = iter(parts)
        try:
            total = next(it)
        except StopIteration:
            raise ValueError("merge_all needs at least one SimilarityStats") from None
        for part in it:
            total = total.merge(part)
        return total

    # -- results --------------------------------------------------------------------------

    def gram_tensor(self) -> torch.Tensor:
        return self._sum

    @property
    def gram(self) -> np.ndarray:
        """The float64 sum over tokens of F @ F.T, (N + 1) x (N + 1), on the host."""
        return self._sum.detach().cpu().numpy().copy()

    def matrix(self, include_output: bool = False) -> np.ndarray:
        """S (Eq. 4): N x N over block inputs, or (N + 1) x (N + 1) with the final state."""
        if self.tokens == 0:
            raise ValueError("no tokens accumulated yet: S is undefined")
        S = self.gram / self.tokens
        S = (S + S.T) / 2  # exact symmetry; the GEMM is symmetric only to rounding
        return S if include_output else S[: self.n_blocks, : self.n_blocks]

    def similarity(self) -> LayerSimilarity:
        return LayerSimilarity(self.matrix(include_output=True), self.n_blocks)

    # -- persistence ----------------------------------------------------------------------

    def metadata(self) -> dict[str, Any]:
        from lorp import __version__

        return {
            "format_version": FORMAT_VERSION,
            "n_blocks": self.n_blocks,
            "tokens": self.tokens,
            "model_fingerprint": self.model_fingerprint,
            "calibration_fingerprint": self.calibration_fingerprint,
            "lorp_version": __version__,
            "extra": self.extra,
        }

    def to_file(self, path: str | os.PathLike[str]) -> Path:
        """Write an .npz (the sum, the token count, JSON metadata), atomically."""
        path = Path(path)
        if path.suffix != ".npz":
            raise ValueError(f"stats file must end in .npz, got {str(path)!r}")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                np.savez(
                    fh,
                    gram=self.gram,
                    tokens=np.int64(self.tokens),
                    metadata=np.array(json.dumps(self.metadata(), sort_keys=True)),
                )
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> SimilarityStats:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"stats file not found: {str(path)!r}")
        try:
            with np.load(path, allow_pickle=False) as z:
                gram, tokens = z["gram"], int(z["tokens"])
                meta = json.loads(str(z["metadata"]))
        except (OSError, KeyError, ValueError) as exc:
            raise ValueError(f"{str(path)!r} is not a lorp stats file ({exc})") from None
        version = meta.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(f"{str(path)!r}: unsupported format_version {version!r}")
        n = int(meta["n_blocks"])
        if gram.shape != (n + 1, n + 1):
            raise ValueError(f"{str(path)!r}: sum of shape {gram.shape} for n_blocks={n}")
        out = cls(
            n,
            model_fingerprint=meta.get("model_fingerprint"),
            calibration_fingerprint=meta.get("calibration_fingerprint"),
            extra=meta.get("extra") or {},
        )
        out._sum = torch.from_numpy(np.ascontiguousarray(gram, dtype=np.float64))
        out.tokens = tokens
        return out

    # Ray and multiprocessing ship stats between processes: always as host memory.
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_sum"] = self._sum.detach().cpu()
        return state

    def __repr__(self) -> str:
        return (
            f"SimilarityStats(n_blocks={self.n_blocks}, tokens={self.tokens}, "
            f"model={self.model_fingerprint!r}, calibration={self.calibration_fingerprint!r})"
        )


def _same(field: str, a: str | None, b: str | None) -> str | None:
    if a is not None and b is not None and a != b:
        raise ValueError(f"cannot merge stats with different {field}: {a!r} vs {b!r}")
    return a if a is not None else b


def load_similarity(path: str | os.PathLike[str]) -> SimilarityStats | LayerSimilarity:
    """Load a saved `SimilarityStats` (.npz) or a bare N x N block-input matrix (.npy)."""
    path = Path(path)
    if path.suffix == ".npy":
        if not path.is_file():
            raise FileNotFoundError(f"similarity file not found: {str(path)!r}")
        try:
            matrix = np.load(path, allow_pickle=False)
        except ValueError as exc:
            raise ValueError(f"{str(path)!r} is not a .npy matrix ({exc})") from None
        if not np.issubdtype(matrix.dtype, np.number):
            raise ValueError(f"{str(path)!r} holds {matrix.dtype}, not numbers")
        return LayerSimilarity.from_matrix(matrix.astype(np.float64))
    if path.suffix == ".npz":
        return SimilarityStats.from_file(path)
    raise ValueError(f"similarity file must be .npz (SimilarityStats) or .npy, got {str(path)!r}")
