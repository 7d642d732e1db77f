"""`LossEvaluator` drives the loss-guided methods with the really pruned tiny models' losses,
bit for bit through shared prefixes, and leaves the model as it found it."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from lorp import select_layers
from lorp.models.architectures import decoder_blocks
from lorp.models.perplexity import calibration_loss
from lorp.models.surgery import blocks_dropped, drop_layers
from lorp.scoring.removal_loss import LossEvaluator
from tests.helpers.loss_oracle import argmin, js_oracle
from tests.helpers.model_checks import assert_unchanged, snapshot
from tests.helpers.similarity_matrices import locality_matrix
from tests.helpers.tiny_models import FAMILIES, tiny_model

S6 = locality_matrix((3, 3))


def test_loss_evaluator_drives_sleb_ppl_and_lorp_loss(windows: torch.Tensor) -> None:
    model = tiny_model("llama")
    before = snapshot(model)
    evaluator = LossEvaluator(model, windows, batch_size=2)

    def brute(dropped: tuple[int, ...]) -> float:
        pruned = copy.deepcopy(model)
        if dropped:
            drop_layers(pruned, dropped)
        return calibration_loss(pruned, windows)

    assert evaluator([()]) == [pytest.approx(brute(()), abs=1e-9)]
    single = {b: brute((b,)) for b in range(1, 5)}
    first = argmin(list(single), single.__getitem__)
    second = argmin([b for b in single if b != first], lambda b: brute(tuple(sorted((first, b)))))

    n0 = evaluator.n_evals
    sel = select_layers(S6, 2, "sleb", losses=evaluator)
    assert sel.details["order"] == [first, second]
    assert sel.details["n_evals"] == evaluator.n_evals - n0 == 7
    for b, loss in sel.details["step_losses"][0].items():
        assert loss == pytest.approx(single[b], abs=1e-6)

    sel = select_layers(S6, 2, "ppl", losses=evaluator, keep_first=1, keep_last=1)
    assert list(sel.layers) == sorted(sorted(single, key=lambda b: (single[b], b))[:2])

    sel = select_layers(S6, 2, "lorp-loss", losses=evaluator, k=2)
    assert sel.details["counts"] == [1, 1]  # clusters {0, 1, 2} and {3, 4, 5}
    assert sel.layers == (argmin([1, 2], single.__getitem__), argmin([3, 4], single.__getitem__))
    assert sel.details["n_evals"] == 4
    assert_unchanged(model, before)
    assert not model.training


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_loss_evaluator_shares_prefixes_bit_identically(family: str, windows: torch.Tensor) -> None:
    """Candidates reuse the hidden state at their shared prefix of kept blocks: every loss
    equals the plain forward of the pruned model bit for bit, in fewer block passes."""
    model = tiny_model(family)
    before = snapshot(model)
    n = len(decoder_blocks(model))
    cands = [(b,) for b in range(n)] + [(1, b) for b in range(2, n)] + [(), (0, 2, 3, 4, 5)]
    cands += [(3, 1), (3,)]  # the same sets again, one unsorted: scored once, answered twice
    cands = cands[::-1]  # order does not matter; values come back in the asked order
    passes = [0]
    hooks = [
        b.register_forward_hook(lambda *_: passes.__setitem__(0, passes[0] + 1))
        for b in decoder_blocks(model)
    ]
    try:
        shared = LossEvaluator(model, windows, batch_size=2)(cands)
    finally:
        for h in hooks:
            h.remove()
    plain = []
    for c in cands:
        with blocks_dropped(model, c):
            plain.append(calibration_loss(model, windows, batch_size=2))
    assert shared == plain  # bit-identical: each block sees exactly its usual input
    batches = math.ceil(len(windows) / 2)
    every = sum(n - len(c) for c in cands) * batches
    assert passes[0] < 0.7 * every, (passes[0], every)
    assert_unchanged(model, before)
    assert all(not b._forward_pre_hooks and not b._forward_hooks for b in decoder_blocks(model))


def test_loss_evaluator_refuses_bad_windows_in_one_line() -> None:
    model = tiny_model("llama")
    for bad in (torch.zeros((0, 8), dtype=torch.long), torch.zeros((2, 1), dtype=torch.long)):
        with pytest.raises(ValueError, match=r"windows must be \[n >= 1, T >= 2\]"):
            LossEvaluator(model, bad)
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        LossEvaluator(model, torch.zeros((2, 8), dtype=torch.long), batch_size=0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_loss_evaluator_scores_sublayer_units_bit_identically(
    family: str, windows: torch.Tensor
) -> None:
    """With units=True a candidate is a set of sub-layers: its loss is the plain forward of
    the model without them (a block that loses both is dropped), through shared prefixes,
    and the model is left as it was."""
    from lorp.models.sublayers import block_units, sublayers_removed

    model = tiny_model(family)
    before = snapshot(model)
    n = len(decoder_blocks(model))
    cands = [(u,) for u in range(1, 2 * n)] + [(2, 5), (5, 2), (4, 5, 8), ()]
    cands += [tuple(block_units([1, 3]))]  # two whole blocks, as units
    shared = LossEvaluator(model, windows, batch_size=2, units=True)(cands)
    plain = []
    for c in cands:
        with sublayers_removed(model, c) if c else blocks_dropped(model, []):
            plain.append(calibration_loss(model, windows, batch_size=2))
    assert shared == pytest.approx(plain, rel=1e-6, abs=1e-7)
    assert len(set(shared)) > len(cands) // 2  # removals really differ
    blocks = LossEvaluator(model, windows, batch_size=2)([(1, 3)])
    assert shared[-1] == pytest.approx(blocks[0], rel=1e-6)
    assert_unchanged(model, before)
    assert all(not b._forward_pre_hooks and not b._forward_hooks for b in decoder_blocks(model))
    with pytest.raises(ValueError, match="attn.0 cannot be removed"):
        LossEvaluator(model, windows, units=True)([(0,)])


@pytest.mark.parametrize("units", [False, True])
def test_js_measure_is_the_divergence_of_the_pruned_outputs_from_the_dense_ones(
    units: bool, windows: torch.Tensor
) -> None:
    """FinerCut's measure: with measure="js" a candidate's value is the mean JS divergence
    per position between its next-token distributions and the dense model's, through the
    shared prefixes, for block and unit candidates alike; the dense model scores 0."""
    from lorp.models.sublayers import sublayers_removed

    model = tiny_model("llama")
    before = snapshot(model)
    with torch.no_grad():
        dense = model(input_ids=windows).logits
    cands = [(2,), (3,), (2, 5), (1, 4)] if units else [(1,), (3,), (1, 2), (2, 4)]
    got = LossEvaluator(model, windows, batch_size=2, units=units, measure="js")([(), *cands])
    expected = []
    for c in cands:
        with sublayers_removed(model, c) if units else blocks_dropped(model, c), torch.no_grad():
            expected.append(js_oracle(dense, model(input_ids=windows).logits))
    assert got[0] == pytest.approx(0.0, abs=1e-6)
    assert got[1:] == pytest.approx(expected, rel=1e-4)
    assert min(expected) > 1e-4 and len(set(round(v, 6) for v in expected)) == len(cands)
    assert all(v < math.log(2) for v in got)  # JS is bounded by ln 2
    assert_unchanged(model, before)
    with pytest.raises(ValueError, match="measure: must be one of nll, js, got 'kl'"):
        LossEvaluator(model, windows, measure="kl")
