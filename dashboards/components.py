"""The pieces both page kinds are built from: cells, badges, intervals, the jobs table.

Rendering only: every number, interval, flag and link arrives computed in the dicts that
`overview_view.py` and `model_view.py` return; these functions turn them into elements
(`markup.el`, escaped).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dashboards.assets import CSS, SCRIPT
from dashboards.intervals import MIN_COMPARABLE_ITEMS, SMALL, UNKNOWN
from dashboards.markup import Markup, document, el, frag
from dashboards.shapes import View

SMALL_MARK = "\u2020"  # dagger: fewer than 100 items
UNKNOWN_MARK = "\u2021"  # double dagger: item count unknown
PM = "\u00b1"


# -- cells -------------------------------------------------------------------------------


def fmt(x: Any, digits: int = 2) -> str:
    if isinstance(x, float):
        return f"{x:,.{digits}f}" if abs(x) < 1e5 else f"{x:.3g}"
    return str(x)


def num(x: Any, digits: int = 2) -> Markup:
    """A number, or a muted dash when there is none."""
    return el("span", "-", class_="muted") if x is None else el("span", fmt(x, digits))


def td(*children: Any, left: bool = False, cls: str | None = None, **attrs: Any) -> Markup:
    classes = " ".join(c for c in ("l" if left else "", cls or "") if c) or None
    return el("td", *children, class_=classes, **attrs)


def value_td(x: Any, digits: int = 2) -> Markup:
    return td(num(x, digits), data_v="" if x is None else x)


def th(*children: Any, left: bool = False) -> Markup:
    return el("th", *children, class_="l" if left else None)


def link(url: str | None, text: str) -> Markup:
    return el("a", text, href=url) if url else el("span", "-", class_="muted")


def version_link(v: View) -> Markup | None:
    """` model version`, linking a variant to its Model Registry page, when registered."""
    if not v.get("model_url"):
        return None
    return frag(" ", el("a", "model version", href=v["model_url"], title=v.get("model_uri")))


def figure(svg: str, caption: str) -> Markup:
    return el("figure", Markup(svg), el("figcaption", caption))


def sortable(head: Sequence[Any], rows: Sequence[Markup], **attrs: Any) -> Markup:
    """A table whose headers sort it (assets.SCRIPT)."""
    return el("table", el("thead", el("tr", head)), el("tbody", rows), class_="sortable", **attrs)


def degraded_badge(v: View) -> Markup | None:
    if not v.get("degraded"):
        return None
    title = "failed the quality gate"
    if v.get("ppl_ratio") is not None:
        title += f": perplexity {fmt(v['ppl_ratio'], 3)} x the dense model's"
    return el("span", "degraded", class_="badge degraded", title=title)


def fits_badge(v: View) -> Markup | None:
    """A variant whose held-out ratio is far over its calibration corpus's
    (`fits_calibration_only`): good only on the kind of text it was fitted on."""
    if not v.get("fits_calibration_only"):
        return None
    title = "its ratio to dense on held-out text is over 1.5x its ratio on calibration text"
    return el("span", "fits calibration only", class_="badge fits-calibration", title=title)


def variant_td(v: View) -> Markup:
    return td(v["label"], degraded_badge(v), fits_badge(v), left=True)


def row_class(v: View) -> str | None:
    return (
        " ".join(c for c, on in (("dense", v["dense"]), ("degraded", v["degraded"])) if on) or None
    )


def budget_td(v: View) -> Markup:
    return td(f"{v['budget']}/{v['n_blocks']}", data_v=v["budget"])


def interval_td(iv: View) -> Markup:
    """An accuracy as `value +- half`, marked when under 100 items or of unknown size."""
    if iv["value"] is None:
        return value_td(None)
    parts: list[Any] = [fmt(iv["value"])]
    if iv["half"] is not None:
        parts.append(f" {PM} {fmt(iv['half'])}")
        title = f"95% interval [{fmt(iv['lo'])}, {fmt(iv['hi'])}] over {fmt(iv['n'], 0)} items"
    else:
        title = "items unknown: no interval"
    if iv["flag"] == SMALL:
        parts.append(el("span", SMALL_MARK, class_="mark small"))
        title += f"; under {MIN_COMPARABLE_ITEMS} items: not comparable to the paper"
    elif iv["flag"] == UNKNOWN:
        parts.append(el("span", UNKNOWN_MARK, class_="mark unknown"))
    return td(*parts, data_v=iv["value"], title=title, data_flag=iv["flag"])


def speed_tds(sv: View) -> list[Markup]:
    """Speed-up +- spread, and the bound N / (N - k) next to it; over-bound is flagged,
    an unresolved timing says so (the measured ratio in small text, not sortable)."""
    if not sv.get("resolved", True):
        return [unresolved_td(sv), value_td(sv["bound"])]
    if sv["speedup"] is None:
        return [value_td(None), value_td(sv["bound"])]
    text = fmt(sv["speedup"]) + (f" {PM} {fmt(sv['std'])}" if sv["std"] is not None else "")
    flag = None
    if sv["exceeds"]:
        flag = el(
            "span",
            "above bound",
            class_="badge over-bound",
            title="more than 5% above N/(N-k): timing noise or a measurement fault",
        )
    speed = td(text, flag, data_v=sv["speedup"], cls="over-bound" if sv["exceeds"] else None)
    return [speed, value_td(sv["bound"])]


def unresolved_td(sv: View) -> Markup:
    """'not resolved', why, and the measured ratio in small text; no sort key."""
    measured = sv.get("measured")
    if sv.get("measured_exceeds"):
        title = "the measured ratio is more than 5% above N/(N-k): not a result"
    else:
        title = "the timing did not settle: two runs did not agree on each side's fastest time"
    note = None
    if measured is not None:
        title += f"; measured {fmt(measured, 3)}x"
        note = el("small", f" ({fmt(measured)} measured)", class_="muted")
    return td(
        el("span", "not resolved", class_="badge unresolved"),
        note,
        data_v="",
        data_measured="" if measured is None else measured,
        cls="unresolved",
        title=title,
    )


# -- pages -------------------------------------------------------------------------------


def page(title: str, *body: Any) -> str:
    return str(document(title, frag(*body), css=CSS, script=SCRIPT))


def _browse(job: View) -> Any:
    if job["command"]:
        how: Any = el("code", job["command"])
    elif job["tracking_uri"]:
        how = frag("open ", el("a", job["ui"], href=job["ui"]))
    else:
        return el("span", "no tracking URI recorded", class_="muted")
    return frag(how, " (credentials redacted: supply your own)" if job["redacted"] else None)


def jobs_section(jobs: Sequence[View]) -> Markup:
    """Where each job's MLflow runs are, and the command that serves them."""
    head = [th(h, left=True) for h in ("job", "experiment", "tracking URI", "browse the runs")]
    rows = [
        el(
            "tr",
            td(j["job"], left=True),
            td(j["experiment_id"] or "-", left=True),
            td(el("code", j["tracking_uri"] or "-"), left=True),
            td(_browse(j), left=True),
        )
        for j in jobs
    ]
    table = el("table", el("thead", el("tr", head)), el("tbody", rows), class_="jobs")
    return frag(el("h2", "MLflow records"), table)
