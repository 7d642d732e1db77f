"""Domains in a job spec: which domain each corpus is text of, a model's own calibration
text, the domain a job ranks on, and each bad value refused in one line."""

from __future__ import annotations

import pytest

from pipeline.spec.checks import SpecError
from pipeline.spec.domains import domain_of, domains_of, uncovered
from pipeline.spec.parse import parse_spec

BASE = {
    "name": "d",
    "models": [
        {"ref": "smollm2-135m"},
        {
            "ref": "qwen2.5-coder-0.5b",
            "calibration": [{"name": "ptb"}, {"name": "code", "weight": 2}],
        },
    ],
    "budgets": [2],
    "methods": [{"name": "shortgpt"}],
    "calibration": {"dataset": "ptb", "samples": 6, "seq_len": 32},
    "evaluation": {"perplexity": ["ptb", "lee", "code", "data/tickets.jsonl"]},
    "domains": {"data/tickets.jsonl": "support"},
}


def test_each_corpus_has_a_domain_and_a_model_may_name_its_own_calibration() -> None:
    spec = parse_spec(BASE)
    assert [spec.domain(c) for c in ("ptb", "lee", "wiki", "code", "c4")] == [
        "prose",
        "prose",
        "prose",
        "code",
        "prose",
    ]
    assert spec.domain("data/tickets.jsonl") == "support"
    assert domain_of("data/My Logs.txt", {}) == "my-logs"  # untagged: a domain of its own
    assert spec.judged_domains() == {
        "prose": ["ptb", "lee"],
        "code": ["code"],
        "support": ["data/tickets.jsonl"],
    }
    small, coder = spec.models
    assert spec.calibration_for(small) is spec.calibration
    mine = spec.calibration_for(coder)
    assert mine.parts == [("ptb", 1.0), ("code", 2.0)] and mine.samples == 6
    assert spec.calibration_domains(coder) == {"prose": ["ptb"], "code": ["code"]}
    assert spec.warnings() == [
        "smollm2-135m: judged on code, support text but calibrated on prose only; add a code "
        "corpus to its calibration (calibration.dataset, or models[].calibration)",
        "qwen2.5-coder-0.5b: judged on support text but calibrated on prose, code only; add a "
        "support corpus to its calibration (calibration.dataset, or models[].calibration)",
    ]
    assert uncovered({"m": ["code"]}, ["code"], {}) == []
    assert domains_of(["lee", "code", "ptb"], {}) == {"prose": ["lee", "ptb"], "code": ["code"]}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"domains": {"data/tickets.jsonl": "Support Desk"}},
            "domains.data/tickets.jsonl: a domain is lower-case letters, digits, '-' and '_' "
            "(at most 32), got 'Support Desk'",
        ),
        ({"domains": {"code": "prose"}}, "domains.code: 'code' is packaged code text, got 'prose'"),
        (
            {"evaluation": {"perplexity": ["ptb"], "rank_domain": "code"}},
            "evaluation.rank_domain: no perplexity corpus is 'code' text, got 'code' "
            "(judged: prose)",
        ),
        (
            {"models": [{"ref": "smollm2-135m", "calibration": [{"name": "ptb", "weight": -1}]}]},
            "models[0].calibration[0].weight: must be a number > 0, got -1",
        ),
        (
            {"models": [{"ref": "smollm2-135m", "calibration": [{"name": "ptb"}] * 2}]},
            "models[0].calibration: dataset: 'ptb' appears twice",
        ),
    ],
)
def test_bad_domains_are_one_line_naming_the_field(change: dict, message: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec({**BASE, **change})
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)
