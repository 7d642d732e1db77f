"""benchmarks/heldout.py at its smallest, on a tiny random model over the PTB vocabulary:
the `window` method ranked by held-out loss and a cut given as blocks, each pruned and
repaired with a follower map and one epoch of distillation, judged on PTB and Lee."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lorp.repair.followers import follower_blocks
from lorp.repair.stats import contiguous_runs
from tests.helpers.benchmark_scripts import torch_threads
from tests.helpers.paths import REPO
from tests.helpers.tiny_models import save_tiny_ptb

sys.path.insert(0, str(REPO))

from benchmarks.heldout import main, parse_cuts  # noqa: E402


@pytest.fixture
def one_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


def check_fit(fit: dict) -> None:
    """What `fit_runs` and `distill_fits` promise of each map they hand back."""
    assert fit["kept"] in ("fit", "unrepaired", "distilled")
    if fit["kept"] == "fit":  # least squares kept only where it beats no map, held out
        assert fit["held_residual"] < fit["held_unrepaired_residual"]
    if fit["kept"] == "unrepaired":
        assert fit["held_residual"] == fit["held_unrepaired_residual"]
    kl, best = fit["distilled"]["held_kl"], fit["distilled"]["best_epoch"]
    assert len(kl) == 2 and best in (0, 1)  # before, and after the one epoch
    assert (fit["kept"] == "distilled") == (best == 1)
    if best:
        assert kl[1] <= kl[0]  # strictly before rounding to 6 digits


def test_smallest_run_writes_every_variant(tmp_path: Path, one_thread: None) -> None:
    model = save_tiny_ptb("llama", tmp_path / "tiny")
    out = tmp_path / "heldout.json"
    args = [
        "--models",
        str(model),
        "--tokens",
        "1024",
        "--eval-windows",
        "2",
        "--methods",
        "window",
        "--window-score",
        "loss",
        "--budgets",
        "2",
        "--cuts",
        "1-2+4",
        "--ridge",
        "auto",
        "--followers",
        "1",
        "--distill",
        "1",
        "--json",
        str(out),
    ]
    assert main(args) == 0
    rows = json.loads(out.read_text())
    assert [(r["method"], r["budget"], r["repair"]) for r in rows] == [
        ("window", 2, "none"),
        ("window", 2, "linear@auto+1f+kd1"),
        ("cuts", 3, "none"),
        ("cuts", 3, "linear@auto+1f+kd1"),
    ]
    assert {(r["model"], r["calib"], r["tokens"]) for r in rows} == {(str(model), "ptb", 1024)}
    start = rows[0]["layers"][0]  # one window of 2 blocks, the boundary blocks kept
    assert rows[0]["layers"] == [start, start + 1] and 1 <= start <= 3
    assert rows[2]["layers"] == parse_cuts("1-2+4") == [1, 2, 4]
    for corpus in ("ptb", "lee"):  # every variant is judged against the same dense model
        dense = {round(r[f"ppl_{corpus}"] / r[f"ratio_{corpus}"], 6) for r in rows}
        assert len(dense) == 1 and 1 < dense.pop() < 1e6
    for pruned, repaired in (rows[0:2], rows[2:4]):
        assert repaired["layers"] == pruned["layers"] and "fits" not in pruned
        layers = pruned["layers"]
        runs = [tuple(f["run"]) for f in repaired["fits"] if "follower" not in f]
        followers = [f["follower"] for f in repaired["fits"] if "follower" in f]
        assert runs == contiguous_runs(layers, 6)
        assert followers == follower_blocks(6, layers, 1) and followers
        for fit in repaired["fits"]:
            check_fit(fit)
