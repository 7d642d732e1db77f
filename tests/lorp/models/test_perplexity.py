"""Perplexity against the hand computation, with and without a BOS first: each text token
predicted exactly once, the BOS never a target."""

from __future__ import annotations

import math

import pytest
import torch

from lorp.data.windows import (
    eval_windows,
    prepend_bos,
)
from lorp.models.perplexity import perplexity, window_losses, window_nll
from tests.helpers.tiny_models import VOCAB, tiny_model


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


def test_window_losses_are_each_windows_mean_nll_in_order() -> None:
    """A window's loss is its own tokens' mean NLL (batches of 2 over 3 windows: the last
    short), and exp of their mean is the perplexity (every window predicts T - 1)."""
    model = tiny_model("llama")
    windows = torch.randint(3, VOCAB, (3, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logp = torch.log_softmax(model(windows).logits[:, :-1].double(), dim=-1)
    hand = (-logp.gather(-1, windows[:, 1:, None]).squeeze(-1)).mean(dim=1).tolist()
    losses = window_losses(model, windows, batch_size=2)
    assert losses == pytest.approx(hand, rel=1e-6)
    ppl = perplexity(model, windows, batch_size=2)
    assert math.exp(sum(losses) / 3) == pytest.approx(ppl, rel=1e-9)


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


@pytest.mark.parametrize(
    ("family", "dtype", "rows"),
    [
        ("gemma3_text", torch.float32, None),
        ("llama", torch.bfloat16, None),
        ("llama", torch.bfloat16, 2),
    ],
)
def test_window_nll_is_the_float64_log_softmax_nll(
    family: str, dtype: torch.dtype, rows: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NLL = logsumexp(logits) - the target's logit, summed: within 1e-6 of log_softmax
    in float64 over the model's own logits (float32 or bfloat16), every position but the
    first a target; scored whole or two rows at a time (39 rows a window: the last chunk
    holds one)."""
    if rows is not None:
        monkeypatch.setattr("lorp.models.perplexity.NLL_CHUNK", rows * VOCAB + VOCAB - 1)
    model = tiny_model(family, dtype=dtype)
    windows = torch.randint(3, VOCAB, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        nll, count = window_nll(model, windows)
        logits = model(input_ids=windows, use_cache=False).logits[:, :-1].double()
    logp = torch.log_softmax(logits, dim=-1)
    expected = -float(logp.gather(-1, windows[:, 1:, None]).sum())
    assert count == 3 * 39
    assert abs(nll - expected) <= 1e-6 * abs(expected)
