"""The job's progress lines (`pipeline.events.progress`): one per point, with what is left
and an ETA at the grid's pace."""

from __future__ import annotations

from pipeline.events.progress import Progress, duration
from tests.helpers.progress_lines import progress_lines


def test_eta_counts_from_the_grid_not_from_capture_and_selection() -> None:
    """The clock is the test's: an hour of capture and loss-guided selection before the
    grid, then points at known times, so every ETA is exact."""
    now = iter([0.0, 3600.0, 3610.0, 3640.0, 3641.0, 3700.0])
    with progress_lines() as lines:
        progress = Progress(bar=False, clock=lambda: next(now))  # 0: created
        progress.fleet(2, 2, 2)
        progress.grow(4)  # 3600: the first points are ready, the grid's clock starts
        progress.add_points("m", 4, 1, 0)  # the model's preparation ended
        progress.point("m lorp-b4", "ppl_ptb 12.5", 2.0)  # 3610: 10 s for 1 point, 3 left
        progress.point("m sleb-b4", "boom", 1.0, ok=False)  # 3640: 40 s for 2, 2 left
        progress.point("m lorp-b8", "ppl_ptb 30.1", 1.0)  # 3641
        progress.point("m sleb-b8", "ppl_ptb 31.0", 59.4)  # 3700: the last point
    assert lines == [
        "fleet: 2 model(s), all in flight, 2 point(s) at once",
        "m ready: 4 points to run, 1 already done; 0 model(s) still preparing",
        "[1/4] m lorp-b4: ppl_ptb 12.5 (2s); 3 left, ETA 30s",  # not 3h: capture's hour
        "[2/4] m sleb-b4: FAILED: boom (1s); 2 left, ETA 40s",
        "[3/4] m lorp-b8: ppl_ptb 30.1 (1s); 1 left, ETA 14s",  # 41 s / 3 points
        "[4/4] m sleb-b8: ppl_ptb 31.0 (59s); 0 left, ETA -",
    ]
    assert (progress.done, progress.failed) == (3, 1)


def test_duration_reads_like_a_clock() -> None:
    assert [duration(s) for s in (0.4, 59, 61, 3599, 3600, 7322)] == [
        "0s",
        "59s",
        "1m01s",
        "59m59s",
        "1h00m",
        "2h02m",
    ]
