"""A variant's speed-up as the dashboard may show it: beside its spread and its bound.

A speed-up is shown with its spread and the physical bound N / (N - k) (k of N equal
blocks removed), and one above the bound by more than 5% is flagged, not hidden. A timing
that was not resolved (`speed_resolved` 0, or a `speedup_measured` with no `speedup`)
shows as "not resolved" with the measured ratio beside it, and is never ranked, sorted by
or plotted as a speed. Older catalogs: no `speedup_std` = no spread, no `speed_resolved`
= resolved.
"""

from __future__ import annotations

from typing import Any

from dashboards.shapes import Row, View
from pipeline.catalog.ranking import finite

BOUND_TOLERANCE = 0.05


def speed_bound(n_blocks: Any, budget: Any) -> float | None:
    """N / (N - k): the most that removing k of N equal blocks can speed a forward up."""
    n, k = finite(n_blocks), finite(budget) or 0.0
    if n is None or n - k <= 0:
        return None
    return n / (n - k)


def speed_resolved(row: Row) -> bool:
    """Whether the row's timing was resolved: false when `speed_resolved` is 0, or when
    there is a measured ratio (`speedup_measured`) but no published speed-up. Catalogs
    older than those columns have only resolved rows."""
    flag = finite(row.get("speed_resolved"))
    if flag is not None:
        return flag != 0.0
    return finite(row.get("speedup")) is not None or finite(row.get("speedup_measured")) is None


def speed_view(row: Row) -> View:
    """{speedup, std, bound, exceeds, resolved, measured, measured_exceeds}: exceeds =
    speed-up above the bound by more than 5%. An unresolved timing has no speed-up (None:
    never ranked or plotted), only the measured ratio, to be shown as such;
    measured_exceeds says whether that ratio is above the bound by more than 5%."""
    resolved = speed_resolved(row)
    speedup = finite(row.get("speedup")) if resolved else None
    measured = finite(row.get("speedup_measured"))
    bound = speed_bound(row.get("n_blocks"), row["budget"])
    return {
        "speedup": speedup,
        "std": finite(row.get("speedup_std")) if resolved else None,
        "bound": bound,
        "exceeds": _above(speedup, bound),
        "resolved": resolved,
        "measured": measured,
        "measured_exceeds": _above(measured, bound),
    }


def _above(speedup: float | None, bound: float | None) -> bool:
    return speedup is not None and bound is not None and speedup > bound * (1 + BOUND_TOLERANCE)
