"""Prune&Comp: block influence (Eq. 2) and alpha (Eq. 4) against numpy on transformers'
hidden states, step after step on the compensated model; the fold (Eq. 5) scales the
stream before the cut by alpha, or (tied embeddings) leaves the logits as that does."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from lorp import select_layers
from lorp.models.surgery import blocks_dropped, drop_layers
from lorp.peers.prune_and_comp import apply_steps, iterate, model_steps
from tests.helpers.peer_states import hidden_rows
from tests.helpers.tiny_models import N_BLOCKS, tiny_model
from tests.helpers.windows import token_windows


def _hand_step(hs: list[np.ndarray], blocks: list[int], removed: list[int]) -> tuple[int, float]:
    """The least-influence candidate and its alpha, from a model's block inputs `hs` whose
    k-th entry is the input of original block `blocks[k]`."""
    bi, alpha = {}, {}
    for k, b in enumerate(blocks):
        if 1 <= b <= N_BLOCKS - 2 and b not in removed:
            x, y = hs[k], hs[k + 1]
            cos = (x * y).sum(1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1))
            bi[b] = 1 - cos.mean()
            alpha[b] = np.linalg.norm(y, axis=1).mean() / np.linalg.norm(x, axis=1).mean()
    b = min(bi, key=lambda c: (bi[c], c))
    return b, alpha[b]


def _without_eps(model: torch.nn.Module) -> torch.nn.Module:
    """The model with its norms' eps at 1e-12: the fold is exact up to eps, and the tiny
    models' embeddings are small enough for 1e-6 to show at 1e-3."""
    for m in model.modules():
        for attr in ("variance_epsilon", "eps"):
            if isinstance(getattr(m, attr, None), float):
                setattr(m, attr, 1e-12)
    return model


def test_each_step_by_hand_on_the_model_compensated_so_far() -> None:
    dense, w = tiny_model("llama"), token_windows(6, 24)
    details = iterate(copy.deepcopy(dense), w, 2)
    b1, a1 = _hand_step(hidden_rows(dense, w), list(range(N_BLOCKS)), [])
    assert details["steps"][0]["block"] == b1
    assert details["steps"][0]["alpha"] == pytest.approx(a1, rel=1e-5)
    compensated = copy.deepcopy(dense)
    apply_steps(compensated, details["steps"][:1])
    with blocks_dropped(compensated, [b1]) as kept:
        b2, a2 = _hand_step(hidden_rows(compensated, w), kept, [b1])
    assert details["steps"][1]["block"] == b2 and details["order"] == [b1, b2]
    assert details["steps"][1]["alpha"] == pytest.approx(a2, rel=1e-5)


def test_alpha_scales_every_state_before_the_cut() -> None:
    """Untied: the embedding and blocks 0..b-1's o_proj and down_proj take alpha, so the
    pruned model's states up to the cut are alpha times the dense ones."""
    dense, w = _without_eps(tiny_model("llama")), token_windows(4, 24)
    hs = hidden_rows(dense, w)
    model = copy.deepcopy(dense)
    record = apply_steps(model, [{"block": 3, "alpha": 1.7}])
    drop_layers(model, [3])
    got = hidden_rows(model, w)
    assert record["fold"] == ["before"]
    for k in range(4):  # block k's input, k <= b: the embedding output up to block 2's output
        np.testing.assert_allclose(got[k], 1.7 * hs[k], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("family", "where"), [("llama", "before"), ("gemma3_text", "after")])
def test_the_logits_are_those_of_the_stream_scaled_at_the_cut(family: str, where: str) -> None:
    """Either fold gives the logits of the pruned model whose stream is multiplied by
    alpha where it leaves block b-1 (Gemma 3 ties its embeddings: 1/alpha after the cut)."""
    dense, w = _without_eps(tiny_model(family)), token_windows(2, 24)
    reference = copy.deepcopy(dense)
    drop_layers(reference, [3])
    scale = lambda m, a, o: (o[0] * 1.7, *o[1:]) if isinstance(o, tuple) else o * 1.7  # noqa: E731
    reference.model.layers[2].register_forward_hook(scale)
    model = copy.deepcopy(dense)
    assert apply_steps(model, [{"block": 3, "alpha": 1.7}])["fold"] == [where]
    drop_layers(model, [3])
    with torch.no_grad():
        want, got = reference(input_ids=w).logits, model(input_ids=w).logits
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_the_registered_method_runs_the_loop_on_a_copy() -> None:
    from lorp.locality.similarity import LayerSimilarity
    from tests.helpers.similarity_matrices import chain

    dense, w = tiny_model("llama"), token_windows(4, 24)
    before = [p.clone() for p in dense.parameters()]
    sim = LayerSimilarity(chain(N_BLOCKS + 1), N_BLOCKS)
    sel = select_layers(sim, 2, "prune-comp", model_steps=model_steps(dense, w))
    assert sel.layers == tuple(sorted(sel.details["order"])) and len(sel.details["steps"]) == 2
    assert all(torch.equal(p, q) for p, q in zip(dense.parameters(), before, strict=True))
    with pytest.raises(ValueError, match="chooses blocks on the model: pass model_steps="):
        select_layers(sim, 2, "prune-comp")
