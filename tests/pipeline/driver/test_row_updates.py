"""What a row learns after it is written (`pipeline.driver.row_updates`): the quality gate
judged on held-out text, and the serving speed-up over the dense row."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass

import pytest

from pipeline.driver.row_updates import judge, serving_speedups

DENSE = {"grid_key": "d", "ppl_ptb": 20.0, "ppl_lee": 40.0}


def test_the_gate_judges_on_held_out_text_and_flags_a_divergence() -> None:
    # fitted on PTB: 1.5x dense there, 4x on the news it never saw
    row = {"grid_key": "v", "ppl_ptb": 30.0, "ppl_lee": 160.0}
    v = judge(row, DENSE, ["ptb", "lee"], ["ptb"], limit=3.0)
    assert v.ratio == 4.0 and v.judged_on == "lee" and v.degraded
    assert v.ratios == {"ratio_ptb": 1.5, "ratio_lee": 4.0}
    assert v.fits_calibration_only is True  # 4.0 > 1.5 x 1.5
    # the same row judged (as before) on its calibration corpus passes the gate
    old = judge(row, DENSE, ["ptb", "lee"], ["lee"], limit=3.0)
    assert old.ratio == 1.5 and not old.degraded and old.judged_on == "ptb"
    assert old.fits_calibration_only is False  # held-out better than the calibration text

    even = judge({**row, "ppl_lee": 88.0}, DENSE, ["ptb", "lee"], ["ptb"], limit=3.0)
    assert even.ratio == pytest.approx(2.2) and even.fits_calibration_only is False


def test_without_a_held_out_corpus_the_row_says_what_it_was_judged_on() -> None:
    row = {"grid_key": "v", "ppl_ptb": 30.0, "ppl_lee": 160.0}
    v = judge(row, DENSE, ["ptb"], ["ptb"], limit=3.0)
    assert v.judged_on == "ptb (calibration text)" and v.ratio == 1.5
    assert v.fits_calibration_only is None
    worst = judge(row, DENSE, ["ptb", "lee"], ["wikitext2"], limit=3.0)
    assert worst.ratio == 4.0 and worst.judged_on == "ptb,lee"  # the worst held-out ratio
    assert worst.fits_calibration_only is None  # no calibration corpus evaluated
    assert judge({"grid_key": "v", "ppl_ptb": 30.0}, DENSE, ["ptb", "lee"], ["ptb"], 3.0) is None


def test_a_row_is_judged_by_its_worst_domain_or_the_one_the_job_ranks_on() -> None:
    dense = {**DENSE, "ppl_code": 4.0}
    # calibrated on PTB and code: prose is judged on lee (held out), code on its test split
    row = {"grid_key": "v", "ppl_ptb": 30.0, "ppl_lee": 80.0, "ppl_code": 12.0}
    v = judge(row, dense, ["ptb", "lee", "code"], ["ptb", "code"], limit=2.5)
    assert v.domain_ratios == {"prose": 2.0, "code": 3.0}
    assert (v.worst_domain, v.worst_domain_ratio, v.ratio) == ("code", 3.0, 3.0)
    assert v.degraded and v.judged_on == "lee; code (calibration text)"
    values = v.values()
    assert values["ratio_domain_code"] == 3.0 and values["worst_domain"] == "code"
    assert v.tags()["worst_domain"] == "code"
    # a job serving prose ranks on prose: the gate takes prose's ratio, the worst stays named
    prose = judge(row, dense, ["ptb", "lee", "code"], ["ptb", "code"], 2.5, rank_domain="prose")
    assert prose.ratio == 2.0 and not prose.degraded and prose.judged_on == "lee"
    assert prose.worst_domain == "code" and prose.worst_domain_ratio == 3.0
    # a corpus the job tags joins its domain
    tagged = judge(row, dense, ["ptb", "lee", "code"], ["ptb"], 2.5, {"code": "code"})
    assert tagged.domain_ratios == {"prose": 2.0, "code": 3.0}


@dataclass(frozen=True)
class _Model:
    label: str = "m"
    n_blocks: int = 6


@dataclass(frozen=True)
class _Point:
    key: str
    layers: tuple[int, ...]
    model: _Model = _Model()

    @property
    def is_dense(self) -> bool:
        return not self.layers

    @property
    def bound_blocks(self) -> int:
        return len(self.layers)


def _row(tps: list[float]) -> dict[str, object]:
    return {"serving": json.dumps({"rounds": [{"output_tps": t} for t in tps]})}


def test_rows_get_their_speedup_over_the_dense_row() -> None:
    dense_tps = [100.0, 100.4, 99.8, 100.1]
    rows = {
        "d": _row(dense_tps),
        "a": _row([119.0, 120.0, 120.5, 119.5]),
        "b": _row([300.0, 301.0, 299.0, 300.5]),  # 3x with 1 of 6 blocks gone: impossible
        "c": {"ppl_ptb": 10.0},  # no serving rounds: nothing to say
    }
    points = [_Point("d", ()), _Point("a", (2,)), _Point("b", (3,)), _Point("c", (1,))]
    out = serving_speedups(rows, points, half_width=0.02)  # type: ignore[arg-type]
    assert set(out) == {"d", "a", "b"}
    assert out["d"]["serve_speedup"] == 1.0
    ratios = [v / d for v in [119.0, 120.0, 120.5, 119.5] for d in dense_tps]
    assert out["a"]["serve_speedup"] == pytest.approx(statistics.median(ratios))
    assert out["a"]["serve_resolved"] == 1.0
    assert out["b"]["serve_resolved"] == 0.0 and out["b"]["serve_speedup_measured"] > 2.9
    # written once: rows that already hold these values are not updated again
    rows["a"] = rows["a"] | out["a"]
    assert "a" not in serving_speedups(rows, points, half_width=0.02)  # type: ignore[arg-type]
