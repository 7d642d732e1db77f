"""FinerCut over whole blocks: SLEB's greedy search, each candidate scored by the JS
divergence of its outputs from the dense model's, which the registry tells the caller to
measure."""

from __future__ import annotations

import pytest
import torch

from lorp import select_layers
from lorp.methods import get_method, register_method, unregister_method
from lorp.models.surgery import blocks_dropped
from lorp.scoring.removal_loss import LossEvaluator
from tests.helpers.loss_oracle import Recorder, argmin, damage, js_oracle
from tests.helpers.similarity_matrices import locality_matrix
from tests.helpers.tiny_models import tiny_model

S6 = locality_matrix((3, 3))


def test_finercut_removes_the_blocks_that_move_the_output_least(windows: torch.Tensor) -> None:
    """On a real tiny model: each step removes the block whose removal, with those gone,
    gives the least JS divergence from the dense outputs, as brute force finds."""
    model = tiny_model("llama")
    with torch.no_grad():
        dense = model(input_ids=windows).logits

    def divergence(blocks: tuple[int, ...]) -> float:
        with blocks_dropped(model, blocks), torch.no_grad():
            return js_oracle(dense, model(input_ids=windows).logits)

    first = argmin([1, 2, 3, 4], lambda b: divergence((b,)))
    rest = [b for b in (1, 2, 3, 4) if b != first]
    second = argmin(rest, lambda b: divergence(tuple(sorted((first, b)))))
    js = LossEvaluator(model, windows, batch_size=2, measure="js")
    sel = select_layers(S6, 2, "finercut", losses=js)
    assert sel.details["order"] == [first, second] and sel.details["n_evals"] == 4 + 3
    assert sel.details["picked_loss"][1] == pytest.approx(divergence(sel.layers), rel=1e-4)
    assert get_method("finercut").measure == "js" and get_method("sleb").measure == "nll"


def test_finercut_keeps_the_barriers_its_options_set() -> None:
    rec = Recorder(damage(8))
    sel = select_layers(locality_matrix((4, 4)), 3, "finercut", losses=rec, keep_last=3)
    assert sel.details["candidates"] == [1, 2, 3, 4] and [len(c) for c in rec.calls] == [4, 3, 2]
    with pytest.raises(ValueError, match="keep_first"):
        select_layers(S6, 1, "finercut", losses=rec, keep_first=-1)


def test_a_method_may_only_measure_what_callers_can_score() -> None:
    with pytest.raises(ValueError, match=r"method 'odd': measure must be one of \('nll', 'js'\)"):

        @register_method("odd", needs_evaluator=True, measure="kl")
        def odd(similarity, budget, *, losses=None):  # type: ignore[no-untyped-def]  # noqa: ARG001
            raise AssertionError

    unregister_method("odd")


def test_a_callable_measuring_the_loss_is_refused_for_finercut(windows: torch.Tensor) -> None:
    """A method and its losses must agree on what they measure: the loss evaluator handed
    to FinerCut (or the JS one to SLEB), over blocks or units, is one line, not a SLEB
    selection labelled FinerCut."""
    from lorp.locality.similarity import LayerSimilarity
    from lorp.methods.sublayer_selection import select_units
    from tests.helpers.similarity_matrices import random_S

    model = tiny_model("llama")
    nll = LossEvaluator(model, windows, batch_size=2)
    with pytest.raises(ValueError, match="'finercut' ranks by 'js', but its losses= measure 'nll'"):
        select_layers(S6, 1, "finercut", losses=nll)
    js = LossEvaluator(model, windows, batch_size=2, units=True, measure="js")
    unit_S = LayerSimilarity(random_S(13, seed=1), 12)  # the tiny model's 12 units
    with pytest.raises(ValueError, match="'sleb' ranks by 'nll', but its losses= measure 'js'"):
        select_units(unit_S, 1, "mixed", "sleb", losses=js)
    assert nll.n_evals == js.n_evals == 0  # refused before scoring anything


def test_js_is_finite_where_a_logit_is_minus_infinity() -> None:
    from lorp.scoring.removal_loss import js_divergence_sum

    a = torch.tensor([[[1.0, 2.0, float("-inf")]]])
    b = torch.tensor([[[2.0, 1.0, float("-inf")]]])
    p, q = a[..., :2].softmax(-1), b[..., :2].softmax(-1)
    m = (p + q) / 2
    want = float(0.5 * (p * (p / m).log()).sum() + 0.5 * (q * (q / m).log()).sum())
    assert js_divergence_sum(a, b) == pytest.approx(want, rel=1e-6)
