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

Beside the all-token Gram it keeps two L x L sums over sequences, taken at each
sequence's last real token only: the cosine matrix and the angular distance
arccos(cos) / pi between every pair of states. The angular-distance method (Gromov et al.,
2024) measures there, and averages the angle (not the cosine) over sequences, so the
angle is summed per sequence; both sums merge across shards like the Gram.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lorp.atomic import atomic_file
from lorp.version import __version__

# 2: adds the last-token sums (`last_gram`, `last_angular`, `sequences`); files of version
# 1 lack them and are refused rather than silently serving methods that need them.
FORMAT_VERSION = 2
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


class SimilarityStats:
    """Running sums over L = N + 1 residual states: the per-token normalised Gram matrix
    (Eq. 4's numerator) and the last-token cosine and angle matrices (one per sequence).

    The sums are accumulated in float64 on the device of the first batch, so a GPU capture
    never copies activations back to the host; `gram`, `matrix()` and pickling bring the
    L x L sums to the CPU.
    """

    def __init__(
        self,
        n_blocks: int,
        *,
        model_fingerprint: str | None = None,
        calibration_fingerprint: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        if isinstance(n_blocks, bool) or not isinstance(n_blocks, int) or n_blocks < 2:
            raise ValueError(f"n_blocks must be an integer >= 2, got {n_blocks!r}")
        self.n_blocks = n_blocks
        self.model_fingerprint = model_fingerprint
        self.calibration_fingerprint = calibration_fingerprint
        self.extra: dict[str, Any] = dict(extra or {})
        self.tokens = 0
        self.sequences = 0
        L = n_blocks + 1
        self._sum: torch.Tensor = torch.zeros(L, L, dtype=torch.float64)
        self._last_sum: torch.Tensor = torch.zeros(L, L, dtype=torch.float64)
        self._last_angle: torch.Tensor = torch.zeros(L, L, dtype=torch.float64)

    @property
    def n_states(self) -> int:
        return self.n_blocks + 1

    # -- accumulation ---------------------------------------------------------------------

    def update(
        self, states: torch.Tensor | np.ndarray, mask: Any = None, *, skip_prefix: int = 0
    ) -> None:
        """Add one batch of states shaped [L, *batch, T, d] (or [L, T, d]: one sequence).

        `mask` ([*batch, T]) is false at padding, which counts nowhere. `skip_prefix` drops
        the first real tokens of each sequence from the Gram only (a BOS: see
        `token_selection`); the last-token sums always take each sequence's last real
        token. One GEMM per batch: F = normalised states as [L, T*d], sum += F @ F.T.
        """
        x = torch.as_tensor(states)
        if x.ndim < 3 or x.shape[0] != self.n_states:
            raise ValueError(
                f"states must be shaped [L={self.n_states}, tokens..., d], got {tuple(x.shape)}"
            )
        if not x.is_floating_point():
            raise ValueError(f"states must be floating point, got {x.dtype}")
        keep, last = token_selection(tuple(x.shape[1:-1]), mask, skip_prefix, x.device)
        x = x.reshape(self.n_states, -1, x.shape[-1])
        tokens = x if keep is None else x[:, keep]
        self.add_normalized(normalize_states(tokens), last=normalize_states(x[:, last].double()))

    def add_normalized(self, f: torch.Tensor, last: torch.Tensor | None = None) -> None:
        """Add states already normalised by `normalize_states`: `f` [L, T, d] the tokens of
        S, `last` [L, B, d] the last real token of each of B sequences. The capture hooks
        fill such buffers block by block, so no raw activation outlives its block.

        Nothing is added unless everything is finite (NonFiniteActivationError names the
        first bad state)."""
        if f.ndim != 3 or f.shape[0] != self.n_states:
            raise ValueError(
                f"normalised states must be [L={self.n_states}, T, d], got {tuple(f.shape)}"
            )
        flat = f.reshape(self.n_states, -1)
        gram = (flat @ flat.T).to(torch.float64)
        diag_ok = torch.isfinite(gram.diagonal())
        if not bool(diag_ok.all()):
            raise NonFiniteActivationError(int((~diag_ok).nonzero()[0, 0]), self.n_blocks)
        sums = None
        if last is not None:
            if last.ndim != 3 or last.shape[0] != self.n_states:
                raise ValueError(
                    f"last-token states must be [L={self.n_states}, B, d], got {tuple(last.shape)}"
                )
            sums = last_token_sums(last, self.n_blocks)
        self._to(gram.device)
        self._sum += gram
        self.tokens += int(f.shape[1])
        if sums is not None:
            self._last_sum += sums[0].to(gram.device)
            self._last_angle += sums[1].to(gram.device)
            self.sequences += int(last.shape[1])

    def _to(self, device: torch.device) -> None:
        if self._sum.device != device:
            self._sum = self._sum.to(device)
            self._last_sum = self._last_sum.to(device)
            self._last_angle = self._last_angle.to(device)

    def merge(self, other: SimilarityStats) -> SimilarityStats:
        """Return the statistics of both calibration shards together (commutative, and
        associative up to float64 rounding)."""
        if not isinstance(other, SimilarityStats):
            raise TypeError(f"can only merge SimilarityStats, got {type(other).__name__}")
        if other.n_blocks != self.n_blocks:
            raise ValueError(f"cannot merge n_blocks={self.n_blocks} with {other.n_blocks}")
        if (
            self._lacks_last_token()
            and other.sequences
            or other._lacks_last_token()
            and (self.sequences)
        ):
            raise ValueError("cannot merge stats with and without last-token statistics")
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
        out._sum = self._sum.cpu() + other._sum.cpu()
        out._last_sum = self._last_sum.cpu() + other._last_sum.cpu()
        out._last_angle = self._last_angle.cpu() + other._last_angle.cpu()
        out.tokens = self.tokens + other.tokens
        out.sequences = self.sequences + other.sequences
        return out

    def _lacks_last_token(self) -> bool:
        """Tokens were added without their last-token sums (`add_normalized` without
        `last`): merging such a part with one that has them would mix calibration sets."""
        return self.tokens > 0 and self.sequences == 0

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

    @property
    def last_gram(self) -> np.ndarray:
        """The float64 sum over sequences of the last-token cosine matrix, (N + 1)^2."""
        return self._last_sum.detach().cpu().numpy().copy()

    @property
    def last_angular_sum(self) -> np.ndarray:
        """The float64 sum over sequences of the last-token arccos(cos) / pi, (N + 1)^2."""
        return self._last_angle.detach().cpu().numpy().copy()

    @property
    def has_last_token(self) -> bool:
        """True when at least one sequence's last token was recorded."""
        return self.sequences > 0

    def matrix(self, include_output: bool = False) -> np.ndarray:
        """S (Eq. 4): N x N over block inputs, or (N + 1) x (N + 1) with the final state."""
        if self.tokens == 0:
            raise ValueError("no tokens accumulated yet: S is undefined")
        S = _symmetric(self.gram / self.tokens)
        return S if include_output else S[: self.n_blocks, : self.n_blocks]

    def last_token_matrix(self) -> np.ndarray:
        """Mean over sequences of the cosine between states at the last token, (N + 1)^2."""
        return _symmetric(self.last_gram / self._sequence_count())

    def last_token_angular(self) -> np.ndarray:
        """Mean over sequences of arccos(cos) / pi at the last token (Gromov et al.'s
        angular distance between every pair of states), (N + 1) x (N + 1)."""
        return _symmetric(self.last_angular_sum / self._sequence_count())

    def _sequence_count(self) -> int:
        if self.sequences == 0:
            raise ValueError("no last-token statistics: these stats hold no sequence")
        return self.sequences

    def similarity(self) -> LayerSimilarity:
        """The matrices every method reads, last-token ones included when recorded."""
        last = (self.last_token_matrix(), self.last_token_angular()) if self.sequences else None
        return LayerSimilarity(
            self.matrix(include_output=True),
            self.n_blocks,
            last_token=last[0] if last else None,
            last_token_angular=last[1] if last else None,
        )

    # -- persistence ----------------------------------------------------------------------

    def metadata(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "n_blocks": self.n_blocks,
            "tokens": self.tokens,
            "sequences": self.sequences,
            "model_fingerprint": self.model_fingerprint,
            "calibration_fingerprint": self.calibration_fingerprint,
            "lorp_version": __version__,
            "extra": self.extra,
        }

    def to_file(self, path: str | os.PathLike[str]) -> Path:
        """Write an .npz (the sums, the counts, JSON metadata), atomically."""
        path = Path(path)
        if path.suffix != ".npz":
            raise ValueError(f"stats file must end in .npz, got {str(path)!r}")
        with atomic_file(path) as tmp, open(tmp, "wb") as fh:
            np.savez(
                fh,  # a file object: np.savez would append .npz to a path
                gram=self.gram,
                tokens=np.int64(self.tokens),
                last_gram=self.last_gram,
                last_angular=self.last_angular_sum,
                sequences=np.int64(self.sequences),
                metadata=np.array(json.dumps(self.metadata(), sort_keys=True)),
            )
        return path

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> SimilarityStats:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"stats file not found: {str(path)!r}")
        arrays, meta = _read_npz(path)
        n = int(meta["n_blocks"])
        for key in ("gram", "last_gram", "last_angular"):
            if arrays[key].shape != (n + 1, n + 1):
                raise ValueError(
                    f"{str(path)!r}: {key} of shape {arrays[key].shape} for n_blocks={n}"
                )
        out = cls(
            n,
            model_fingerprint=meta.get("model_fingerprint"),
            calibration_fingerprint=meta.get("calibration_fingerprint"),
            extra=meta.get("extra") or {},
        )
        out._sum, out._last_sum, out._last_angle = (
            torch.from_numpy(np.ascontiguousarray(arrays[k], dtype=np.float64))
            for k in ("gram", "last_gram", "last_angular")
        )
        out.tokens, out.sequences = int(arrays["tokens"]), int(arrays["sequences"])
        return out

    # Ray and multiprocessing ship stats between processes: always as host memory.
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in ("_sum", "_last_sum", "_last_angle"):
            state[key] = state[key].detach().cpu()
        return state

    def __repr__(self) -> str:
        return (
            f"SimilarityStats(n_blocks={self.n_blocks}, tokens={self.tokens}, "
            f"sequences={self.sequences}, model={self.model_fingerprint!r}, "
            f"calibration={self.calibration_fingerprint!r})"
        )


_NPZ_KEYS = ("gram", "tokens", "last_gram", "last_angular", "sequences")


def _read_npz(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The arrays and metadata of a stats file; one-line errors for anything else."""
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["metadata"]))
            version = meta.get("format_version")
            if version != FORMAT_VERSION:
                raise _VersionError(version)
            arrays = {key: z[key] for key in _NPZ_KEYS}
    except _VersionError as exc:
        raise ValueError(
            f"{str(path)!r}: unsupported format_version {exc.version!r} (this lorp reads "
            f"{FORMAT_VERSION}: capture the statistics again)"
        ) from None
    except (OSError, KeyError, ValueError) as exc:
        raise ValueError(f"{str(path)!r} is not a lorp stats file ({exc})") from None
    return arrays, meta


class _VersionError(Exception):
    def __init__(self, version: Any) -> None:
        self.version = version


def _symmetric(M: np.ndarray) -> np.ndarray:
    """Exact symmetry; a GEMM of F with itself is symmetric only to rounding."""
    return (M + M.T) / 2


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
