"""The fleet page: one sortable, filterable row per model, Table 1 (RLS) and Fig. 2."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from dashboards.components import (
    figure,
    jobs_section,
    link,
    num,
    page,
    sortable,
    td,
    th,
    value_td,
)
from dashboards.figures import distance_svg
from dashboards.markup import Markup, el, frag
from dashboards.shapes import View


def best_td(best: View) -> Markup:
    """The best passing variant at one budget, or why there is none."""
    skipped = best["skipped"]
    note = el("span", f" ({skipped} degraded skipped)", class_="muted") if skipped else None
    if best["status"] == "all-degraded":
        return td(el("span", "none (all degraded)", class_="mark"), left=True, data_v="")
    if best["status"] == "none":
        return td(num(None), note, left=True, data_v="")
    value = best["value"]
    return td(
        f"{best['label']}: ", num(value), note, left=True, data_v="" if value is None else value
    )


def model_tr(row: View) -> Markup:
    return el(
        "tr",
        td(el("a", row["model"], href=row["page"]), left=True),
        td(el("code", row["protocol"]), left=True, data_v=row["protocol"]),
        td(row["family"], left=True),
        value_td(row["n_blocks"]),
        value_td(row["rls"], 3),
        value_td(row["k"]),
        value_td(row["dense_value"]),
        [best_td(b) for b in row["best"]],
        value_td(row["degraded"]),
        td(link(row["run_url"], "run"), left=True),
        data_row=True,
        data_family=row["family"],
        data_protocol=row["protocol"],
        data_method=" ".join(row["methods"]),
        data_budget=" ".join(map(str, row["budgets"])),
    )


def _select(name: str, values: Iterable[Any]) -> Markup:
    options = [el("option", "all", value="")] + [el("option", v, value=v) for v in values]
    return el("label", f"{name} ", el("select", options, data_filter=name))


def overview_table(ov: View) -> Markup:
    metric = ov["metric"] or "n/a"
    head = [
        th("model", left=True),
        th("protocol", left=True),
        th("family", left=True),
        th("N"),
        th("RLS"),
        th("K"),
        th(f"dense {ov['metric'] or ''}"),
        [th(f"best @ {b} ({metric})") for b in ov["budgets"]],
        th("degraded"),
        th("MLflow", left=True),
    ]
    return sortable(head, [model_tr(r) for r in ov["rows"]], id="overview")


def rls_table(ov: View) -> Markup:
    rows = [
        el(
            "tr",
            td(r["model"], left=True),
            value_td(r["n_blocks"]),
            value_td(r["rls"], 3),
            value_td(r["k"]),
        )
        for r in ov["rows"]
    ]
    head = [th("model", left=True), th("N"), th("RLS"), th("K")]
    return frag(el("h2", "Representation Locality Score (Table 1)"), sortable(head, rows))


DECAY_CAPTION = (
    "Mean inter-layer cosine similarity against normalised layer distance (the paper's "
    "Fig. 2), from each model's calibration statistics S. Faster decay = more local "
    "redundancy = higher RLS."
)


def nav_bar(nav: Sequence[tuple[str, str]]) -> Markup | None:
    """Links to the site's other pages (text, href), e.g. the job's timeline."""
    if not nav:
        return None
    links = [
        frag(" \u00b7 " if i else None, el("a", text, href=href))
        for i, (text, href) in enumerate(nav)
    ]
    return el("nav", "Pages: ", links, class_="pages")


def overview_page(
    ov: View, profiles: Mapping[str, np.ndarray], nav: Sequence[tuple[str, str]] = ()
) -> str:
    """The whole fleet page from `overview_view.overview` and every model's S; `nav` links the
    site's other pages (text, href)."""
    metric = ov["metric"] or "metric"
    filters = [
        _select("family", ov["families"]),
        _select("method", ov["methods"]),
        _select("budget", ov["budgets"]),
        _select("protocol", ov["protocols"]),
    ]
    note = (
        f"One line per model and evaluation protocol: figures are compared only within one "
        f"protocol (its id names the corpora, windows, BOS, tasks and dtype). Best = lowest "
        f"{metric} among the variants at that budget that passed the quality gate; degraded "
        f"variants ({ov['n_degraded']} in the fleet) are never best. Click a header to sort; "
        "MLflow links need the command below."
    )
    decay = figure(distance_svg(profiles), DECAY_CAPTION) if profiles else None
    return page(
        "lorp fleet",
        el(
            "h1",
            f"lorp fleet: {ov['n_models']} models, {len(ov['protocols'])} protocol(s), "
            f"{ov['n_points']} pruned variants",
        ),
        nav_bar(nav),
        el("div", filters, class_="filters"),
        overview_table(ov),
        el("p", note, class_="muted"),
        jobs_section(ov["jobs"]),
        rls_table(ov),
        decay,
    )
