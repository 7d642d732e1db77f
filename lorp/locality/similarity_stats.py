"""`SimilarityStats`: the mergeable sums behind S (the paper's Eq. 3-4), what a capture
shard returns and a reducer adds up; their `.npz` file, its format version, and the hash
a pruned checkpoint's provenance records.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lorp.atomic import atomic_file
from lorp.experts.stats import ExpertStats
from lorp.locality.similarity import (
    LayerSimilarity,
    NonFiniteActivationError,
    last_token_sums,
    normalize_states,
    token_selection,
)
from lorp.version import __version__

# 2: adds the last-token sums (`last_gram`, `last_angular`, `sequences`); files of version
# 1 lack them and are refused rather than silently serving methods that need them.
FORMAT_VERSION = 2


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
        self.experts: ExpertStats | None = None
        """The routed experts' sums over the same tokens, where the capture took them
        (`lorp.experts.saliency`)."""

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
        if (self.experts is None) != (other.experts is None):
            raise ValueError("cannot merge stats with and without expert statistics")
        if self.experts is not None and other.experts is not None:
            out.experts = self.experts.merge(other.experts)
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

    @property
    def sublayers(self) -> bool:
        """Whether the states are the 2N + 1 sub-layer boundaries
        (`lorp.locality.capture.capture_stats(sublayers=True)`), n_blocks counting units."""
        return bool(self.extra.get("sublayers"))

    def block_stats(self) -> SimilarityStats:
        """The block statistics inside sub-layer ones: the even states are the blocks'
        inputs and the last block's output, so their sums are a block capture's."""
        if not self.sublayers:
            raise ValueError("block_stats reads sub-layer statistics (capture sublayers=True)")
        extra = {k: v for k, v in self.extra.items() if k != "sublayers"}
        out = SimilarityStats(
            self.n_blocks // 2,
            model_fingerprint=self.model_fingerprint,
            calibration_fingerprint=self.calibration_fingerprint,
            extra=extra,
        )
        out.tokens, out.sequences = self.tokens, self.sequences
        out._sum = self._sum[::2, ::2].clone()
        out._last_sum = self._last_sum[::2, ::2].clone()
        out._last_angle = self._last_angle[::2, ::2].clone()
        out.experts = self.experts  # the experts' sums are per token, whatever the states
        return out

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
                **(self.experts.arrays() if self.experts is not None else {}),
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
        out.experts = ExpertStats.from_arrays(arrays)
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
            arrays |= {key: z[key] for key in z.files if key.startswith("experts_")}
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


def stats_hash(stats: SimilarityStats) -> str:
    """Hash of the statistics themselves (recorded in each pruned checkpoint's provenance)."""
    h = hashlib.sha256()
    h.update(stats.gram.tobytes())
    h.update(str(stats.tokens).encode())
    h.update(stats.last_gram.tobytes())
    h.update(stats.last_angular_sum.tobytes())
    h.update(str(stats.sequences).encode())
    return h.hexdigest()[:32]
