"""Held-out judgement: variants are gated and ranked on text they were not fitted on
(`pipeline.records.row_updates.judge`, `pipeline.records.ranking`), the held-out news
corpus `lee` (`lorp.data`)."""

from __future__ import annotations

import pytest
import torch

from lorp.data.corpora import load_corpus
from pipeline.records.protocol import held_out, rank_column
from pipeline.records.ranking import best
from pipeline.records.row_updates import judge


def test_the_held_out_news_corpus_is_packaged() -> None:
    test, valid = load_corpus("lee", "test"), load_corpus("lee", "valid")
    assert len(test.documents) == 300 and len(valid.documents) == 50
    assert test.documents[0].startswith("Hundreds of people have been forced to vacate")
    assert "£" in " ".join(valid.documents)  # the Latin-1 file decoded, not mangled
    assert sum(len(d.split()) for d in test.documents) == 59_890
    with pytest.raises(ValueError, match="corpus 'lee' has no split 'train'"):
        load_corpus("lee", "train")


def test_held_out_corpora_are_those_not_calibrated_on() -> None:
    assert held_out(["ptb", "lee"], ["ptb"]) == ["lee"]
    assert held_out(["ptb"], ["ptb"]) == []
    assert held_out(["ptb", "lee", "wikitext2"], ["ptb", "wikitext2"]) == ["lee"]


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


def test_best_ranks_by_the_held_out_ratio() -> None:
    """The variant best on its calibration corpus is not best when it fails elsewhere."""
    common = {"budget": 8, "protocol": "p", "method": "m", "judged_on": "lee"}
    fits_ptb = {**common, "method_label": "a", "ppl_ptb": 25.0, "ppl_ratio": 2.9}
    general = {**common, "method_label": "b", "ppl_ptb": 31.0, "ppl_ratio": 1.9}
    assert rank_column(fits_ptb) == "ppl_ratio"
    assert best([fits_ptb, general], 8, "p") is general
    degraded = {**general, "degraded": True}
    assert best([fits_ptb, degraded], 8, "p") is fits_ptb


# -- calibration from several corpora ---------------------------------------------------


def _spec(dataset):  # type: ignore[no-untyped-def]
    from pipeline.spec.parse import parse_spec

    return parse_spec(
        {"name": "mix", "models": [{"ref": "x"}], "budgets": [1], "methods": [{"name": "lorp"}],
         "calibration": {"dataset": dataset, "samples": 10, "seq_len": 16, "loss_samples": 4}}
    )  # fmt: skip


def test_a_calibration_mix_is_parsed_and_bad_parts_named() -> None:
    from pipeline.spec.checks import SpecError

    cal = _spec([{"name": "ptb", "weight": 3}, {"name": "wiki"}]).calibration
    assert cal.corpora == ["ptb", "wiki"] and cal.parts == [("ptb", 3.0), ("wiki", 1.0)]
    assert _spec("ptb").calibration.parts == [("ptb", 1.0)]
    with pytest.raises(SpecError, match=r"calibration\.dataset\[1\]\.weight: must be a number > 0"):
        _spec([{"name": "ptb"}, {"name": "wiki", "weight": -1}])
    with pytest.raises(SpecError, match="'ptb' appears twice"):
        _spec([{"name": "ptb"}, {"name": "ptb", "weight": 2}])


def test_mixed_windows_hold_each_corpus_in_its_share(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Shards of a mix: 10 windows, 3:2 -> 6 from one corpus and 4 from the other, every
    window cut from its corpus's tokens, the same on a second call; the held-out windows
    are another draw of the same mix."""
    from lorp.data.windows import mixture_counts
    from pipeline.stages.calibration import heldout_windows, read_shard, write_shards
    from tests.helpers.tiny_models import ptb_tokenizer

    tok = ptb_tokenizer()
    (tmp_path / "a.txt").write_text(" ".join(["the cat sat on the mat"] * 40))
    (tmp_path / "b.txt").write_text(" ".join(["stocks fell in new york trading"] * 40))
    mix = [
        {"name": str(tmp_path / "a.txt"), "weight": 3},
        {"name": str(tmp_path / "b.txt"), "weight": 2},
    ]
    cal = _spec(mix).calibration
    assert mixture_counts([3, 2], 10) == [6, 4]
    shards = write_shards(tok, cal, tmp_path / "shards")
    windows = torch.cat([read_shard(p) for p in shards.paths])
    a, b = (set(tok(t.read_text())["input_ids"]) for t in (tmp_path / "a.txt", tmp_path / "b.txt"))
    kinds = [
        ("a" if set(w.tolist()) <= a else "b" if set(w.tolist()) <= b else "?") for w in windows
    ]
    assert sorted(kinds) == ["a"] * 6 + ["b"] * 4
    again = write_shards(tok, cal, tmp_path / "again")
    assert again.fingerprint == shards.fingerprint and again.fingerprint.startswith("mix-")
    assert torch.equal(torch.cat([read_shard(p) for p in again.paths]), windows)
    held, fp = heldout_windows(tok, cal)
    assert held.shape == (4, 16) and fp.startswith("heldout:mix-") and fp != shards.fingerprint
    single = write_shards(tok, _spec(str(tmp_path / "a.txt")).calibration, tmp_path / "one")
    assert not single.fingerprint.startswith("mix-")


def test_the_repair_ridge_is_auto_or_a_positive_number() -> None:
    from pipeline.spec.checks import SpecError
    from pipeline.spec.parse import parse_spec

    base = {"name": "r", "models": [{"ref": "x"}], "budgets": [1], "methods": [{"name": "lorp"}]}
    assert parse_spec(base).ridge_value is None  # auto: chosen on held-out windows
    assert parse_spec(base | {"repair_ridge": 0.01}).ridge_value == 0.01
    for bad, shown in (("fast", "'fast'"), (0, "0")):
        with pytest.raises(
            SpecError, match=f"repair_ridge: must be auto or a number > 0, got {shown}"
        ):
            parse_spec(base | {"repair_ridge": bad})
    assert parse_spec(base).repair_followers == 1
    assert parse_spec(base | {"repair_followers": 0}).repair_followers == 0
    for bad, says in ((-1, "must be an integer >= 0, got -1"), (1.5, "expected an integer")):
        with pytest.raises(SpecError, match=f"repair_followers: {says}"):
            parse_spec(base | {"repair_followers": bad})
    assert parse_spec(base).repair_distill == 0  # least squares only, unless asked
    assert not parse_spec(base).distills
    job = parse_spec(base | {"repair_distill": 2})
    assert job.distill_epochs(job.methods[0]) == 2 and job.distills
    own = [{"name": "lorp", "repair_distill": 3}, {"name": "shortgpt"}]
    one = parse_spec(base | {"methods": own})  # a method's own epochs, the job's elsewhere
    assert [one.distill_epochs(m) for m in one.methods] == [3, 0] and one.distills
    assert not parse_spec(base | {"methods": own, "repair": ["none"]}).distills
    with pytest.raises(SpecError, match="methods.0..repair_distill: must be an integer >= 0"):
        parse_spec(base | {"methods": [{"name": "lorp", "repair_distill": -1}]})
    with pytest.raises(SpecError, match="repair_distill: must be an integer >= 0, got -1"):
        parse_spec(base | {"repair_distill": -1})
    for bad, says in (
        ("fast", "expected a number, got str 'fast'"),
        (0, "must be a number in .0, 1., got 0"),
        (2, "must be a number in .0, 1., got 2"),
    ):
        with pytest.raises(SpecError, match=f"repair_distill_lr: {says}"):
            parse_spec(base | {"repair_distill_lr": bad})
