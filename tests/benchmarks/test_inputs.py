"""benchmarks/inputs.py: the windows the benchmarks measure on (calibration windows from
PTB's train split, evaluation windows from a test split, in batches) and the models of a
given shape with random weights."""

from __future__ import annotations

import torch

from benchmarks.inputs import batches_of, evaluation_windows, ptb_calibration, random_model
from lorp.data.corpora import load_corpus, tokenize_documents
from lorp.data.windows import calibration_windows
from tests.helpers.tiny_models import word_tokenizer


def test_windows_are_cut_into_batches_in_order_the_last_one_short() -> None:
    windows = torch.arange(5 * 3).reshape(5, 3)
    got = batches_of(windows.tolist(), size=2)
    assert [b.shape[0] for b in got] == [2, 2, 1]
    assert torch.equal(torch.cat(got), windows)


def test_calibration_and_evaluation_windows_come_from_their_splits(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Calibration: seed 0's windows of PTB train (here the test split stands in for it:
    tokenizing the whole train split takes seconds); evaluation: the test split's first
    tokens, consecutive, with the BOS first where one is given."""
    import benchmarks.inputs as inputs

    test_split = load_corpus("ptb", "test")
    words = sorted(set(next(iter(test_split.documents)).split()))
    tok = word_tokenizer(words, add_bos=False)
    asked = []
    monkeypatch.setattr(inputs, "load_corpus", lambda *a: asked.append(a) or test_split)
    cal = ptb_calibration(tok, 3, 16)
    assert asked == [("ptb", "train")]
    docs = tokenize_documents(tok, test_split)
    assert torch.equal(cal, calibration_windows(docs, 3, 16, seed=0))
    plain = evaluation_windows(tok, "ptb", 2, 8)
    assert asked[-1] == ("ptb", "test")
    assert torch.equal(plain, torch.as_tensor(docs[0][:16]).reshape(2, 8))
    with_bos = evaluation_windows(tok, "ptb", 2, 8, bos=1)
    assert with_bos.shape == (2, 9) and (with_bos[:, 0] == 1).all()
    assert torch.equal(with_bos[:, 1:], plain)


def test_a_random_model_has_the_shape_asked_for_and_the_same_weights_each_time() -> None:
    fields = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    fields |= {"num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 100}
    model = random_model("llama", **fields)
    assert not model.training and model.config.num_hidden_layers == 2
    assert next(model.parameters()).dtype == torch.float32
    again = random_model("llama", **fields)
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True)
    )
