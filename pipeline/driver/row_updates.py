"""What a catalog row learns after it is written, as pure functions over the rows: its speed
figures (measured, or its unrepaired twin's), and the quality gate (`ppl_ratio` on held-
out text, `degraded`, `fits_calibration_only`). Each returns the new values; the recorder
(`pipeline.driver.recorder`) writes them to the catalog and the point's MLflow run through its
one update path, and says what they came to in the log (`speed_summary`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.catalog.protocol import FITS_CALIBRATION_ONLY, held_out, ratio_name
from pipeline.evaluation.corpora import metric_name
from pipeline.plan.grid import CHECKPOINTS, GridPoint
from pipeline.spec.domains import domains_of
from pipeline.spec.evaluation import EvaluationSpec

SPEED_COLUMNS = (
    "latency_ms",
    "latency_dense_ms",
    "speedup",
    "speedup_std",
    "speedup_low",
    "speedup_high",
    "speedup_measured",
    "speed_runs",
    "speed_resolved",
    "peak_mem_gib",
)
STREAMED_UNTIMED = (
    "not timed: the model is streamed a module at a time (too large for one worker), "
    "and a streamed forward times the disk, not the model"
)
"""The `speed_skipped` of a streamed model's rows: its forwards read every block from
disk, so a timing would measure the disk."""
EXPERTS_UNTIMED = (
    "not timed: an expert cut leaves a token's compute as it was (it is still routed to "
    "top-k experts), so its prefill is its blocks' (weight_bytes says what the cut saves)"
)
"""The `speed_skipped` of a row that removed routed experts."""

Row = Mapping[str, Any]
Rows = Mapping[str, Row]
"""grid key -> catalog row."""


def missing(row: Mapping[str, Any], column: str) -> bool:
    value = row.get(column)
    return value is None or (isinstance(value, float) and math.isnan(value))


def same(a: Any, b: Any) -> bool:
    """Equal, NaN equal to NaN (an unresolved speed-up stays NaN)."""
    nan = isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    return nan or a == b


def finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def unmeasured(
    rows: Rows, points: list[GridPoint], twins: Mapping[str, str], *, again: bool = False
) -> list[GridPoint]:
    """The finished points still without speed figures (`again`: every finished point);
    a repaired variant with an unrepaired twin in the job is never timed (it takes the
    twin's figures)."""
    return [
        p
        for p in points
        if p.key in rows and p.key not in twins and (again or missing(rows[p.key], "latency_ms"))
    ]


def row_storage(row: Mapping[str, Any]) -> str | None:
    """Where a row's files are: its `storage` column, else (rows written before it) the
    storage its checkpoint lies in; None when the row says neither."""
    if row.get("storage"):
        return str(row["storage"])
    ckpt = row.get("checkpoint")
    if not ckpt:
        return None
    marker = f"/{CHECKPOINTS}/"
    return ckpt.rsplit(marker, 1)[0] if marker in ckpt else None


def stored_elsewhere(rows: list[Mapping[str, Any]], storage: str) -> dict[str, str]:
    """grid key -> its storage, for the rows whose files are not in `storage` (the
    job's): a working copy left by a run with another storage. They are not done here."""
    out = {}
    for r in rows:
        where = row_storage(r)
        if where is not None and where != storage:
            out[r["grid_key"]] = where
    return out


def by_value(mapping: Mapping[str, str]) -> dict[str, list[str]]:
    """value -> the keys that have it."""
    out: dict[str, list[str]] = {}
    for key, value in mapping.items():
        out.setdefault(value, []).append(key)
    return out


def speed_summary(figures: Mapping[str, Mapping[str, float]]) -> str:
    """What a model's speed pass found (`figures`: grid key -> its speed figures): how
    many variants were timed, the top resolved speed-up, how many were not resolved."""
    resolved = [v["speedup"] for v in figures.values() if finite(v.get("speedup"))]
    unresolved = len(figures) - len(resolved)
    top = f"top speed-up {max(resolved):.2f}x" if resolved else "no speed-up resolved"
    more = f"; {unresolved} not resolved" if unresolved else ""
    return f"{len(figures)} variants timed ({top}{more})"


def twin_speed(rows: Rows, twins: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """repaired key -> the speed figures to copy from its timed twin (latency, speed-up,
    spread, peak memory: the checkpoint is the same size), where they differ."""
    out = {}
    for key, twin in twins.items():
        row, base = rows.get(key), rows.get(twin)
        if row is None or base is None or missing(base, "latency_ms"):
            continue
        values = {c: base[c] for c in SPEED_COLUMNS if c in base}
        if any(not same(row.get(c), v) for c, v in values.items()):
            out[key] = values
    return out


def _serve_tps(row: Mapping[str, Any] | None) -> list[float]:
    """A row's per-round output tokens/s from its `serving` column ([] without one)."""
    if row is None or not isinstance(row.get("serving"), str):
        return []
    return [float(r["output_tps"]) for r in json.loads(row["serving"]).get("rounds", [])]


def serving_speedups(
    rows: Rows, points: list[GridPoint], half_width: float
) -> dict[str, dict[str, float]]:
    """grid key -> its serving speed-up columns (`pipeline.evaluation.serving`), for
    every point whose row and dense row have serving rounds, where they differ. The
    dense row's is 1 by definition."""
    from pipeline.evaluation.serving import serving_speedup
    from pipeline.evaluation.speed import speedup_bound

    dense = {p.model.label: rows.get(p.key) for p in points if p.is_dense}
    out = {}
    for p in points:
        row, base = rows.get(p.key), dense.get(p.model.label)
        variant_tps, dense_tps = _serve_tps(row), _serve_tps(base)
        if row is None or not variant_tps or not dense_tps:
            continue
        if p.is_dense:
            values = {
                "serve_speedup": 1.0,
                "serve_speedup_measured": 1.0,
                "serve_speedup_low": 1.0,
                "serve_speedup_high": 1.0,
                "serve_resolved": 1.0,
            }
        else:
            bound = speedup_bound(p.model.n_blocks, p.bound_blocks)
            values = serving_speedup(variant_tps, dense_tps, bound, half_width)
        if any(not same(row.get(c), v) for c, v in values.items()):
            out[p.key] = values
    return out


@dataclass(frozen=True)
class Verdict:
    """A row's quality judgement. `ratios`: each corpus's perplexity over dense's
    (`ratio_<corpus>` columns). Each domain (`pipeline.spec.domains`) is judged on its
    corpora the model was not calibrated on, or, where it has none, on its calibration
    corpora's evaluation split (a test split that shares no document with the calibration
    split); `worst_domain` is the domain whose ratio is highest, `worst_domain_ratio` that
    ratio. `ratio` is the gate's figure: the worst domain's, or the job's `rank_domain`'s;
    `judged_on` names the corpora it came from. Over `evaluation.degraded_ratio` it is
    `degraded`; held-out more than `FITS_CALIBRATION_ONLY` x the calibration corpus's
    ratio, `fits_calibration_only`."""

    key: str
    ratio: float
    ratios: dict[str, float]
    judged_on: str
    degraded: bool
    fits_calibration_only: bool | None
    """None: the job evaluated no calibration corpus, or no held-out one."""
    worst_domain: str | None = None
    worst_domain_ratio: float | None = None
    domain_ratios: dict[str, float] | None = None
    """Domain -> its ratio to dense (`ratio_domain_<domain>` columns)."""

    def values(self) -> dict[str, Any]:
        """The row's columns."""
        per_domain = {f"ratio_domain_{d}": r for d, r in (self.domain_ratios or {}).items()}
        return {
            "ppl_ratio": self.ratio,
            **self.ratios,
            **per_domain,
            "worst_domain": self.worst_domain,
            "worst_domain_ratio": self.worst_domain_ratio,
            "judged_on": self.judged_on,
            "degraded": self.degraded,
            "fits_calibration_only": self.fits_calibration_only,
        }

    def changed(self, row: Mapping[str, Any]) -> bool:
        """The row does not hold these values yet."""
        return any(row.get(c) != v for c, v in self.values().items())

    def metrics(self) -> dict[str, float]:
        """The figures its point's MLflow run gets."""
        per_domain = {f"ratio_domain_{d}": r for d, r in (self.domain_ratios or {}).items()}
        return {"ppl_ratio": self.ratio, **self.ratios, **per_domain}

    def tags(self) -> dict[str, str]:
        """The tags its point's MLflow run gets."""
        tags = {"degraded": str(self.degraded).lower(), "judged_on": self.judged_on}
        if self.worst_domain is not None:
            tags["worst_domain"] = self.worst_domain
        if self.fits_calibration_only is not None:
            tags["fits_calibration_only"] = str(self.fits_calibration_only).lower()
        return tags


def judge(  # type: ignore[no-untyped-def]
    row: Row,
    dense: Row,
    corpora: list[str],
    calibration: list[str],
    limit: float,
    domains: Mapping[str, str] | None = None,
    rank_domain: str | None = None,
):
    """`row`'s Verdict against `dense` (both with every corpus's perplexity), or None.
    `domains`: the job's corpus -> domain tags (`pipeline.spec.domains.domain_of`)."""
    ratios = {}
    for c in corpora:
        column = metric_name(c)
        if missing(row, column) or missing(dense, column):
            return None
        ratios[c] = float(row[column]) / float(dense[column])
    unseen = held_out(corpora, calibration)
    seen = [c for c in corpora if c not in unseen]
    per_domain: dict[str, float] = {}
    judged: dict[str, list[str]] = {}
    for domain, members in domains_of(corpora, domains or {}).items():
        judged[domain] = [c for c in members if c in unseen] or members
        per_domain[domain] = max(ratios[c] for c in judged[domain])
    worst = max(per_domain, key=lambda d: (per_domain[d], d))
    chosen = rank_domain if rank_domain in per_domain else worst
    ratio = per_domain[chosen]
    fits_only = None
    if unseen and seen:
        fits_only = max(ratios[c] for c in unseen) > FITS_CALIBRATION_ONLY * max(
            ratios[c] for c in seen
        )
    shown = [c for d in ([chosen] if rank_domain else judged) for c in judged[d]]
    label = ",".join(c for c in shown if c in unseen)
    fitted = [c for c in shown if c not in unseen]  # judged on a calibration corpus's test split
    if fitted:
        label += ("; " if label else "") + f"{','.join(fitted)} (calibration text)"
    named = {ratio_name(c): r for c, r in ratios.items()}
    return Verdict(
        row["grid_key"],
        ratio,
        named,
        label,
        ratio > limit,
        fits_only,
        worst,
        per_domain[worst],
        per_domain,
    )


def quality_gate(
    rows: Rows,
    points: list[GridPoint],
    ev: EvaluationSpec,
    calibration: Mapping[str, list[str]],
    domains: Mapping[str, str] | None = None,
) -> list[Verdict]:
    """The verdict of every point whose row and dense row have every corpus's perplexity
    (`calibration`: model label -> the corpora it was calibrated on; `domains`: the job's
    corpus -> domain tags)."""
    if not (ev.enabled and ev.perplexity):
        return []
    corpora = list(ev.perplexity)
    dense = {p.model.label: rows.get(p.key) for p in points if p.is_dense}
    out = []
    for p in points:
        row, base = rows.get(p.key), dense.get(p.model.label)
        if row is None or base is None:
            continue
        verdict = judge(
            {**row, "grid_key": p.key},
            base,
            corpora,
            list(calibration.get(p.model.label, [])),
            ev.degraded_ratio,
            domains,
            ev.rank_domain,
        )
        if verdict is not None:
            out.append(verdict)
    return out
