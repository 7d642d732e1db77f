"""Zero-shot accuracy with its uncertainty, as the model page's tables show it.

Each accuracy carries a 95% binomial interval, +-1.96 * sqrt(p (1 - p) / n) in percent,
from the `n_<task>` item count; fewer than 100 items is flagged as not comparable to the
paper, an unknown count (no `n_<task>` column in older catalogs) is flagged and gets no
interval.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from dashboards.shapes import Row, View
from pipeline.catalog.ranking import finite

Z95 = 1.96
MIN_COMPARABLE_ITEMS = 100
SMALL = "small"  # fewer than MIN_COMPARABLE_ITEMS items
UNKNOWN = "unknown"  # no item count in the catalog


def accuracy_tasks(rows: Iterable[Row]) -> list[str]:
    """Task names with an `acc_<task>` column (not the average)."""
    return sorted({k[4:] for r in rows for k in r if k.startswith("acc_") and k != "acc_avg"})


def _flag(counts: Sequence[float | None]) -> str | None:
    if any(n is None or n <= 0 for n in counts):
        return UNKNOWN
    return SMALL if any(n < MIN_COMPARABLE_ITEMS for n in counts) else None


def _interval(value: float | None, se: float | None, n: float | None, flag: str | None) -> View:
    half = None if value is None or se is None else Z95 * se
    return {
        "value": value,
        "half": half,
        "lo": None if half is None else max(0.0, value - half),
        "hi": None if half is None else min(100.0, value + half),
        "n": n,
        "flag": flag if value is not None else None,
    }


def standard_error(acc_percent: float, n: float) -> float:
    """Binomial SE of an accuracy in percent: 100 * sqrt(p (1 - p) / n)."""
    p = min(max(acc_percent / 100.0, 0.0), 1.0)
    return 100.0 * math.sqrt(p * (1.0 - p) / n)


def accuracy_interval(acc_percent: Any, n: Any) -> View:
    """{value, half, lo, hi, n, flag} for one accuracy; half = 1.96 SE, flag small/unknown."""
    value, count = finite(acc_percent), finite(n)
    flag = _flag([count])
    se = standard_error(value, count) if value is not None and flag != UNKNOWN else None
    return _interval(value, se, count, flag)


def average_interval(row: Row, tasks: Sequence[str]) -> View:
    """acc_avg with the tasks' SEs combined as independent: sqrt(sum SE_t^2) / T."""
    value = finite(row.get("acc_avg"))
    present = [t for t in tasks if finite(row.get(f"acc_{t}")) is not None]
    counts = [finite(row.get(f"n_{t}")) for t in present]
    flag = _flag(counts) if present else UNKNOWN
    se = None
    if value is not None and flag != UNKNOWN:
        ses = [standard_error(float(row[f"acc_{t}"]), float(row[f"n_{t}"])) for t in present]
        se = math.sqrt(sum(s * s for s in ses)) / len(ses)
    n = sum(counts) if flag != UNKNOWN else None  # type: ignore[arg-type]
    return _interval(value, se, n, flag)
