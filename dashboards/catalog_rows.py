"""How the dashboard reads catalog rows: which page each belongs on, which column ranks
them, and the quality gate's verdict, shared by the fleet page and the model pages.

A variant marked `degraded` by the quality gate is never a "best" variant; a catalog
without the `degraded` column has no degraded rows.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

from dashboards.shapes import Row
from pipeline.catalog.protocol import rank_column, row_protocol
from pipeline.catalog.ranking import finite


def slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def group_by_model(rows: Iterable[Row]) -> dict[str, list[Row]]:
    """model -> its rows, models in name order."""
    out: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        out[r["model"]].append(r)
    return dict(sorted(out.items()))


def protocol_of(row: Row) -> str:
    """The row's evaluation protocol (`pipeline.catalog.protocol`): what its figures may
    be compared with."""
    return row_protocol(row)


def group_pages(rows: Iterable[Row]) -> dict[tuple[str, str], list[Row]]:
    """(model, protocol) -> its rows, in name order: one page each, since figures are
    compared only within one protocol."""
    out: dict[tuple[str, str], list[Row]] = defaultdict(list)
    for r in rows:
        out[(r["model"], protocol_of(r))].append(r)
    return dict(sorted(out.items()))


def page_names(keys: Iterable[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """(model, protocol) -> its page: `model-<model>.html` for a model measured under one
    protocol, `model-<model>-<protocol>.html` for each of several."""
    keys = list(keys)
    count = defaultdict(int)
    for model, _ in keys:
        count[model] += 1
    return {
        (m, p): f"model-{slug(m)}.html" if count[m] == 1 else f"model-{slug(m)}-{slug(p)}.html"
        for m, p in keys
    }


def split_dense(rows: Iterable[Row]) -> tuple[Row | None, list[Row]]:
    """(the dense row or None, the pruned variants by method label then budget)."""
    rows = list(rows)
    dense = next((r for r in rows if r["method"] == "dense"), None)
    points = sorted(
        (r for r in rows if r["method"] != "dense"), key=lambda r: (r["method_label"], r["budget"])
    )
    return dense, points


def ppl_metric(rows: Iterable[Row]) -> str | None:
    """The first perplexity column (by name) that has a value: what "best" ranks by."""
    names = sorted({k for r in rows for k in r if k.startswith("ppl_") and r[k] is not None})
    names = [n for n in names if n != "ppl_ratio"]
    return names[0] if names else None


def judged_metric(rows: Iterable[Row]) -> str | None:
    """The perplexity column of the held-out corpus the gate judged the rows on (the first
    of `judged_on`'s corpora); rows judged on calibration text, or from before the
    judgement: the first perplexity column by name."""
    from pipeline.evaluation.corpora import metric_name  # imports torch: only here

    rows = list(rows)
    held = [str(r["judged_on"]) for r in rows if r.get("judged_on")]
    held = [j for j in held if not j.endswith("(calibration text)")]
    column = metric_name(held[0].split(",")[0]) if held else None
    if column and any(finite(r.get(column)) is not None for r in rows):
        return column
    return ppl_metric(rows)


def rank_metric(rows: Sequence[Row]) -> str | None:
    """The column "best" ranks by, as the registry's aliases do: the protocol's first
    perplexity (`pipeline.catalog.protocol.rank_column`); catalogs without an
    `evaluation` column: the first perplexity column by name."""
    column = rank_column(rows[0]) if rows else None
    if column and any(finite(r.get(column)) is not None for r in rows):
        return column
    return ppl_metric(rows)


def is_degraded(row: Row) -> bool:
    """The quality gate's verdict; a catalog without the column has no degraded rows."""
    return bool(row.get("degraded") or False)
