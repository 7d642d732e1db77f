"""Fitting each run's map: the ridge chosen on held-out windows, and a map that does not help
there not kept, full and normed alike."""

from __future__ import annotations

import copy

import pytest
import torch

from lorp.models.architectures import decoder_blocks
from lorp.repair.capture import capture_repair_stats
from lorp.repair.fit import fit_runs
from lorp.repair.fold import fold
from lorp.repair.maps import RIDGES
from lorp.repair.stats import RepairStats
from tests.helpers.repair_runs import RUNS, batches
from tests.helpers.tiny_models import N_BLOCKS, tiny_model
from tests.helpers.windows import token_windows


def test_ridge_must_be_positive() -> None:
    dense = tiny_model("llama")
    stats = capture_repair_stats(dense, batches(token_windows()), RUNS, progress=False)
    with pytest.raises(ValueError, match="ridge must be > 0"):
        fit_runs(dense, stats, ridge=0.0)


def _synthetic_stats(T_true: torch.Tensor, tokens: int, seed: int, noise: float) -> RepairStats:
    """Run 2-3 of a tiny llama: features X and gaps D = X T_true + noise, as sums."""
    g = torch.Generator().manual_seed(seed)
    d = T_true.shape[0]
    stats = RepairStats(N_BLOCKS, d, [(2, 3)])
    X = torch.randn(tokens, d, generator=g, dtype=torch.float64)
    D = X @ T_true + noise * torch.randn(tokens, d, generator=g, dtype=torch.float64)
    stats.add({2: X}, {(2, 3): D}, {(2, 3): D})
    return stats


def test_the_ridge_is_chosen_on_held_out_windows_and_a_map_that_does_not_help_is_not_kept(
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    model = tiny_model("llama")
    d = int(model.config.hidden_size)
    g = torch.Generator().manual_seed(1)
    T_true = torch.eye(d, dtype=torch.float64) + 0.3 * torch.randn(d, d, generator=g).double()
    # few fitting tokens and noisy gaps: the least-ridge map overfits them
    stats = _synthetic_stats(T_true, tokens=80, seed=2, noise=1.0)
    stats.held = _synthetic_stats(T_true, tokens=400, seed=3, noise=1.0)
    [fit] = fit_runs(model, stats, ridge=None)
    assert fit.kept == "fit" and fit.validation is not None
    assert fit.relative_ridge == min(fit.validation, key=fit.validation.get)
    assert fit.relative_ridge > min(RIDGES)  # the held-out windows wanted more ridge
    assert fit.held_residual < fit.held_unrepaired
    assert fit.held_residual == pytest.approx(fit.validation[fit.relative_ridge])
    fixed = fit_runs(model, stats, ridge=min(RIDGES))[0]
    assert fixed.held_residual > fit.held_residual and fixed.residual < fit.residual

    # held-out windows on which the unrepaired map is already exact: nothing is kept
    stats.held = _synthetic_stats(torch.eye(d, dtype=torch.float64), 400, seed=4, noise=0.0)
    [kept] = fit_runs(model, stats, ridge=None)
    assert kept.kept == "unrepaired" and kept.held_unrepaired == 0.0
    assert torch.equal(kept.matrix, torch.eye(d, dtype=torch.float64))
    assert kept.record()["kept"] == "unrepaired"
    before = copy.deepcopy(model.state_dict())
    fold(model, [kept])  # folding the unrepaired map changes no weight
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())

    # the held-out sums travel with subset, merge and the file
    path = stats.to_file(tmp_path / "r.npz")
    back = RepairStats.from_file(path, [(2, 3)])
    assert back.held is not None and torch.equal(back.held.gram[2], stats.held.gram[2])
    assert back.merge(back).held.tokens == 800
    with pytest.raises(ValueError, match="held-out sums of other domains"):
        back.merge(_synthetic_stats(T_true, 80, seed=2, noise=1.0))
    with pytest.raises(ValueError, match="needs held-out sums"):
        fit_runs(model, _synthetic_stats(T_true, 80, seed=2, noise=1.0), ridge=None)


def test_a_map_that_costs_one_domain_is_not_kept_and_the_ridge_serves_the_worst(
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    """Held-out windows of two domains: prose's gaps follow the map the fit learns, code's
    are exact without one. A map that helps prose and costs code is not kept; where both
    are helped, the ridge is the one whose worse domain gains most, and the sums of each
    domain travel through subset, merge, join and the file."""
    model = tiny_model("llama")
    d = int(model.config.hidden_size)
    g = torch.Generator().manual_seed(1)
    T_true = torch.eye(d, dtype=torch.float64) + 0.3 * torch.randn(d, d, generator=g).double()
    stats = _synthetic_stats(T_true, tokens=400, seed=2, noise=0.1)
    prose = _synthetic_stats(T_true, 400, seed=3, noise=0.1)
    stats.held_domains = {
        "prose": prose,
        "code": _synthetic_stats(torch.eye(d).double(), 400, 4, 0.0),
    }
    [fit] = fit_runs(model, stats, ridge=None)
    assert fit.kept == "unrepaired" and fit.record()["kept"] == "unrepaired"
    assert set(fit.held_domains) == {"prose", "code"}
    # one domain alone would have kept it
    stats_one = _synthetic_stats(T_true, tokens=400, seed=2, noise=0.1)
    stats_one.held = prose
    assert fit_runs(model, stats_one, ridge=None)[0].kept == "fit"

    # both domains helped, one far less: the worst domain's ratio decides
    other = torch.eye(d, dtype=torch.float64) + 0.6 * (T_true - torch.eye(d).double())
    stats.held_domains = {"prose": prose, "code": _synthetic_stats(other, 400, 5, 0.1)}
    [fit] = fit_runs(model, stats, ridge=None)
    assert fit.kept == "fit" and fit.validation is not None
    ratios = {dom: r / u for dom, (r, u) in fit.held_domains.items()}
    assert all(r < 1 for r in ratios.values())
    assert fit.validation[fit.relative_ridge] == pytest.approx(max(ratios.values()))
    assert fit.relative_ridge == min(fit.validation, key=fit.validation.get)
    assert fit.record()["held_by_domain"]["code"]["unrepaired"] > 0

    path = stats.to_file(tmp_path / "domains.npz")
    back = RepairStats.from_file(path, [(2, 3)])
    assert set(back.held_domains) == {"prose", "code"}
    assert torch.equal(
        back.held_domains["code"].cross[(2, 3)], stats.held_domains["code"].cross[(2, 3)]
    )
    assert back.merge(back).held_domains["prose"].tokens == 800
    assert back.held.tokens == 800  # the total over both domains
    assert RepairStats.join([back.subset([(2, 3)])]).held_domains.keys() == {"prose", "code"}


def test_a_normed_run_is_validated_too() -> None:
    """Gemma 3 (post-MLP norm): the orthogonal map is kept only if it beats the norm's
    own scale on the held-out windows, else the scale stays as it was."""
    model = tiny_model("gemma3_text")
    d = int(model.config.hidden_size)
    norm = decoder_blocks(model)[1].post_feedforward_layernorm
    with torch.no_grad():
        norm.weight.copy_(0.5 * torch.rand(d))  # a scale that is not the identity
    T0 = torch.diag(norm.weight.detach().double() + 1.0)
    g = torch.Generator().manual_seed(5)
    rotated = T0 @ torch.linalg.qr(torch.randn(d, d, generator=g).double())[0]
    stats = _synthetic_stats(rotated, 200, seed=2, noise=0.1)
    stats.forms = {(2, 3): "normed"}
    stats.held = _synthetic_stats(rotated, 400, seed=3, noise=0.1)
    stats.held.forms = {(2, 3): "normed"}
    [fit] = fit_runs(model, stats, ridge=None, rounds=20)
    assert fit.kept == "fit" and fit.held_residual < 0.5 * fit.held_unrepaired
    # held-out windows on which the norm's own scale is exact: it stays as it was
    stats.held = _synthetic_stats(T0, 400, seed=4, noise=0.0)
    stats.held.forms = {(2, 3): "normed"}
    [kept] = fit_runs(model, stats, ridge=None, rounds=20)
    assert kept.kept == "unrepaired" and torch.equal(kept.scale, torch.diagonal(T0))
    assert torch.equal(kept.matrix, torch.eye(d, dtype=torch.float64))
