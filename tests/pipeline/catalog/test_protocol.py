"""Which figures compare (`pipeline.catalog.protocol`): the held-out corpora of a job, and
protocol ids that name what makes figures comparable."""

from __future__ import annotations

import json

import pytest

from pipeline.catalog.protocol import calibration_id, held_out, protocol_id, row_protocol


def test_held_out_corpora_are_those_not_calibrated_on() -> None:
    assert held_out(["ptb", "lee"], ["ptb"]) == ["lee"]
    assert held_out(["ptb"], ["ptb"]) == []
    assert held_out(["ptb", "lee", "wikitext2"], ["ptb", "wikitext2"]) == ["lee"]


@pytest.mark.integration
def test_protocol_ids_name_what_makes_figures_comparable() -> None:
    ev = {"enabled": True, "perplexity": ["ptb"], "seq_len": 256, "max_windows": 8}
    base = protocol_id(ev, "float32")
    assert base.startswith("ptb256-") and len(base) == len("ptb256-") + 8
    assert protocol_id(ev | {"batch_size": 16, "backend": "vllm"}, "float32") == base
    assert protocol_id(ev | {"rank_domain": None}, "float32") == base  # the default: as before
    for change in (
        {"seq_len": 512},
        {"max_windows": 4},
        {"bos": "never"},
        {"zero_shot": ["boolq"]},
        {"perplexity": ["ptb", "wikitext2"]},
        {"rank_domain": "prose"},
    ):
        assert protocol_id(ev | change, "float32") != base, change
    assert protocol_id(ev, "bfloat16") != base
    assert protocol_id({"enabled": False}, "float32") == "none"
    row = {"evaluation": json.dumps(ev), "dtype": "float32"}  # a row from before the column
    assert row_protocol(row) == base
    cal = {"dataset": "ptb", "split": "train", "samples": 128, "seq_len": 2048, "seed": 0}
    assert (
        calibration_id(cal | {"shards": 8})
        == calibration_id(cal)
        != calibration_id(cal | {"seed": 1})
    )
