"""The job's progress lines: one per point, with what is left and an ETA at the grid's pace."""

from __future__ import annotations

from progress_lines import progress_lines

from pipeline.progress import Progress, duration


def test_eta_counts_from_the_grid_not_from_capture_and_selection() -> None:
    with progress_lines() as lines:
        progress = Progress(bar=False)
        progress.start -= 3600  # an hour of capture and loss-guided selection before the grid
        progress.grid(4, 1)
        progress.point("m lorp-b4", "ppl_ptb 12.5", 2.0)
        progress.point("m sleb-b4", "boom", 1.0, ok=False)
    assert lines[0] == "grid: 4 points to run, 1 already done"
    assert lines[1].startswith("[1/4] m lorp-b4: ppl_ptb 12.5 (2s); 3 left, ETA ")
    assert lines[1].endswith(" ETA 0s")  # not 3h: the hour before the grid is not its pace
    assert lines[2].startswith("[2/4] m sleb-b4: FAILED: boom (1s); 2 left, ETA ")
    assert (progress.done, progress.failed) == (1, 1)


def test_duration_reads_like_a_clock() -> None:
    assert [duration(s) for s in (0.4, 59, 61, 3599, 3600, 7322)] == [
        "0s", "59s", "1m01s", "59m59s", "1h00m", "2h02m",
    ]  # fmt: skip
