"""Token windows: seeded calibration windows, evaluation windows, the BOS policy, and the
fingerprint that keys cached statistics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lorp.data.corpora import load_corpus
from lorp.data.windows import (
    BOS_POLICIES,
    calibration_fingerprint,
    calibration_windows,
    eval_windows,
    prepend_bos,
    resolve_bos,
)
from tests.helpers.tiny_models import word_tokenizer


def test_calibration_windows_seeded_from_long_documents() -> None:
    docs = [np.arange(10), np.arange(100, 400), np.arange(1000, 1050)]
    a = calibration_windows(docs, 4, 64, seed=3)
    assert a.shape == (4, 64)
    assert torch.equal(a, calibration_windows(docs, 4, 64, seed=3))
    assert not torch.equal(a, calibration_windows(docs, 4, 64, seed=4))
    for w in a:  # each window is a contiguous run of one long-enough document
        assert int(w[0]) >= 100 and int(w[-1]) < 400 and torch.all(w.diff() == 1)
    with pytest.raises(
        ValueError, match="too small: 350 tokens in documents of >= 50 tokens, 8 x 50 = 400"
    ):
        calibration_windows(docs, 8, 50, name="corpus")


def test_eval_windows() -> None:
    w = eval_windows(np.arange(1030), 256)
    assert w.shape == (4, 256) and int(w[1, 0]) == 256
    assert eval_windows(np.arange(1030), 256, max_windows=2).shape == (2, 256)
    with pytest.raises(ValueError, match="fewer than seq_len=256"):
        eval_windows(np.arange(100), 256)


def test_bos_policy_follows_the_tokenizer() -> None:
    adds = word_tokenizer(["a", "b"], add_bos=True)
    plain = word_tokenizer(["a", "b"], add_bos=False)
    none = word_tokenizer(["a", "b"], add_bos=False, with_bos_token=False)
    assert adds("a")["input_ids"] == [1, 4] and plain("a")["input_ids"] == [4]
    assert resolve_bos(adds, "auto") == 1 and resolve_bos(plain, "auto") is None
    assert resolve_bos(plain, "always") == 1 and resolve_bos(adds, "never") is None
    assert resolve_bos(none, "auto") is None and resolve_bos(none, "never") is None
    with pytest.raises(ValueError, match="bos 'always': the tokenizer has no bos_token_id"):
        resolve_bos(none, "always")
    with pytest.raises(ValueError, match="bos must be one of auto, always, never, got 'yes'"):
        resolve_bos(adds, "yes")
    assert BOS_POLICIES == ("auto", "always", "never")


def test_prepend_bos_and_the_fingerprint() -> None:
    w = torch.arange(12).reshape(3, 4)
    b = prepend_bos(w, 7)
    assert b.shape == (3, 5) and torch.equal(b[:, 0], torch.full((3,), 7))
    assert torch.equal(b[:, 1:], w) and b.dtype == w.dtype
    assert prepend_bos(w, None) is w
    corpus = load_corpus("ptb", "valid")
    plain = calibration_fingerprint(corpus, 8, 64, 0)
    assert plain == calibration_fingerprint(corpus, 8, 64, 0, bos_id=None)
    assert plain.endswith(":8x64:seed0")  # unchanged for windows without a BOS
    assert calibration_fingerprint(corpus, 8, 64, 0, bos_id=1) == plain + ":bos1"
    assert calibration_fingerprint(corpus, 8, 64, 0, bos_id=2) != plain + ":bos1"


def test_held_out_offsets_never_share_a_token_with_the_fit_windows() -> None:
    from lorp.data.windows import cut, window_offsets

    docs = [np.arange(1000) + 10_000 * i for i in range(3)]  # every token id unique
    fit = window_offsets(docs, 40, 16, seed=0)
    assert torch.equal(cut(docs, fit, 16), calibration_windows(docs, 40, 16, seed=0))
    held = window_offsets(docs, 30, 16, seed=1, avoid=fit)
    fit_tokens = set(cut(docs, fit, 16).reshape(-1).tolist())
    held_tokens = cut(docs, held, 16).reshape(-1).tolist()
    assert not fit_tokens & set(held_tokens)
    assert len(set(held_tokens)) == 30 * 16  # and apart from each other
    # without `avoid` the same seeds overlap: the construction is what keeps them apart
    loose = set(cut(docs, window_offsets(docs, 30, 16, seed=1), 16).reshape(-1).tolist())
    assert fit_tokens & loose
    with pytest.raises(ValueError, match="too small to hold 20 windows of 16 tokens apart"):
        window_offsets([np.arange(400)], 20, 16, seed=1, avoid=np.array([[0, 0]]))
