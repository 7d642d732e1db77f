"""The linear repair of removed sub-layers: the block repair with units for blocks.

Removing units s..e (a run of consecutive sub-layers, `lorp.models.sublayers`) leaves
boundary s at Y + M, M being what unit s-1 adds to the residual stream; the dense model
had boundary e + 1 there. As for blocks (`lorp.repair.stats`), M is replaced by X T with
T fitted in closed form from the same mergeable sums, in a `RepairStats` over the 2N
units, so fitting, validation on held-out windows (`lorp.repair.fit.validated`) and the
record are the block repair's. Only the site differs:

- unit s-1 a channel mixing (an MLP, a mixture of experts): the map folds into what writes
  its output (`down_proj`, every expert's), its post-norm's weight too for a `normed`
  family, as for a block run;
- unit s-1 a token mixing (an attention, a Mamba mixer): into its output projection
  (`o_proj`, `out_proj`: W <- T^T W, a bias b <- b T), or for a family with a
  post-attention norm (Gemma 2/3, OLMo 2/3) the orthogonal map into the projection and
  the diagonal into that norm: the exact fold of a `normed` run.

Each is unit s-1's stage (`lorp.models.architectures.unit_stage`).

Unit 0 (block 0's attention) is never removed (`lorp.models.sublayers.check_units`), so
every run has a site. The repaired variant has the unrepaired one's architecture and
parameter count: only the kept sub-layers' weights change.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lorp.locality.capture import unpack_batch
from lorp.locality.similarity import token_selection
from lorp.models.architectures import (
    architecture_of,
    decoder_blocks,
    decoder_stack,
    text_config,
    unit_stage,
)
from lorp.models.streaming import device_of, streamer_of
from lorp.models.sublayers import check_units, remove_sublayers, unit_sites
from lorp.repair.distill import distill_fits, sublayer_cut
from lorp.repair.fit import fit_runs
from lorp.repair.fold import fold_into
from lorp.repair.maps import DEFAULT_RIDGE, RunFit
from lorp.repair.stats import Form, RepairStats, Run, contiguous_runs, rms_unit

Batch = torch.Tensor | Mapping[str, torch.Tensor]


def unit_runs(model: nn.Module, units: Iterable[int]) -> list[Run]:
    """The maximal runs of consecutive removed units, in depth order."""
    n_units = 2 * len(decoder_blocks(model))
    return contiguous_runs(check_units(units, n_units // 2), n_units)


def site_norm(model: nn.Module, unit: int) -> nn.Module | None:
    """The RMSNorm unit `unit`'s output passes before the residual add, or None."""
    return unit_stage(model, unit).post_norm


def unit_form(model: nn.Module, run: Run) -> Form:
    return "normed" if site_norm(model, run[0] - 1) is not None else "full"


def unit_T0(model: nn.Module, run: Run, form: Form) -> torch.Tensor:
    """What the pruned model applies to X now: I, or the site norm's scale."""
    d = int(text_config(model.config).hidden_size)
    if form == "full":
        return torch.eye(d, dtype=torch.float64)
    return torch.diag(site_scale(model, run[0] - 1))


def site_scale(model: nn.Module, unit: int) -> torch.Tensor:
    """The scale unit `unit`'s post-norm applies (its weight plus the family's offset)."""
    norm = site_norm(model, unit)
    assert norm is not None
    return norm.weight.detach().double().cpu() + architecture_of(model).norm_offset


class _UnitStates:
    """Hooks on one model recording, per batch, the block inputs (and the last block's
    output) and the outputs of the sub-layer sites `sites` (X as well for `normed`)."""

    def __init__(self, model: nn.Module, sites: Iterable[int], normed: set[int]) -> None:
        blocks = decoder_blocks(model)
        self.n = len(blocks)
        self.seen: dict[Any, torch.Tensor] = {}
        self.keep: torch.Tensor | None = None
        self.handles = [
            b.register_forward_pre_hook(self._block_in(i), with_kwargs=True)
            for i, b in enumerate(blocks)
        ]
        self.handles.append(blocks[-1].register_forward_hook(self._block_out, with_kwargs=True))
        for u in sorted(set(sites)):
            ((site, scale),) = unit_sites(model, u, blocks)
            self.handles.append(site.register_forward_hook(self._site(u, u in normed, scale)))

    def flat(self, x: Any) -> torch.Tensor:
        x = x[0] if isinstance(x, tuple | list) else x
        x = x.reshape(-1, x.shape[-1])
        return x if self.keep is None else x[self.keep]

    def _block_in(self, i: int):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self.seen[("in", i)] = self.flat(args[0] if args else kwargs["hidden_states"])

        return hook

    def _block_out(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self.seen[("in", self.n)] = self.flat(output)

    def _site(self, unit: int, normed: bool, scale: float):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            added = self.flat(output) * scale if scale != 1.0 else self.flat(output)
            self.seen[("M", unit)] = added
            self.seen[("X", unit)] = self.flat(rms_unit(module, args[0])) if normed else added

        return hook

    def boundary(self, j: int) -> torch.Tensor:
        """Boundary state j in float32: block j/2's input, or for odd j block (j-1)/2's
        input plus what its attention added."""
        if j % 2 == 0:
            return self.seen[("in", j // 2)].float()
        return self.seen[("in", j // 2)].float() + self.seen[("M", j - 1)].float()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def capture_unit_stats(
    model: nn.Module,
    batches: Iterable[Batch],
    runs: Sequence[Run],
    *,
    skip_prefix: int = 0,
    target: nn.Module | None = None,
) -> RepairStats:
    """The repair sums of unit `runs` over `batches`: X, M and boundary s from `model`,
    boundary e + 1 (what a run's map aims at) from `target` (default: `model` itself, the
    dense model's one-pass fit). With a pruned and repaired `model` and the dense model
    as `target`, the fit corrects what the earlier maps left (`repair_sublayers(rounds=2)`);
    its maps then compose with the folded ones."""
    n = len(decoder_blocks(model))
    forms = {r: unit_form(model, r) for r in runs}
    stats = RepairStats(2 * n, int(text_config(model.config).hidden_size), runs, forms)
    for r in runs:  # a normed start's scale as it is now, as block sums keep it (T0)
        if forms[r] == "normed":
            stats.base[r[0]] = site_scale(model, r[0] - 1)
    device = device_of(model)
    # Unit s-1's site for each start s (X and M), and the attention site of every odd
    # boundary a run reads (M: the stream between a block's attention and its MLP).
    starts = {r[0] - 1 for r in runs}
    normed = {r[0] - 1 for r in runs if forms[r] == "normed"}
    odd_s = {s - 1 for s, _ in runs if s % 2 == 1}
    odd_e = {e for _, e in runs if (e + 1) % 2 == 1}
    source = _UnitStates(model, starts | odd_s | (odd_e if target is None else set()), normed)
    aim = source if target is None else _UnitStates(target, odd_e, set())
    try:
        with torch.inference_mode():
            for batch in batches:
                ids, mask = unpack_batch(batch)
                ids, mask = ids.to(device), None if mask is None else mask.to(device)
                keep, _ = token_selection(tuple(ids.shape), mask, skip_prefix, device)
                for states in {id(source): source, id(aim): aim}.values():
                    states.keep = keep
                    states.seen.clear()
                decoder_stack(model)(input_ids=ids, attention_mask=mask, use_cache=False)
                if target is not None:
                    decoder_stack(target)(input_ids=ids, attention_mask=mask, use_cache=False)
                features = {s: source.seen[("X", s - 1)] for s in stats.starts}
                targets = {
                    (s, e): aim.boundary(e + 1)
                    - source.boundary(s)
                    + source.seen[("M", s - 1)].float()
                    for s, e in stats.runs
                }
                ends = {(s, e): aim.boundary(e + 1) for s, e in stats.runs}
                stats.add(features, targets, ends)
    finally:
        source.remove()
        if aim is not source:
            aim.remove()
    return stats


def fit_unit_runs(
    model: nn.Module, stats: RepairStats, *, ridge: float | None = None
) -> list[RunFit]:
    """Every unit run's map, as `lorp.repair.fit.fit_runs` fits block runs: validated on
    `stats.held_domains` where it has them (the ridge chosen on the worst domain unless
    `ridge` fixes it, the map kept only if no domain is worse), else at `ridge` or the
    default. T0 is the unit's (`unit_T0`)."""
    fixed = ridge if stats.held_domains else (ridge or DEFAULT_RIDGE)
    return fit_runs(model, stats, ridge=fixed, unrepaired=lambda r, f: unit_T0(model, r, f))


@torch.no_grad()
def fold_units(model: nn.Module, fits: Sequence[RunFit]) -> None:
    """Fold every unit fit into the dense `model`'s weights, in place: the site's output
    projection (`o_proj` or `down_proj`) and, for a `normed` fit, its post-norm's weight.
    A streamed model's projection gets an override its streamer serves, folded from the
    file's tensor in the file's dtype, as `lorp.repair.fold.fold` does for block runs: the
    figures are those of the checkpoint written from the files with `folded_parameters`."""
    streamer = streamer_of(model)
    for fit in fits:
        fold_into(streamer, unit_stage(model, fit.run[0] - 1), fit)


def folded_parameters(model: nn.Module, fits: Sequence[RunFit]) -> dict[str, torch.Tensor]:
    """The parameters `fold_units` rewrites for `fits`, by their names in the model's
    state (the checkpoint's keys): what a sub-layer manifest stores
    (`lorp.models.variant_manifest.write_unit_manifest`) and what a streamed model's
    checkpoint takes in place of its files' tensors (its folded matrices are the
    streamer's overrides, its vectors resident)."""
    streamer = streamer_of(model)
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for fit in fits:
        stage = unit_stage(model, fit.run[0] - 1)
        norm = stage.post_norm if fit.form == "normed" else None
        modules = {id(t.module): t.module for t in stage.fold_targets()}
        for module in [*modules.values(), *([norm] if norm is not None else [])]:
            for attr, p in module.named_parameters(recurse=False):
                if p.is_meta and streamer is not None:
                    out[names[id(p)]] = streamer.overridden(module, attr)
                else:
                    out[names[id(p)]] = p.detach()
    return out


def repair_sublayers(
    model: nn.Module,
    units: Iterable[int],
    batches: Sequence[Batch],
    *,
    held: Mapping[str, Sequence[Batch]] | None = None,
    skip_prefix: int = 0,
    ridge: float | None = None,
    sequential: bool = False,
    distill_epochs: int = 0,
) -> list[RunFit]:
    """Remove `units` from the dense `model` in place and fold their repair: every run's
    map fitted on `batches`, validated on `held` (domain -> held-out batches; without
    them `ridge` is fixed). One pass (default): every run fitted from the dense model's
    states, one forward per batch for all of them. `sequential`: runs in depth order,
    each fitted on the states the model pruned and repaired so far gives it, against the
    dense model's (a copy is held meanwhile): an earlier run's leftover error is part of
    what a later map corrects, at two forwards per run and batch. `distill_epochs`
    (one pass only): the fitted maps then trained jointly towards the dense model's
    next-token distribution on `batches`, an epoch kept only where it beats them on every
    domain of `held` (`lorp.repair.distill`)."""
    wanted = list(units)
    runs = unit_runs(model, wanted)
    if distill_epochs and (sequential or not held):
        raise ValueError("distill_epochs: needs held-out batches and the one-pass fit")
    if not sequential:
        sums = unit_stats(model, runs, batches, held, skip_prefix=skip_prefix)
        fits = fit_unit_runs(model, sums, ridge=ridge)
        if distill_epochs:
            windows = torch.cat([torch.as_tensor(b) for b in batches])
            parts = {d: torch.cat([torch.as_tensor(b) for b in h]) for d, h in (held or {}).items()}
            cut = sublayer_cut(model, wanted)
            fits = distill_fits(model, fits, cut, windows, parts, epochs=distill_epochs)
        fold_units(model, fits)
        remove_sublayers(model, wanted)
        return fits
    dense = copy.deepcopy(model)
    fits = []
    for run in runs:
        sums = unit_stats(
            model, [run], batches, held, skip_prefix=skip_prefix, target=dense if fits else None
        )
        fit = fit_unit_runs(model, sums, ridge=ridge)
        fold_units(model, fit)
        remove_sublayers(model, range(run[0], run[1] + 1))
        fits += fit
    return fits


def unit_stats(
    model: nn.Module,
    runs: Sequence[Run],
    batches: Sequence[Batch],
    held: Mapping[str, Sequence[Batch]] | None,
    *,
    skip_prefix: int = 0,
    target: nn.Module | None = None,
) -> RepairStats:
    """The sums of `runs` over `batches`, with `held`'s per domain: one capture serves
    every variant whose runs are among them (`repair_from_stats`)."""
    stats = capture_unit_stats(model, batches, runs, skip_prefix=skip_prefix, target=target)
    if held:
        stats.held_domains = {
            d: capture_unit_stats(model, b, runs, skip_prefix=skip_prefix, target=target)
            for d, b in held.items()
        }
    return stats


def repair_from_stats(
    model: nn.Module, units: Iterable[int], stats: RepairStats, *, ridge: float | None = None
) -> list[RunFit]:
    """`repair_sublayers`' one-pass fit from sums captured already (`unit_stats` of the
    dense `model`, holding at least these units' runs): fit, fold, remove, in place."""
    wanted = list(units)
    fits = fit_unit_runs(model, stats.subset(unit_runs(model, wanted)), ridge=ridge)
    fold_units(model, fits)
    remove_sublayers(model, wanted)
    return fits
