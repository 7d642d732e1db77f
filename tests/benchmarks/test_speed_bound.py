"""benchmarks/speed_bound.py at its smallest, on a tiny random model: every timing
condition runs and reports its figures beside N/(N-k), and the speed pass's timer it
wraps for the group rounds is its own again afterwards. The figures themselves are timings
of a 2 ms forward beside another test process: what they are is the benchmark's business
(it runs on idle cores), so this checks what they are made of, never how large they are."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pipeline.evaluation import speed
from tests.helpers.paths import REPO
from tests.helpers.tiny_models import save_tiny

sys.path.insert(0, str(REPO))

from benchmarks.speed_bound import main  # noqa: E402

N = 6  # the tiny model's blocks


@pytest.fixture
def threads_back() -> Iterator[None]:
    """The script sets torch's thread count (`--threads 1` here): the process's own back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_every_condition_is_timed_beside_its_bound(tmp_path: Path, threads_back: None) -> None:
    model = save_tiny("llama", tmp_path / "tiny")
    out = tmp_path / "speed.json"
    timer = speed._time_ms
    args = [
        "--model",
        str(model),
        "--removed",
        "1",
        "2",
        "--rounds",
        "10",
        "--seq-len",
        "16",
        "--threads",
        "1",
        "--load-reps",
        "2",
        "--json",
        str(out),
    ]
    assert main(args) == 0
    assert speed._time_ms is timer
    rows = json.loads(out.read_text())
    per_k = ["copies", "file vs copy", "under load", "under load", "per block"]
    assert [(r["condition"], r["removed"]) for r in rows] == [
        ("A/A copies", 0),
        ("A/A file vs copy", 0),
        *[(c, 1) for c in per_k],
        *[(c, 2) for c in per_k],
        ("group rounds (medians)", 1),
        ("group rounds (medians)", 2),
        ("group rounds (medians)", 0),
    ]
    for r in rows:
        k = r["removed"]
        if r["condition"] == "per block":  # the same block on the same states
            assert r["block_ratio_median"] > 0
            assert r["blocks_dense_ms"] > 0 and r["blocks_pruned_ms"] > 0
            continue
        assert r["bound"] == pytest.approx(N / (N - k))
        assert r["min_a_ms"] > 0 and r["min_b_ms"] > 0
        assert r["ratio_of_minima"] == pytest.approx(r["min_a_ms"] / r["min_b_ms"])
        assert r["median_paired"] > 0  # a median of paired ratios: noisy under load
        if r["condition"].startswith("group"):
            low, high = r["interval"]
            assert low <= r["median_paired"] <= high
