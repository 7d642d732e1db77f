"""benchmarks/demo.py's page, from catalog rows built in the test: figures against dense,
the speed cell's three forms, the gate's count per model and budget."""

from __future__ import annotations

import math
import sys

from tests.helpers.paths import REPO

sys.path.insert(0, str(REPO))

from benchmarks.demo import blocks, render, speed_cell, summary  # noqa: E402

NAN = math.nan


def row(method: str, budget: int, repair: str, lee: float, ptb: float, **kw):  # type: ignore[no-untyped-def]
    label = method if repair == "none" else f"{method}+linear"
    base = {
        "model": "m",
        "n_blocks": 10,
        "dtype": "bfloat16",
        "method": method,
        "method_label": label,
        "budget": budget,
        "repair": repair,
        "ppl_lee": lee,
        "ppl_ptb": ptb,
        "pruned_layers": list(range(2, 2 + budget)),
        "degraded": lee > 60.0,
        "speedup": NAN,
        "speedup_low": NAN,
        "speedup_high": NAN,
        "speedup_measured": NAN,
        "speed_resolved": 0.0,
        "peak_mem_gib": 1.0,
        "checkpoint": None,
    }
    return base | kw


ROWS = [
    row("dense", 0, "none", 20.0, 10.0),
    row("lorp", 2, "none", 100.0, 30.0, speedup_measured=1.2, speedup_low=1.1, speedup_high=1.3),
    row("lorp", 2, "linear", 50.0, 15.0, speedup_measured=1.2, speedup_low=1.1, speedup_high=1.3),
    row(
        "shortgpt",
        2,
        "none",
        80.0,
        20.0,
        speedup=1.3,
        speedup_low=1.29,
        speedup_high=1.31,
        speedup_measured=1.3,
        speed_resolved=1.0,
    ),
    row("shortgpt", 4, "none", 900.0, 90.0),
]


def test_speed_cell_publishes_only_a_resolved_figure() -> None:
    assert speed_cell(ROWS[3]) == "1.300 [1.290, 1.310]"
    assert speed_cell(ROWS[1]) == "unresolved (1.200 [1.100, 1.300])"
    assert speed_cell(ROWS[4]) == "not timed"


def test_blocks_are_written_as_runs() -> None:
    assert blocks([3, 9, 10, 11, 14]) == "3 9-11 14"


def test_summary_counts_the_gate_per_model_and_budget() -> None:
    lines = summary(ROWS)
    assert lines[0] == "- speed-ups published: 1 of 4 pruned variants"
    assert lines[1] == (
        "- above the bound N/(N-k): 1 of 1 published, by at most 4.0% (the rule allows 5%: "
        "more is a broken timing)"
    )
    assert lines[2] == (
        "- m, 2 of 10 blocks (20%): 1 of 3 variants pass the gate; best lorp+linear at "
        "2.50x dense on lee"
    )
    assert lines[3] == (
        "- m, 4 of 10 blocks (40%): 0 of 1 variants pass the gate; best none (all degraded)"
    )


def test_table_puts_twins_side_by_side() -> None:
    text = render(ROWS, None, None)
    assert "| dense | - | 1 (20.0) | - | 1 (10.0) | - | 1 | 1 | 1.000 | - | - |" in text
    assert (
        "| lorp | 2-3 | 5.00 (degraded) | 2.50 | 3.00 | 1.50 | unresolved (1.200 [1.100, 1.300]) "
        "| 1.250 |" in text
    )
    assert "| shortgpt | 2-5 | 45.00 (degraded) | - | 9.00 | - | not timed | 1.667 |" in text


def test_a_demo_judged_on_code_shows_it_and_names_the_worst_domain() -> None:
    rows = [r | {"ppl_code": 2.0 * (1 + (r["budget"] or 0))} for r in ROWS]
    for r in rows:
        r |= {"worst_domain": "code", "worst_domain_ratio": r["ppl_code"] / 2.0}
    rows[3]["worst_domain"], rows[3]["worst_domain_ratio"] = "prose", 4.0
    page = render(rows, None, None)
    assert "| PTB x dense: pruned | repaired | code x dense: pruned | repaired |" in page
    assert "| dense | - | 1 (20.0) | - | 1 (10.0) | - | 1 (2.00) | - | 1 | 1 |" in page
    assert "| shortgpt | 2-3 | 4.00 (degraded) | - | 2.00 | - | 3.00 | - |" in page  # on prose
    said = summary(rows)
    assert "best lorp+linear at 3.00x dense on its worst domain (code; lee 2.50x)" in said[2]
    assert "| lorp | 2-3 | 5.00 | 2.50 | 3.00 | 1.50 | 3.00 (degraded) | 3.00 |" in page


def test_memory_lines_hold_every_point_against_its_plan() -> None:
    """Per model, the range of the points' peaks, the plan's figures (an unrepaired
    point's is the smaller), and how many points went over theirs; events without a plan
    (vLLM points) are not counted."""
    from benchmarks.demo import memory_lines

    events = [
        {"event": "point", "model": "b", "peak_gib": 0.5, "planned_gib": 0.8},
        {"event": "point", "model": "b", "peak_gib": 0.6, "planned_gib": 0.75},  # unrepaired
        {"event": "point", "model": "a", "peak_gib": 0.9, "planned_gib": 1.0},
        {"event": "point", "model": "a", "method": "dense", "peak_gib": 1.005, "planned_gib": 1.0},
        {
            "event": "point",
            "model": "a",
            "method": "lorp",
            "budget": 3,
            "peak_gib": 1.1,
            "planned_gib": 1.0,
        },
        {"event": "point", "model": "a", "seconds": 3.0},
        {"event": "memory", "model": "a", "peak_gib": 9.0, "planned_gib": 1.0},
    ]
    assert memory_lines(events) == [
        "- a: points' peak memory 0.90-1.10 GiB against 1.00 planned (90.0%-110.0% of the"
        " plan; 2 of 3 over it: dense by 0.5%, lorp-b3 by 10.0%)",
        "- b: points' peak memory 0.50-0.60 GiB against 0.75 and 0.80 planned (62.5%-80.0% of"
        " the plan; none of 2 over it)",
    ]
