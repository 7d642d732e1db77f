"""A cell of the peers report (`benchmarks/peers.py`): one model at one budget, lorp's own
best variant, each peer recipe's, the best peer and `best-<b>`, read from the catalog
rows, and the paired tests between lorp's best and the peers (`benchmarks.paired`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from benchmarks import paired
from benchmarks.quality import latest
from pipeline.catalog.protocol import row_protocol
from pipeline.catalog.ranking import best, budgets, finite, is_variant, reference_protocol

Row = dict[str, Any]


@dataclass
class Cell:
    """One model at one budget: what the page sets side by side."""

    model: str
    budget: int
    dense: Row | None
    mine: Row | None
    """lorp's own best (over the grid without the peer entries)."""
    peers: list[Row]
    """Each peer recipe's variant at this budget, in label order."""
    best_peer: Row | None
    alias: Row | None
    """The row `best-<b>` names, over every entry."""
    zero_shot: dict[str, Row] = field(default_factory=dict)
    """`mine` and `peer`: the zero-shot job's rows of the two."""


def is_peer(row: Row) -> bool:
    """A variant of a peer recipe's entry (`lorp.peers`: its method carries `peer`)."""
    from lorp.methods import get_method

    return is_variant(row) and get_method(str(row["method"])).peer is not None


def pick(rows: list[Row], budget: int, protocol: str) -> Row | None:
    """`best-<b>`'s row among `rows`; where the gate passed none, the least bad by the
    same figure (the page marks it degraded)."""
    chosen = best(rows, budget, protocol)
    if chosen is not None:
        return chosen
    at = [
        r
        for r in rows
        if is_variant(r)
        and int(r["budget"]) == budget
        and row_protocol(r) == protocol
        and finite(r.get("ppl_ratio")) is not None
    ]
    return min(at, key=lambda r: finite(r["ppl_ratio"]) or 0.0, default=None)


def cells(rows: list[Row]) -> list[Cell]:
    """One model's cells, from its catalog rows (the newest of each variant, in the
    model's reference protocol)."""
    rows = latest(rows)
    protocol = reference_protocol(rows)
    if protocol is None:
        return []
    rows = [r for r in rows if row_protocol(r) == protocol]
    dense = next((r for r in rows if r.get("method") == "dense"), None)
    theirs = [r for r in rows if is_peer(r)]
    mine = [r for r in rows if is_variant(r) and not is_peer(r)]
    out = []
    for b in budgets(rows):
        at = sorted((r for r in theirs if int(r["budget"]) == b), key=lambda r: r["method_label"])
        out.append(
            Cell(
                str(rows[0]["model"]),
                b,
                dense,
                pick(mine, b, protocol),
                at,
                pick(theirs, b, protocol),
                best(rows, b, protocol),
            )
        )
    return out


def attach_zero_shot(grid: list[Cell], rows: list[Row]) -> None:
    """Each cell's zero-shot rows of its two picks (the newest of each)."""
    found = {(r["model"], r["method_label"], r["budget"]): r for r in latest(rows)}
    for c in grid:
        for side, row in (("mine", c.mine), ("peer", c.best_peer)):
            got = found.get((c.model, row["method_label"], c.budget)) if row else None
            if got is not None:
                c.zero_shot[side] = got


def items(row: Row) -> dict[str, str]:
    """A zero-shot row's items right (1) or wrong (0) per task (its `zero_shot`)."""
    scored = json.loads(row.get("zero_shot") or "{}")
    return {t: v["correct"] for t, v in scored.items() if "correct" in v}


def zero_shot_test(cell: Cell) -> dict[str, Any] | None:
    """McNemar's exact test of lorp's best against the best peer over the items of every
    task both were scored on, pooled; None where either has no items recorded."""
    if len(cell.zero_shot) < 2:
        return None
    a, b = items(cell.zero_shot["mine"]), items(cell.zero_shot["peer"])
    tasks = [t for t in sorted(a) if t in b and len(a[t]) == len(b[t])]
    if not tasks:
        return None
    x, y = "".join(a[t] for t in tasks), "".join(b[t] for t in tasks)
    only_mine, only_peer = paired.discordant(x, y)
    return {
        "tasks": {t: len(a[t]) for t in tasks},
        "n": len(x),
        "right": (x.count("1"), y.count("1")),
        "discordant": (only_mine, only_peer),
        "p": paired.mcnemar_exact(only_mine, only_peer),
        "detectable": paired.detectable(len(x), only_mine + only_peer),
        "side": paired.mcnemar_side(only_mine, only_peer),
    }


def window_losses(row: Row | None) -> dict[str, list[float]]:
    return json.loads((row or {}).get("window_nll") or "{}")


def ppl_tests(mine: Row | None, peer: Row) -> dict[str, tuple[float, float, float]]:
    """Per corpus both recorded on the same number of windows: lorp's best over `peer`,
    the ratio of perplexities and its paired bootstrap interval."""
    a, b = window_losses(mine), window_losses(peer)
    return {
        c: paired.paired_bootstrap(a[c], b[c])
        for c in sorted(a)
        if c in b and len(a[c]) == len(b[c]) and a[c]
    }


def verdict(cell: Cell) -> str:
    """`lorp`, `peer` (the best peer) or `tie`: the side every deciding test names, the
    bootstrap on each corpus and McNemar's test."""
    if cell.mine is None or cell.best_peer is None:
        return paired.TIE
    tests = ppl_tests(cell.mine, cell.best_peer).values()
    sides = [paired.interval_side(low, high) for _, low, high in tests]
    zero = zero_shot_test(cell)
    sides += [zero["side"]] if zero else []
    return {paired.FIRST: "lorp", paired.SECOND: "peer"}.get(paired.combined(sides), "tie")
