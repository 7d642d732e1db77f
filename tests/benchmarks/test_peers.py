"""benchmarks/peers.py: the page written from a finished run's catalogs (real Delta
tables of `CatalogRow`s, `--run`, nothing run), and the quick job it would run."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.helpers.paths import REPO
from tests.helpers.peer_rows import catalog, zero_shot

sys.path.insert(0, str(REPO))

from benchmarks.peers import BEGIN, END, QUICK_BEGIN, job_spec, main  # noqa: E402


def test_the_page_is_written_from_a_finished_run(tmp_path: Path) -> None:
    from pipeline.catalog.table import write_catalog

    run = tmp_path / "run"
    write_catalog(run / "catalog", catalog())
    zs = [zero_shot("window+linear", "1111111000"), zero_shot("replaceme+cosine-map", "0" * 10)]
    write_catalog(run / "zero-shot" / "catalog", zs)
    page = tmp_path / "peers.md"
    page.write_text(f"# Peers\n\nhand-written prose\n\n{BEGIN}\nnot run yet\n{END}\n\nmore\n")
    assert main(["--run", str(run), "--page", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("# Peers\n\nhand-written prose") and text.endswith(f"{END}\n\nmore\n")
    assert "not run yet" not in text and "### m (N = 12)" in text
    lines = text.splitlines()
    mine = next(line for line in lines if "**lorp: window+linear**" in line)
    assert mine.startswith("| 4 | **lorp: window+linear** | 4 5 6 7 | 24.0 (1.20x) | 36.0 (1.20x)")
    peer = next(line for line in lines if line.startswith("| 4 | replaceme+cosine-map"))
    assert "| prose 1.10x | 1.111 [" in peer  # exp(0.105): lorp's best 11% worse
    degraded = next(line for line in lines if line.startswith("| 4 | prune-comp"))
    assert "prose 2.00x (degraded)" in degraded
    cell = next(line for line in lines if line.startswith("| 4 | window+linear ("))
    assert "selection window, repair linear, 1 follower map(s), distilled 0 epochs" in cell
    assert "| 7 / 0 of 10 (arc_easy 10) | 7 / 0 | 0.0156 | 70.0 points | tie |" in cell
    assert cell.endswith("| peer: replaceme+cosine-map |")
    assert main(["--quick", "--run", str(run), "--page", str(page)]) == 0
    again = page.read_text()  # the smoke run in a section of its own, the full run's kept
    assert again.startswith(text) and f"## The smoke run\n\n{QUICK_BEGIN}\n" in again
    assert "`python benchmarks/peers.py --quick`" in again.split(QUICK_BEGIN)[1]


def test_quick_runs_one_model_at_one_budget_with_every_peer(tmp_path: Path) -> None:
    spec = job_spec(True, tmp_path / "quick")
    assert [m.label for m in spec.models] == ["smollm2-135m"] and spec.budgets == (4,)
    assert [m.key for m in spec.methods if m.peer] == [
        "replaceme",
        "linear-patch",
        "prune-comp",
        "streamline-layer",
    ]
    assert [m.key for m in spec.methods if not m.peer] == ["lorp", "shortgpt", "streamline"]
    assert (spec.evaluation.max_windows, spec.evaluation.seq_len) == (8, 256)
    assert spec.name == "peers" and spec.output_dir == str(tmp_path / "quick")
    full = job_spec(False, tmp_path / "full")
    assert len(full.methods) == 18 and full.budgets == (4, 8) and len(full.models) == 3
