"""Sub-layer units: labels, candidates, refusals, and removal on every family (both halves
of a block removed is the block dropped; a removed attention still generates)."""

from __future__ import annotations

import copy

import pytest
import torch

from lorp.models.sublayers import (
    block_units,
    budget_limit,
    candidate_units,
    check_units,
    kept_attention_blocks,
    kept_mlp_blocks,
    parse_unit_label,
    remove_sublayers,
    sublayer_parameters,
    sublayers_removed,
    unit_label,
)
from lorp.models.surgery import drop_layers
from tests.helpers.repair_runs import logits
from tests.helpers.tiny_models import FAMILIES, tiny_model
from tests.helpers.windows import token_windows


def test_units_labels_and_candidates() -> None:
    assert [unit_label(u) for u in range(4)] == ["attn.0", "mlp.0", "attn.1", "mlp.1"]
    assert all(parse_unit_label(unit_label(u)) == u for u in range(60))
    assert candidate_units("attention", 3) == [0, 2, 4]
    assert candidate_units("mlp", 3) == [1, 3, 5]
    assert candidate_units("mixed", 2) == [0, 1, 2, 3]
    assert block_units([1, 3]) == [2, 3, 6, 7]
    assert (budget_limit("block", 30), budget_limit("attention", 30)) == (28, 28)
    assert budget_limit("mixed", 30) == 56
    assert kept_attention_blocks(4, [2, 5]) == [0, 2, 3]
    assert kept_mlp_blocks(4, [2, 5]) == [0, 1, 3]


@pytest.mark.parametrize(
    ("units", "message"),
    [
        ([0], "attn.0 cannot be removed"),
        ([12], r"must be in \[0, 11\]"),
        ([], "empty"),
        (list(range(1, 12)) + [0], "attn.0"),
    ],
)
def test_bad_units_are_refused_in_one_line(units: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_units(units, 6)
    with pytest.raises(ValueError, match="granularity: must be one of"):
        candidate_units("heads", 6)
    with pytest.raises(ValueError, match=r"sub-layer 'att.3'"):
        parse_unit_label("att.3")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_removing_both_halves_of_a_block_is_dropping_it(family: str) -> None:
    model = tiny_model(family)
    x = token_windows(n=2, T=20)
    dense = logits(model, x)
    dropped = copy.deepcopy(model)
    drop_layers(dropped, [2, 4])
    with sublayers_removed(model, block_units([2, 4])):
        inside = logits(model, x)
        assert not torch.allclose(inside, dense)
    torch.testing.assert_close(inside, logits(dropped, x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits(model, x), dense, rtol=0, atol=0)  # restored


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text", "olmo2"])
def test_an_attention_removed_model_generates_as_its_forward_predicts(family: str) -> None:
    model = tiny_model(family)
    remove_sublayers(model, [2, 6, 9])  # attn.1, attn.3, mlp.4
    assert type(model.model.layers[1].self_attn).__name__ == "Removed"
    prompt = token_windows(n=1, T=10)
    out = model.generate(prompt, max_new_tokens=5, do_sample=False, use_cache=True)
    ids = prompt
    for _ in range(5):  # greedy, no cache: what generate must reproduce
        nxt = logits(model, ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    assert out.tolist() == ids.tolist()


def test_sublayer_parameters_count_the_modules() -> None:
    model = tiny_model("llama")  # d 64, 2 heads and 1 KV head of 32, intermediate 128
    attention = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64
    assert sublayer_parameters(model, [2]) == attention
    assert sublayer_parameters(model, [3]) == 3 * 64 * 128
    assert sublayer_parameters(model, [2, 3, 5]) == attention + 2 * 3 * 64 * 128
