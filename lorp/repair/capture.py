"""Capturing `RepairStats` from a model with hooks: the mergeable sums of each run's (and each
follower's) input and target states, on calibration batches, in one forward pass per
batch where the memory allows it (`repair_passes`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from tqdm.auto import tqdm

from lorp.locality.capture import unpack_batch
from lorp.locality.similarity import token_selection
from lorp.models.architectures import (
    Architecture,
    StopForward,
    architecture_of,
    decoder_blocks,
    forward_until_stopped,
    text_config,
)
from lorp.models.blocks import Stage
from lorp.models.streaming import device_of
from lorp.models.surgery import blocks_dropped
from lorp.repair.stats import RepairStats, Run, rms_unit, run_form

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
        self.parts: dict[int, list[torch.Tensor]] = {}
        """Start s -> what the sites of its stage added so far in this forward."""

    def flat(self, x: Any) -> torch.Tensor:
        """`x` (or a module output's first element) as [tokens, d], S's tokens only."""
        x = x[0] if isinstance(x, tuple | list) else x
        x = x.reshape(-1, x.shape[-1])
        return x if self.keep is None else x[self.keep]

    def record(self, owed: set[_StateKey], key: _StateKey, x: Any) -> None:
        """Store `x` under `key`; the rest of the forward is wasted once `owed` is in."""
        self.seen[key] = self.flat(x)
        if owed <= self.seen.keys():
            raise StopForward

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


def _site_hook(rec: _StateRecorder, s: int, normed: bool, scale: float, sites: int) -> _Hook:
    """Forward hook on one site of block s-1's last stage (`lorp.models.blocks.Stage`). M_s is
    what the stage adds to the residual stream: the sum of its `sites` sites' outputs,
    each times its `scale`; X_s, what the map multiplies, is M_s itself, or for a normed
    start the norm's input at unit scale (the norm's weight is part of the map)."""

    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        added = rec.flat(output) * scale if scale != 1.0 else rec.flat(output)
        parts = rec.parts.setdefault(s, [])
        parts.append(added)
        if normed:
            rec.seen[("X", s)] = rec.flat(rms_unit(module, args[0]))
        if len(parts) == sites:  # the stage's last site: M and X are whole
            rec.seen[("M", s)] = parts[0] if sites == 1 else sum(parts[1:], parts[0])
            if not normed:
                rec.seen[("X", s)] = rec.seen[("M", s)]
            del rec.parts[s]

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
        stage = Stage(blocks[s - 1], arch.layout(blocks[s - 1]).last_stage, arch.norm_offset)
        if normed:
            assert stage.post_norm is not None
            stats.base[s] = stage.post_norm.weight.detach().double().cpu() + arch.norm_offset
        sites = stage.sites()
        for site, scale in sites:
            hook = _site_hook(rec, s, normed, scale, len(sites))
            handles.append(site.register_forward_hook(hook))
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
    rec.parts.clear()
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
    """One forward of the decoder stack, until a hook has everything it owes (the
    deepest state any run needs)."""
    forward_until_stopped(model, ids, mask)


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
    stats = RepairStats(len(blocks), int(text_config(model.config).hidden_size), runs, forms)
    source, target = _owed_states(stats, shared=False)
    device = device_of(model)
    with torch.inference_mode():
        for batch in tqdm(batches, total=total, disable=None if progress else True, desc="follow"):
            ids, mask, keep = _batch_inputs(batch, device, skip_prefix)
            seen = _states(
                model,
                ids,
                mask,
                keep,
                _StateRecorder(set(), target),
                contextlib.nullcontext(),
                lambda rec, handles: _hook_targets(model, stats, rec, handles),
            )
            seen |= _states(
                model,
                ids,
                mask,
                keep,
                _StateRecorder(source, set()),
                repaired(),
                lambda rec, handles: _hook_sources(blocks, arch, stats, rec, handles),
            )
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
        int(text_config(model.config).hidden_size),
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
                rec.parts.clear()
    finally:
        for h in handles:
            h.remove()
    return stats
