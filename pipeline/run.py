"""The job driver: (models x budgets x methods) -> pruned, recorded, catalogued variants.

Per model: calibration shards once, S once (cached by content key: model fingerprint,
calibration fingerprint, capture dtype), RLS / K / clusters once; then per (budget, method)
a selection in the driver (milliseconds) and a Ray task for surgery, saving and
evaluation. Grid points already in the catalog are skipped, so a rerun resumes; `force`
redoes them. The catalog row is written before the point's MLflow run is closed, so a
driver killed at any moment leaves a state the next start repairs exactly.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import ray

import lorp
from lorp import SimilarityStats, select_layers
from lorp.architectures import architecture_for
from lorp.locality import k_for_rls, rls
from lorp.methods import resolve_budget
from lorp.similarity import FORMAT_VERSION
from lorp.sources import cache_root, materialize, parse_model_ref, read_config
from pipeline.calibration import write_shards
from pipeline.catalog import read_catalog, upsert, write_catalog
from pipeline.evaluation import resolve_backend
from pipeline.spec import JobSpec, ModelSpec, SpecError
from pipeline.tracking import Tracker, default_tracking_uri
from pipeline.workers import PointTask, distributed_capture, run_point

log = logging.getLogger(__name__)


@dataclass
class ModelPlan:
    spec: ModelSpec
    path: Path
    fingerprint: str
    n_blocks: int
    family: str
    budgets: list[int]


@dataclass
class Point:
    grid_key: str
    plan: ModelPlan
    method: str
    label: str
    options: dict[str, Any]
    budget: int
    layers: tuple[int, ...]
    details: dict[str, Any]
    parent_run: str
    model_info: dict[str, Any]


@dataclass
class RunSummary:
    run_dir: Path
    catalog: Path
    tracking_uri: str
    checkpoints: Path
    captured: int = 0
    cached: int = 0
    done: int = 0
    skipped: int = 0
    failed: list[str] = field(default_factory=list)


class EventLog:
    """Append-only JSON lines in the run directory: what this job did, and when."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def __call__(self, event: str, **data: Any) -> None:
        record = {"time": _now(), "event": event, **data}
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record, default=str) + "\n")

    def read(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line]


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


# -- planning (all input errors surface here, before any work) ---------------------------


def plan_models(spec: JobSpec) -> list[ModelPlan]:
    from lorp.fingerprint import fingerprint_checkpoint

    for i, m in enumerate(spec.models):
        try:
            parse_model_ref(m.ref)
        except ValueError as exc:
            raise SpecError(f"models[{i}].ref: {exc}") from None
    plans = []
    for i, m in enumerate(spec.models):
        try:
            path = materialize(m.ref, allow_pickle=m.allow_pickle)
            config = read_config(path)
            family = architecture_for(str(config.get("model_type"))).family
        except ValueError as exc:
            raise SpecError(f"models[{i}].ref: {exc}") from None
        n = int(config["num_hidden_layers"])
        max_pos = config.get("max_position_embeddings")
        if max_pos is not None and spec.calibration.seq_len > max_pos:
            raise SpecError(
                f"calibration.seq_len: {spec.calibration.seq_len} exceeds {m.label}'s "
                f"max_position_embeddings {max_pos}"
            )
        budgets = []
        for j, b in enumerate(spec.budgets):
            try:
                budgets.append(resolve_budget(b, n))
            except ValueError as exc:
                raise SpecError(f"budgets[{j}]: {exc} ({m.label})") from None
        plans.append(
            ModelPlan(m, path, fingerprint_checkpoint(path), n, family, sorted(set(budgets)))
        )
    return plans


def init_ray(spec: JobSpec) -> None:
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS") or spec.ray.address
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
    else:
        # Embedded local Ray; its dashboard (when installed) binds to loopback only.
        ray.init(
            num_cpus=spec.ray.num_cpus,
            include_dashboard=False,
            dashboard_host="127.0.0.1",
            logging_level=logging.WARNING,
        )


# -- the job -----------------------------------------------------------------------------


def run_job(spec: JobSpec, *, force: bool = False) -> RunSummary:
    plans = plan_models(spec)
    run_dir = spec.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    catalog_path = run_dir / "catalog.parquet"
    ckpt_root = run_dir / "checkpoints"
    uri = os.environ.get("MLFLOW_TRACKING_URI") or spec.tracking.mlflow_uri
    uri = uri or default_tracking_uri(run_dir)
    summary = RunSummary(run_dir, catalog_path, uri, ckpt_root)
    events = EventLog(run_dir / "events.jsonl")
    tracker = Tracker(uri, spec.tracking.experiment or spec.name, run_dir / "mlartifacts")

    rows = read_catalog(catalog_path)
    completed = {r["grid_key"]: r["mlflow_run_id"] for r in rows}
    closed = tracker.close_stale_runs(spec.name, completed)
    _remove_partial_checkpoints(ckpt_root)
    events("start", job=spec.name, force=force, closed_stale_runs=closed)
    init_ray(spec)

    points: list[Point] = []
    for plan in plans:
        stats = _statistics(spec, plan, run_dir, events, summary, force)
        model_key = _key(plan.fingerprint, stats.calibration_fingerprint)
        parent = tracker.model_run(spec.name, model_key, plan.spec.label)
        details = _record_model(tracker, parent, spec, plan, stats)
        points += _plan_points(spec, plan, stats, model_key, details, parent)

    todo = []
    for p in points:
        if p.grid_key in completed and not force:
            summary.skipped += 1
            continue
        if p.grid_key in completed and completed[p.grid_key]:
            tracker.delete(completed[p.grid_key])  # --force: the redo replaces the old run
        todo.append(p)
    events("grid", points=len(points), todo=len(todo), skipped=summary.skipped)
    rows = _run_points(spec, todo, rows, tracker, events, summary, catalog_path, ckpt_root)
    events("end", done=summary.done, skipped=summary.skipped, failed=len(summary.failed))
    return summary


def _statistics(
    spec: JobSpec,
    plan: ModelPlan,
    run_dir: Path,
    events: EventLog,
    summary: RunSummary,
    force: bool,
) -> SimilarityStats:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        str(plan.path), trust_remote_code=plan.spec.trust_remote_code
    )
    shards = write_shards(tokenizer, spec.calibration, run_dir / "calibration")
    key = _key(plan.fingerprint, shards.fingerprint, plan.spec.dtype, FORMAT_VERSION)
    cache_dir = Path(spec.cache_dir) if spec.cache_dir else cache_root() / "stats"
    cache_file = cache_dir / f"{key}.npz"
    if cache_file.is_file() and not force:
        stats = SimilarityStats.from_file(cache_file)
        if stats.model_fingerprint != plan.fingerprint:
            raise ValueError(
                f"cached statistics {str(cache_file)!r} belong to model {stats.model_fingerprint}, "
                f"not {plan.spec.label} ({plan.fingerprint})"
            )
        summary.cached += 1
        stats.extra["file"] = str(cache_file.resolve())
        events("capture", model=plan.spec.label, source="cache", file=str(cache_file))
        return stats
    start = time.perf_counter()
    stats = distributed_capture(
        str(plan.path),
        plan.spec.dtype,
        [str(p) for p in shards.paths],
        spec.calibration.batch_size,
        spec.resources.capture,
        plan.fingerprint,
        shards.fingerprint,
        plan.spec.trust_remote_code,
    )
    seconds = time.perf_counter() - start
    stats.extra.update({"capture_seconds": seconds, "dtype": plan.spec.dtype})
    stats.to_file(cache_file)
    stats.extra["file"] = str(cache_file.resolve())
    summary.captured += 1
    events(
        "capture",
        model=plan.spec.label,
        source="computed",
        file=str(cache_file),
        seconds=round(seconds, 3),
        tokens=stats.tokens,
        shards=len(shards.paths),
    )
    return stats


def _record_model(
    tracker: Tracker, run_id: str, spec: JobSpec, plan: ModelPlan, stats: SimilarityStats
) -> dict[str, Any]:
    S = stats.matrix()
    try:
        score = rls(S)
        k = k_for_rls(score)
    except ValueError:
        score, k = math.nan, None
    labels = None
    if k is not None:
        from lorp import cluster_layers

        labels = cluster_layers(S, k).tolist()
    cal = spec.calibration
    tracker.record_model(
        run_id,
        params={
            "model": plan.spec.label,
            "model_ref": plan.spec.ref,
            "fingerprint": plan.fingerprint,
            "family": plan.family,
            "n_blocks": plan.n_blocks,
            "dtype": plan.spec.dtype,
            "calibration": stats.calibration_fingerprint,
            "calibration.dataset": cal.dataset,
            "calibration.samples": cal.samples,
            "calibration.seq_len": cal.seq_len,
            "calibration.shards": cal.shards,
            "cluster_labels": labels,
        },
        metrics={
            "rls": score,
            "k": float(k) if k is not None else math.nan,
            "capture_seconds": float(stats.extra.get("capture_seconds", math.nan)),
            "calibration_tokens": float(stats.tokens),
        },
        S=S,
        labels=labels,
    )
    return {"rls": score, "k": k, "stats_file": stats.extra.get("file")}


def _plan_points(
    spec: JobSpec,
    plan: ModelPlan,
    stats: SimilarityStats,
    model_key: str,
    info: dict[str, Any],
    parent: str,
) -> list[Point]:
    points = []
    if spec.evaluation.enabled:  # the dense row: evaluated once per model, reused
        key = _key(model_key, "dense")
        points.append(Point(key, plan, "dense", "dense", {}, 0, (), {}, parent, info))
    for budget in plan.budgets:
        for m in spec.methods:
            sel = select_layers(stats, budget, m.name, **m.options)
            options = sel.to_dict()["options"]
            key = _key(model_key, m.name, options, budget)
            points.append(
                Point(
                    key,
                    plan,
                    m.name,
                    m.key,
                    options,
                    budget,
                    sel.layers,
                    dict(sel.details),
                    parent,
                    info,
                )
            )
    return points


def _run_points(
    spec: JobSpec,
    todo: list[Point],
    rows: list[dict[str, Any]],
    tracker: Tracker,
    events: EventLog,
    summary: RunSummary,
    catalog_path: Path,
    ckpt_root: Path,
) -> list[dict[str, Any]]:
    res = spec.resources.grid
    backend = resolve_backend(spec.evaluation, res.num_gpus) if spec.evaluation.enabled else "none"
    if backend == "vllm" and not spec.save_checkpoints:
        backend = "transformers"  # auto: vLLM needs checkpoints on disk
    evaluators: list[Any] = []
    if backend == "vllm" and todo:
        from pipeline.vllm_engine import vllm_evaluators

        n = max(1, min(len(todo), spec.resources.max_concurrent_points))
        evaluators = vllm_evaluators(n, spec.evaluation, res.num_cpus, res.num_gpus)
    idle = list(evaluators)
    in_flight: dict[Any, tuple[Point, str, Any]] = {}  # ref -> (point, run id, evaluator)
    queue = list(todo)
    while queue or in_flight:
        limit = len(evaluators) or spec.resources.max_concurrent_points
        while queue and len(in_flight) < limit:
            p = queue.pop(0)
            run_id = tracker.start_point(
                spec.name, p.parent_run, p.grid_key, f"{p.label}-{p.budget}"
            )
            tracker.log(run_id, params=_point_params(p))
            ckpt = None
            if spec.save_checkpoints and p.layers:
                ckpt = str(ckpt_root / _safe(p.plan.spec.label) / f"{_safe(p.label)}-b{p.budget}")
            task = PointTask(
                p.grid_key,
                str(p.plan.path),
                p.plan.spec.dtype,
                p.layers,
                ckpt,
                _provenance(p, spec),
                spec.evaluation,
                res,
                p.plan.spec.trust_remote_code,
                backend,
            )
            if evaluators:  # vLLM: the actor that owns a GPU runs the whole point
                ev = idle.pop(0)
                ref = ev.run.remote(task, _checkpoint_of(spec, p) or str(p.plan.path))
            else:
                ev = None
                ref = run_point.options(num_cpus=res.num_cpus, num_gpus=res.num_gpus).remote(task)
            in_flight[ref] = (p, run_id, ev)
        ready, _ = ray.wait(list(in_flight), num_returns=1)
        p, run_id, evaluator = in_flight.pop(ready[0])
        if evaluator is not None:
            idle.append(evaluator)
        try:
            result = ray.get(ready[0])
        except Exception as exc:  # a task that failed after its retries: record, go on
            tracker.finish(run_id, "FAILED")
            cause = str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc)
            summary.failed.append(f"{p.plan.spec.label}/{p.label}/{p.budget}: {cause}")
            events("point_failed", grid_key=p.grid_key, error=str(exc)[-4000:], cause=cause)
            continue
        result["backend"] = backend
        row = _catalog_row(spec, p, result, run_id, tracker)
        rows = upsert(rows, row)
        write_catalog(catalog_path, rows)  # before FINISHED: see the module docstring
        tracker.log(
            run_id,
            metrics={**result["metrics"], "params": result["params"], "seconds": result["seconds"]},
            tags={"checkpoint": row["checkpoint"] or "", "eval_backend": row["eval_backend"]},
        )
        tracker.finish(run_id)
        summary.done += 1
        events(
            "point", grid_key=p.grid_key, model=p.plan.spec.label, method=p.label, budget=p.budget
        )
    return rows


def _point_params(p: Point) -> dict[str, Any]:
    return {
        "method": p.method,
        "method_label": p.label,
        "options": p.options,
        "budget": p.budget,
        "pruned_layers": list(p.layers),
        "kept_layers": [i for i in range(p.plan.n_blocks) if i not in set(p.layers)],
    }


def _provenance(p: Point, spec: JobSpec) -> dict[str, Any]:
    return {
        "lorp_version": lorp.__version__,
        "job": spec.name,
        "source_model": p.plan.spec.ref,
        "source_fingerprint": p.plan.fingerprint,
        "method": p.method,
        "options": p.options,
        "budget": p.budget,
        "n_blocks": p.plan.n_blocks,
        "pruned": list(p.layers),
        "kept": [i for i in range(p.plan.n_blocks) if i not in set(p.layers)],
        "grid_key": p.grid_key,
        "calibration": asdict(spec.calibration),
    }


def _catalog_row(
    spec: JobSpec, p: Point, result: dict[str, Any], run_id: str, tracker: Tracker
) -> dict[str, Any]:
    d = p.details
    k = d.get("k", p.model_info["k"])  # LoRP's own K (fixed or from RLS), else the model's
    row = {
        "grid_key": p.grid_key,
        "job": spec.name,
        "model": p.plan.spec.label,
        "model_ref": p.plan.spec.ref,
        "family": p.plan.family,
        "fingerprint": p.plan.fingerprint,
        "n_blocks": p.plan.n_blocks,
        "method": p.method,
        "method_label": p.label,
        "variant": p.options.get("variant"),
        "options": json.dumps(p.options, sort_keys=True),
        "budget": p.budget,
        "pruned_layers": list(p.layers),
        "kept_layers": result["kept"],
        "stages": json.dumps(d.get("stages")) if d.get("stages") else None,
        "rls": p.model_info["rls"],
        "k": int(k) if k is not None else None,
        "calibration": json.dumps(asdict(spec.calibration), sort_keys=True),
        "stats_file": p.model_info.get("stats_file"),
        "params": result["params"],
        "params_dense": result["params_dense"],
        "checkpoint": _checkpoint_of(spec, p),
        "eval_backend": result.get("backend"),
        "mlflow_run_id": run_id,
        "created_at": _now(),
        "lorp_version": lorp.__version__,
    }
    row.update(result["metrics"])
    return row


def _checkpoint_of(spec: JobSpec, p: Point) -> str | None:
    if not (spec.save_checkpoints and p.layers):
        return None
    path = spec.run_dir / "checkpoints" / _safe(p.plan.spec.label) / f"{_safe(p.label)}-b{p.budget}"
    return str(path.resolve())


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _remove_partial_checkpoints(root: Path) -> None:
    if root.is_dir():
        for partial in root.glob("*/.*.partial"):
            shutil.rmtree(partial, ignore_errors=True)
