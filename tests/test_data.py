"""Corpora, calibration windows and perplexity."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
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
from lorp.models.perplexity import perplexity, window_nll
from tests.helpers.tiny_models import VOCAB, tiny_model, word_tokenizer


def test_ptb_splits() -> None:
    train, test = load_corpus("ptb", "train"), load_corpus("ptb", "test")
    assert len(train.documents) == 1 and train.documents[0].startswith("aer banknote")
    assert load_corpus("ptb", "validation").split == "valid"
    assert train.fingerprint != test.fingerprint
    with pytest.raises(ValueError, match="no split 'dev2'"):
        load_corpus("ptb", "dev2")


def test_local_files(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("one document")
    (tmp_path / "b.jsonl").write_text('{"text": "x y"}\n{"text": "z"}\n')
    (tmp_path / "c.json").write_text(json.dumps(["p", "q", ""]))
    pq.write_table(pa.table({"text": ["d1", "d2", None]}), tmp_path / "d.parquet")
    assert load_corpus(str(tmp_path / "a.txt")).documents == ("one document",)
    assert load_corpus(str(tmp_path / "b.jsonl")).documents == ("x y", "z")
    assert load_corpus(str(tmp_path / "c.json")).documents == ("p", "q")
    assert load_corpus(str(tmp_path / "d.parquet")).documents == ("d1", "d2")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ValueError, match="is empty"):
        load_corpus(str(tmp_path / "empty.txt"))
    unknown = "unknown corpus 'c4x': not a file or an alias \\(ptb, lee, wiki\\)"
    with pytest.raises(ValueError, match=unknown):
        load_corpus("c4x")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "e.parquet")
    with pytest.raises(ValueError, match="no 'text' column"):
        load_corpus(str(tmp_path / "e.parquet"))


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


def test_perplexity_equals_hand_computation() -> None:
    model = tiny_model("qwen3")
    windows = torch.randint(3, VOCAB, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(windows).logits.double()
    nll, count = 0.0, 0
    for b in range(3):
        for t in range(1, 20):
            row = logits[b, t - 1]
            nll += float(torch.logsumexp(row, 0) - row[windows[b, t]])
            count += 1
    assert count == 57
    assert perplexity(model, windows, batch_size=2) == pytest.approx(
        math.exp(nll / count), rel=1e-6
    )


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


def test_bos_windows_score_exactly_their_text_tokens() -> None:
    """Non-overlapping BOS windows predict every text token once, the first from the BOS."""
    model = tiny_model("llama")
    text = torch.randint(3, VOCAB, (60,), generator=torch.Generator().manual_seed(2))
    windows = prepend_bos(eval_windows(text, 20), 1)
    assert windows.shape == (3, 21)
    with torch.no_grad():
        nll, count = window_nll(model, windows)
    assert count == 60  # 3 windows x 20 text tokens, the BOS never a target
    with torch.no_grad():
        logits = model(windows).logits.double()
    expected = 0.0
    for b in range(3):
        for t in range(20):  # text token t sits at position t + 1, predicted at t
            row = logits[b, t]
            expected += float(torch.logsumexp(row, 0) - row[windows[b, t + 1]])
    assert nll == pytest.approx(expected, rel=1e-6)
    assert perplexity(model, windows) == pytest.approx(math.exp(expected / 60), rel=1e-6)
