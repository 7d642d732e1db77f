"""A job's cached S (`pipeline.stages.statistics`) is a plain `SimilarityStats` file that
`lorp select` reads."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lorp import SimilarityStats

pytestmark = [pytest.mark.integration]

LORP = shutil.which("lorp") or str(Path(sys.executable).parent / "lorp")


def test_stats_file_of_a_job_is_a_normal_stats_file(tmp_path: Path) -> None:
    # Cached S files are plain SimilarityStats: `lorp select` reads them.
    s = SimilarityStats(4)
    s.update(np.random.default_rng(0).normal(size=(5, 10, 8)) + 1)
    s.to_file(tmp_path / "x.npz")
    out = subprocess.run(
        [LORP, "select", str(tmp_path / "x.npz"), "--budget", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and len(json.loads(out.stdout)["pruned"]) == 1
