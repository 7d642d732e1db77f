"""benchmarks/experts.py's core on a tiny random Llama over the PTB vocabulary (hidden 64,
MLP 128, 2 blocks) MoEfied into 8 experts, top-2: a row for every calibration x budget x
method with real perplexities, the selectors disagreeing, the MoEfied checkpoint cached,
the variant on files equal to the one in memory, and the page written with its table."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from lorp.data import corpora
from tests.helpers.benchmark_scripts import load_benchmark, torch_threads
from tests.helpers.tiny_models import save_tiny_ptb

ex = load_benchmark("experts")
SETTINGS = ex.Settings(seq_len=16, moefy_windows=4, calibration_windows=8, eval_windows=4)


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("experts")
    model = save_tiny_ptb("llama", root / "tiny", n_blocks=2, width=64)
    s = dataclasses.replace(SETTINGS, models=(str(model),))
    real, memo = corpora.tokenize_documents, {}

    def once(tokenizer, corpus):  # type: ignore[no-untyped-def]
        """Each train split tokenized once, not once per calibration (seconds each)."""
        key = (id(tokenizer), corpus.name, corpus.split)
        if key not in memo:
            memo[key] = real(tokenizer, corpus)
        return memo[key]

    with torch_threads(1), pytest.MonkeyPatch.context() as patch:
        patch.setattr(corpora, "tokenize_documents", once)
        results = ex.results_of(s, root / "runs", root / "cache")
    return root, s, results


def test_every_calibration_budget_and_method_has_a_measured_row(measured) -> None:  # type: ignore[no-untyped-def]
    _, _, (result,) = measured
    rows = result["rows"]
    keys = {(r["calibration"], r["budget"], r["method"]) for r in rows}
    assert keys == {
        (c, b, m) for c in ex.CALIBRATIONS for b in ex.BUDGETS for m in ex.EXPERT_METHODS
    }
    assert len(rows) == 12
    for r in rows:
        assert r["kept"] == 8 - round(8 * r["budget"])
        assert all(len(e) == 8 - r["kept"] for e in r["removed"].values())
        assert all(1.0 < p < 1e6 for p in r["ppl"].values())
        assert r["worst"] == max(r["ppl"][d] / result["moe"]["ppl"][d] for d in ex.DOMAINS)
        # a token still runs 2 experts: only the removed experts' router rows go
        router_rows = (8 - r["kept"]) * 64 * 2
        assert r["params"]["active"] == result["moe"]["params"]["active"] - router_rows
        assert r["params"]["total"] < result["moe"]["params"]["total"]
    # the dense model's MLP is the 8 experts: same total, less the routers
    assert result["moe"]["params"]["active"] < result["dense"]["params"]["total"]
    assert result["moe"]["params"]["total"] > result["dense"]["params"]["total"]


def test_the_selectors_disagree_and_frequency_reroutes_least(measured) -> None:  # type: ignore[no-untyped-def]
    _, _, (result,) = measured
    by = {(r["calibration"], r["budget"], r["method"]): r for r in result["rows"]}
    for cal in ex.CALIBRATIONS:
        for budget in ex.BUDGETS:
            reap, freq, rand = (by[cal, budget, m] for m in ("reap", "frequency", "random"))
            assert rand["removed"] != reap["removed"]
            assert freq["rerouted"] <= min(reap["rerouted"], rand["rerouted"])
    # random reads no statistics: the same cut (and numbers) under both calibrations
    assert by["mix", 0.5, "random"]["removed"] == by["prose", 0.5, "random"]["removed"]
    assert by["mix", 0.5, "random"]["ppl"] == by["prose", 0.5, "random"]["ppl"]


def test_the_variant_on_files_is_the_one_in_memory(measured) -> None:  # type: ignore[no-untyped-def]
    _, _, (result,) = measured
    sanity = result["sanity"]
    assert sanity["num_experts"] == 6 and sanity["finite"]
    assert sanity["logit_gap"] < 1e-4
    assert len(sanity["generated"]) == len(ex.PROMPTS) and all(sanity["generated"])


def test_a_rerun_reads_the_runs_and_the_cached_checkpoint(measured) -> None:  # type: ignore[no-untyped-def]
    root, s, (result,) = measured
    assert result["moefied_now"]
    assert len(list((root / "cache").iterdir())) == 1  # one checkpoint, nothing partial
    assert ex.results_of(s, root / "runs", root / "cache") == [result]


def test_the_page_has_the_table_and_the_findings(measured, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _, _, results = measured
    page = tmp_path / "experts.md"
    page.write_text("# Experts\n\nBy hand.\n\n<!-- experts:begin -->\nold\n<!-- experts:end -->\n")
    ex.write_page(page, ex.page(results, "python benchmarks/experts.py"))
    text = page.read_text()
    assert "By hand." in text and "old" not in text
    assert "| model | calibration | method | experts kept | ppl prose | ppl code |" in text
    assert text.count("| tiny | mix | reap | 6 of 8 |") == 1
    assert text.count("| tiny | prose | random | 4 of 8 |") == 1
    assert "lowest worst-domain ratio, cells won of 4:" in text
    assert "indicative only" in text
