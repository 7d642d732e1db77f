"""Distilled repair maps (`lorp.repair.distill`): trained maps fold exactly, the held-out KL the
record keeps is the folded variant's, a distillation that does not help is not kept,
and the model is left as it was found."""

from __future__ import annotations

import copy

import pytest
import torch

from lorp.models.surgery import drop_layers
from lorp.repair.capture import capture_repair_stats
from lorp.repair.distill import _applied, _Map, block_cut, distill_fits
from lorp.repair.fit import fit_runs
from lorp.repair.fold import fold
from lorp.repair.followers import fit_followers
from tests.helpers.tiny_models import tiny_model
from tests.helpers.windows import token_windows

LAYERS = [2, 3]


def kl(dense: torch.nn.Module, variant: torch.nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        p = torch.log_softmax(dense(input_ids=x, use_cache=False).logits.float(), -1)
        q = torch.log_softmax(variant(input_ids=x, use_cache=False).logits.float(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def least_squares(model: torch.nn.Module, x: torch.Tensor, held: torch.Tensor) -> list:
    stats = capture_repair_stats(model, [x[:8], x[8:]], [(2, 3)], progress=False)
    stats.held = capture_repair_stats(model, [held], [(2, 3)], progress=False)
    fits = fit_runs(model, stats)
    return fits + fit_followers(model, fits, LAYERS, x, held, 1, batch_size=8)


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "gemma3_text"])
def test_distilled_maps_fold_exactly_and_lower_the_held_out_kl(family: str) -> None:
    """Qwen2's maps are full, Gemma's orthogonal times a diagonal (Gemma 2's logits soft
    capped): all fold, the
    folded variant's KL on the held-out windows is the record's best, lower than the
    least-squares maps', and the dense model is untouched."""
    model = tiny_model(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, held = token_windows(16, seed=0), token_windows(8, seed=1)
    fits = least_squares(model, x, held)
    out = distill_fits(model, fits, LAYERS, x, held, epochs=3, lr=3e-3, autocast=False)

    record = out[0].distilled
    assert record is not None and record["best_epoch"] >= 1
    assert record["held_kl"][record["best_epoch"]] < record["held_kl"][0]
    assert [f.kept for f in out] == ["distilled"] * len(fits)
    assert [f.run for f in out] == [f.run for f in fits]  # the run's map and the follower's
    assert all(p.requires_grad for p in model.parameters())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())

    def variant(maps: list) -> torch.nn.Module:
        m = copy.deepcopy(model)
        fold(m, maps)
        drop_layers(m, LAYERS)
        return m

    distilled, plain = variant(out), variant(fits)
    best = record["held_kl"][record["best_epoch"]]
    assert kl(model, distilled, held) == pytest.approx(best, rel=1e-4)
    assert kl(model, plain, held) == pytest.approx(record["held_kl"][0], rel=1e-4)
    if family != "qwen2":  # still an orthogonal matrix: it passes the post-MLP norm
        Q = out[0].matrix
        assert torch.allclose(Q.T @ Q, torch.eye(Q.shape[0], dtype=Q.dtype), atol=1e-5)
    assert out[0].record()["distilled"]["best_epoch"] == record["best_epoch"]


def test_a_distillation_that_does_not_help_keeps_the_least_squares_maps() -> None:
    """A learning rate that throws the maps away: no epoch beats the start on the held-out
    windows, so the fits come back as given, with the record saying so."""
    model = tiny_model("llama")
    x, held = token_windows(16, seed=0), token_windows(8, seed=1)
    fits = least_squares(model, x, held)
    out = distill_fits(model, fits, LAYERS, x, held, epochs=2, lr=10.0, autocast=False)
    record = out[0].distilled
    assert record["best_epoch"] == 0 and min(record["held_kl"][1:]) > record["held_kl"][0]
    assert [f.kept for f in out] == [f.kept for f in fits]
    assert all(torch.equal(a.matrix, b.matrix) for a, b in zip(out, fits, strict=True))


def test_the_maps_apply_as_the_fold_does_before_training() -> None:
    """The hooks training runs under are the fold: the same logits, untrained (the norms'
    weights made unequal: a map applied after the norm's weight would differ)."""
    model = tiny_model("olmo2")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
    x, held = token_windows(16, seed=0), token_windows(8, seed=1)
    fits = least_squares(model, x, held)
    maps = [_Map(f) for f in fits]
    with torch.no_grad(), _applied(model, maps, block_cut(model, LAYERS)):
        hooked = model(input_ids=held, use_cache=False).logits
    folded = copy.deepcopy(model)
    fold(folded, fits)
    drop_layers(folded, LAYERS)
    with torch.no_grad():
        assert torch.allclose(folded(input_ids=held, use_cache=False).logits, hooked, atol=1e-4)


def test_bad_settings_are_refused() -> None:
    model = tiny_model("llama")
    x = token_windows(4, seed=0)
    with pytest.raises(ValueError, match="epochs must be >= 0 and lr > 0, got 1, 0"):
        distill_fits(model, [], LAYERS, x, x, epochs=1, lr=0)
