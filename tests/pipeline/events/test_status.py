"""`lorp status` (`pipeline.events.status`) from a hand-written catalog and event log: which
rows await the speed pass, and how many speed and serving figures resolved."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.catalog.delta_table import DeltaTable
from pipeline.catalog.table import NAME, to_table
from pipeline.events.status import format_status, run_status

SPEED = json.dumps({"enabled": True, "speed": True}, sort_keys=True)

NO_SPEED = json.dumps({"enabled": True, "speed": False}, sort_keys=True)


def _row(key: str, evaluation: str = SPEED, **metrics: float) -> dict:
    return {
        "grid_key": key,
        "job": "j",
        "model": "m",
        "method": key,
        "budget": 1,
        "evaluation": evaluation,
        **metrics,
    }


def _run_dir(tmp_path: Path, rows: list[dict]) -> Path:
    DeltaTable(str(tmp_path / NAME)).create(to_table(rows), None)  # a job's catalog table
    events = [{"time": "t0", "event": "start", "job": "j"}, {"time": "t1", "event": "end"}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return tmp_path


def test_timed_rows_do_not_await_the_speed_pass_and_unresolved_ones_are_counted(
    tmp_path: Path,
) -> None:
    nan = float("nan")
    rows = [
        _row("dense", speedup=1.0, latency_ms=10.0, speed_resolved=1.0),
        _row("untimed", ppl_ptb=12.0),  # awaits the pass
        _row("unresolved", latency_ms=7.0, speedup=nan, speedup_measured=1.9, speed_resolved=0.0),
        _row("older", speedup=1.2),  # a catalog from before latency and speed_resolved
        _row("no-speed", NO_SPEED, ppl_ptb=13.0),  # the job asked for no timing
    ]
    st = run_status(_run_dir(tmp_path, rows))
    assert (st.state, st.speed_pending, st.speed_unresolved) == ("finished", 1, 1)
    lines = format_status(st)
    # the one timed pruned row with a measured ratio did not resolve: no range to show
    assert "measured     prefill none resolved over dense; 0 of 1 resolved (timed)" in lines
    assert "speed        1 rows await the speed pass" in lines
    assert "speed        1 figure(s) not resolved" in lines

    timed = [*rows, _row("fast", speedup=1.31, speedup_measured=1.31, speed_resolved=1.0)]
    timed.append(_row("slow", speedup=1.12, speedup_measured=1.12, speed_resolved=1.0))
    lines = format_status(run_status(_run_dir(tmp_path / "timed", timed)))
    assert "measured     prefill 1.12-1.31x over dense; 2 of 3 resolved (timed)" in lines
    resolved = [r for r in rows if r["grid_key"] not in ("untimed", "unresolved")]
    lines = format_status(run_status(_run_dir(tmp_path / "all-timed", resolved)))
    assert not [line for line in lines if line.startswith("speed")]


def test_serving_speedups_are_summarised_with_how_many_resolved(tmp_path: Path) -> None:
    nan = float("nan")
    rows = [
        _row("dense", serve_speedup=1.0, serve_speedup_measured=1.0),
        _row("a", serve_speedup=1.21, serve_speedup_measured=1.21),
        _row("b", serve_speedup=1.08, serve_speedup_measured=1.08),
        _row("c", serve_speedup=nan, serve_speedup_measured=1.4),
        _row("d", ppl_ptb=3.0),  # not served (transformers)
    ]
    rows[0]["method"] = "dense"
    lines = format_status(run_status(_run_dir(tmp_path, rows)))
    assert "serving      output tokens/s 1.08-1.21x over dense; 2 of 3 resolved (vLLM)" in lines
    unresolved = format_status(run_status(_run_dir(tmp_path / "c", rows[3:])))
    assert "serving      output tokens/s none resolved over dense; 0 of 1 resolved (vLLM)" in (
        unresolved
    )
    unserved = format_status(run_status(_run_dir(tmp_path / "d", [rows[0], rows[4]])))
    assert not [ln for ln in unserved if ln.startswith("serving")]
