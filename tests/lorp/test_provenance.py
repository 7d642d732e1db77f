"""One provenance layout whoever writes the checkpoint, so readers never branch on the writer;
JSON-safe, its blocks checked."""

from __future__ import annotations

import json

import pytest

import lorp
from lorp import provenance


def test_provenance_has_one_layout() -> None:
    manual = provenance(
        source_model="m",
        source_fingerprint="f",
        method="manual",
        options={},
        budget=2,
        n_blocks=6,
        pruned=[4, 1],
    )
    grid = provenance(
        source_model="m",
        source_fingerprint="f",
        method="lorp",
        options={"variant": "paper", "thresholds": (1.0, 0.7)},
        budget=2,
        n_blocks=6,
        pruned=(1, 4),
        stats_hash="h",
        details={"rls": float("inf")},
        grid_key="g",
        job="demo",
        calibration={"dataset": "ptb"},
    )
    assert (
        manual.keys()
        == grid.keys()
        == {
            "lorp_version",
            "source_model",
            "source_fingerprint",
            "method",
            "options",
            "budget",
            "n_blocks",
            "pruned",
            "kept",
            "stats_hash",
            "details",
            "grid_key",
            "job",
            "calibration",
            "repair",
        }
    )
    assert manual["repair"] is None  # set only by a repaired grid point
    assert manual["pruned"] == grid["pruned"] == [1, 4] and manual["kept"] == [0, 2, 3, 5]
    assert manual["lorp_version"] == lorp.__version__ and manual["grid_key"] is None
    assert grid["options"]["thresholds"] == [1.0, 0.7] and grid["details"] == {"rls": None}
    assert json.loads(json.dumps(grid)) == grid
    with pytest.raises(ValueError, match=r"pruned blocks must be in \[0, 5\], got \[6\]"):
        provenance(
            source_model="m",
            source_fingerprint=None,
            method="manual",
            options={},
            budget=1,
            n_blocks=6,
            pruned=[6],
        )
