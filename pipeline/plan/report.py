"""`lorp plan JOB.yaml`: what a job would do, before it does anything.

No weights are loaded or hashed and no stage runs; a packaged model not yet converted is
converted once (a reference must resolve to be checked). What a plan builds from a
model's config on the meta device is kept in lorp's cache by content
(`pipeline.plan.reads`), so the second plan of a job imports no model code: 1.8 s where
the first takes 6.3 (jobs/quality.yaml, `benchmarks/plan_speed.py`).

Per model: its size, the memory decision of each stage (held whole or streamed) with the
figures it came from, its grid points per method, how many of its rows the job's catalog
already holds, and, where an earlier run of the job left its events, how long the stages
took then. Every problem found is one line; a job with any is refused (exit 2). `lorp run`
prints the same plan first.

The memory decisions are the run's own (`pipeline.plan.memory.plan_memory`): before Ray
is up they use the local node lorp would start, whose memory comes from the machine's total
(`pipeline.cluster.capacity.local_node`), so the plan does not depend on what happens to be free.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from lorp.models.loading import parse_dtype
from lorp.models.memory import weight_size
from lorp.models.safetensors_index import tensor_index
from pipeline.catalog.table import NAME, read_catalog
from pipeline.events.log import read_events
from pipeline.plan.grid import ModelPlan
from pipeline.plan.memory import plan_memory
from pipeline.plan.models import plan_model, resolve_backend, unwritable_locations
from pipeline.spec.calibration import CalibrationSpec
from pipeline.spec.checks import SpecError
from pipeline.spec.domains import domain_of
from pipeline.spec.experts import ExpertsSpec
from pipeline.spec.job import JobSpec
from pipeline.spec.models import MethodSpec
from pipeline.storage.store import Storage


@dataclass
class ModelOutline:
    """One model as the plan sees it."""

    label: str
    ref: str
    family: str = ""
    n_blocks: int = 0
    weights_gib: float = 0.0
    dtype: str = ""
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per stage: the decision's record (mode, figures, where the worker's memory came from)."""
    points: dict[str, int] = field(default_factory=dict)
    """Grid points per method label (`dense`, `lorp`, `lorp+linear`, ...)."""
    done: int = 0
    """Rows of this model the job's catalog already holds."""
    last_run: dict[str, float] = field(default_factory=dict)
    """Seconds the stages took in the job's last run (capture, mean per point)."""
    calibrated: dict[str, list[str]] = field(default_factory=dict)
    """Domain -> the corpora the model is calibrated on in it (with their shares)."""
    judged: dict[str, list[str]] = field(default_factory=dict)
    """Domain -> the corpora the model is judged on in it."""
    sublayers: str = ""
    """How its sub-layer variants are stored and judged (a job with a sub-layer
    granularity): vLLM-servable Nemotron-NAS checkpoints, or why not."""


@dataclass
class JobOutline:
    name: str
    backend: str
    storage: str
    models: list[ModelOutline] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    """Lines about a job that runs but judges less than it seems to (`JobSpec.warnings`)."""

    @property
    def ok(self) -> bool:
        return not self.problems


def plan_job(spec: JobSpec) -> JobOutline:
    """The job's outline; every problem a line in `problems` (the other models planned)."""
    backend = resolve_backend(spec, importlib.util.find_spec("vllm") is not None)
    storage = Storage(spec.storage or spec.output_dir)
    out = JobOutline(spec.name, backend, storage.uri())
    out.problems += unwritable_locations(spec)
    out.warnings = spec.warnings()
    if out.problems:
        return out  # nothing below can be read or written
    rows = _rows(storage, spec.name)
    events = read_events(spec.run_dir / "events.jsonl")
    for i, m in enumerate(spec.models):
        outline = ModelOutline(m.label, m.ref)
        outline.calibrated = _shares(spec.calibration_for(m), spec.domains)
        outline.judged = spec.judged_domains() if spec.evaluation.enabled else {}
        out.models.append(outline)
        try:
            plan = plan_model(spec, i, m, fingerprint=False)  # read, not hashed
            _describe(outline, plan)
            plan = plan_memory(spec, plan, backend)
        except (SpecError, ValueError) as exc:
            out.problems.append(str(exc))
            continue
        out.warnings += plan.warnings(spec.repair, spec.sublayers, spec.experts.enabled)
        outline.stages = plan.memory_record()
        outline.points = grid_points(spec.granularity, spec.methods, spec.repair, plan)
        outline.points |= expert_points(spec.experts, spec.methods, plan)
        if not spec.evaluation.enabled:
            outline.points.pop("dense")
        outline.sublayers = _sublayer_line(plan) if spec.sublayers else ""
        outline.done = sum(1 for r in rows if r.get("model") == m.label)
        outline.last_run = _last_run(events, m.label)
    return out


def _sublayer_line(plan: ModelPlan) -> str:
    if plan.not_servable is None:
        return "stored as Nemotron-NAS checkpoints (vLLM serves them)"
    return f"judged in transformers, not stored ({plan.not_servable})"


def _describe(outline: ModelOutline, plan: ModelPlan) -> None:
    size = weight_size(tensor_index(plan.path), parse_dtype(plan.spec.dtype), plan.disk_layout())
    outline.family, outline.n_blocks = plan.family, plan.n_blocks
    outline.weights_gib = round(size.total / 2**30, 3)
    outline.dtype = plan.spec.dtype


def _shares(calibration: CalibrationSpec, domains: dict[str, str]) -> dict[str, list[str]]:
    """Domain -> "corpus share%" of a model's calibration text."""
    parts = calibration.parts
    total = sum(w for _, w in parts)
    out: dict[str, list[str]] = {}
    for corpus, weight in parts:
        share = f"{corpus} {100 * weight / total:.0f}%"
        out.setdefault(domain_of(corpus, domains), []).append(share)
    return out


def grid_points(
    granularity: Sequence[str],
    methods: Sequence[MethodSpec],
    repairs: Sequence[str],
    plan: ModelPlan,
) -> dict[str, int]:
    """Points per method label, the dense point first: every budget the model resolves
    to, once per repair (a repaired twin whose cut cannot fold is refused later, when
    its blocks are known)."""
    out = {"dense": 1}
    for g in granularity:
        for m in methods:
            key = m.key if g == "block" else f"{m.key}-{g}"  # `GridPoint.label`
            for repair in [m.peer] if m.peer else repairs:  # a peer: its own repair only
                label = key if repair == "none" else f"{key}+{repair}"
                out[label] = len(plan.budgets_for(g))
    return out


def expert_points(
    cuts: ExpertsSpec, methods: Sequence[MethodSpec], plan: ModelPlan
) -> dict[str, int]:
    """Points per expert cut label: each selector at every expert budget the model
    resolves to, alone and (`combine`) with each unrepaired block point."""
    out: dict[str, int] = {}
    n = len(plan.expert_budgets)
    if not n:
        return out
    for selector in cuts.methods:
        out[f"{selector}-experts"] = n  # `GridPoint.label`
        for m in methods if cuts.combine else ():
            out[f"{m.key}&{selector}-experts"] = n * len(plan.budgets)
    return out


def _rows(storage: Storage, job: str) -> list[dict[str, Any]]:
    local = storage.local_path(NAME)
    if local is None:  # a remote storage: its catalog is read when the job starts
        return []
    return [r for r in read_catalog(local) if r.get("job") == job]


def _last_run(events: list[dict[str, Any]], model: str) -> dict[str, float]:
    """From the job's events: the last capture's seconds and the mean point's."""
    mine = [e for e in events if e.get("model") == model]
    out = {}
    captures = [e["seconds"] for e in mine if e["event"] == "capture" and "seconds" in e]
    if captures:
        out["capture_s"] = float(captures[-1])
    points = [e["seconds"] for e in mine if e["event"] == "point" and "seconds" in e]
    if points:
        out["point_s"] = float(statistics.mean(points))
    return out


def plan_lines(outline: JobOutline, workers: int) -> list[str]:
    """The plan as lines for a terminal; `workers`: grid points run at once."""
    lines = [f"job {outline.name}: backend {outline.backend}, storage {outline.storage}"]
    for m in outline.models:
        lines += _model_lines(m, workers)
    total = sum(sum(m.points.values()) for m in outline.models)
    done = sum(m.done for m in outline.models)
    lines.append(f"grid: {total} points, {done} already in the catalog")
    lines += [f"warning: {w}" for w in outline.warnings]
    lines += [f"problem: {p}" for p in outline.problems]
    return lines


def _model_lines(m: ModelOutline, workers: int) -> list[str]:
    if not m.n_blocks:
        return [f"{m.label}: not planned ({m.ref})"]
    head = (
        f"{m.label}: {m.family}, {m.n_blocks} blocks, {m.weights_gib:g} GiB of weights at {m.dtype}"
    )
    lines = [head]
    if m.calibrated:
        cal = "; ".join(f"{d} ({', '.join(c)})" for d, c in m.calibrated.items())
        judged = "; ".join(f"{d} ({', '.join(c)})" for d, c in m.judged.items())
        lines.append(f"  domains: calibrated on {cal}; judged on {judged or 'nothing'}")
    for stage, d in m.stages.items():
        held = d["mode"] == "memory"
        # A load that converts maps the file beside the weights: that moment must fit too.
        loading = d.get("memory_gib", 0) > d["need_gib"] and held
        lines.append(
            f"  {stage}: {'held whole' if held else 'streamed'}, needs "
            f"{d['need_gib']:g} GiB"
            + (f" ({d['memory_gib']:g} while it loads, the file's pages mapped)" if loading else "")
            + f" of a worker's {d['worker_gib']:g} GiB"
            f" ({d.get('source', 'the spec')}), {d['batch']} windows per pass"
        )
    points = ", ".join(f"{k} {v}" for k, v in m.points.items())
    lines.append(f"  points: {sum(m.points.values())} ({points}); {m.done} already done")
    if m.sublayers:
        lines.append(f"  sub-layer variants: {m.sublayers}")
    if m.last_run:
        todo = max(0, sum(m.points.values()) - m.done)
        est = m.last_run.get("point_s", 0.0) * todo / max(workers, 1)
        capture = m.last_run.get("capture_s")
        lines.append(
            "  last run: "
            + (f"capture {capture:.0f} s, " if capture is not None else "")
            + f"{m.last_run.get('point_s', 0):.0f} s a point; the {todo} left about "
            + f"{est / 60:.0f} min at {workers} at once"
        )
    return lines


def plan_json(outline: JobOutline) -> str:
    return json.dumps(asdict(outline) | {"ok": outline.ok}, indent=2, default=str)
