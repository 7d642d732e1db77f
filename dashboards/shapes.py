"""The two shapes the dashboard passes around."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Row = Mapping[str, Any]  # one catalog row, as `pipeline.catalog.table.read_catalog` returns it
View = dict[str, Any]  # what the `*_view` modules hand to the pages: plain values, lists and dicts
