"""benchmarks/quality.py's tables and findings, from catalog rows built in the test."""

from __future__ import annotations

import sys

from tests.helpers.paths import REPO

sys.path.insert(0, str(REPO))

from benchmarks.quality import (  # noqa: E402
    findings,
    followers,
    latest,
    model_table,
    repair_findings,
    repair_table,
    shown,
)


def row(label: str, budget: int, ppl: float, pruned=(), degraded=False, evals=0, secs=0.0):  # type: ignore[no-untyped-def]
    method = "dense" if not budget else label.split("-s")[0]
    return {
        "method": method,
        "method_label": label,
        "budget": budget,
        "ppl_ptb": ppl,
        "pruned_layers": list(pruned),
        "degraded": degraded,
        "n_evals": evals,
        "select_s": secs,
    }


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


def test_the_repair_report_is_the_latest_run_and_says_which_variants_lack_a_follower() -> None:
    """A rerun with followers leaves the earlier repaired rows in the catalog under other
    keys: the report takes each variant's newest row, and marks a repaired variant whose
    fits hold no follower map."""
    import json

    def fixed(ppl: float, lee: float, when: str, fits: list[dict]) -> dict:
        out = row("window+linear", 2, ppl, (3, 4))
        return out | {
            "model": "m",
            "n_blocks": 6,
            "repair": "linear",
            "ratio_lee": lee,
            "ppl_ratio": lee,
            "judged_on": "lee",
            "created_at": when,
            "repair_fits": json.dumps(fits),
        }

    run = {"run": [3, 4], "kept": "fit"}
    base = {"model": "m", "n_blocks": 6, "created_at": "2026-12-01"}
    rows = [
        row("dense", 0, 50.0) | base,
        row("window", 2, 100.0, (3, 4)) | base,
        fixed(60.0, 2.0, "2026-12-01T10:00", [run]),  # before followers
        fixed(55.0, 1.8, "2026-12-02T10:00", [run, {"run": [5, 4], "follower": 4}]),
    ]
    (newest,) = [r for r in latest(rows) if r["method_label"] == "window+linear"]
    assert newest["ppl_ptb"] == 55.0 and followers(newest) == 1
    line = next(x for x in repair_table(latest(rows)) if x.startswith("| window |"))
    assert "**55.0 (1.10x); lee 1.80x**" in line and "no follower" not in line
    older = next(x for x in repair_table(rows[:3]) if x.startswith("| window |"))
    assert "60.0 (1.20x); lee 2.00x** (no follower)" in older
    # a distilled twin says so; one whose distillation was not kept does not
    kept = {"run": [3, 4], "kept": "distilled", "distilled": {"best_epoch": 2}}
    rows.append(fixed(52.0, 1.6, "2026-12-03T10:00", [kept, {"run": [5, 4], "follower": 4}]))
    line = next(x for x in repair_table(latest(rows)) if x.startswith("| window |"))
    assert line.endswith("**52.0 (1.04x); lee 1.60x** (distilled) |")
    not_kept = [run | {"distilled": {"best_epoch": 0}}, {"run": [5, 4], "follower": 4}]
    rows.append(fixed(52.0, 1.6, "2026-12-04T10:00", not_kept))
    line = next(x for x in repair_table(latest(rows)) if x.startswith("| window |"))
    assert "distilled" not in line


def test_a_report_drawn_from_a_catalog_keeps_to_its_methods_and_survives_lone_twins() -> None:
    """`--from-catalog` with `--methods`: rows of other methods (an interrupted full run
    left some) are not drawn; a method with only repaired rows still gets its line."""
    rows = [r | {"model": "m"} for r in ROWS[:3]]
    rows.append(row("lorp-released+linear", 2, 60.0, (1, 2)) | {"model": "m", "repair": "linear"})
    rows.append(row("shortgpt", 4, 90.0, (1, 2, 3, 4)) | {"model": "m"})  # none at 4 for the rest
    assert [r["method_label"] for r in rows if shown(r, ["m"], ["lorp"])] == ["dense", "lorp"]
    assert not [r for r in rows if shown(r, ["other"], None)]
    line = next(x for x in repair_table(rows) if x.startswith("| lorp-released |"))
    assert line.startswith("| lorp-released | 1 2 | - | **60.0 (1.20x)**")
