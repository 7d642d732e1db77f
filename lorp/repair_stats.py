"""Mergeable sufficient statistics of the linear repair, and their capture from a model.

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
(`lorp.repair.fit_followers`). Its sums come from `capture_follower_stats`: X and Y
from the model pruned and repaired so far, H from the same model dense, two forwards of
one model per batch.

`held` carries the same sums over calibration windows held out from the fit (the job's
loss windows: same split, another seed, never in S). The fit never sees them; they choose
its ridge and decide whether the fitted map is kept at all (`lorp.repair.fit_runs`). They
travel with the fit's sums through `subset`, `merge`, `join` and the file (`held_*`).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from tqdm.auto import tqdm

from lorp.architectures import Architecture, architecture_of, decoder_blocks, decoder_stack
from lorp.atomic import atomic_file
from lorp.capture import unpack_batch
from lorp.similarity import token_selection
from lorp.streaming import device_of
from lorp.surgery import blocks_dropped
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
    """How the map of `run` enters the model: `full` (added as it is, into `down_proj` or
    the embedding) or `normed` (through the RMSNorm after block s-1's MLP)."""
    if run[0] == 0 or architecture_of(model).post_mlp_norm is None:
        return "full"
    return "normed"


def rms_unit(norm: nn.Module, m: torch.Tensor) -> torch.Tensor:
    """What an RMSNorm makes of `m` before its weight: m / sqrt(mean(m^2) + eps), fp32."""
    eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
    if eps is None:
        raise ValueError(f"{type(norm).__name__} has no eps: not an RMSNorm this repair knows")
    x = m.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def mlp_site(block: nn.Module, post_mlp_norm: str | None) -> nn.Module:
    """The module whose output block s-1 adds to the residual stream."""
    return getattr(block, post_mlp_norm) if post_mlp_norm else block.mlp


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
        self.held: RepairStats | None = None
        """The same runs' sums over held-out calibration windows (module docstring)."""

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
        if (self.held is None) != (other.held is None):
            raise ValueError("cannot merge repair stats with and without held-out sums")
        out.held = self.held.merge(other.held) if self.held and other.held else None
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
        out.held = self.held.subset(wanted) if self.held is not None else None
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
        helds = [g.held for g in groups]
        if any(h is not None for h in helds):
            if any(h is None for h in helds):
                raise ValueError("cannot join repair stats with and without held-out sums")
            out.held = cls.join(helds)  # type: ignore[arg-type]
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
        if self.held is not None:
            meta["held"] = self.held.metadata()
            arrays |= self.held._arrays("held_")
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


class _StopForward(Exception):
    """Raised once the deepest state any run needs has been seen."""


_StateKey = tuple[str, int]
"""A state a hook saw: ("X" | "M" | "out", start s) from the source model, or ("H", j),
the output of block j-1 (the input of block j), from the target."""
_Hook = Callable[..., None]


class _StateRecorder:
    """Hook state for one batch: which tokens count, and the states seen so far, so each
    forward stops as soon as nothing it owes is still ahead."""

    def __init__(self, source_owed: set[_StateKey], target_owed: set[_StateKey]) -> None:
        self.source_owed = source_owed
        self.target_owed = target_owed
        self.keep: torch.Tensor | None = None
        self.seen: dict[_StateKey, torch.Tensor] = {}

    def flat(self, x: Any) -> torch.Tensor:
        """`x` (or a module output's first element) as [tokens, d], S's tokens only."""
        x = x[0] if isinstance(x, tuple | list) else x
        x = x.reshape(-1, x.shape[-1])
        return x if self.keep is None else x[self.keep]

    def record(self, owed: set[_StateKey], key: _StateKey, x: Any) -> None:
        """Store `x` under `key`; the rest of the forward is wasted once `owed` is in."""
        self.seen[key] = self.flat(x)
        if owed <= self.seen.keys():
            raise _StopForward

    def missing(self) -> set[_StateKey]:
        """What the batch's forwards owed and never produced (a hook that never fired)."""
        return (self.source_owed | self.target_owed) - self.seen.keys()


def _owed_states(stats: RepairStats, shared: bool) -> tuple[set[_StateKey], set[_StateKey]]:
    """The states the source forward (X, M, Y + M per start) and the target forward (H_e
    per run) must produce. `shared`: one forward does both, so each owes the union, lest
    it stop before the other's states are in."""
    source = {(k, s) for s in stats.starts for k in ("X", "M", "out")}
    target = {("H", e + 1) for _, e in stats.runs}
    if shared:
        source = target = source | target
    return source, target


def _check_capture_inputs(
    stats: RepairStats, dropped: Sequence[int], target: nn.Module, n: int
) -> None:
    """Refuse, before any forward, a capture whose sums would silently be wrong: a dropped
    block next to a run changes the states the run's map must bridge, and a reference of
    another depth is not the dense model the runs index."""
    touched = {i for s, e in stats.runs for i in range(s - 1, e + 2) if 0 <= i < n}
    if set(dropped) & touched:
        raise ValueError(f"dropped blocks {sorted(dropped)} touch the runs being fitted")
    if len(decoder_blocks(target)) != n:
        raise ValueError("reference must be the dense model the runs index")


def _hooked_state(args: tuple, kwargs: dict, output: tuple) -> Any:
    """The state a block hook sees: the block's output for a forward hook, else its input,
    positional or keyword as the family's decoder passes it."""
    return output[0] if output else (args[0] if args else kwargs["hidden_states"])


def _site_hook(rec: _StateRecorder, s: int, normed: bool) -> _Hook:
    """Forward hook on block s-1's MLP site. M_s is what the site adds to the residual
    stream; X_s, what the map multiplies, is M_s itself, or for a normed start the norm's
    input at unit scale (the norm's weight is part of the map)."""

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        rec.seen[("X", s)] = rec.flat(rms_unit(module, args[0]) if normed else output)
        rec.seen[("M", s)] = rec.flat(output)

    return hook


def _out_hook(rec: _StateRecorder, s: int) -> _Hook:
    """Hook recording Y + M of start s: block s-1's output, or for s = 0 block 0's input."""

    def hook(module: nn.Module, args: tuple, kwargs: dict, *output: Any) -> None:
        x = _hooked_state(args, kwargs, output)
        if s == 0:  # block 0's input: the embedding output is X, M and Y + M at once
            rec.seen[("X", 0)] = rec.seen[("M", 0)] = rec.flat(x)
        rec.record(rec.source_owed, ("out", s), x)

    return hook


def _target_hook(rec: _StateRecorder, j: int) -> _Hook:
    """Hook recording H as block j receives it (j = N: the last block's output)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict, *output: Any) -> None:
        rec.record(rec.target_owed, ("H", j), _hooked_state(args, kwargs, output))

    return hook


def _hook_sources(
    blocks: nn.ModuleList,
    arch: Architecture,
    stats: RepairStats,
    rec: _StateRecorder,
    handles: list[RemovableHandle],
) -> None:
    """Hook X_s, M_s and Y + M of every start into `blocks`, appending to `handles` as it
    goes so the caller removes every hook even if one fails. A normed start's norm scale
    goes into `stats.base` as it is now: the fit starts from it without the model."""
    for s in stats.starts:
        if s == 0:
            handles.append(blocks[0].register_forward_pre_hook(_out_hook(rec, 0), with_kwargs=True))
            continue
        normed = stats.start_form(s) == "normed"
        site = mlp_site(blocks[s - 1], arch.post_mlp_norm if normed else None)
        if normed:
            weight = site.weight.detach().double().cpu()
            stats.base[s] = weight + arch.norm_offset
        handles.append(site.register_forward_hook(_site_hook(rec, s, normed)))
        handles.append(blocks[s - 1].register_forward_hook(_out_hook(rec, s), with_kwargs=True))


def _hook_targets(
    target: nn.Module, stats: RepairStats, rec: _StateRecorder, handles: list[RemovableHandle]
) -> None:
    """Hook H_e of every run into `target`: block e+1's input, or the last block's output
    (before the final norm) for a run ending at N-1; appends to `handles` as it goes."""
    target_blocks = decoder_blocks(target)
    n = len(target_blocks)
    for _, e in stats.runs:
        if e + 1 < n:
            hook = _target_hook(rec, e + 1)
            handles.append(target_blocks[e + 1].register_forward_pre_hook(hook, with_kwargs=True))
        else:
            hook = _target_hook(rec, n)
            handles.append(target_blocks[n - 1].register_forward_hook(hook, with_kwargs=True))


def _forward_batch(
    models: Sequence[nn.Module],
    batch: torch.Tensor | Mapping[str, torch.Tensor],
    device: torch.device,
    skip_prefix: int,
    rec: _StateRecorder,
) -> None:
    """Run one batch through each of `models` until its hooks have what they owe; a state
    still missing afterwards means a hook never fired, and the sums would be wrong."""
    ids, mask, rec.keep = _batch_inputs(batch, device, skip_prefix)
    rec.seen.clear()
    for m in models:
        _forward(m, ids, mask)
    missing = rec.missing()
    if missing:
        raise RuntimeError(f"the forward never produced {sorted(missing)}")


def _batch_sums(
    stats: RepairStats, seen: Mapping[_StateKey, torch.Tensor]
) -> tuple[dict[int, torch.Tensor], dict[Run, torch.Tensor], dict[Run, torch.Tensor]]:
    """One batch's X_s, D_se = H_e - (Y + M) + M and H_e, as `RepairStats.add` takes them.
    D is formed in float32 whatever the model's dtype (a float64 model's too), so the
    difference of two residual states is not rounded to a 16-bit dtype."""
    features = {s: seen[("X", s)] for s in stats.starts}
    targets = {
        (s, e): seen[("H", e + 1)].float() - seen[("out", s)].float() + seen[("M", s)].float()
        for s, e in stats.runs
    }
    states = {(s, e): seen[("H", e + 1)] for s, e in stats.runs}
    return features, targets, states


def _batch_inputs(
    batch: torch.Tensor | Mapping[str, torch.Tensor], device: torch.device, skip_prefix: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A batch's ids and mask on `device`, and which of its tokens the sums count."""
    ids, mask = unpack_batch(batch)
    ids, mask = ids.to(device), None if mask is None else mask.to(device)
    keep, _ = token_selection(tuple(ids.shape), mask, skip_prefix, device)
    return ids, mask, keep


def _forward(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None) -> None:
    """One forward of the decoder stack, until a hook has everything it owes."""
    with contextlib.suppress(_StopForward):
        decoder_stack(model)(input_ids=ids, attention_mask=mask, use_cache=False)


def _states(
    model: nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor | None,
    keep: torch.Tensor | None,
    rec: _StateRecorder,
    context: contextlib.AbstractContextManager[Any],
    hook_into: Callable[[_StateRecorder, list[RemovableHandle]], None],
) -> dict[_StateKey, torch.Tensor]:
    """The states `rec` owes, from one forward of `model` inside `context` with the hooks
    `hook_into` registers (removed afterwards, whatever happens)."""
    rec.keep = keep
    handles: list[RemovableHandle] = []
    try:
        hook_into(rec, handles)
        with context:
            _forward(model, ids, mask)
    finally:
        for h in handles:
            h.remove()
    if rec.missing():
        raise RuntimeError(f"the forward never produced {sorted(rec.missing())}")
    return rec.seen


def capture_follower_stats(
    model: nn.Module,
    batches: Iterable[torch.Tensor | Mapping[str, torch.Tensor]],
    runs: Sequence[Run],
    repaired: Callable[[], contextlib.AbstractContextManager[Any]],
    *,
    skip_prefix: int = 0,
    progress: bool = True,
    total: int | None = None,
) -> RepairStats:
    """The sums of `runs` (followers: module docstring) with X and Y from `model` inside
    `repaired()` (its blocks dropped and its maps applied, by `lorp.repair`) and the
    target H from `model` as it is, the dense model: per batch, one dense forward up to
    the deepest target, then one repaired forward up to the deepest source, so nothing
    is copied and a streamed model is read as any forward reads it. Runs index the
    original blocks."""
    arch = architecture_of(model)
    blocks = decoder_blocks(model)  # the original indices, whatever `repaired` drops
    forms = {r: run_form(model, r) for r in runs}
    stats = RepairStats(len(blocks), int(model.config.hidden_size), runs, forms)
    source, target = _owed_states(stats, shared=False)
    device = device_of(model)
    with torch.inference_mode():
        for batch in tqdm(batches, total=total, disable=None if progress else True, desc="follow"):
            ids, mask, keep = _batch_inputs(batch, device, skip_prefix)
            seen = _states(
                model, ids, mask, keep, _StateRecorder(set(), target), contextlib.nullcontext(),
                lambda rec, handles: _hook_targets(model, stats, rec, handles),
            )  # fmt: skip
            seen |= _states(
                model, ids, mask, keep, _StateRecorder(source, set()), repaired(),
                lambda rec, handles: _hook_sources(blocks, arch, stats, rec, handles),
            )  # fmt: skip
            stats.add(*_batch_sums(stats, seen))
    return stats


def capture_repair_stats(
    model: nn.Module,
    batches: Iterable[torch.Tensor | Mapping[str, torch.Tensor]],
    runs: Sequence[Run],
    *,
    reference: nn.Module | None = None,
    dropped: Sequence[int] = (),
    skip_prefix: int = 0,
    model_fingerprint: str | None = None,
    calibration_fingerprint: str | None = None,
    extra: dict[str, Any] | None = None,
    progress: bool = True,
    total: int | None = None,
) -> RepairStats:
    """Run `batches` through `model` and sum the repair statistics of `runs`.

    Hooks read block s-1's MLP output (or, where a norm follows the MLP, that norm's input
    and output) and block s-1's output Y + M; the target H_e is block e's output (the
    last block's before the final norm, for a run ending at N-1). Each forward stops once
    every state it owes has been seen.

    By default everything comes from the dense `model`, in one forward per batch. With
    `reference` (the dense model) and `dropped` (earlier runs' blocks, already repaired
    in `model` by `lorp.repair.fold`), X and Y come from `model` run without `dropped`
    and the target from `reference`: the fit then sees the inputs the repaired model
    will really give block s-1, not the dense ones. Runs index the original blocks.
    """
    arch = architecture_of(model)
    blocks = decoder_blocks(model)
    n = len(blocks)
    forms = {r: run_form(model, r) for r in runs}
    stats = RepairStats(
        n,
        int(model.config.hidden_size),
        runs,
        forms,
        model_fingerprint=model_fingerprint,
        calibration_fingerprint=calibration_fingerprint,
        extra=extra,
    )
    target = reference if reference is not None else model
    _check_capture_inputs(stats, dropped, target, n)
    rec = _StateRecorder(*_owed_states(stats, shared=target is model))
    models = (model,) if target is model else (model, target)
    handles: list[RemovableHandle] = []
    try:
        _hook_sources(blocks, arch, stats, rec, handles)
        _hook_targets(target, stats, rec, handles)
        device = device_of(model)
        with torch.inference_mode(), blocks_dropped(model, dropped):
            for batch in tqdm(
                batches, total=total, disable=None if progress else True, desc="repair"
            ):
                _forward_batch(models, batch, device, skip_prefix, rec)
                stats.add(*_batch_sums(stats, rec.seen))
                rec.seen.clear()
    finally:
        for h in handles:
            h.remove()
    return stats
