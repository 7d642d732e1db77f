"""Prune and repair in one call: capture the repair sums on calibration batches, fit every
run (in one pass on dense inputs, or in depth order with `sequential=True`), fold the maps.
The fleet does the same in stages (`pipeline.stages`); this is the notebook's path.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lorp.models.architectures import decoder_blocks
from lorp.models.layer_config import check_cut
from lorp.models.surgery import drop_layers, kept_layers
from lorp.repair.capture import capture_repair_stats
from lorp.repair.fit import check_repairable, fit_runs
from lorp.repair.fold import fold
from lorp.repair.maps import DEFAULT_RIDGE, RunFit, fit_full, unrepaired_map
from lorp.repair.stats import RepairStats

log = logging.getLogger(__name__)


def full_fits(
    model: nn.Module, stats: RepairStats, *, ridge: float = DEFAULT_RIDGE
) -> list[RunFit]:
    """Every run fitted as an unconstrained map, whatever the family: on a post-MLP-norm
    family these do not fold and serve, through `applied_by_hooks`, as the upper bound
    the `normed` fold is measured against."""
    out = []
    for run in stats.runs:
        T0 = unrepaired_map(model, run, stats.forms[run])
        out.append(
            fit_full(
                stats.gram[run[0]], stats.cross[run], stats.energy[run], T0, ridge=ridge, run=run
            )
        )
    return [
        RunFit(f.run, stats.forms[f.run], f.matrix, None, f.ridge, f.residual, f.unrepaired)
        for f in out
    ]


def prune_and_repair(
    model: nn.Module,
    windows: torch.Tensor,
    layers: Sequence[int],
    *,
    ridge: float = DEFAULT_RIDGE,
    batch_size: int = 8,
    skip_prefix: int = 0,
    sequential: bool = True,
    progress: bool = False,
) -> list[RunFit]:
    """Drop `layers` from the loaded `model` and repair every run, in place.

    `windows` [n, T] are calibration token ids (a BOS first when the tokenizer wants one,
    with `skip_prefix=1` to keep it out of the sums, as for S). `sequential` (default)
    fits the runs in depth order, each on the inputs the model repaired so far gives it
    and towards the dense model's state (one partial pass per run, and a copy of the
    model as the reference); False fits every run on dense inputs in one pass. Returns
    the fits; their `record()`s belong in the checkpoint's provenance.
    """
    runs = check_repairable(model, layers)
    n = len(decoder_blocks(model))
    check_cut(model.config, kept_layers(n, layers), type(model))  # refused before any fold
    start = time.perf_counter()
    batches = [windows[i : i + batch_size] for i in range(0, len(windows), batch_size)]
    kw: dict[str, Any] = {"skip_prefix": skip_prefix, "progress": progress}
    if sequential and len(runs) > 1:
        from lorp.models.streaming import streamer_of

        if streamer_of(model) is not None:
            raise ValueError(
                "sequential=True copies the model, and a streamed model cannot be copied "
                "(its hooks read through its own streamer): use sequential=False"
            )
        reference = copy.deepcopy(model)
        fits: list[RunFit] = []
        for j, run in enumerate(runs):
            earlier = [i for s, e in runs[:j] for i in range(s, e + 1)]
            stats = capture_repair_stats(
                model, batches, [run], reference=reference, dropped=earlier, **kw
            )
            fits += fit_runs(model, stats, ridge=ridge)
            fold(model, fits[-1:])
        del reference
    else:
        fits = fit_runs(model, capture_repair_stats(model, batches, runs, **kw), ridge=ridge)
        fold(model, fits)
    drop_layers(model, layers)
    log.info(
        "repaired %d run(s) in %.1f s: %s",
        len(fits),
        time.perf_counter() - start,
        ", ".join(f"{f.run[0]}-{f.run[1]} {f.unrepaired:.3f}->{f.residual:.3f}" for f in fits),
    )
    return fits
