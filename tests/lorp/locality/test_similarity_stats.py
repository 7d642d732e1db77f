"""SimilarityStats (Eq. 3-4) is exact, merges from shards in any order, refuses mismatches and
non-finite states, and survives its file."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from lorp import FORMAT_VERSION, NonFiniteActivationError, SimilarityStats, load_similarity
from tests.helpers.states import brute_force_S, make_states


def test_matches_brute_force_float64(states: np.ndarray) -> None:
    stats = SimilarityStats(n_blocks=8)
    stats.update(states)
    np.testing.assert_allclose(
        stats.matrix(include_output=True), brute_force_S(states), rtol=1e-12, atol=1e-12
    )
    # The paper's S is the leading N x N block (inputs of blocks 0..N-1).
    np.testing.assert_allclose(stats.matrix(), brute_force_S(states)[:8, :8], rtol=1e-12)
    assert stats.tokens == 40


def test_unit_diagonal_and_symmetry(states: np.ndarray) -> None:
    stats = SimilarityStats(n_blocks=8)
    stats.update(states)
    S = stats.matrix(include_output=True)
    np.testing.assert_allclose(np.diag(S), 1.0, atol=1e-12)
    assert np.array_equal(S, S.T)


def test_merge_of_seven_shuffled_shards_equals_one_pass() -> None:
    batches = [make_states(7, 16, 24, seed=s) for s in range(21)]
    one = SimilarityStats(6, model_fingerprint="m", calibration_fingerprint="c")
    for b in batches:
        one.update(b)
    shards = []
    for k in range(7):
        part = SimilarityStats(6, model_fingerprint="m", calibration_fingerprint="c")
        for b in batches[k::7]:
            part.update(b)
        shards.append(part)
    random.Random(3).shuffle(shards)
    merged = SimilarityStats.merge_all(shards)
    assert merged.tokens == one.tokens == 21 * 16
    np.testing.assert_allclose(merged.gram, one.gram, rtol=1e-12, atol=0)
    # Commutative and associative.
    a, b, c = shards[:3]
    np.testing.assert_allclose(a.merge(b).gram, b.merge(a).gram, rtol=1e-15)
    np.testing.assert_allclose(a.merge(b).merge(c).gram, a.merge(b.merge(c)).gram, rtol=1e-12)
    assert merged.model_fingerprint == "m" and merged.calibration_fingerprint == "c"


def test_merge_refuses_mismatches() -> None:
    a = SimilarityStats(4, model_fingerprint="x")
    with pytest.raises(ValueError, match="n_blocks=4 with 5"):
        a.merge(SimilarityStats(5))
    with pytest.raises(ValueError, match="different model_fingerprint: 'x' vs 'y'"):
        a.merge(SimilarityStats(4, model_fingerprint="y"))


def test_non_finite_names_the_layer(states: np.ndarray) -> None:
    bad = states.copy()
    bad[3, 5, 0] = np.nan
    stats = SimilarityStats(8)
    with pytest.raises(NonFiniteActivationError, match="layer 3 \\(the input of block 3\\)") as e:
        stats.update(bad)
    assert e.value.layer == 3
    assert stats.tokens == 0  # nothing half-added
    bad = states.astype(np.float16)
    bad[8, 0, 1] = np.inf
    with pytest.raises(NonFiniteActivationError, match="output of block 7"):
        stats.update(torch.from_numpy(bad))


def test_shape_errors(states: np.ndarray) -> None:
    stats = SimilarityStats(8)
    with pytest.raises(ValueError, match=r"L=9"):
        stats.update(states[:5])
    with pytest.raises(ValueError, match="mask has 3 tokens"):
        stats.update(states, mask=np.ones(3, bool))
    with pytest.raises(ValueError, match="no tokens"):
        stats.matrix()
    with pytest.raises(ValueError, match="n_blocks must be an integer >= 2"):
        SimilarityStats(1)


def test_file_round_trip_keeps_metadata(tmp_path, states: np.ndarray) -> None:
    stats = SimilarityStats(
        8, model_fingerprint="abc", calibration_fingerprint="ptb:8x256", extra={"dtype": "fp32"}
    )
    stats.update(states)
    path = stats.to_file(tmp_path / "s.npz")
    back = SimilarityStats.from_file(path)
    assert np.array_equal(back.gram, stats.gram)
    assert (back.tokens, back.n_blocks) == (40, 8)
    assert back.model_fingerprint == "abc" and back.calibration_fingerprint == "ptb:8x256"
    assert back.extra == {"dtype": "fp32"}
    assert back.metadata()["format_version"] == FORMAT_VERSION == 2
    assert np.array_equal(back.last_gram, stats.last_gram) and back.sequences == 1
    assert np.array_equal(back.last_angular_sum, stats.last_angular_sum)
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind
    assert isinstance(load_similarity(path), SimilarityStats)


def test_bad_files(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.npz"):
        SimilarityStats.from_file(tmp_path / "nope.npz")
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a lorp stats file"):
        SimilarityStats.from_file(junk)
    np.save(tmp_path / "rect.npy", np.ones((3, 4)))
    with pytest.raises(ValueError, match=r"square, got shape \(3, 4\)"):
        load_similarity(tmp_path / "rect.npy")
    asym = np.eye(4)
    asym[0, 1] = 0.5
    np.save(tmp_path / "asym.npy", asym)
    with pytest.raises(ValueError, match="symmetric"):
        load_similarity(tmp_path / "asym.npy")
    with pytest.raises(ValueError, match="must be .npz"):
        load_similarity(tmp_path / "s.csv")


def test_pickles_to_host_memory(states: np.ndarray) -> None:
    import pickle

    stats = SimilarityStats(8)
    stats.update(states)
    back = pickle.loads(pickle.dumps(stats))
    assert np.array_equal(back.gram, stats.gram) and back.tokens == stats.tokens
    assert np.array_equal(back.last_gram, stats.last_gram) and back.sequences == 1
    assert np.array_equal(back.last_angular_sum, stats.last_angular_sum)


def test_last_token_sums_merge_like_the_gram() -> None:
    batches = [make_states(7, 24, 16, seed=s).reshape(7, 3, 8, 16) for s in range(9)]
    one = SimilarityStats(6)
    for b in batches:
        one.update(b)
    shards = []
    for k in range(3):
        part = SimilarityStats(6)
        for b in batches[k::3]:
            part.update(b)
        shards.append(part)
    merged = SimilarityStats.merge_all(shards[::-1])
    assert merged.sequences == one.sequences == 9 * 3
    np.testing.assert_allclose(merged.last_gram, one.last_gram, rtol=1e-12)
    np.testing.assert_allclose(merged.last_angular_sum, one.last_angular_sum, rtol=1e-12)
    # A part whose tokens came without their last-token sums cannot join one with them.
    bare = SimilarityStats(6)
    bare.add_normalized(torch.from_numpy(make_states(7, 5, 16)))
    with pytest.raises(ValueError, match="with and without last-token statistics"):
        merged.merge(bare)
    with pytest.raises(ValueError, match="no last-token statistics"):
        bare.last_token_matrix()


def test_version_1_files_are_refused(tmp_path) -> None:
    import json

    path = tmp_path / "old.npz"
    meta = {"format_version": 1, "n_blocks": 2}
    np.savez(path, gram=np.eye(3), tokens=np.int64(1), metadata=np.array(json.dumps(meta)))
    with pytest.raises(ValueError, match="unsupported format_version 1 .*capture the statistics"):
        SimilarityStats.from_file(path)
