"""benchmarks/domains.py's transfer table and findings, from catalog rows built here."""

from __future__ import annotations

import sys
from types import SimpleNamespace

from tests.helpers.paths import REPO

sys.path.insert(0, str(REPO))

from benchmarks.domains import findings, job_spec, model_table, page, twins  # noqa: E402


def row(label: str, budget: int, lee: float, code: float, **extra):  # type: ignore[no-untyped-def]
    repair = "linear" if label.endswith("+linear") else "none"
    bad = max(lee, code) > 3.0
    return {
        "model": "m",
        "method_label": label,
        "budget": budget,
        "repair": repair,
        "ratio_lee": lee,
        "ratio_code": code,
        "degraded": bad,
        **extra,
    }


DATA = {
    "prose": [
        row("dense", 0, 1.0, 1.0),
        row("window", 8, 3.3, 4.35),
        row("window+linear", 8, 1.9, 4.58, repair_gate="least squares"),
    ],
    "mix": [
        row("dense", 0, 1.0, 1.0),
        row("window", 8, 3.2, 3.9),
        row("window+linear", 8, 2.1, 2.8, repair_gate="least squares"),
    ],
}


def test_the_table_puts_each_calibration_beside_the_others() -> None:
    lines = model_table("m", DATA)
    prose = "| window | 8 | prose | 3.30x -> 1.90x | 4.35x -> 4.58x | 4.58x (degraded) |"
    assert lines[2] == prose + " least squares |"
    assert (
        lines[3] == "| window | 8 | mix | 3.20x -> 2.10x | 3.90x -> 2.80x | 2.80x | least squares |"
    )
    assert [(a["method_label"], b["method_label"]) for a, b in twins(DATA["mix"])] == [
        ("window", "window+linear")
    ]


def test_findings_name_the_best_by_worst_domain_and_every_repair_that_costs_one() -> None:
    f = findings(DATA)
    assert f["models"]["m"]["8/mix"] == {
        "variant": "window+linear",
        "lee": 2.1,
        "code": 2.8,
        "worst": 2.8,
    }
    assert f["models"]["m"]["8/prose"]["variant"] == "window"  # 4.35 beats 4.58 on code
    assert f["twins_worse"] == ["m window+linear at 8 (prose): code 4.35x -> 4.58x"]
    assert f["mislabelled"] == []
    bad = {"mix": [row("lorp", 4, 1.2, 3.4) | {"degraded": False}]}
    assert findings(bad)["mislabelled"] == ["m lorp (mix)"]
    unjudged = {"mix": [{"model": "m", "method_label": "lorp", "budget": 4, "repair": "none"}]}
    assert findings(unjudged)["mislabelled"] == [] and findings(unjudged)["models"]["m"] == {}
    args = SimpleNamespace(methods=["window"], max_windows=16, dtype="bfloat16")
    text = page(DATA, args)
    assert "--max-windows 16 --dtype bfloat16" in text
    assert "unrepaired twin on a domain, calibrated on prose: 1 (m window+linear" in text
    assert "unrepaired twin on a domain, calibrated on mix: 0" in text


def test_the_job_is_the_quality_job_calibrated_as_asked() -> None:
    args = SimpleNamespace(dtype="bfloat16", max_windows=8, runs="runs/x", distill=False)
    spec = job_spec("code", ["smollm2-135m"], ["shortgpt", "window"], args)
    assert [m.label for m in spec.models] == ["smollm2-135m"]
    assert spec.models[0].dtype == "bfloat16"
    assert spec.calibration.corpora == ["code"] and spec.calibration.samples == 128
    assert [m.key for m in spec.methods] == ["shortgpt", "window"]
    assert all(m.repair_distill is None for m in spec.methods)  # no distillation
    assert spec.evaluation.perplexity == ("ptb", "lee", "code")
    assert spec.output_dir == "runs/x/code" and spec.name == "domains-code"
