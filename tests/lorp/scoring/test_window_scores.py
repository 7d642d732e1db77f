"""What the window method ranks by, measured on the model: the relative error a window's map
leaves (on held-out windows where given), and its folded variant's loss; for runs of whole
blocks and of sub-layer units."""

from __future__ import annotations

import copy

import pytest
import torch

from lorp.models.architectures import decoder_blocks
from lorp.models.perplexity import calibration_loss
from lorp.models.sublayers import remove_sublayers
from lorp.models.surgery import drop_layers
from lorp.repair.capture import capture_repair_stats
from lorp.repair.fit import fit_runs
from lorp.repair.fold import applied_by_hooks, fold
from lorp.repair.prune_and_repair import full_fits
from lorp.repair.sublayer_repair import repair_from_stats, unit_stats, unit_T0
from lorp.scoring.window_scores import window_losses, window_scores
from tests.helpers.tiny_models import N_BLOCKS, tiny_model
from tests.helpers.windows import token_windows


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_window_scores_are_the_repaired_states_relative_error(family: str) -> None:
    """||Y + X T - H_e||^2 / ||H_e||^2 measured by running the dense model with the full
    map applied at block s-1 by a hook, against the score from the sums alone (no model:
    Gemma's T0 comes from the norm scale the statistics kept)."""
    model = tiny_model(family)
    x = token_windows(n=6)
    runs = [(1, 2), (2, 3), (3, 4)]
    stats = capture_repair_stats(model, [x], runs, progress=False)
    scores = window_scores(stats)
    if family == "gemma3_text":
        norm = decoder_blocks(model)[0].post_feedforward_layernorm
        torch.testing.assert_close(stats.base[1], norm.weight.double() + 1.0)
    fits = {f.run: f for f in full_fits(model, stats)}
    with torch.no_grad():
        dense = model(input_ids=x, output_hidden_states=True, use_cache=False).hidden_states
        for (s, e), score in scores.items():
            with applied_by_hooks(model, [fits[(s, e)]]):
                got = model(input_ids=x, output_hidden_states=True, use_cache=False).hidden_states
            target = dense[e + 1].double()
            error = float((got[s].double() - target).pow(2).sum() / target.pow(2).sum())
            assert score == pytest.approx(error, rel=2e-3)
    assert len(set(scores.values())) == 3  # the windows differ, so the ranking means something


def test_with_held_out_sums_windows_are_scored_on_the_held_out_windows() -> None:
    """The score is the relative error the validated map leaves on windows it was not
    fitted on, measured here by running those windows with the map applied by a hook."""
    model = tiny_model("llama")
    x, held = token_windows(n=6), token_windows(n=4, seed=9)
    runs = [(1, 2), (2, 3), (3, 4)]
    stats = capture_repair_stats(model, [x], runs, progress=False)
    stats.held = capture_repair_stats(model, [held], runs, progress=False)
    scores = window_scores(stats)
    with torch.no_grad():
        dense = model(input_ids=held, output_hidden_states=True, use_cache=False).hidden_states
        for (s, e), score in scores.items():
            [fit] = fit_runs(model, stats.subset([(s, e)]), ridge=None)
            with applied_by_hooks(model, [fit]):
                got = model(input_ids=held, output_hidden_states=True, use_cache=False)
            target = dense[e + 1].double()
            error = float(
                (got.hidden_states[s].double() - target).pow(2).sum() / target.pow(2).sum()
            )
            assert score == pytest.approx(error, rel=2e-3)
    fitted = window_scores(capture_repair_stats(model, [x], runs, progress=False))
    assert all(scores[r] > fitted[r] for r in runs)  # held-out error exceeds the fit's


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_window_losses_are_the_folded_variants_calibration_losses(family: str) -> None:
    """Each run's loss is that of the checkpoint a repaired point writes: the validated
    map folded, the run's blocks dropped; the model scored is left as it was."""
    model = tiny_model(family)
    x, held = token_windows(n=6), token_windows(n=4, seed=9)
    runs = [(1, 2), (2, 3), (3, 4)]
    stats = capture_repair_stats(model, [x], runs, progress=False)
    stats.held = capture_repair_stats(model, [held], runs, progress=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    losses = window_losses(model, stats, held, batch_size=3)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert len(decoder_blocks(model)) == N_BLOCKS
    for run, loss in losses.items():
        variant = copy.deepcopy(model)
        fold(variant, fit_runs(model, stats.subset([run]), ridge=None))
        drop_layers(variant, range(run[0], run[1] + 1))
        assert loss == pytest.approx(calibration_loss(variant, held), rel=1e-5)
        pruned = copy.deepcopy(model)
        drop_layers(pruned, range(run[0], run[1] + 1))
        assert loss != pytest.approx(calibration_loss(pruned, held), rel=1e-5)
    assert len(set(losses.values())) == 3
    assert window_losses(model, stats, held, runs=[(2, 3)]) == {(2, 3): losses[(2, 3)]}


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_window_losses_of_unit_runs_are_the_repaired_sublayer_variants_losses(family: str) -> None:
    """A run of sub-layer units scores the loss of the variant a repaired sub-layer point
    writes (its map folded into unit s-1's projection, its units removed; Gemma 3: the
    exact fold through its post-norms); the model scored is left as it was. A run of
    whole blocks' units scores by residual what the block run does."""
    model = tiny_model(family)
    x, held = token_windows(n=6), token_windows(n=4, seed=9)
    runs = [(2, 5), (3, 6), (5, 7)]  # blocks 1-2; mlp.1 to attn.3; mlp.2 to attn.3
    stats = unit_stats(model, runs, [x], {"": [held]})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    losses = window_losses(model, stats, held, batch_size=3, units=True)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    for (s, e), loss in losses.items():
        variant = copy.deepcopy(model)
        repair_from_stats(variant, range(s, e + 1), stats)
        assert loss == pytest.approx(calibration_loss(variant, held), rel=1e-5)
        pruned = copy.deepcopy(model)
        remove_sublayers(pruned, range(s, e + 1))
        assert loss != pytest.approx(calibration_loss(pruned, held), rel=1e-5)  # a map folded
    assert len(set(losses.values())) == 3
    if family == "gemma3_text":  # the normed starts keep their scale, as block sums do
        torch.testing.assert_close(stats.base[3], torch.diagonal(unit_T0(model, (3, 6), "normed")))
    blocks = capture_repair_stats(model, [x], [(1, 2)], progress=False)
    units = unit_stats(model, [(2, 5)], [x], None)
    assert window_scores(units)[(2, 5)] == pytest.approx(window_scores(blocks)[(1, 2)], rel=1e-4)
