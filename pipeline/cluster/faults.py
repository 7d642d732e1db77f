"""Test-only fault injection. Production code consults it through one call per site,
`maybe_fail(site, name)`, which does nothing unless a test set the site's variable.

A test names the unit of work to kill (`LORP_FAULT_CAPTURE_SHARD=shard-0001.parquet`,
`LORP_FAULT_POINT_SUFFIX=lorp-b2`) and a marker path (`LORP_FAULT_MARKER`). The first
worker that reaches that unit writes `<marker>.<site>` and exits hard, as a lost node would
look; the retry finds the marker and goes on, so each site's fault happens exactly once
(one run can lose a capture worker and a grid worker).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

Site = Literal["capture", "repair", "point"]
SITE_ENV: dict[str, str] = {
    "capture": "LORP_FAULT_CAPTURE_SHARD",
    "repair": "LORP_FAULT_REPAIR_SHARD",
    "point": "LORP_FAULT_POINT_SUFFIX",
}
MARKER_ENV = "LORP_FAULT_MARKER"
FAULT_SHARD_ENV = SITE_ENV["capture"]
FAULT_POINT_ENV = SITE_ENV["point"]
FAULT_MARKER_ENV = MARKER_ENV


def maybe_fail(site: Site, name: str) -> None:
    """Exit this process hard when `name` ends with the target a test set for `site`."""
    target = os.environ.get(SITE_ENV[site])
    marker = os.environ.get(MARKER_ENV)
    if not (target and marker) or not Path(name).name.endswith(target):
        return
    written = Path(f"{marker}.{site}")
    if written.exists():
        return
    written.write_text(str(os.getpid()))
    os._exit(1)
