"""Grid points on Ray workers: fit and fold the repair, drop the blocks, save the
checkpoint, evaluate (`run_point` as a task, `PointEvaluator` as the vLLM actor).

A grid point writes its checkpoint from the node that made it: straight into a filesystem
storage (atomic rename), else into node-local scratch, uploaded with its completion
marker, then evaluated from that local copy.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from pathlib import Path
from typing import Any

import ray

from lorp.provenance import with_repair_runs
from pipeline.cluster.faults import maybe_fail
from pipeline.cluster.model_source import load_checked
from pipeline.events.timeline import span
from pipeline.messages import FollowerWindows, PointResult, PointTask
from pipeline.stages.point_evaluation import evaluate_point, split_records, zero_shot_info
from pipeline.stages.sublayer_points import held_windows
from pipeline.stages.worker_setup import device_for, pin_threads
from pipeline.storage.store import Storage, scratch_dir

log = logging.getLogger(__name__)


# -- capture -----------------------------------------------------------------------------


# -- grid points -------------------------------------------------------------------------


_FLOOR: dict[tuple[str, str, str, str], float] = {}
"""(device type, model, fingerprint, dtype) -> what this worker process held before that
model's first point (GiB): the process itself (Python, torch, Ray, the points' code),
the model's tokenizer and its evaluation windows, which no model's plan counts."""


def _import_point_code() -> None:
    """What every point imports (transformers' model classes, the repair, the evaluation
    and lm-eval's), so the process's floor holds the code (a quarter of a GiB) and the
    peak only the model."""
    import transformers  # noqa: F401
    from lm_eval.models.huggingface import HFLM  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    import lorp.repair.domain_gate  # noqa: F401
    import lorp.repair.fit  # noqa: F401
    import pipeline.evaluation.backends  # noqa: F401
    import pipeline.evaluation.zero_shot  # noqa: F401
    from lorp.models.surgery import drop_layers  # noqa: F401


_TOKENIZER: dict[str, Any] = {}
"""The tokenizer of the model this worker process ran last."""


def _point_tokenizer(task: PointTask) -> Any:
    """The model's tokenizer, loaded once per process and model: part of the process's
    floor, as the plan's headroom has it (a Rust tokenizer of a 150k vocabulary holds
    about 0.08 GiB)."""
    from transformers import AutoTokenizer

    from pipeline.cluster.model_source import model_dir

    if task.model.ref not in _TOKENIZER:
        _TOKENIZER.clear()
        trust = task.model.trust_remote_code
        path = str(model_dir(task.model))
        _TOKENIZER[task.model.ref] = AutoTokenizer.from_pretrained(path, trust_remote_code=trust)
    return _TOKENIZER[task.model.ref]


def execute_point(task: PointTask) -> PointResult:
    """Fit and fold the repair (if any), drop the blocks, save the checkpoint, evaluate;
    `layers=()` is the dense model. Its span carries `peak_gib`, the most memory the
    point's worker held above its process's own (transformers points): the figure the
    plan's `memory` decision for `evaluate` estimates, so a job can check its plan."""
    import torch

    from pipeline.evaluation.peak_memory import measuring

    pin_threads(task.resources.num_cpus)
    mode = "streamed" if task.model.streamed else "memory"
    labels = {"model": task.model.label, "point": task.name, "unit": task.grid_key}
    # The span holds all the slot's work for the point: the first point's imports before
    # it, the collection after it.
    with span("point", **labels, mode=mode) as more:
        try:
            device = torch.device(device_for(task.resources))
            if task.backend == "vllm":  # an engine's memory is its own processes'
                return _execute_point(task)
            with measuring(_point_marks(task, device)) as marks:
                result = _execute_point(task)
            more |= {
                "peak_gib": marks.peak,
                "phase_gib": marks.marks,
                "left_gib": marks.left,
                "resident_gib": marks.resident_peak(),
            }
            return dataclasses.replace(result, peak_gib=marks.peak)
        finally:
            # The worker process outlives the point: a model kept alive by a reference
            # cycle (transformers' modules, a streamer's hooks) would hold its weights
            # until the collector next ran, and a large model's next point would load
            # beside it.
            gc.collect()


def _point_marks(task: PointTask, device: Any) -> Any:
    """The point's phase marks (`PhaseMarks`) above what its process holds of its own
    when it starts, less the dense model kept for later points (`_PRISTINE`: the plan
    counts it). Its own: the code every point runs, the model's tokenizer and the
    evaluation's windows (the plan's headroom covers them,
    `pipeline.plan.decisions.HEADROOM`), loaded before the model's first point in this
    process, and what earlier points left (lm-eval's tasks: `PhaseMarks.left`)."""
    from pipeline.evaluation.peak_memory import (
        PhaseMarks,
        fixed_malloc_thresholds,
        reset_peak_memory,
        resident_gib,
    )

    m = task.model
    key = (device.type, m.ref, m.fingerprint, m.dtype)
    if key not in _FLOOR:
        _FLOOR.clear()
        _PRISTINE.clear()  # another model's, gone before this one's floor is taken
        fixed_malloc_thresholds()  # freed activations go back, not kept for the next
        _import_point_code()
        _warm_evaluation(task)
        gc.collect()
        reset_peak_memory(device)
        _FLOOR[key] = PhaseMarks(device, 0.0).now()
    reset_peak_memory(device)  # the heap's free pages back (CUDA: the allocator's peak)
    held = sum(_model_bytes(lm.model) for lm in _PRISTINE.values()) / 2**30
    floor = PhaseMarks(device, 0.0).now() - held
    resident = resident_gib(device) - held
    return PhaseMarks(device, floor, left=floor - _FLOOR[key], resident=resident)


def _warm_evaluation(task: PointTask) -> None:
    """The model's tokenizer and the evaluation's windows, cut once in this process
    (`corpus_windows` keeps them; the corpora's texts stay cached, a few hundredths of
    a GiB)."""
    from pipeline.evaluation.corpora import corpus_windows

    tokenizer = _point_tokenizer(task)
    if task.backend == "transformers":
        for corpus in task.evaluation.perplexity:
            corpus_windows(tokenizer, corpus, task.evaluation)


def _model_bytes(model: Any) -> int:
    """The bytes of `model`'s parameters and buffers, each storage once (tied ones)."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in [*model.parameters(), *model.buffers()]
    }
    return sum(storages.values())


def _execute_point(task: PointTask) -> PointResult:
    from lorp.models.surgery import drop_layers
    from pipeline.evaluation.peak_memory import mark_phase
    from pipeline.evaluation.speed import count_params

    start = time.perf_counter()
    mark_phase("load")
    lm = _point_model(task)
    if task.units:
        from pipeline.stages.sublayer_points import execute_sublayer_point

        return execute_sublayer_point(task, lm, start)
    params_dense = count_params(lm.model)
    if task.experts:  # before the blocks: the cut names blocks in the dense numbering
        _drop_experts(task, lm.model)
    if task.repair is not None and task.repair.peer is not None:
        layers, records, changes = _peer(task, lm.model)
    else:
        fits = _repair(task, lm.model) if task.repair else []
        layers, records = task.layers, [f.record() for f in fits]
        changes = _file_folds(fits)
    mark_phase("drop")
    kept = drop_layers(lm.model, layers) if layers else list(range(lm.n_blocks))
    params = count_params(lm.model)
    provenance = with_repair_runs(task.provenance, records) if task.repair else task.provenance
    with scratch_dir() as scratch:
        mark_phase("save")
        saved = _save_checkpoint(task, lm, scratch, provenance, layers, changes)
        metrics = evaluate_point(task, lm, saved or lm.path, scratch)
    seconds = time.perf_counter() - start
    serving = metrics.pop("serving", None) or {}
    metrics, windows, items = split_records(metrics)
    info = zero_shot_info(task.evaluation, metrics, items)
    return PointResult(
        task.grid_key,
        kept,
        int(params),
        int(params_dense),
        metrics,
        seconds,
        info,
        records,
        serving,
        window_nll=windows,
    )


def _file_folds(fits: list[Any]) -> Any:
    """The linear maps' folds on a checkpoint's files (None: no map)."""
    from lorp.repair.fold import file_folds

    return file_folds(fits) if fits else None


def _peer(task: PointTask, model: Any) -> tuple[tuple[int, ...], list[Any], Any]:
    """A peer recipe's repair on the dense model, in place (`lorp.peers`): the blocks to
    drop (the replacement layer keeps the run's last), its record, and the tensors it
    changed as the variant's files hold them."""
    import torch

    from lorp.peers.recipes import repair_peer

    rt = task.repair
    assert rt is not None and rt.windows is not None
    fw: FollowerWindows = ray.get(rt.windows)
    held = {d: torch.from_numpy(w).long() for d, w in fw.held_by_domain().items()}
    windows = torch.from_numpy(fw.windows).long()
    result = repair_peer(
        model,
        task.layers,
        windows,
        held,
        rt.peer,
        batch_size=fw.batch_size,
        skip_prefix=fw.skip_prefix,
    )
    log.info("%s %s: %s", task.model.label, task.name, result.record)
    return result.dropped, [result.record], changed_tensors(model, result.changed)


def changed_tensors(model: Any, names: tuple[str, ...]) -> Any:
    """`FileChanges` (`lorp.models.file_surgery`) that write each changed parameter's
    value as the model holds it now, in the file's dtype, under its names on disk."""
    from lorp.models.disk_names import disk_names

    values = dict(model.named_parameters())
    now = {n: values[n].detach().cpu().clone() for n in names}

    def changes(index: Any, skeleton: Any, tied: bool) -> dict[str, Any]:
        on_disk = disk_names(skeleton, list(now))
        return {k: _value(now[n]) for n in now for k in on_disk[n]}

    return changes if names else None


def _value(tensor: Any) -> Any:
    return lambda stored: tensor.to(stored.dtype)


def _drop_experts(task: PointTask, model: Any) -> None:
    """The point's routed experts removed in memory (`lorp.experts.surgery`). A streamed
    model holds no weights to cut: refused in one line."""
    from lorp.experts.surgery import drop_experts

    if task.model.streamed:
        raise ValueError(
            f"{task.model.label}: an expert cut of a streamed model is not evaluated; give "
            "the evaluate stage room to hold it whole (resources.grid.memory_gib)"
        )
    drop_experts(model, dict(task.experts))


_PRISTINE: dict[tuple[str, str, str], Any] = {}
"""The last dense model this worker process loaded for a grid point (CPU only)."""


def _point_model(task: PointTask) -> Any:
    """The point's dense model: a private copy of the one this worker loaded last when it
    is the same model (a copy costs a fraction of a load: Gemma 3 270M 0.6 s, not 6 s);
    on GPUs and for vLLM points, a fresh load (no second copy held in GPU memory); also
    where the plan found room for one copy only, or streams the model."""
    import copy
    import dataclasses

    device = device_for(task.resources)
    tokenizer = _point_tokenizer(task)
    if device != "cpu" or task.backend == "vllm" or task.model.streamed or not task.model.pristine:
        return load_checked(task.model, device, tokenizer=tokenizer)
    key = (task.model.ref, task.model.fingerprint, task.model.dtype)
    if key not in _PRISTINE:
        from pipeline.evaluation.peak_memory import release_free_heap

        _PRISTINE.clear()  # one model per process: a worker serves one model at a time
        _PRISTINE[key] = load_checked(task.model, device, tokenizer=tokenizer)
        release_free_heap()  # what the load freed (the files' headers, its own buffers)
    pristine = _PRISTINE[key]
    return dataclasses.replace(pristine, model=copy.deepcopy(pristine.model))


def _repair(task: PointTask, model: Any) -> list[Any]:
    """Fit every run's map from its statistics and fold it into the dense model, here,
    where the checkpoint is made (the fits need the model's own norm weights)."""
    from lorp.repair.fit import check_repairable, fit_runs
    from lorp.repair.fold import fold
    from pipeline.evaluation.peak_memory import mark_phase, release_free_heap
    from pipeline.stages.sublayer_points import run_statistics

    rt = task.repair
    assert rt is not None
    check_repairable(model, task.layers)  # RepairRefused: the point fails with its reason
    mark_phase("fit")
    fits = []
    for i in range(len(rt.runs)):  # one run's sums held at a time, gone after its fit
        fits += fit_runs(model, run_statistics(task, i), ridge=rt.ridge, rounds=rt.rounds)
    release_free_heap()  # the fits' buffers, before the gate's and evaluation's forwards
    candidates = [("runs only", list(fits))]
    if rt.followers:
        mark_phase("followers")
        fits += _followers(task, model, fits)
        candidates.insert(0, ("least squares", list(fits)))
    if rt.distill:
        mark_phase("distill")
        fits = _distill(task, model, fits)
        candidates.insert(0, ("distilled", list(fits)))
    mark_phase("gate")
    fits = _gate(task, model, candidates)
    mark_phase("fold")
    fold(model, fits)  # a streamed model's too: its files get the fold when written
    return fits


def _gate(task: PointTask, model: Any, candidates: list[tuple[str, list[Any]]]) -> list[Any]:
    """The maps the point keeps: the first candidate (best first) whose held-out loss is
    no worse than the unrepaired variant's on any domain (`lorp.repair.domain_gate`); its
    record rides on the first run's."""

    from lorp.repair.domain_gate import gate_repair

    rt = task.repair
    assert rt is not None
    if rt.windows is None or not rt.gate:  # the job keeps its maps as validated
        return candidates[0][1]
    fw: FollowerWindows = ray.get(rt.windows)
    gate = gate_repair(model, task.layers, candidates, held_windows(fw), fw.batch_size)
    log.info("%s %s: repair gate kept %s", task.model.label, task.name, gate.kept)
    fits = list(gate.fits)
    if fits:
        fits[0] = dataclasses.replace(fits[0], gate=gate.record())
    return fits


def _followers(task: PointTask, model: Any, fits: list[Any]) -> list[Any]:
    """The point's follower maps, fitted on the model's calibration windows with its runs'
    maps applied by hooks (nothing copied: a streamed model too)."""
    import torch

    from lorp.repair.followers import fit_followers

    rt = task.repair
    assert rt is not None and rt.windows is not None
    fw: FollowerWindows = ray.get(rt.windows)
    return fit_followers(
        model,
        fits,
        task.layers,
        torch.from_numpy(fw.windows).long(),
        held_windows(fw),
        rt.followers,
        ridge=rt.ridge,
        rounds=rt.rounds,
        batch_size=fw.batch_size,
        skip_prefix=fw.skip_prefix,
    )


def _distill(task: PointTask, model: Any, fits: list[Any]) -> list[Any]:
    """The point's maps distilled together on the model's calibration windows, validated
    on its held-out windows (`lorp.repair.distill`); one log line per epoch."""
    import torch

    from lorp.repair.distill import DEFAULT_BATCH, distill_fits

    rt = task.repair
    assert rt is not None and rt.windows is not None
    fw: FollowerWindows = ray.get(rt.windows)
    return distill_fits(
        model,
        fits,
        task.layers,
        torch.from_numpy(fw.windows).long(),
        held_windows(fw),
        epochs=rt.distill,
        lr=rt.distill_lr,
        batch_size=min(fw.batch_size, DEFAULT_BATCH),
        say=lambda line: log.info("%s %s: %s", task.model.label, task.name, line),
    )


def _save_checkpoint(
    task: PointTask,
    lm: Any,
    scratch: Path,
    provenance: dict[str, Any],
    layers: tuple[int, ...],
    changes: Any,
) -> Path | None:
    """The saved checkpoint's local directory: in a filesystem storage itself (written
    atomically), else in this node's scratch, uploaded (marker last) before evaluation.
    A streamed model's variant is written from the dense model's files, the fold applied
    there (`lorp.models.file_surgery`): the model in this process has no weights to save."""
    if not (task.checkpoint and (task.layers or task.experts)):  # a peer's cut: its blocks
        return None
    maybe_fail("point", task.checkpoint)  # dies mid-checkpoint in tests
    storage = Storage(task.storage)
    local = storage.local_path(task.checkpoint) or scratch / "checkpoint"
    if task.checkpoint_format == "manifest":  # the base by reference, the changed tensors
        from lorp.models.variant_manifest import BaseRef, write_manifest
        from pipeline.storage.bases import stored_base_uri

        m = task.model
        stored = stored_base_uri(task.storage, m.kind, m.fingerprint)  # the preparation's copy
        base = BaseRef(m.ref, m.kind, m.fingerprint, m.revision, stored)
        write_manifest(
            lm.path,
            local,
            base,
            layers,
            provenance,
            changes=changes,
            dtype=m.dtype,
            overwrite=True,
            experts=dict(task.experts) or None,
        )
    elif task.model.streamed:  # in the checkpoint's own dtype: a bf16 model's stay bf16
        from lorp.models.file_surgery import write_pruned_files

        write_pruned_files(lm.path, local, layers, provenance, changes=changes, overwrite=True)
    else:
        from lorp.models.surgery import save_pruned

        save_pruned(lm.model, lm.tokenizer, local, provenance, overwrite=True)
    if storage.remote:
        storage.put_dir(local, task.checkpoint)
    return local


@ray.remote(max_retries=2)
def run_point(task: PointTask) -> PointResult:
    """A grid point as a Ray task (the transformers backend)."""
    return execute_point(task)


@ray.remote
class PointEvaluator:
    """One per GPU, reused across checkpoints: runs whole grid points whose evaluation
    starts a vLLM engine, so one actor owns its GPU end to end and no second task ever
    waits for that GPU; the process (and its imports) outlives each engine."""

    def __init__(self) -> None:
        from pipeline.evaluation.vllm_engine import prepare_vllm

        prepare_vllm()

    def run(self, task: PointTask) -> PointResult:
        return execute_point(task)


# -- the speed pass ----------------------------------------------------------------------
