"""The job's timeline page, as data: rows of worker slots, one bar per span, headline
figures and a per-model table, from the run's `events.jsonl` (`pipeline.events.timeline`).

Pure functions, no HTML and no file IO (`site.py` reads the events, `timeline_page.py`
renders). The figures are `pipeline.events.timeline.summarise`'s, over the latest attempt, so the
page says what `lorp status` says; times on the page are seconds since that attempt's
first span.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from dashboards.shapes import View
from pipeline.catalog.ranking import finite
from pipeline.events.timeline import Utilisation, attempt, spans_of, summarise

DRIVER = "driver"
STAGES = ("load", "capture", "repair_sums", "losses", "point", "speed", "prepare", "gate")
"""The stages in pipeline order: the legend's order (others follow, by name)."""
LABELS = ("of", "selection", "step", "shard")
"""A span's optional labels, shown in its tooltip."""


def worker_key(span: Mapping[str, Any]) -> str:
    """A span's row: `node/pid` (as `summarise`'s per-worker figures), or `driver`."""
    if DRIVER in (span.get("worker"), span.get("node")):
        return DRIVER
    return f"{span.get('node', '?')}/{span.get('worker', '?')}"


def _valid(event: Mapping[str, Any]) -> bool:
    """Not a span, or a span with a finite start no later than its end."""
    if event.get("event") != "span":
        return True
    start, end = finite(event.get("start")), finite(event.get("end"))
    return start is not None and end is not None and start <= end


def tooltip(span: Mapping[str, Any], t0: float) -> str:
    """`model point: stage, 1.23 s (from 4.56 s) on node/pid`, labels and failure after."""
    what = " ".join(str(span[k]) for k in ("model", "point") if span.get(k))
    labels = ", ".join(f"{k} {span[k]}" for k in LABELS if span.get(k) is not None)
    seconds = span["end"] - span["start"]
    text = f"{what or '(job)'}: {span['stage']}, {seconds:.2f} s (from {span['start'] - t0:.2f} s)"
    text += f" on {worker_key(span)}" + (f"; {labels}" if labels else "")
    return text + ("; FAILED" if span.get("failed") else "")


def held(span: Mapping[str, Any], kind: str) -> float:
    """The slots of `kind` a span held (as `summarise` counts them)."""
    return float((span.get("slots") or {}).get(kind, 0.0))


def _rows(spans: Sequence[Mapping[str, Any]], util: Utilisation) -> list[View]:
    """Workers by node, then by first start; the driver's row last."""
    first: dict[str, tuple[str, float]] = {}
    for s in spans:
        key = worker_key(s)
        node = "\uffff" if key == DRIVER else str(s.get("node", "?"))
        first[key] = min(first.get(key, (node, s["start"])), (node, s["start"]))
    order = sorted(first, key=lambda k: first[k])
    return [{"key": k, "busy": util.per_worker.get(k, 0.0)} for k in order]


def _lanes(bars: Sequence[View], rows: Sequence[View]) -> None:
    """Give each bar (in start order) the first lane of its row that is free by its start,
    so spans that overlap on one row (the driver prepares models in threads) all show;
    each row gets its lane count."""
    ends: list[list[float]] = [[] for _ in rows]
    for b in bars:
        lanes = ends[b["row"]]
        free = next((i for i, end in enumerate(lanes) if end <= b["start"]), len(lanes))
        if free == len(lanes):
            lanes.append(b["end"])
        lanes[free] = b["end"]
        b["lane"] = free
    for row, lanes in zip(rows, ends, strict=True):
        row["lanes"] = max(len(lanes), 1)


def _models(spans: Sequence[Mapping[str, Any]], kind: str, t0: float) -> list[View]:
    """Per model: first start, last end (s since t0), busy slot-seconds, stages in order."""
    by_model: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for s in spans:
        if s.get("model"):
            by_model[str(s["model"])].append(s)
    out = []
    for model, ss in sorted(by_model.items()):
        ss = sorted(ss, key=lambda s: s["start"])
        busy = sum(held(s, kind) * (s["end"] - s["start"]) for s in ss)
        out.append(
            {
                "model": model,
                "first": ss[0]["start"] - t0,
                "last": max(s["end"] for s in ss) - t0,
                "busy": busy,
                "spans": len(ss),
                "failed": sum(bool(s.get("failed")) for s in ss),
                "stages": list(dict.fromkeys(s["stage"] for s in ss)),
            }
        )
    return out


def headline_figures(util: Utilisation) -> View:
    """The figures above the chart, as numbers (None when undefined: no slots counted)."""
    return {
        "kind": util.kind,
        "slots": util.slots,
        "utilisation": finite(util.utilisation),
        "makespan": util.makespan,
        "busy": util.busy,
        "busy_hours": util.busy / 3600.0,
        "lower_bound": util.lower_bound,
        "ratio": finite(util.makespan_ratio),
        "chain": util.chain,
        "chain_model": util.chain_model,
    }


def timeline_view(events: Sequence[Mapping[str, Any]]) -> View | None:
    """Everything the timeline page shows, or None when the latest attempt has no span.

    {job, headline, t0 (unix s), makespan, rows [{key, busy, lanes}], bars [{row, lane,
    start, end, stage, model, point, failed, tip}] (start/end: s since t0), stages (legend
    order), models [per-model rows], running [begin events not finished]}.
    """
    events = [e for e in attempt(events) if _valid(e)]
    util = summarise(events)
    if util is None:
        return None
    spans = sorted(spans_of(events), key=lambda s: (s["start"], s["end"]))
    t0 = spans[0]["start"]
    rows = _rows(spans, util)
    index = {r["key"]: i for i, r in enumerate(rows)}
    bars = [
        {
            "row": index[worker_key(s)],
            "start": s["start"] - t0,
            "end": s["end"] - t0,
            "stage": str(s["stage"]),
            "model": s.get("model"),
            "point": s.get("point"),
            "failed": bool(s.get("failed")),
            "tip": tooltip(s, t0),
        }
        for s in spans
    ]
    _lanes(bars, rows)
    present = {b["stage"] for b in bars}
    stages = [s for s in STAGES if s in present] + sorted(present - set(STAGES))
    job = next((e.get("job") for e in events if e.get("event") == "start"), None)
    return {
        "job": job,
        "headline": headline_figures(util),
        "t0": t0,
        "makespan": util.makespan,
        "rows": rows,
        "bars": bars,
        "stages": stages,
        "models": _models(spans, util.kind, t0),
        "running": util.running,
    }
