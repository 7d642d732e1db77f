"""The job's timeline page: headline figures, a Gantt chart per worker slot, per model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dashboards.components import page, sortable, td, th, value_td
from dashboards.figures import FAILED, gantt_svg, stage_colour
from dashboards.markup import Markup, el, frag
from dashboards.shapes import View

PAGE = "timeline.html"


def duration(seconds: float | None) -> str:
    """12.3 s, 4.5 min or 2.35 h."""
    if seconds is None:
        return "n/a"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 3 * 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def percent(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def headline_rows(h: View) -> list[tuple[str, str, Any]]:
    """(key, label, value text) of each headline figure."""
    ratio = "n/a" if h["ratio"] is None else f"{h['ratio']:.2f}"
    return [
        ("utilisation", "utilisation", f"{percent(h['utilisation'])} (busy / (slots x makespan))"),
        ("slots", "slots", f"{h['slots']:g} {h['kind']}"),
        ("makespan", "makespan", f"{duration(h['makespan'])} (first span start to last end)"),
        ("busy", "busy", f"{h['busy_hours']:.3g} slot-hours ({h['busy']:,.1f} slot-s)"),
        ("lower_bound", "lower bound", f"{duration(h['lower_bound'])}; makespan / bound {ratio}"),
        ("chain", "longest chain", f"{duration(h['chain'])} ({h['chain_model'] or '-'})"),
    ]


def headline_table(h: View) -> Markup:
    rows = [
        el("tr", td(label, left=True, cls="muted"), td(text, left=True, data_figure=key))
        for key, label, text in headline_rows(h)
    ]
    return el("table", el("tbody", rows), class_="headline")


def running(units: Sequence[View]) -> Markup | None:
    if not units:
        return None
    items = [" ".join(str(u[k]) for k in ("model", "point", "stage") if u.get(k)) for u in units]
    return el("p", f"Running now ({len(units)}): ", "; ".join(items), class_="running")


def legend(stages: Sequence[str], failed: bool) -> Markup:
    items = [
        el("li", el("span", class_="swatch", style=f"background:{stage_colour(s)}"), s)
        for s in stages
    ]
    if failed:
        items.append(
            el("li", el("span", class_="swatch failed", style=f"border-color:{FAILED}"), "failed")
        )
    return el("ul", items, class_="legend")


def models_table(models: Sequence[View]) -> Markup:
    head = [
        th("model", left=True),
        th("first start (s)"),
        th("last end (s)"),
        th("busy slot-s"),
        th("spans"),
        th("failed"),
        th("stages", left=True),
    ]
    rows = [
        el(
            "tr",
            td(m["model"], left=True),
            value_td(m["first"], 1),
            value_td(m["last"], 1),
            value_td(m["busy"], 1),
            value_td(m["spans"]),
            value_td(m["failed"]),
            td(", ".join(m["stages"]), left=True),
        )
        for m in models
    ]
    return frag(el("h2", "Per model"), sortable(head, rows, id="timeline-models"))


CAPTION = (
    "One row per worker (node/pid), the driver's own stages at the bottom; one bar per "
    "span, coloured by stage (hover for model, point, stage and duration); failed spans "
    "outlined in red and hatched. Time is seconds since the latest attempt's first span."
)
NO_TIMELINE = "No timeline: {why} (runs older than span records have none)."


def timeline_page(tv: View | None, why: str = "no span recorded in events.jsonl") -> str:
    """The page from `timeline_view.timeline_view`; one line saying why when it is None."""
    back = el("p", el("a", "\u2190 fleet", href="index.html"))
    if tv is None:
        return page(
            "lorp timeline",
            back,
            el("h1", "Timeline"),
            el("p", NO_TIMELINE.format(why=why), class_="no-timeline"),
        )
    title = f"Timeline: {tv['job']}" if tv["job"] else "Timeline"
    failed = any(b["failed"] for b in tv["bars"])
    return page(
        f"lorp {title.lower()}",
        back,
        el("h1", title),
        headline_table(tv["headline"]),
        running(tv["running"]),
        el("h2", f"Workers ({len(tv['rows'])} rows, {len(tv['bars'])} spans)"),
        legend(tv["stages"], failed),
        el("figure", gantt_svg(tv), el("figcaption", CAPTION), class_="wide"),
        models_table(tv["models"]),
    )
