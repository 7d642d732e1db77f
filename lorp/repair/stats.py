"""Mergeable sufficient statistics of the linear repair (captured by `lorp.repair.capture`).

Removing blocks s..e (a run) leaves block s-1's output at Y + M, where M is what its MLP
adds to the residual stream and Y the stream it is added to; the dense model had H_e, the
output of block e, there instead. The repair replaces M by X T, X being M itself (or, in
a family that normalises its MLP output, M before the norm's weight), fitted so that
Y + X T ~ H_e. With D = H_e - Y = H_e - H_s + M (H_s, block s's input, is Y + M), the
least-squares fit needs only

    A_s = X_s^T X_s        (d x d, one per run start s: runs from s share it)
    B_se = X_s^T D_se      (d x d, one per run)
    c_se = ||D_se||_F^2    (one scalar per run: the fit's residual without a second pass)
    h_se = ||H_e||_F^2     (one scalar per run: the scale of the state it aims at, so
                            windows at different depths compare by relative error)

summed over calibration tokens, so shards of the calibration set are captured anywhere
and merged by adding, as `SimilarityStats` is. Sums are float64 whatever the model's
dtype; each batch's product is taken in float32 (float64 for float64 states) and added.
The tokens are S's: padding and the first `skip_prefix` real tokens (a BOS) are excluded.

A run starting at block 0 has no block before it: its X is the embedding output (Y = 0),
and the map folds into the embedding matrix (`lorp.repair`).

A follower is a run of no blocks, (k + 1, k): block k is kept, and its map takes the
state it leaves from where the repaired model puts it to the dense model's H_(k+1)
(`lorp.repair.followers.fit_followers`). Its sums come from
`lorp.repair.capture.capture_follower_stats`: X and Y from the model pruned and repaired
so far, H from the same model dense, two forwards of one model per batch.

`held_domains` carries the same sums over calibration windows held out from the fit (the
job's loss windows: same split, drawn apart from every fit window), one set per domain of
calibration text (`held`, their total; one domain is named ""). The fit never sees them;
they choose its ridge on the worst domain and decide whether the fitted map is kept at all
(`lorp.repair.fit.fit_runs`). They travel with the fit's sums through `subset`, `merge`,
`join` and the file (`held_*`, or `held.<domain>_*` per domain).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from lorp.atomic import atomic_file
from lorp.models.architectures import block_stage
from lorp.version import __version__

FORMAT_VERSION = 2  # 2: the target state's energy per run
Run = tuple[int, int]
Form = Literal["full", "normed"]


def contiguous_runs(layers: Iterable[int], n_blocks: int) -> list[Run]:
    """The maximal runs [s, e] (inclusive) of consecutive removed blocks, in depth order."""
    out: list[Run] = []
    for i in sorted({int(x) for x in layers}):
        if not 0 <= i < n_blocks:
            raise ValueError(f"layers must be in [0, {n_blocks - 1}], got {i}")
        if out and out[-1][1] == i - 1:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return out


def run_form(model: nn.Module, run: Run) -> Form:
    """How the map of `run` enters the model: `full` (added as it is, into block s-1's
    output projections or the embedding) or `normed` (through the norm block s-1 applies
    to what its last stage adds: `lorp.models.blocks.Stage`)."""
    if run[0] == 0 or block_stage(model, run[0] - 1).post_norm is None:
        return "full"
    return "normed"


def rms_unit(norm: nn.Module, m: torch.Tensor) -> torch.Tensor:
    """What an RMSNorm makes of `m` before its weight: m / sqrt(mean(m^2) + eps), fp32."""
    eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
    if eps is None:
        raise ValueError(f"{type(norm).__name__} has no eps: not an RMSNorm this repair knows")
    x = m.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RepairStats:
    """Running sums A_s, B_se, c_se for a set of runs of one model (module docstring)."""

    def __init__(
        self,
        n_blocks: int,
        hidden: int,
        runs: Sequence[Run],
        forms: Mapping[Run, Form] | None = None,
        *,
        model_fingerprint: str | None = None,
        calibration_fingerprint: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        runs = sorted({(int(s), int(e)) for s, e in runs})
        if not runs:
            raise ValueError("runs must name at least one run of removed blocks")
        for s, e in runs:
            if not (0 <= s <= e < n_blocks or 0 < s == e + 1 <= n_blocks):  # or a follower
                raise ValueError(f"run {s}-{e} is not within blocks 0..{n_blocks - 1}")
        self.n_blocks, self.hidden, self.runs = n_blocks, hidden, runs
        self.forms: dict[Run, Form] = {r: (forms or {}).get(r, "full") for r in runs}
        for s in self.starts:
            kinds = {self.forms[r] for r in runs if r[0] == s}
            if len(kinds) > 1:
                raise ValueError(f"runs starting at block {s} disagree on their form: {kinds}")
        self.model_fingerprint = model_fingerprint
        self.calibration_fingerprint = calibration_fingerprint
        self.extra: dict[str, Any] = dict(extra or {})
        self.tokens = 0
        zeros = lambda: torch.zeros(hidden, hidden, dtype=torch.float64)  # noqa: E731
        self.gram: dict[int, torch.Tensor] = {s: zeros() for s in self.starts}
        self.cross: dict[Run, torch.Tensor] = {r: zeros() for r in runs}
        self.energy: dict[Run, float] = {r: 0.0 for r in runs}
        self.state_energy: dict[Run, float] = {r: 0.0 for r in runs}
        """||H_e||^2 per run: the scale a window's leftover error is judged at."""
        self.base: dict[int, torch.Tensor] = {}
        """Per `normed` start: the post-MLP norm's effective scale (weight + offset) at
        capture, what the unrepaired model applies to X (T0 = diag(base)), so runs can be
        fitted and compared without the model."""
        self.held_domains: dict[str, RepairStats] = {}
        """Domain -> the same runs' sums over its held-out calibration windows (module
        docstring); one domain is named ""."""

    @property
    def held(self) -> RepairStats | None:
        """The held-out sums over every domain's windows (None: no held-out windows)."""
        if not self.held_domains:
            return None
        return RepairStats.merge_all(self.held_domains.values())

    @held.setter
    def held(self, value: RepairStats | None) -> None:
        self.held_domains = {} if value is None else {"": value}

    @property
    def starts(self) -> list[int]:
        return sorted({s for s, _ in self.runs})

    def start_form(self, s: int) -> Form:
        """The form of the runs from block s (they share X_s, so they share a form)."""
        return next(self.forms[r] for r in self.runs if r[0] == s)

    @property
    def matrices(self) -> int:
        """How many d x d float64 sums this object holds (its memory is 8 d^2 each)."""
        return len(self.gram) + len(self.cross)

    # -- accumulation ---------------------------------------------------------------------

    def add(
        self,
        features: Mapping[int, torch.Tensor],
        targets: Mapping[Run, torch.Tensor],
        states: Mapping[Run, torch.Tensor] | None = None,
    ) -> None:
        """Add one batch: X_s [T, d] for every start s and D_se [T, d] for every run, over
        the same T tokens, and optionally H_e [T, d], the state the run's map aims at.
        Nothing is added unless every input is finite."""
        T = None
        for key, x in [*features.items(), *targets.items()]:
            if x.ndim != 2 or x.shape[1] != self.hidden or (T is not None and x.shape[0] != T):
                raise ValueError(
                    f"repair batch for {key} must be [T, {self.hidden}], got {tuple(x.shape)}"
                )
            T = x.shape[0]
            if not bool(torch.isfinite(x).all()):
                raise ValueError(f"non-finite activations in the repair batch for {key}")
        for s in self.starts:
            self.gram[s] = self._on(self.gram[s], features[s]) + _gram(features[s], features[s])
        for r in self.runs:
            d = targets[r]
            self.cross[r] = self._on(self.cross[r], d) + _gram(features[r[0]], d)
            self.energy[r] += float(d.double().pow(2).sum())
            if states is not None:
                self.state_energy[r] += float(states[r].double().pow(2).sum())
        self.tokens += int(T or 0)

    @staticmethod
    def _on(total: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return total if total.device == x.device else total.to(x.device)

    def merge(self, other: RepairStats) -> RepairStats:
        """The statistics of both calibration shards together (any order)."""
        if not isinstance(other, RepairStats):
            raise TypeError(f"can only merge RepairStats, got {type(other).__name__}")
        for field in ("n_blocks", "hidden", "runs", "forms"):
            if getattr(self, field) != getattr(other, field):
                raise ValueError(f"cannot merge repair stats with different {field}")
        out = RepairStats(
            self.n_blocks,
            self.hidden,
            self.runs,
            self.forms,
            model_fingerprint=_same("model", self.model_fingerprint, other.model_fingerprint),
            calibration_fingerprint=_same(
                "calibration", self.calibration_fingerprint, other.calibration_fingerprint
            ),
            extra={**other.extra, **self.extra},
        )
        out.gram = {s: self.gram[s].cpu() + other.gram[s].cpu() for s in self.starts}
        out.cross = {r: self.cross[r].cpu() + other.cross[r].cpu() for r in self.runs}
        out.energy = {r: self.energy[r] + other.energy[r] for r in self.runs}
        out.state_energy = {r: self.state_energy[r] + other.state_energy[r] for r in self.runs}
        out.base = {**other.base, **self.base}
        out.tokens = self.tokens + other.tokens
        if set(self.held_domains) != set(other.held_domains):
            raise ValueError(
                "cannot merge repair stats with held-out sums of other domains "
                f"({sorted(self.held_domains)} and {sorted(other.held_domains)})"
            )
        out.held_domains = {d: h.merge(other.held_domains[d]) for d, h in self.held_domains.items()}
        return out

    def subset(self, runs: Iterable[Run]) -> RepairStats:
        """The sums of `runs` only (each must be one of this object's runs): what one
        pruned variant needs of a model's statistics."""
        wanted = sorted({(int(s), int(e)) for s, e in runs})
        missing = [r for r in wanted if r not in self.cross]
        if missing:
            raise ValueError(f"repair stats hold no run {missing[0][0]}-{missing[0][1]}")
        out = RepairStats(
            self.n_blocks,
            self.hidden,
            wanted,
            {r: self.forms[r] for r in wanted},
            model_fingerprint=self.model_fingerprint,
            calibration_fingerprint=self.calibration_fingerprint,
            extra=self.extra,
        )
        out.gram = {s: self.gram[s] for s in out.starts}
        out.cross = {r: self.cross[r] for r in wanted}
        out.energy = {r: self.energy[r] for r in wanted}
        out.state_energy = {r: self.state_energy[r] for r in wanted}
        out.base = {s: self.base[s] for s in out.starts if s in self.base}
        out.tokens = self.tokens
        out.held_domains = {d: h.subset(wanted) for d, h in self.held_domains.items()}
        return out

    @classmethod
    def merge_all(cls, parts: Iterable[RepairStats]) -> RepairStats:
        it = iter(parts)
        try:
            total = next(it)
        except StopIteration:
            raise ValueError("merge_all needs at least one RepairStats") from None
        for part in it:
            total = total.merge(part)
        return total

    @classmethod
    def join(cls, groups: Sequence[RepairStats]) -> RepairStats:
        """One object holding the runs of `groups`, statistics of the same model over the
        same tokens whose runs were summed in separate passes (runs sharing a start
        always travel together, so A_s comes from one group)."""
        if not groups:
            raise ValueError("join needs at least one RepairStats")
        if len(groups) == 1:
            return groups[0]
        first = groups[0]
        runs = [r for g in groups for r in g.runs]
        if len(set(runs)) != len(runs):
            raise ValueError("joined repair stats must hold disjoint runs")
        for g in groups[1:]:
            for field in ("n_blocks", "hidden", "tokens"):
                if getattr(g, field) != getattr(first, field):
                    raise ValueError(f"cannot join repair stats with different {field}")
        out = cls(
            first.n_blocks,
            first.hidden,
            runs,
            {r: g.forms[r] for g in groups for r in g.runs},
            model_fingerprint=first.model_fingerprint,
            calibration_fingerprint=first.calibration_fingerprint,
            extra=first.extra,
        )
        for g in groups:
            _same("model", out.model_fingerprint, g.model_fingerprint)
            _same("calibration", out.calibration_fingerprint, g.calibration_fingerprint)
            out.gram.update(g.gram)
            out.cross.update(g.cross)
            out.energy.update(g.energy)
            out.state_energy.update(g.state_energy)
            out.base.update(g.base)
        out.tokens = first.tokens
        domains = [sorted(g.held_domains) for g in groups]
        if any(d != domains[0] for d in domains):
            raise ValueError("cannot join repair stats with held-out sums of other domains")
        out.held_domains = {
            d: cls.join([g.held_domains[d] for g in groups]) for d in groups[0].held_domains
        }
        return out

    # -- persistence ----------------------------------------------------------------------

    def metadata(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "n_blocks": self.n_blocks,
            "hidden": self.hidden,
            "runs": [list(r) for r in self.runs],
            "forms": [self.forms[r] for r in self.runs],
            "energy": [self.energy[r] for r in self.runs],
            "state_energy": [self.state_energy[r] for r in self.runs],
            "tokens": self.tokens,
            "model_fingerprint": self.model_fingerprint,
            "calibration_fingerprint": self.calibration_fingerprint,
            "lorp_version": __version__,
            "extra": self.extra,
        }

    def to_file(self, path: str | os.PathLike[str]) -> Path:
        """An .npz of the sums with JSON metadata (runs, fingerprints), written atomically;
        the held-out sums, if any, beside them (`held_*`)."""
        path = Path(path)
        if path.suffix != ".npz":
            raise ValueError(f"repair stats file must end in .npz, got {str(path)!r}")
        meta, arrays = self.metadata(), self._arrays("")
        if list(self.held_domains) == [""]:  # one domain: the file earlier versions wrote
            meta["held"] = self.held_domains[""].metadata()
            arrays |= self.held_domains[""]._arrays("held_")
        elif self.held_domains:
            meta["held_domains"] = {d: h.metadata() for d, h in self.held_domains.items()}
            for d, h in self.held_domains.items():
                arrays |= h._arrays(f"held.{d}_")
        with atomic_file(path) as tmp, open(tmp, "wb") as fh:
            np.savez(fh, metadata=np.array(json.dumps(meta, sort_keys=True)), **arrays)
        return path

    def _arrays(self, prefix: str) -> dict[str, np.ndarray]:
        arrays = {f"gram_{s}": self.gram[s].cpu().numpy() for s in self.starts}
        arrays |= {f"cross_{s}_{e}": self.cross[(s, e)].cpu().numpy() for s, e in self.runs}
        arrays |= {f"base_{s}": v.cpu().numpy() for s, v in self.base.items()}
        return {prefix + k: v for k, v in arrays.items()}

    @classmethod
    def from_file(
        cls, path: str | os.PathLike[str], runs: Iterable[Run] | None = None
    ) -> RepairStats:
        """The statistics saved at `path`; with `runs`, only those runs' sums are read
        (an .npz reads each array on demand), so a file of many candidate windows costs
        the memory of the few a variant needs."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"repair stats file not found: {str(path)!r}")
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(str(z["metadata"]))
                if meta.get("format_version") != FORMAT_VERSION:
                    raise ValueError(f"unsupported format_version {meta.get('format_version')!r}")
                out = cls._load(z, meta, "", runs)
                if meta.get("held"):
                    out.held = cls._load(z, meta["held"], "held_", out.runs)
                for d, m in (meta.get("held_domains") or {}).items():
                    out.held_domains[d] = cls._load(z, m, f"held.{d}_", out.runs)
        except (OSError, KeyError, ValueError, TypeError) as exc:
            raise ValueError(f"{str(path)!r} is not a lorp repair stats file ({exc})") from None
        return out

    @classmethod
    def _load(cls, z: Any, meta: dict[str, Any], prefix: str, runs: Iterable[Run] | None):  # type: ignore[no-untyped-def]
        """One set of sums from an open .npz: `runs` of them (None: all)."""
        saved = [(int(r[0]), int(r[1])) for r in meta["runs"]]
        wanted = saved if runs is None else sorted({(int(s), int(e)) for s, e in runs})
        missing = sorted(set(wanted) - set(saved))
        if missing:
            raise ValueError(f"no run {missing[0][0]}-{missing[0][1]} in the file")
        index = {r: i for i, r in enumerate(saved)}
        out = cls(
            meta["n_blocks"],
            meta["hidden"],
            wanted,
            {r: meta["forms"][index[r]] for r in wanted},
            model_fingerprint=meta.get("model_fingerprint"),
            calibration_fingerprint=meta.get("calibration_fingerprint"),
            extra=meta.get("extra") or {},
        )
        out.gram = {s: torch.from_numpy(z[f"{prefix}gram_{s}"].copy()) for s in out.starts}
        out.cross = {
            (s, e): torch.from_numpy(z[f"{prefix}cross_{s}_{e}"].copy()) for s, e in wanted
        }
        out.base = {
            s: torch.from_numpy(z[f"{prefix}base_{s}"].copy())
            for s in out.starts
            if f"{prefix}base_{s}" in z.files
        }
        out.energy = {r: float(meta["energy"][index[r]]) for r in wanted}
        out.state_energy = {r: float(meta["state_energy"][index[r]]) for r in wanted}
        out.tokens = int(meta["tokens"])
        return out

    def __getstate__(self) -> dict[str, Any]:
        """Ray and multiprocessing ship the sums as host memory."""
        state = self.__dict__.copy()
        state["gram"] = {k: v.cpu() for k, v in self.gram.items()}
        state["cross"] = {k: v.cpu() for k, v in self.cross.items()}
        state["base"] = {k: v.cpu() for k, v in self.base.items()}
        return state

    def __repr__(self) -> str:
        runs = ", ".join(f"{s}-{e}" for s, e in self.runs)
        return f"RepairStats(runs=[{runs}], hidden={self.hidden}, tokens={self.tokens})"


def _gram(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x^T y over tokens, taken in float32 (float64 for float64 input), returned float64."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (x.to(work).T @ y.to(work)).to(torch.float64)


def _same(field: str, a: str | None, b: str | None) -> str | None:
    if a is not None and b is not None and a != b:
        raise ValueError(f"cannot merge repair stats of different {field}: {a!r} vs {b!r}")
    return a if a is not None else b


def bytes_per_pass(runs: Sequence[Run], hidden: int) -> int:
    """Memory of the sums for `runs`: one d x d float64 per start and one per run."""
    return 8 * hidden * hidden * (len({s for s, _ in runs}) + len(set(runs)))


def repair_passes(runs: Iterable[Run], hidden: int, max_bytes: int) -> list[list[Run]]:
    """Split `runs` into groups whose sums fit in `max_bytes` each (runs sharing a start
    stay together, since they share A_s), so a worker's memory stays bounded: every
    group is one pass over the calibration shard."""
    by_start: dict[int, list[Run]] = {}
    for r in sorted(set(runs)):
        by_start.setdefault(r[0], []).append(r)
    groups: list[list[Run]] = []
    for rs in by_start.values():
        need = bytes_per_pass(rs, hidden)
        if need > max_bytes:
            raise ValueError(
                f"max_bytes={max_bytes} cannot hold the {len(rs) + 1} d x d sums of the runs "
                f"from block {rs[0][0]} (need {need}; d = {hidden})"
            )
        if groups and bytes_per_pass(groups[-1] + rs, hidden) <= max_bytes:
            groups[-1] += rs
        else:
            groups.append(list(rs))
    return groups
