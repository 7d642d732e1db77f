"""Followers: which kept blocks take a map after each cut, and the first one's map bringing
the state towards the dense model's by what its validation says."""

from __future__ import annotations

import copy

import pytest
import torch

from lorp.models.architectures import decoder_blocks
from lorp.models.surgery import drop_layers
from lorp.repair.capture import capture_repair_stats
from lorp.repair.fit import fit_runs
from lorp.repair.fold import fold
from lorp.repair.followers import fit_followers, follower_blocks
from tests.helpers.tiny_models import N_BLOCKS, tiny_model
from tests.helpers.windows import token_windows


def test_follower_blocks_are_the_kept_blocks_after_each_cut_up_to_the_next_map() -> None:
    assert follower_blocks(10, [2, 3, 6], 2) == [4, 7, 8]  # block 5 carries run 6's map
    assert follower_blocks(10, [2, 3, 6], 1) == [4, 7]
    assert follower_blocks(10, [8, 9], 3) == []  # nothing after the cut
    assert follower_blocks(10, [2, 3], 0) == []
    with pytest.raises(ValueError, match="count must be >= 0"):
        follower_blocks(10, [2], -1)


def _state_entering(
    model: torch.nn.Module, maps: list, layers: list[int], position: int, x: torch.Tensor
) -> torch.Tensor:
    """The state entering kept `position` of `model` with `maps` folded and `layers` dropped."""
    variant = copy.deepcopy(model)
    fold(variant, maps)
    drop_layers(variant, layers)
    with torch.no_grad():
        return (
            variant(input_ids=x, output_hidden_states=True, use_cache=False)
            .hidden_states[position]
            .double()
        )


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_a_follower_takes_the_state_after_its_block_towards_the_dense_models(family: str) -> None:
    """After blocks 2-3 go and their map is folded, blocks 4 and 5 take follower maps: the
    model is left as it was, and the first follower's validation figures are what the
    folded checkpoint's own states say, computed independently: the error of the state
    entering block 5 against the dense model's, with the follower and without."""
    model = tiny_model(family)
    layers, x, held = [2, 3], token_windows(n=24), token_windows(n=8, seed=9)
    stats = capture_repair_stats(model, [x], [(2, 3)], progress=False)
    stats.held = capture_repair_stats(model, [held], [(2, 3)], progress=False)
    fits = fit_runs(model, stats, ridge=None)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    followers = fit_followers(model, fits, layers, x, held, 2, batch_size=4)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert len(decoder_blocks(model)) == N_BLOCKS
    assert [f.run for f in followers] == [(5, 4), (6, 5)]
    assert followers[0].record()["follower"] == 4 and "follower" not in fits[0].record()
    first = followers[0]
    assert first.kept == "fit" and first.held_residual < first.held_unrepaired
    with torch.no_grad():
        dense = model(input_ids=held, output_hidden_states=True, use_cache=False).hidden_states[5]
    err = lambda maps: float(  # noqa: E731
        (_state_entering(model, maps, layers, 3, held) - dense.double()).pow(2).sum()
    )
    ratio = err([*fits, first]) / err(fits)
    assert ratio == pytest.approx(first.held_residual / first.held_unrepaired, rel=1e-3)
    assert ratio < 0.99
