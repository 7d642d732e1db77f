"""Calibration shards (`pipeline.stages.calibration`) of a weighted mix: each corpus in its
share, the same on a second call, held-out windows another draw."""

from __future__ import annotations

import torch

from tests.helpers.spec_dicts import calibration_job as _spec


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
    held = heldout_windows(tok, cal, {str(tmp_path / "b.txt"): "other"})
    assert held.windows.shape == (4, 16) and held.fingerprint.startswith("heldout-apart:")
    assert sorted(held.domains) == ["a", "a", "other", "other"]  # a.txt's own domain, b's tag
    by = held.by_domain()
    assert all(set(w.tolist()) <= a for w in by["a"]) and all(
        set(w.tolist()) <= b for w in by["other"]
    )

    single = write_shards(tok, _spec(str(tmp_path / "a.txt")).calibration, tmp_path / "one")
    assert not single.fingerprint.startswith("mix-")
