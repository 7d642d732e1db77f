"""The repair's sufficient statistics: runs, the normed features, shards that merge into
one pass, the file, and passes that bound memory."""

from __future__ import annotations

import pytest
import torch

from lorp.models.architectures import decoder_blocks
from lorp.repair.capture import capture_repair_stats
from lorp.repair.stats import RepairStats, contiguous_runs, repair_passes, rms_unit
from tests.helpers.repair_runs import RUNS, batches
from tests.helpers.tiny_models import tiny_model
from tests.helpers.windows import token_windows


def test_contiguous_runs() -> None:
    assert contiguous_runs([7, 2, 3, 5, 4, 0], 8) == [(0, 0), (2, 5), (7, 7)]
    with pytest.raises(ValueError, match="layers must be in"):
        contiguous_runs([8], 8)


def test_sharded_statistics_equal_one_pass() -> None:
    dense = tiny_model("qwen3")
    x = token_windows(n=12)
    mask = torch.ones_like(x)
    mask[0, -5:] = 0  # padding counts nowhere
    whole = capture_repair_stats(
        dense, [{"input_ids": x, "attention_mask": mask}], RUNS, skip_prefix=1, progress=False
    )
    parts = [
        capture_repair_stats(
            dense,
            [{"input_ids": x[i : i + 4], "attention_mask": mask[i : i + 4]}],
            RUNS,
            skip_prefix=1,
            progress=False,
        )
        for i in (8, 0, 4)
    ]
    merged = RepairStats.merge_all(parts)
    assert merged.tokens == whole.tokens == 12 * 23 - 5
    # A forward over 4 windows and over 12 rounds differently in float32: compare at that
    # level (the sums are O(1e3); a missing or doubled token moves them by O(1)).
    for a, b in [(merged.gram[s], whole.gram[s]) for s in whole.starts] + [
        (merged.cross[r], whole.cross[r]) for r in whole.runs
    ]:
        assert float((a - b).abs().max()) < 1e-5 * float(b.abs().max())
    for r in whole.runs:
        assert merged.energy[r] == pytest.approx(whole.energy[r], rel=1e-6)


def test_normed_features_are_the_norm_input_before_its_weight() -> None:
    model = tiny_model("gemma3_text")
    norm = decoder_blocks(model)[1].post_feedforward_layernorm
    m = torch.randn(5, 64) * 30
    u = rms_unit(norm, m)
    torch.testing.assert_close(u * (1 + norm.weight), norm(m))
    Q, _ = torch.linalg.qr(torch.randn(64, 64))
    torch.testing.assert_close(rms_unit(norm, m @ Q), u @ Q, rtol=1e-5, atol=1e-5)


def test_save_load_round_trip_keeps_fingerprints(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = tiny_model("olmo2")
    stats = capture_repair_stats(
        model,
        batches(token_windows()),
        RUNS,
        model_fingerprint="m1",
        calibration_fingerprint="c1",
        progress=False,
    )
    back = RepairStats.from_file(stats.to_file(tmp_path / "repair.npz"))
    assert (back.runs, back.forms, back.tokens) == (stats.runs, stats.forms, stats.tokens)
    assert back.state_energy == stats.state_energy and stats.base  # olmo2: a normed family
    assert all(torch.equal(back.base[s], stats.base[s]) for s in stats.base)
    one = RepairStats.from_file(tmp_path / "repair.npz", [stats.runs[-1]])  # reads one run
    assert one.runs == [stats.runs[-1]] and list(one.gram) == [stats.runs[-1][0]]
    assert torch.equal(one.cross[stats.runs[-1]], stats.cross[stats.runs[-1]])
    assert one.energy == {stats.runs[-1]: stats.energy[stats.runs[-1]]}
    with pytest.raises(ValueError, match="no run 0-0 in the file"):
        RepairStats.from_file(tmp_path / "repair.npz", [(0, 0)])
    assert (back.model_fingerprint, back.calibration_fingerprint) == ("m1", "c1")
    for r in stats.runs:
        assert torch.equal(back.cross[r], stats.cross[r])
    other = capture_repair_stats(
        model, batches(token_windows()), RUNS, model_fingerprint="m2", progress=False
    )
    with pytest.raises(ValueError, match="different model"):
        stats.merge(other)
    with pytest.raises(ValueError, match="not a lorp repair stats file"):
        (tmp_path / "bad.npz").write_bytes(b"nope")
        RepairStats.from_file(tmp_path / "bad.npz")


def test_repair_passes_bound_memory_and_keep_starts_together() -> None:
    runs = [(2, 3), (2, 5), (7, 7), (9, 12), (9, 9)]
    d = 64
    per = 8 * d * d
    groups = repair_passes(runs, d, 4 * per)
    assert sorted(r for g in groups for r in g) == sorted(runs)
    for g in groups:
        assert len({s for s, _ in g}) + len(g) <= 4
        for s in {s for s, _ in g}:
            assert all(r in g for r in runs if r[0] == s)
    with pytest.raises(ValueError, match="cannot hold"):
        repair_passes(runs, d, 2 * per)
