"""benchmarks/repair_check.py at its smallest, on two tiny random models over the PTB
vocabulary: a Llama (the full map, folded; two runs, so the sequential fit too) and a
Gemma 3 (post-MLP norms: the foldable normed map beside the full map applied by hooks)."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lorp.repair.stats import contiguous_runs
from tests.helpers.benchmark_scripts import torch_threads
from tests.helpers.paths import REPO
from tests.helpers.tiny_models import save_tiny_ptb

sys.path.insert(0, str(REPO))

from benchmarks.repair_check import main  # noqa: E402


@pytest.fixture
def one_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


def test_smallest_run_reports_every_variant(tmp_path: Path, one_thread: None) -> None:
    llama = save_tiny_ptb("llama", tmp_path / "llama", n_blocks=10)
    gemma = save_tiny_ptb("gemma3_text", tmp_path / "gemma")  # 6 blocks, tied embeddings
    out = tmp_path / "repair.json"
    args = [
        "--models",
        str(llama),
        str(gemma),
        "--methods",
        "random",
        "shortgpt",
        "--budgets",
        "2",
        "--calib",
        "8x64",
        "--test",
        "2x128",
        "--json",
        str(out),
    ]
    assert main(args) == 0
    rows = json.loads(out.read_text())
    assert [(r["model"], r["method"], r["blocks"]) for r in rows] == [
        (str(llama), "random", 2),
        (str(llama), "shortgpt", 2),
        (str(gemma), "random", 2),
        (str(gemma), "shortgpt", 2),
    ]
    blocks, form = {str(llama): 10, str(gemma): 6}, {str(llama): "full", str(gemma): "normed"}
    for model in blocks:
        assert len({r["dense"] for r in rows if r["model"] == model}) == 1
    for r in rows:
        n = blocks[r["model"]]
        assert "refused" not in r, r["refused"]  # neither method takes block 0
        assert len(r["layers"]) == 2 and all(1 <= i <= n - 2 for i in r["layers"])
        for key in ("dense", "pruned", "repaired"):
            assert math.isfinite(r[key]) and r[key] > 1
        runs = contiguous_runs(r["layers"], n)
        assert [tuple(f["run"]) for f in r["fits"]] == runs
        for fit in r["fits"]:
            assert fit["form"] == form[r["model"]]
            assert fit["residual"] < fit["unrepaired_residual"]  # on the calibration sums
        assert ("full_hook" in r) == (r["model"] == str(gemma))  # normed: the hook bound too
        assert ("sequential" in r) == (len(runs) > 1)
    # random's seeded draw from blocks 1..8 of the Llama is two runs: the sequential fit ran
    assert rows[0]["layers"] == [6, 8] and math.isfinite(rows[0]["sequential"])
