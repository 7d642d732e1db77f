"""What a model's preparation says as it goes (`pipeline.driver.model_stages`): S captured
or read from the cache, the base stored, repair sums and scores, repaired twins refused,
loss-guided selections' batches, and the driver's own spans. Each is an event and, where
a person would want to know, a log line; called from the model threads (the event log
is locked; the summary's lists take appends from any thread).

The recorder (`pipeline.driver.recorder`) owns it and hands it the job's event log: it
is part of the one writer of the job's records, holding no writer of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pipeline.cluster.nodes import first_line
from pipeline.driver.summary import RunSummary
from pipeline.events.progress import Progress
from pipeline.plan.grid import GridPoint, ModelPlan
from pipeline.stages.statistics import ModelRepairStats, ModelStats, describe
from pipeline.storage.bases import store_base
from pipeline.storage.store import Storage


class PreparationLog:
    """The preparations' events and lines (`pipeline.driver.model_stages.PrepareRecords`)."""

    def __init__(
        self,
        events: Callable[..., None],
        progress: Progress,
        summary: RunSummary,
        storage: Storage,
    ) -> None:
        """`events(kind, **fields)`: the job's event log."""
        self.events, self.progress, self.summary, self.storage = events, progress, summary, storage

    def captured(self, plan: ModelPlan, ms: ModelStats) -> None:
        self.events("capture", model=plan.label, **describe(ms))
        self.progress.capture(plan.label, ms.source, ms.seconds, ms.stats.tokens)

    def store_base(self, plan: ModelPlan) -> None:
        """The model's base below the storage once (`pipeline.storage.bases`)."""
        got = store_base(self.storage, plan.ref, plan.kind, plan.fingerprint, plan.path)
        if got is not None:
            self.events("base_stored", model=plan.label, **got.record())
            self.progress.note(got.line(plan.label))

    def repair_scored(self, plan: ModelPlan, rs: ModelRepairStats, runs: int) -> None:
        self.events(
            "repair_scores",
            model=plan.label,
            source=rs.source,
            runs=runs,
            seconds=round(rs.seconds, 3),
        )
        where = "from the cache" if rs.source == "cache" else f"captured in {rs.seconds:.1f} s"
        self.progress.note(f"repair scores {plan.label}: {runs} candidate runs, {where}")

    def repair_refused(self, point: GridPoint, why: str) -> None:
        label = point.model.label
        self.summary.refused.append(f"{label} {point.name}: {why}")
        self.events("repair_refused", model=label, point=point.name, reason=why)
        self.progress.note(f"{label} {point.name}: not repaired: {why}")

    def repair_captured(
        self, label: str, rs: ModelRepairStats, runs: list[tuple[int, int]], variants: int
    ) -> None:
        self.events(
            "repair_capture",
            model=label,
            source=rs.source,
            runs=[list(r) for r in runs],
            passes=rs.passes,
            seconds=round(rs.seconds, 3),
            tokens=rs.stats.tokens,
            file=rs.location,
        )
        where = (
            "from the cache"
            if rs.source == "cache"
            else f"captured in {rs.seconds:.1f} s, {rs.passes} pass(es)"
        )
        self.progress.note(
            f"repair statistics {label}: {len(runs)} run(s) for {variants} variant(s), {where}"
        )

    def repair_failed(self, label: str, points: list[GridPoint], exc: BaseException) -> None:
        """A model's repair capture failed: its repaired points fail with the reason."""
        cause = first_line(exc)
        for p in points:
            self.summary.failed.append(f"{label}/{p.label}/{p.budget}: {cause}")
            self.events("point_failed", grid_key=p.key, error=str(exc)[-4000:], cause=cause)
        self.progress.note(f"repair statistics of {label} failed: {cause}")

    def losses(self, candidates: int, evaluated: int, spans: list[dict[str, Any]]) -> None:
        """One batch of a loss-guided selection's candidates (`RayLosses`)."""
        self.events("losses", candidates=candidates, evaluated=evaluated, spans=spans)

    def span(self, stage: str, model: str, start: float, end: float) -> None:
        """A span of the driver's own (preparing a model, gating it)."""
        self.events(
            "span",
            stage=stage,
            model=model,
            start=start,
            end=end,
            node="driver",
            worker="driver",
            slots={},
        )
