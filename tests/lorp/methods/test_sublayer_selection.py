"""Selecting sub-layers from an S over 2N + 1 boundaries: ShortGPT per unit, LoRP's
clusters over all units with the budget spent on the granularity's, blocks from the even
boundaries, and one-line refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lorp.locality.similarity import LayerSimilarity
from lorp.methods import select_layers
from lorp.methods.sublayer_selection import (
    block_similarity,
    check_sublayer_method,
    select_units,
    sublayer_influence,
)
from lorp.models.architectures import decoder_blocks
from lorp.models.perplexity import calibration_loss
from lorp.models.sublayers import block_units, eligible_units, sublayers_removed, unit_label
from lorp.scoring.removal_loss import LossEvaluator
from tests.helpers.loss_oracle import argmin
from tests.helpers.similarity_matrices import chain, random_S, set_sym
from tests.helpers.tiny_models import tiny_model

N = 6  # blocks: 12 units, 13 boundaries


def unit_S() -> LayerSimilarity:
    """A chain over 13 boundaries with three units made nearly idle: attn.2 (unit 4),
    attn.4 (unit 8) and mlp.3 (unit 7)."""
    S = chain(2 * N + 1, 0.7)
    for u, value in [(4, 0.99), (8, 0.98), (7, 0.995), (0, 0.999)]:
        set_sym(S, u, u + 1, value)
    return LayerSimilarity(S, 2 * N)


def test_shortgpt_per_unit_takes_the_idlest_units_of_the_granularity() -> None:
    sim = unit_S()
    bi = sublayer_influence(sim)
    assert bi[7] == pytest.approx(0.005)
    attention = select_units(sim, 2, "attention", "shortgpt")
    assert attention.layers == (4, 8)  # attn.0 is idler still, but block 0 stays
    assert attention.details["sublayers"] == ["attn.2", "attn.4"]
    assert attention.n_blocks == 2 * N and attention.budget == 2
    assert select_units(sim, 1, "mlp", "shortgpt").layers == (7,)
    assert select_units(sim, 2, "mixed", "shortgpt").layers == (4, 7)


def test_lorp_spends_an_attention_budget_on_attention_units_only() -> None:
    S = random_S(2 * N + 1, seed=3)
    sim = LayerSimilarity(S, 2 * N)
    for granularity, parity in [("attention", 0), ("mlp", 1)]:
        sel = select_units(sim, 3, granularity, "lorp", k=3)
        assert len(sel.layers) == 3
        assert all(u % 2 == parity and 0 < u // 2 < N - 1 for u in sel.layers)
        assert len(sel.details["labels"]) == 2 * N  # clusters over every unit
    mixed = select_units(sim, 5, "mixed", "lorp", k=3)
    assert len(mixed.layers) == 5 and {u % 2 for u in mixed.layers} <= {0, 1}


def test_block_granularity_is_the_block_method_on_the_even_boundaries() -> None:
    sim = LayerSimilarity(random_S(2 * N + 1, seed=1), 2 * N)
    for method in ("shortgpt", "lorp", "streamline"):
        sel = select_units(sim, 2, "block", method)
        blocks = select_layers(block_similarity(sim), 2, method).layers
        assert sel.layers == tuple(u for b in blocks for u in (2 * b, 2 * b + 1))
        assert sel.details["blocks"] == list(blocks)
    np.testing.assert_array_equal(block_similarity(sim).matrix, sim.matrix[::2, ::2])


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda s: select_units(s, 5, "attention", "shortgpt"), r"budget: 5 attention units"),
        (lambda s: select_units(s, 0, "mlp", "lorp"), "budget: 0"),
        (
            lambda s: select_units(s, 2, "attention", "lorp-loss"),
            "method: 'lorp-loss' has no sub-layer",
        ),
        (
            lambda s: select_units(s, 2, "attention", "sleb"),
            "'sleb' scores candidate models: pass losses=.* sub-layer units",
        ),
        (lambda s: select_units(s, 2, "heads", "lorp"), "granularity: must be one of"),
        (
            lambda s: select_units(s, 2, "attention", "window", repair_scores=lambda r, x: r),
            "method: 'window' removes a contiguous run, and 'attention' units are not",
        ),
        (lambda s: select_units(s, 2, "mixed", "window"), "'window' ranks runs .* repair_scores="),
        (
            lambda s: select_units(
                s, 2, "mixed", "window", repair_scores=lambda r, x: [0.0] * len(r), score="kl"
            ),
            "score",
        ),
        (
            lambda s: select_units(LayerSimilarity(s.matrix[:12, :12], 11), 2, "mlp", "lorp"),
            "needs the sub-layer S",
        ),
    ],
)
def test_bad_points_are_refused_in_one_line(call, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        call(unit_S())
    check_sublayer_method("lorp-loss", "block")  # any method runs on whole blocks


def test_sleb_per_unit_removes_greedily_by_the_loss_of_the_model_without_them(
    windows: torch.Tensor,
) -> None:
    """SLEB's sub-layer form on a real tiny model: every step removes the eligible unit of
    lowest loss given those gone, as brute force over `sublayers_removed` finds; at block
    granularity a block is its two units."""
    model = tiny_model("llama")
    n = len(decoder_blocks(model))
    evaluator = LossEvaluator(model, windows, batch_size=2, units=True)
    sim = LayerSimilarity(random_S(2 * n + 1, seed=1), 2 * n)

    def loss(units: tuple[int, ...]) -> float:
        with sublayers_removed(model, units):
            return calibration_loss(model, windows, batch_size=2)

    for granularity in ("mixed", "attention"):
        pool, removed = eligible_units(granularity, n), []
        for _ in range(3):
            rest = [u for u in pool if u not in removed]
            gone = tuple(removed)
            removed.append(argmin(rest, lambda u, gone=gone: loss(tuple(sorted({*gone, u})))))
        sel = select_units(sim, 3, granularity, "sleb", losses=evaluator)
        assert sel.details["order"] == [unit_label(u) for u in removed]
        assert sel.layers == tuple(sorted(removed))
        assert sel.details["n_evals"] == 3 * len(pool) - 3
    assert all(u % 2 == 0 for u in sel.layers)
    by_blocks = select_units(sim, 2, "block", "sleb", losses=evaluator)
    blocks = select_layers(
        block_similarity(sim), 2, "sleb", losses=LossEvaluator(model, windows, batch_size=2)
    )
    assert by_blocks.details["blocks"] == list(blocks.layers)
    assert by_blocks.layers == tuple(block_units(blocks.layers))


def test_ppl_per_unit_removes_the_units_whose_lone_removal_costs_least(
    windows: torch.Tensor,
) -> None:
    """Shortened LLaMA's criterion per unit on a real tiny model: one round scoring each
    eligible unit of blocks keep_first..N-1-keep_last alone; the `budget` lowest go, as
    brute force over `sublayers_removed` finds. A budget beyond the pool is one line."""
    model = tiny_model("llama")
    n = len(decoder_blocks(model))
    evaluator = LossEvaluator(model, windows, batch_size=2, units=True)
    sim = LayerSimilarity(random_S(2 * n + 1, seed=1), 2 * n)

    def loss(unit: int) -> float:
        with sublayers_removed(model, (unit,)):
            return calibration_loss(model, windows, batch_size=2)

    keep = {"keep_first": 1, "keep_last": 1}
    pool = [u for u in eligible_units("mixed", n) if 1 <= u // 2 < n - 1]
    expected = sorted(pool, key=lambda u: (round(loss(u), 12), u))[:3]
    sel = select_units(sim, 3, "mixed", "ppl", losses=evaluator, **keep)
    assert sel.layers == tuple(sorted(expected))
    assert sel.details["order"][:3] == [unit_label(u) for u in expected]
    assert sel.details["n_evals"] == len(pool)
    with pytest.raises(ValueError, match=r"budget 3 exceeds the 2 candidate attention units"):
        select_units(sim, 3, "attention", "ppl", losses=evaluator, keep_first=2, keep_last=2)


def test_finercut_removes_greedily_what_moves_the_output_distribution_least(
    windows: torch.Tensor,
) -> None:
    """FinerCut on a real tiny model: each step removes the eligible unit whose removal,
    with those gone, gives the least JS divergence from the dense outputs, as brute force
    over `sublayers_removed` finds; the registry says its losses measure JS, and its pick
    differs from SLEB's here (a different measure, not a renamed one)."""
    from lorp.methods.sublayer_selection import loss_measure
    from tests.helpers.loss_oracle import js_oracle

    model = tiny_model("llama")
    n = len(decoder_blocks(model))
    js = LossEvaluator(model, windows, batch_size=2, units=True, measure="js")
    sim = LayerSimilarity(random_S(2 * n + 1, seed=1), 2 * n)
    with torch.no_grad():
        dense = model(input_ids=windows).logits

    def divergence(units: tuple[int, ...]) -> float:
        with sublayers_removed(model, units), torch.no_grad():
            return js_oracle(dense, model(input_ids=windows).logits)

    pool, removed = eligible_units("mixed", n), []
    for _ in range(3):
        rest, gone = [u for u in pool if u not in removed], tuple(removed)
        removed.append(argmin(rest, lambda u, gone=gone: divergence(tuple(sorted({*gone, u})))))
    sel = select_units(sim, 3, "mixed", "finercut", losses=js)
    assert sel.details["order"] == [unit_label(u) for u in removed]
    assert sel.details["picked_loss"][-1] == pytest.approx(divergence(tuple(removed)), rel=1e-4)
    assert loss_measure("finercut") == "js" and loss_measure("sleb") == "nll"
    nll = LossEvaluator(model, windows, batch_size=2, units=True)
    assert select_units(sim, 3, "mixed", "sleb", losses=nll).layers != sel.layers
    by_blocks = select_units(sim, 2, "block", "finercut", losses=js)
    block_js = LossEvaluator(model, windows, batch_size=2, measure="js")
    blocks = select_layers(block_similarity(sim), 2, "finercut", losses=block_js)
    assert by_blocks.details["blocks"] == list(blocks.layers)


def test_window_per_unit_removes_the_consecutive_units_whose_repair_scores_lowest() -> None:
    """At mixed granularity the candidates are every run of `budget` consecutive units
    from attn.1 to mlp.N-2 (attentions and MLPs alternate); the run scored lowest goes,
    the shallower of equals; `score` reaches the scorer; the block form gets block runs."""
    asked: list[tuple[list[tuple[int, int]], str]] = []

    def scores(runs: list[tuple[int, int]], score: str) -> list[float]:
        asked.append((runs, score))
        return [{(3, 5): 0.1, (6, 8): 0.1}.get(r, 0.5) for r in runs]

    sel = select_units(unit_S(), 3, "mixed", "window", repair_scores=scores, score="loss")
    assert asked == [([(2, 4), (3, 5), (4, 6), (5, 7), (6, 8), (7, 9)], "loss")]
    assert sel.layers == (3, 4, 5) and sel.details["window_start"] == "mlp.1"
    assert sel.details["sublayers"] == ["mlp.1", "attn.2", "mlp.2"]
    assert sel.details["window_loss"]["mlp.1"] == 0.1
    with pytest.raises(ValueError, match="option 'last_block'"):
        select_units(unit_S(), 3, "mixed", "window", repair_scores=scores, last_block=True)
    asked.clear()
    blocks = select_units(unit_S(), 2, "block", "window", repair_scores=scores)
    assert asked[0][0] == [(1, 2), (2, 3), (3, 4)] and blocks.details["blocks"] == [1, 2]
