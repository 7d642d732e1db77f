"""What every section of a job spec checks with: `SpecError`, whose message always names the
field, and the shared checks of integers, numbers, storage locations and BOS policies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lorp.data.windows import BOS_POLICIES


class SpecError(ValueError):
    """A job spec problem, always naming the field."""


def positive(name: str, value: int, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(f"{name}: must be an integer >= {minimum}, got {value!r}")


def check_storage(location: str, field: str = "storage") -> None:
    """Opens the filesystem (pyarrow resolves the scheme and its options) before any work."""
    from pipeline.storage.store import Storage

    try:
        Storage(location)
    except ValueError as exc:
        raise SpecError(f"{field}: {exc}") from None


def check_budgets(name: str, budgets: Sequence[object], unit: str, whole: str = "") -> None:
    """Each budget a count of `unit` ("a block", "an expert": an int >= 1) or a fraction
    (of `whole`) in (0, 1); one line naming `name[i]` otherwise."""
    of = f" of {whole}" if whole else ""
    for i, b in enumerate(budgets):
        if isinstance(b, bool) or not isinstance(b, int | float):
            raise SpecError(f"{name}[{i}]: {unit} count or a fraction{of}, got {b!r}")
        if isinstance(b, int) and b < 1:
            raise SpecError(f"{name}[{i}]: {unit} count must be >= 1, got {b}")
        if isinstance(b, float) and not 0.0 < b < 1.0:
            raise SpecError(f"{name}[{i}]: a fraction must be in (0, 1), got {b}")


def check_bos(value: str) -> None:
    if value not in BOS_POLICIES:
        raise SpecError(f"bos: must be one of {', '.join(BOS_POLICIES)}, got {value!r}")


def unique(name: str, values: list[Any], hint: str = "") -> None:
    seen = set()
    for v in values:
        if v in seen:
            raise SpecError(f"{name}: {v!r} appears twice" + (f" ({hint})" if hint else ""))
        seen.add(v)


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
