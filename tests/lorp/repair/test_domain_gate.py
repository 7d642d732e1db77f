"""The repair's last check: the repaired variant against its unrepaired twin by the
held-out loss of every domain, the first candidate no worse anywhere kept."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from lorp.models.perplexity import calibration_loss
from lorp.models.surgery import drop_layers
from lorp.repair.capture import capture_repair_stats
from lorp.repair.domain_gate import MIN_GAIN, as_unrepaired, domain_losses, gate_repair, passes
from lorp.repair.fit import fit_runs
from lorp.repair.fold import fold
from tests.helpers.repair_runs import LAYERS, RUNS, batches
from tests.helpers.tiny_models import tiny_model
from tests.helpers.windows import token_windows


def _scaled(fits: list, k: float) -> list:  # type: ignore[type-arg]
    """`fits` with every map scaled by k: a candidate that costs some domain."""
    return [
        replace(f, matrix=f.matrix * k) if f.scale is None else replace(f, scale=f.scale * k)
        for f in fits
    ]


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_a_candidate_worse_on_one_domain_is_passed_over(family: str) -> None:
    model = tiny_model(family)
    stats = capture_repair_stats(model, batches(token_windows(16)), RUNS, progress=False)
    fits = fit_runs(model, stats)
    held = {"prose": token_windows(4, seed=1), "code": token_windows(4, seed=2)}
    before = copy.deepcopy(model.state_dict())
    base = domain_losses(model, LAYERS, [], held)
    fitted = domain_losses(model, LAYERS, fits, held)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # as found
    # the unrepaired losses are the pruned model's own
    pruned = copy.deepcopy(model)
    drop_layers(pruned, LAYERS)
    assert base["code"] == pytest.approx(calibration_loss(pruned, held["code"]), rel=1e-5)

    # a map scaled off costs a domain (on these random weights, a scale found by trying):
    # it is passed over for the next candidate
    scaled = lambda k: _scaled(fits, k)  # noqa: E731
    worse = lambda fs: any(v > base[d] for d, v in domain_losses(model, LAYERS, fs, held).items())  # noqa: E731
    wild = next(scaled(k) for k in (-1.0, -3.0, 5.0, 20.0, 0.0) if worse(scaled(k)))
    gate = gate_repair(model, LAYERS, [("wild", wild), ("fitted", fits)], held)
    assert any(gate.losses["wild"][d] > base[d] for d in held)
    if passes(fitted, base):
        assert gate.kept == "fitted" and gate.fits == fits
    else:
        assert gate.kept == "unrepaired"
    assert gate.losses.get("fitted", fitted) == pytest.approx(fitted)
    record = gate.record()
    assert record["tried"] == ["wild", "fitted"] and set(record["losses"]["unrepaired"]) == {
        "prose",
        "code",
    }

    # nothing passes: every map becomes its run's unrepaired map, and folding them changes
    # no weight, so the variant is its unrepaired twin
    gate = gate_repair(model, LAYERS, [("wild", wild)], held)
    assert gate.kept == "unrepaired" and record["worst_loss_ratio"] <= 1.0
    assert all(f.kept == "unrepaired" and f.residual == f.unrepaired for f in gate.fits)
    assert gate.record()["worst_loss_ratio"] == 1.0
    folded = copy.deepcopy(model)
    fold(folded, gate.fits)
    assert all(torch.equal(v, folded.state_dict()[k]) for k, v in model.state_dict().items())
    assert as_unrepaired(model, fits[0]).distilled is None


def test_a_gain_within_the_noise_or_a_loss_anywhere_does_not_pass() -> None:
    base = {"prose": 4.0, "code": 2.0}
    assert passes({"prose": 3.8, "code": 1.9}, base)  # 5% on both
    assert not passes({"prose": 3.99, "code": 1.999}, base)  # 0.15%: within the noise
    assert not passes({"prose": 3.0, "code": 2.001}, base)  # costs code, however it helps prose
    edge = 1 - MIN_GAIN
    assert passes({"prose": 4.0 * edge, "code": 2.0 * edge}, base)
    assert passes({"prose": 4.0 * (1 - 2 * MIN_GAIN), "code": 2.0}, base)  # prose only


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_the_gate_judges_a_sub_layer_cut_and_falls_back_to_its_units_t0(family: str) -> None:
    """With a `Cut` the unrepaired losses are the sub-layer variant's own, a candidate's
    are its maps' at their unit sites (equal to the folded variant's), and where nothing
    passes each map becomes its unit run's T0, whose fold changes no weight."""
    from lorp.models.sublayers import remove_sublayers
    from lorp.repair.distill import sublayer_cut
    from lorp.repair.sublayer_repair import (
        fit_unit_runs,
        fold_units,
        unit_runs,
        unit_stats,
        unit_T0,
    )

    model = tiny_model(family)
    units = [3, 4, 7]  # attn.2's MLP neighbour run (mlp.1, attn.2) and mlp.3
    held = {"prose": token_windows(4, seed=1), "code": token_windows(4, seed=2)}
    stats = unit_stats(model, unit_runs(model, units), batches(token_windows(16)), None)
    fits = fit_unit_runs(model, stats)
    cut = sublayer_cut(model, units)
    base = domain_losses(model, cut, [], held)
    pruned = copy.deepcopy(model)
    remove_sublayers(pruned, units)
    assert base["code"] == pytest.approx(calibration_loss(pruned, held["code"]), rel=1e-5)
    repaired = copy.deepcopy(model)
    fold_units(repaired, fits)
    remove_sublayers(repaired, units)
    fitted = domain_losses(model, cut, fits, held)
    assert fitted["prose"] == pytest.approx(calibration_loss(repaired, held["prose"]), rel=1e-4)

    scaled = lambda k: _scaled(fits, k)  # noqa: E731
    worse = lambda fs: any(v > base[d] for d, v in domain_losses(model, cut, fs, held).items())  # noqa: E731
    wild = next(scaled(k) for k in (-1.0, -3.0, 5.0, 20.0, 0.0) if worse(scaled(k)))
    t0 = lambda fit: unit_T0(model, fit.run, fit.form)  # noqa: E731
    gate = gate_repair(model, cut, [("wild", wild)], held, unrepaired=t0)
    assert gate.kept == "unrepaired" and gate.losses["unrepaired"] == pytest.approx(base)
    folded = copy.deepcopy(model)
    fold_units(folded, gate.fits)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(folded.state_dict()[k], v, rtol=1e-5, atol=1e-6)
