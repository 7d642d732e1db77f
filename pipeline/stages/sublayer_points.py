"""A sub-layer grid point on its worker (`pipeline.stages.points` hands it over): fit and
fold the unit runs' repair, remove the attention or MLP sub-layers, save the Nemotron-NAS
checkpoint vLLM serves (Llama and Qwen2 families), evaluate.

The repair is the block point's with units for blocks (`lorp.repair.sublayer_repair`):
each unit run's sums come from the capture workers, its map is validated on the held-out
calibration windows per domain, distilled where the job distils, and the whole repair is
gated by the held-out loss per domain against the unrepaired variant. A family vLLM cannot
serve in this form is evaluated with the variant in memory (transformers), whatever the
job's backend, and is not stored: its result says which backend judged it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from lorp.provenance import with_repair_runs
from pipeline.messages import FollowerWindows, PointResult, PointTask
from pipeline.storage.store import Storage, scratch_dir


def held_windows(fw: FollowerWindows) -> dict[str, Any]:
    """Domain -> its held-out windows as token tensors: what the followers, distillation
    and the gate each judge on per domain (block and sub-layer points alike)."""
    return {d: _tokens(w) for d, w in fw.held_by_domain().items()}


log = logging.getLogger(__name__)


def execute_sublayer_point(task: PointTask, lm: Any, start: float) -> PointResult:
    """`task`'s sub-layers removed from the dense `lm` (repaired first where asked), its
    checkpoint saved where its family serves, its figures measured."""
    from lorp.models.sublayers import remove_sublayers
    from pipeline.evaluation.speed import count_params
    from pipeline.stages.point_evaluation import evaluate_point, split_records, zero_shot_info

    params_dense = count_params(lm.model)
    fits = _unit_repair(task, lm.model) if task.repair else []
    remove_sublayers(lm.model, task.units)
    params = count_params(lm.model)
    records = [f.record() for f in fits]
    provenance = with_repair_runs(task.provenance, records) if task.repair else task.provenance
    backend = task.backend if task.checkpoint or task.backend != "vllm" else "transformers"
    with scratch_dir() as scratch:
        saved = _save(task, lm, scratch, provenance, fits)
        metrics = evaluate_point(task, lm, saved or lm.path, scratch, backend)
    serving = metrics.pop("serving", None) or {}
    metrics, windows, items = split_records(metrics)
    return PointResult(
        task.grid_key,
        list(range(lm.n_blocks)),
        int(params),
        int(params_dense),
        metrics,
        time.perf_counter() - start,
        zero_shot_info(task.evaluation, metrics, items),
        records,
        serving,
        window_nll=windows,
        backend=backend if backend != task.backend else None,
    )


def _save(
    task: PointTask, lm: Any, scratch: Path, provenance: dict[str, Any], fits: list[Any]
) -> Path | None:
    """The Nemotron-NAS checkpoint (`lorp.models.nemotron_nas`), or under `checkpoints:
    manifest` the units and the folded projections by reference to the base
    (`lorp.models.variant_manifest.write_unit_manifest`), written into the storage (or
    scratch, then uploaded) as a block point's is; None where none is wanted. A streamed
    model's checkpoint is written from its files, tensor by tensor, the folded projections
    in place of theirs: the model in this process has no weights to save."""
    if not task.checkpoint:
        return None
    from lorp.models.nemotron_nas import check_servable, save_sublayer_variant
    from lorp.repair.sublayer_repair import folded_parameters

    storage = Storage(task.storage)
    local = storage.local_path(task.checkpoint) or scratch / "checkpoint"
    m, units = task.model, task.units
    if task.checkpoint_format == "manifest" or m.streamed:
        check_servable(lm.model.config.to_dict())  # as the whole checkpoint: before writing
        changed = folded_parameters(lm.model, fits)
    if task.checkpoint_format == "manifest":
        from lorp.models.variant_manifest import BaseRef, write_unit_manifest
        from pipeline.storage.bases import stored_base_uri

        stored = stored_base_uri(task.storage, m.kind, m.fingerprint)  # the preparation's copy
        base = BaseRef(m.ref, m.kind, m.fingerprint, m.revision, stored)
        write_unit_manifest(
            local, base, units, provenance, changed=changed, dtype=m.dtype, overwrite=True
        )
    elif m.streamed:  # in the checkpoint's own dtype, as a streamed block point's
        from lorp.models.nemotron_nas import write_sublayer_files

        write_sublayer_files(lm.path, local, units, provenance, changed=changed, overwrite=True)
    else:
        save_sublayer_variant(lm.model, lm.tokenizer, local, units, provenance, overwrite=True)
    if storage.remote:
        storage.put_dir(local, task.checkpoint)
    return local


def _unit_repair(task: PointTask, model: Any) -> list[Any]:
    """Every unit run's map, fitted from its sums, distilled where asked, gated on the
    held-out loss per domain, then folded into the dense `model` (its sub-layers are
    removed after)."""
    import dataclasses

    import ray

    from lorp.repair.distill import DEFAULT_BATCH, distill_fits, sublayer_cut
    from lorp.repair.domain_gate import gate_repair
    from lorp.repair.sublayer_repair import fit_unit_runs, fold_units, unit_T0

    rt = task.repair
    assert rt is not None
    fits = []
    for i in range(len(rt.runs)):  # one run's sums held at a time, as a block point's
        fits += fit_unit_runs(model, run_statistics(task, i), ridge=rt.ridge)
    cut = sublayer_cut(model, task.units)
    candidates = [("least squares", list(fits))]
    fw: FollowerWindows | None = ray.get(rt.windows) if rt.windows is not None else None
    if rt.distill and fw is not None:
        fits = distill_fits(
            model,
            fits,
            cut,
            _tokens(fw.windows),
            held_windows(fw),
            epochs=rt.distill,
            lr=rt.distill_lr,
            batch_size=min(fw.batch_size, DEFAULT_BATCH),
            say=lambda line: log.info("%s %s: %s", task.model.label, task.name, line),
        )
        candidates.insert(0, ("distilled", list(fits)))
    if fw is not None and rt.gate:
        gate = gate_repair(
            model,
            cut,
            candidates,
            held_windows(fw),
            fw.batch_size,
            unrepaired=lambda fit: unit_T0(model, fit.run, fit.form),
        )
        log.info("%s %s: repair gate kept %s", task.model.label, task.name, gate.kept)
        fits = list(gate.fits)
        if fits:
            fits[0] = dataclasses.replace(fits[0], gate=gate.record())
    else:
        fits = candidates[0][1]
    fold_units(model, fits)
    return fits


def run_statistics(task: PointTask, i: int) -> Any:
    """The sums of a repaired point's run `i` (a block run, or a unit run), fetched and
    checked to be its model's and that run's."""
    import ray

    rt = task.repair
    assert rt is not None
    run, stats = rt.runs[i], ray.get(rt.stats[i])
    if stats.model_fingerprint != task.model.fingerprint or stats.runs != [run]:
        what = "units" if rt.units else "run"
        raise ValueError(
            f"repair statistics of {what} {run[0]}-{run[1]} belong to another model or "
            f"run ({stats.model_fingerprint}, {stats.runs})"
        )
    return stats


def _tokens(windows: Any) -> Any:
    import torch

    return torch.from_numpy(windows).long()
