"""Static fleet dashboards: the catalog and the cached statistics as browsable pages.

`build_site` is imported on first use: every `lorp` command loads `dashboards.cli` (an
entry point of the console script), and the site's modules import Ray (the timeline's),
about half a second that `lorp plan` and the others need not spend."""

from __future__ import annotations

from typing import Any

__all__ = ["build_site"]


def __getattr__(name: str) -> Any:
    if name == "build_site":
        from dashboards.site import build_site

        return build_site
    raise AttributeError(f"module 'dashboards' has no attribute {name!r}")
