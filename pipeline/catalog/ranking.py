"""The one rule that says which variant is "best": `lorp catalog best`, the registry's
aliases and the dashboard all rank with it.

- Rows are compared only within one protocol (`pipeline.catalog.protocol`) and one
  model (its catalog label, the registered model `lorp-<label>`), granularity and
  budget: 8 attention sub-layers are not 8 blocks (`best-<b>` ranks whole blocks,
  `best-attention-<b>` attention sub-layers; a row without a granularity is a block's).
  An expert cut alone ranks by its experts removed per layer (`best-experts-<e>`), and a
  row that removed both blocks and experts among those that removed as many experts
  (`best-block-e<e>-<b>`).
- A degraded row (over the quality gate) is never best; among the rest the lowest value
  of the protocol's first perplexity wins (no perplexity in the protocol: the highest
  `acc_avg`), ties broken by method label, job and grid key, so every reader picks the
  same row whatever order the rows came in.
- A model's *reference protocol* (the one its plain `best-<budget>` aliases rank in) is
  the protocol of its oldest row: the first job that recorded it. A job with
  `tracking.reference: true` takes it over (`reference_claim` on its rows); among
  several claims the latest job to start claiming wins.

Pure functions over plain dicts, which may be catalog rows or a registry version's tags
(they carry the same names).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pipeline.catalog.protocol import NO_EVALUATION, rank_column, row_protocol

Row = Mapping[str, Any]


def finite(value: Any) -> float | None:
    """`value` as a float, or None when it is missing, not a number or not finite."""
    if value is None or isinstance(value, bool):
        return None
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _true(value: Any) -> bool:
    return value is True or str(value).lower() == "true"


def rank(row: Row, ppl_column: str | None = None) -> tuple[int, float] | None:
    """Lower is better: `(0, perplexity)`, else `(1, -acc_avg)`; None for a degraded row
    or one without a figure. `ppl_column` defaults to the row's protocol's first corpus
    (`rank_by` in a version's tags)."""
    if _true(row.get("degraded")):
        return None
    column = ppl_column or row.get("rank_by") or rank_column(row)
    ppl = finite(row.get(column)) if column else None
    if ppl is not None:
        return (0, ppl)
    acc = finite(row.get("acc_avg"))
    return (1, -acc) if acc is not None else None


def order_key(row: Row, ppl_column: str | None = None) -> tuple[Any, ...]:
    """The total order of rows (see the module docstring); rows without a figure last."""
    r = rank(row, ppl_column) or (2, 0.0)
    return (r, str(row.get("method_label")), str(row.get("job")), str(row.get("grid_key")))


def is_variant(row: Row) -> bool:
    return row.get("method") != "dense" and int(row.get("budget") or 0) > 0


def granularity(row: Row) -> str:
    """What a row's budget counts: `block` (also a row from before sub-layers), a
    sub-layer granularity or `experts`; `<granularity>-e<e>` where the row removed `e`
    routed experts per layer besides its budget."""
    g = str(row.get("granularity") or "block")
    cut = row.get("expert_budget")
    e = int(cut) if cut not in (None, "") and not _nan(cut) else 0
    return f"{g}-e{e}" if e and g != "experts" else g


def _nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def best(
    rows: Iterable[Row], budget: int, protocol: str, granularity_: str = "block"
) -> Row | None:
    """The best non-degraded variant of `budget` units of `granularity_` under `protocol`
    among `rows` (one model's), or None."""
    ranked = [
        r
        for r in rows
        if is_variant(r)
        and int(r["budget"]) == budget
        and granularity(r) == granularity_
        and row_protocol(r) == protocol
        and rank(r) is not None
    ]
    return min(ranked, key=order_key) if ranked else None


def reference_protocol(rows: Sequence[Row]) -> str | None:
    """The reference protocol of one model's rows (see the module docstring); None
    when no row was evaluated."""
    rows = [r for r in rows if row_protocol(r) != NO_EVALUATION]
    if not rows:
        return None
    claims: dict[str, str] = {}  # job -> its earliest claiming row's created_at
    for r in rows:
        if _true(r.get("reference_claim")):
            job, at = str(r.get("job")), str(r.get("created_at") or "")
            claims[job] = min(claims.get(job, at), at)
    if claims:
        job = max(claims, key=lambda j: (claims[j], j))
        pool = [r for r in rows if str(r.get("job")) == job]
        return row_protocol(min(pool, key=lambda r: str(r.get("created_at") or "")))
    first = min(rows, key=lambda r: (str(r.get("created_at") or ""), str(r.get("grid_key"))))
    return row_protocol(first)


def protocols(rows: Iterable[Row]) -> list[str]:
    """The evaluated protocols among `rows`, sorted."""
    return sorted({row_protocol(r) for r in rows} - {NO_EVALUATION})


def budgets(rows: Iterable[Row], granularity_: str = "block") -> list[int]:
    return sorted(
        {int(r["budget"]) for r in rows if is_variant(r) and granularity(r) == granularity_}
    )


def granularities(rows: Iterable[Row]) -> list[str]:
    """The granularities of `rows`' variants, `block` first."""
    return sorted({granularity(r) for r in rows if is_variant(r)}, key=lambda g: (g != "block", g))


def alias_stem(budget: int, granularity_: str = "block") -> str:
    """`best-<b>` for blocks, `best-<granularity>-<b>` for sub-layers."""
    return f"best-{budget}" if granularity_ == "block" else f"best-{granularity_}-{budget}"


def best_rows(rows: Sequence[Row]) -> dict[str, Row]:
    """alias -> the row it should point at, for one model's rows: `best-<b>-<protocol>`
    for every budget and protocol with a qualifying variant, `best-<b>` for the
    reference protocol's (`best-<granularity>-<b>...` for sub-layer budgets). (`dense`
    is the registry's: `pipeline.tracking.aliases`.)"""
    out: dict[str, Row] = {}
    reference = reference_protocol(rows)
    by_protocol: dict[str, list[Row]] = {}
    for r in rows:  # each row's protocol once, not once per budget and protocol
        by_protocol.setdefault(row_protocol(r), []).append(r)
    for protocol in protocols(rows):
        for g in granularities(rows):
            for b in budgets(rows, g):
                row = best(by_protocol[protocol], b, protocol, g)
                if row is None:
                    continue
                out[f"{alias_stem(b, g)}-{protocol}"] = row
                if protocol == reference:
                    out[alias_stem(b, g)] = row
    return out
