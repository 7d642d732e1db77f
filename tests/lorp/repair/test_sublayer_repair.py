"""The repair of removed sub-layers: its fold into `o_proj` / `down_proj` (and a post-norm)
equals the fitted map applied by hooks on every kind of site, it closes part of the gap
on held-out windows, and a sequential fit of one run is the one-pass fit."""

from __future__ import annotations

import copy

import pytest
import torch

from lorp.models.sublayers import map_sites, remove_sublayers
from lorp.repair.maps import residual_of
from lorp.repair.stats import rms_unit
from lorp.repair.sublayer_repair import (
    capture_unit_stats,
    fit_unit_runs,
    fold_units,
    repair_sublayers,
    unit_runs,
)
from tests.helpers.repair_runs import batches, logits
from tests.helpers.tiny_models import tiny_model
from tests.helpers.windows import token_windows

UNITS = [4, 7, 8]  # attn.2 (after mlp.1), and mlp.3 + attn.4 (after attn.3)
NORMED = {"gemma3_text", "olmo2"}


def by_hooks(model: torch.nn.Module, fits) -> list:  # type: ignore[no-untyped-def]
    """Each fit's map applied to its site's output by a forward hook (no weight changes)."""
    handles = []
    for fit in fits:
        T = fit.matrix if fit.scale is None else fit.matrix * fit.scale
        normed = fit.form == "normed"

        def hook(module, args, output, T=T, normed=normed):  # type: ignore[no-untyped-def]
            out = output[0] if isinstance(output, tuple) else output
            x = rms_unit(module, args[0]).double() if normed else out.double()
            new = (x @ T).to(out.dtype)
            return (new, *output[1:]) if isinstance(output, tuple) else new

        for site in map_sites(model, fit.run[0] - 1, normed):
            handles.append(site.register_forward_hook(hook))
    return handles


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text", "olmo2"])
def test_fold_equals_the_map_applied_by_hooks(family: str) -> None:
    dense = tiny_model(family)
    x = token_windows(n=12, T=24)
    runs = unit_runs(dense, UNITS)
    assert runs == [(4, 4), (7, 8)]
    stats = capture_unit_stats(dense, batches(x), runs)
    fits = fit_unit_runs(dense, stats, ridge=1e-3)
    assert [f.form for f in fits] == ["normed" if family in NORMED else "full"] * 2
    for f in fits:  # the fit closes part of the gap the removal leaves
        assert f.residual < 0.9 * f.unrepaired
    folded = copy.deepcopy(dense)
    fold_units(folded, fits)
    remove_sublayers(folded, UNITS)
    hooked = copy.deepcopy(dense)
    remove_sublayers(hooked, UNITS)
    handles = by_hooks(hooked, fits)
    try:
        expect = logits(hooked, x)
    finally:
        for h in handles:
            h.remove()
    torch.testing.assert_close(logits(folded, x), expect, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(logits(hooked, x), expect, atol=1e-3)  # the maps do something


def test_validated_repair_is_no_worse_on_held_out_windows_and_closer_to_dense() -> None:
    dense = tiny_model("llama")
    fit_x, held_x = token_windows(n=16, T=24, seed=0), token_windows(n=8, T=24, seed=9)
    repaired = copy.deepcopy(dense)
    fits = repair_sublayers(repaired, UNITS, batches(fit_x), held={"": batches(held_x)})
    assert {f.kept for f in fits} <= {"fit", "unrepaired"}
    for f in fits:
        assert f.held_residual is not None and f.held_residual <= f.held_unrepaired
    assert any(f.kept == "fit" for f in fits)
    unrepaired = copy.deepcopy(dense)
    remove_sublayers(unrepaired, UNITS)
    target = logits(dense, held_x)
    gap = lambda m: float((logits(m, held_x) - target).pow(2).mean())  # noqa: E731
    assert gap(repaired) < gap(unrepaired)


def test_a_sequential_fit_of_one_run_is_the_one_pass_fit_and_later_runs_differ() -> None:
    dense = tiny_model("qwen2")
    x = token_windows(n=12, T=24)
    one, seq = copy.deepcopy(dense), copy.deepcopy(dense)
    a = repair_sublayers(one, UNITS, batches(x), ridge=1e-3)
    b = repair_sublayers(seq, UNITS, batches(x), ridge=1e-3, sequential=True)
    torch.testing.assert_close(a[0].matrix, b[0].matrix)  # nothing removed before run 1
    assert not torch.allclose(a[1].matrix, b[1].matrix, atol=1e-6)  # run 2 sees run 1's cut
    # The sequential fit's sums of run 2 are taken on the model without run 1: its own
    # residual on them is what the fit reports.
    stats = capture_unit_stats(dense, batches(x), [(7, 8)])
    A, B = stats.gram[7].double(), stats.cross[(7, 8)].double()
    assert residual_of(A, B, stats.energy[(7, 8)], a[1].matrix) == pytest.approx(a[1].residual)


def mean_kl(dense: torch.nn.Module, variant: torch.nn.Module, x: torch.Tensor) -> float:
    """Mean KL(dense || variant) of the next-token distribution over every position."""
    p, q = (torch.log_softmax(logits(m, x).double(), -1) for m in (dense, variant))
    return float((p.exp() * (p - q)).sum(-1).mean())


def test_distilled_unit_maps_fold_to_the_held_out_kl_they_were_kept_for() -> None:
    """Distillation trains the maps through hooks on the attention and MLP sites (an
    attention site returns a tuple); the folded variant's held-out KL is the record's."""
    dense = tiny_model("llama")
    fit_x, held_x = token_windows(n=16, T=24, seed=0), token_windows(n=8, T=24, seed=9)
    variant = copy.deepcopy(dense)
    fits = repair_sublayers(
        variant, UNITS, batches(fit_x), held={"": batches(held_x)}, distill_epochs=3
    )
    record = fits[0].distilled
    assert record is not None and len(record["held_kl"]) == 4
    best = record["best_epoch"]
    assert best > 0 and record["held_kl"][best] < record["held_kl"][0]  # training helped
    assert {f.kept for f in fits} == {"distilled"}
    assert mean_kl(dense, variant, held_x) == pytest.approx(record["held_kl"][best], rel=2e-3)
    with pytest.raises(ValueError, match="distill_epochs: needs held-out batches"):
        repair_sublayers(copy.deepcopy(dense), UNITS, batches(fit_x), distill_epochs=1)


def test_one_capture_serves_every_variant_whose_runs_it_holds() -> None:
    from lorp.repair.sublayer_repair import repair_from_stats, unit_stats

    dense = tiny_model("gemma3_text")
    x, held = batches(token_windows(n=12, T=24)), {"": batches(token_windows(n=4, seed=5))}
    shared = unit_stats(dense, unit_runs(dense, UNITS) + [(2, 3)], x, held)
    alone, from_shared = copy.deepcopy(dense), copy.deepcopy(dense)
    a = repair_sublayers(alone, UNITS, x, held=held)
    b = repair_from_stats(from_shared, UNITS, shared)
    assert [f.run for f in b] == [(4, 4), (7, 8)]
    for f, g in zip(a, b, strict=True):
        torch.testing.assert_close(f.matrix, g.matrix)
    y = token_windows(n=2, T=16, seed=7)
    torch.testing.assert_close(logits(alone, y), logits(from_shared, y))
