"""benchmarks/quality.py's tables and findings, from catalog rows built in the test."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quality import findings, model_table, repair_findings  # noqa: E402


def row(label: str, budget: int, ppl: float, pruned=(), degraded=False, evals=0, secs=0.0):  # type: ignore[no-untyped-def]
    method = "dense" if not budget else label.split("-s")[0]
    return {
        "method": method, "method_label": label, "budget": budget, "ppl_ptb": ppl,
        "pruned_layers": list(pruned), "degraded": degraded, "n_evals": evals, "select_s": secs,
    }  # fmt: skip


ROWS = [
    row("dense", 0, 50.0),
    row("lorp", 2, 900.0, (1, 2), degraded=True),
    row("shortgpt", 2, 80.0, (3, 4)),
    row("streamline", 2, 70.0, (2, 3)),
    row("lorp-loss", 2, 75.0, (3, 5), evals=9, secs=4.0),
    row("sleb", 2, 40.0, (1, 5), evals=11, secs=6.5),  # below dense: still best, not degraded
]


def test_table_marks_the_best_and_the_degraded() -> None:
    lines = model_table(ROWS)
    assert lines[0] == "| method | 2 blocks: pruned | PPL | evaluations | selection s |"
    assert lines[2] == "| dense | - | 50.0 | - | - |"
    by = {line.split(" | ")[0][2:]: line for line in lines[3:]}
    assert by["sleb"] == "| sleb | 1 5 | **40.0** | 11 | 6.5 |"
    assert by["lorp"] == "| lorp | 1 2 | 900.0 (degraded) | 0 | 0.0 |"
    assert list(by) == ["sleb", "streamline", "lorp-loss", "shortgpt", "lorp"]  # by PPL


def test_where_every_variant_is_degraded_the_least_bad_is_bold() -> None:
    rows = [row("dense", 0, 50.0), row("a", 2, 900.0, (1, 2), True)]
    lines = model_table([*rows, row("b", 2, 400.0, (3, 4), True)])
    assert lines[3] == "| b | 3 4 | **400.0** (degraded) | 0 | 0.0 |"
    assert lines[4] == "| a | 1 2 | 900.0 (degraded) | 0 | 0.0 |"


def test_findings_hold_lorp_loss_to_one_pass_and_to_sleb() -> None:
    said = findings(ROWS)
    assert said == [
        "at 2 blocks the paper's ranking does not hold (LoRP 900.0, best of "
        "ShortGPT/Streamline 70.0)",
        "at 2 blocks lorp-loss (75.0) is above the best one-pass method (streamline, 70.0)",
        "at 2 blocks lorp-loss / SLEB = 1.88 (outside 1.25x; SLEB 40.0)",
    ]


def test_repair_findings_name_the_best_by_the_held_out_ratio() -> None:
    """The best repaired variant is the gate's (lee) best, not PTB's; both ratios shown."""

    def fixed(label: str, ppl: float, lee: float, degraded: bool = False) -> dict:
        out = row(label, 2, ppl, (3, 4), degraded)
        return out | {"repair": "linear", "ratio_lee": lee, "ppl_ratio": lee, "judged_on": "lee"}

    rows = [
        row("dense", 0, 50.0),
        row("shortgpt", 2, 100.0, (3, 4)),
        row("lorp", 2, 500.0, (1, 2), True),
        fixed("shortgpt+linear", 60.0, 2.5),  # best on PTB, worse held out
        fixed("lorp+linear", 70.0, 1.5),
    ]
    [line] = repair_findings(rows)
    assert line.startswith(
        "at 2 blocks the best repaired variant is lorp+linear: PTB 1.40x, lee 1.50x"
    )
    assert line.endswith("repaired LoRP passes the quality gate (PTB 1.40x, lee 1.50x dense)")
