"""Linear repair (`lorp.repair`): the fold equals the map applied by a hook on every tiny
family, sharded statistics equal one pass, the sums equal a brute-force computation, and
the fits never leave more of the gap than the unrepaired model."""

from __future__ import annotations

import copy

import pytest
import torch

from lorp.methods.removal_loss import calibration_loss
from lorp.methods.window_scores import window_losses, window_scores
from lorp.models.architectures import decoder_blocks
from lorp.models.surgery import drop_layers
from lorp.repair.capture import capture_repair_stats
from lorp.repair.fit import check_repairable, fit_runs
from lorp.repair.fold import applied_by_hooks, fold
from lorp.repair.followers import fit_followers, follower_blocks
from lorp.repair.maps import RIDGES, RepairRefused, fit_full
from lorp.repair.normed import fit_normed
from lorp.repair.prune_and_repair import full_fits, prune_and_repair
from lorp.repair.stats import RepairStats, contiguous_runs, repair_passes, rms_unit
from tests.helpers.tiny_models import FAMILIES, N_BLOCKS, tiny_model
from tests.helpers.windows import token_windows

LAYERS = [2, 3, N_BLOCKS - 1]  # a run inside the stack and one ending at block N-1
RUNS = [(2, 3), (N_BLOCKS - 1, N_BLOCKS - 1)]


def batches(x: torch.Tensor, size: int = 4) -> list[torch.Tensor]:
    return [x[i : i + size] for i in range(0, len(x), size)]


def logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=x, use_cache=False).logits


def test_contiguous_runs() -> None:
    assert contiguous_runs([7, 2, 3, 5, 4, 0], 8) == [(0, 0), (2, 5), (7, 7)]
    with pytest.raises(ValueError, match="layers must be in"):
        contiguous_runs([8], 8)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fold_equals_the_map_applied_by_hooks(family: str) -> None:
    dense = tiny_model(family)
    x = token_windows()
    stats = capture_repair_stats(dense, batches(x), RUNS, progress=False)
    fits = fit_runs(dense, stats)
    assert [f.form for f in fits] == ["normed" if family in NORMED else "full"] * 2
    for f in fits:  # the fit closes part of the gap the pruned model leaves
        assert f.residual < f.unrepaired

    folded = copy.deepcopy(dense)
    fold(folded, fits)
    drop_layers(folded, LAYERS)
    pruned = copy.deepcopy(dense)
    kept = drop_layers(pruned, LAYERS)
    probe = token_windows(seed=1, n=2)
    with applied_by_hooks(pruned, fits, kept):
        hooked = logits(pruned, probe)
    assert sum(p.numel() for p in folded.parameters()) == sum(
        p.numel() for p in pruned.parameters()
    )
    torch.testing.assert_close(logits(folded, probe), hooked, rtol=1e-4, atol=1e-4)
    # The fold changed the model: not the unrepaired pruned one.
    assert (logits(folded, probe) - logits(pruned, probe)).abs().max() > 1e-2


NORMED = {"gemma2", "gemma3_text", "olmo2", "olmo3"}


def test_sharded_statistics_equal_one_pass() -> None:
    dense = tiny_model("qwen3")
    x = token_windows(n=12)
    mask = torch.ones_like(x)
    mask[0, -5:] = 0  # padding counts nowhere
    whole = capture_repair_stats(
        dense, [{"input_ids": x, "attention_mask": mask}], RUNS, skip_prefix=1, progress=False
    )
    parts = [
        capture_repair_stats(
            dense,
            [{"input_ids": x[i : i + 4], "attention_mask": mask[i : i + 4]}],
            RUNS,
            skip_prefix=1,
            progress=False,
        )
        for i in (8, 0, 4)
    ]
    merged = RepairStats.merge_all(parts)
    assert merged.tokens == whole.tokens == 12 * 23 - 5
    # A forward over 4 windows and over 12 rounds differently in float32: compare at that
    # level (the sums are O(1e3); a missing or doubled token moves them by O(1)).
    for a, b in [(merged.gram[s], whole.gram[s]) for s in whole.starts] + [
        (merged.cross[r], whole.cross[r]) for r in whole.runs
    ]:
        assert float((a - b).abs().max()) < 1e-5 * float(b.abs().max())
    for r in whole.runs:
        assert merged.energy[r] == pytest.approx(whole.energy[r], rel=1e-6)


def test_sums_equal_brute_force_from_hidden_states() -> None:
    """A_s, B_se and c_se against the definitions, from transformers' own hidden states
    (block inputs) and a direct call of block s-1's MLP: an independent computation."""
    model = tiny_model("llama")
    x = token_windows(n=4)
    stats = capture_repair_stats(model, [x], [(2, 3)], progress=False)
    with torch.no_grad():
        out = model(input_ids=x, output_hidden_states=True, use_cache=False)
        H = [h.reshape(-1, h.shape[-1]).double() for h in out.hidden_states]
        block = decoder_blocks(model)[1]
        captured = {}
        handle = block.mlp.register_forward_hook(lambda m, a, o: captured.setdefault("M", o))
        model(input_ids=x, use_cache=False)
        handle.remove()
    M = captured["M"].reshape(-1, H[0].shape[-1]).double()
    D = H[4] - H[2] + M  # H_e (output of block 3 = input of 4) - Y, Y = H_2 - M
    torch.testing.assert_close(stats.gram[2], M.T @ M, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(stats.cross[(2, 3)], M.T @ D, rtol=1e-5, atol=1e-3)
    assert stats.energy[(2, 3)] == pytest.approx(float((D * D).sum()), rel=1e-6)
    assert stats.state_energy[(2, 3)] == pytest.approx(float((H[4] * H[4]).sum()), rel=1e-6)


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


def test_normed_features_are_the_norm_input_before_its_weight() -> None:
    model = tiny_model("gemma3_text")
    norm = decoder_blocks(model)[1].post_feedforward_layernorm
    m = torch.randn(5, 64) * 30
    u = rms_unit(norm, m)
    torch.testing.assert_close(u * (1 + norm.weight), norm(m))
    Q, _ = torch.linalg.qr(torch.randn(64, 64))
    torch.testing.assert_close(rms_unit(norm, m @ Q), u @ Q, rtol=1e-5, atol=1e-5)


def test_save_load_round_trip_keeps_fingerprints(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = tiny_model("olmo2")
    stats = capture_repair_stats(
        model,
        batches(token_windows()),
        RUNS,
        model_fingerprint="m1",
        calibration_fingerprint="c1",
        progress=False,
    )
    back = RepairStats.from_file(stats.to_file(tmp_path / "repair.npz"))
    assert (back.runs, back.forms, back.tokens) == (stats.runs, stats.forms, stats.tokens)
    assert back.state_energy == stats.state_energy and stats.base  # olmo2: a normed family
    assert all(torch.equal(back.base[s], stats.base[s]) for s in stats.base)
    one = RepairStats.from_file(tmp_path / "repair.npz", [stats.runs[-1]])  # reads one run
    assert one.runs == [stats.runs[-1]] and list(one.gram) == [stats.runs[-1][0]]
    assert torch.equal(one.cross[stats.runs[-1]], stats.cross[stats.runs[-1]])
    assert one.energy == {stats.runs[-1]: stats.energy[stats.runs[-1]]}
    with pytest.raises(ValueError, match="no run 0-0 in the file"):
        RepairStats.from_file(tmp_path / "repair.npz", [(0, 0)])
    assert (back.model_fingerprint, back.calibration_fingerprint) == ("m1", "c1")
    for r in stats.runs:
        assert torch.equal(back.cross[r], stats.cross[r])
    other = capture_repair_stats(
        model, batches(token_windows()), RUNS, model_fingerprint="m2", progress=False
    )
    with pytest.raises(ValueError, match="different model"):
        stats.merge(other)
    with pytest.raises(ValueError, match="not a lorp repair stats file"):
        (tmp_path / "bad.npz").write_bytes(b"nope")
        RepairStats.from_file(tmp_path / "bad.npz")


def test_run_from_block_zero_folds_into_untied_embeddings_and_is_refused_when_tied() -> None:
    dense = tiny_model("llama")
    x = token_windows()
    stats = capture_repair_stats(dense, batches(x), [(0, 1)], progress=False)
    fits = fit_runs(dense, stats)
    folded = copy.deepcopy(dense)
    fold(folded, fits)
    drop_layers(folded, [0, 1])
    pruned = copy.deepcopy(dense)
    kept = drop_layers(pruned, [0, 1])
    with applied_by_hooks(pruned, fits, kept):
        hooked = logits(pruned, x[:2])
    torch.testing.assert_close(logits(folded, x[:2]), hooked, rtol=1e-4, atol=1e-4)

    with pytest.raises(RepairRefused, match="starts at block 0 and the model ties"):
        check_repairable(tiny_model("gemma3_text"), [0, 1])


def test_prune_and_repair_lowers_calibration_loss() -> None:
    """The whole call on a loaded model and a windows tensor: the repaired model fits the
    calibration tokens' next-token loss better than the unrepaired twin."""
    from lorp.methods.removal_loss import calibration_loss

    x = token_windows(n=16, T=32)
    dense = tiny_model("mistral")
    pruned = copy.deepcopy(dense)
    drop_layers(pruned, [1, 2, 3])
    repaired = copy.deepcopy(dense)
    fits = prune_and_repair(repaired, x, [1, 2, 3])
    assert [f.run for f in fits] == [(1, 3)]
    assert repaired.config.num_hidden_layers == N_BLOCKS - 3
    assert calibration_loss(repaired, x) < calibration_loss(pruned, x)


def test_normed_fit_descends_to_near_the_full_map_on_an_exactly_orthogonal_target() -> None:
    """When D = u Q* G* exactly, the orthogonal-diagonal fit recovers the map (residual
    ~0) from a start far from it; the full fit reaches it too."""
    torch.manual_seed(0)
    d, n = 16, 4000
    u = torch.randn(n, d, dtype=torch.float64) * torch.linspace(0.2, 3, d, dtype=torch.float64)
    Q, _ = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64))
    g = torch.linspace(0.5, 2.0, d, dtype=torch.float64)
    D = (u @ Q) * g
    A, B, c = u.T @ u, u.T @ D, float((D * D).sum())
    T0 = torch.eye(d, dtype=torch.float64)
    normed = fit_normed(A, B, c, T0, ridge=1e-9)
    full = fit_full(A, B, c, T0, ridge=1e-9)
    assert normed.unrepaired > 0.1
    assert normed.residual < 1e-6 and full.residual < 1e-6
    torch.testing.assert_close(normed.matrix * normed.scale, Q * g, rtol=1e-4, atol=1e-4)


def test_full_fits_on_a_normed_family_are_an_upper_bound_applied_by_hooks() -> None:
    dense = tiny_model("gemma2")
    stats = capture_repair_stats(dense, batches(token_windows()), RUNS, progress=False)
    exact, free = fit_runs(dense, stats), full_fits(dense, stats)
    for a, b in zip(exact, free, strict=True):
        assert b.residual <= a.residual + 1e-9  # fewer constraints fit at least as well
    pruned = copy.deepcopy(dense)
    kept = drop_layers(pruned, LAYERS)
    with applied_by_hooks(pruned, free, kept):
        assert torch.isfinite(logits(pruned, token_windows(seed=2, n=2))).all()


def test_repair_passes_bound_memory_and_keep_starts_together() -> None:
    runs = [(2, 3), (2, 5), (7, 7), (9, 12), (9, 9)]
    d = 64
    per = 8 * d * d
    groups = repair_passes(runs, d, 4 * per)
    assert sorted(r for g in groups for r in g) == sorted(runs)
    for g in groups:
        assert len({s for s, _ in g}) + len(g) <= 4
        for s in {s for s, _ in g}:
            assert all(r in g for r in runs if r[0] == s)
    with pytest.raises(ValueError, match="cannot hold"):
        repair_passes(runs, d, 2 * per)


def test_ridge_must_be_positive() -> None:
    dense = tiny_model("llama")
    stats = capture_repair_stats(dense, batches(token_windows()), RUNS, progress=False)
    with pytest.raises(ValueError, match="ridge must be > 0"):
        fit_runs(dense, stats, ridge=0.0)


def test_sequential_fit_reads_the_inputs_of_the_model_repaired_so_far() -> None:
    """The second run's sums, captured with the first run folded and dropped in memory and
    the dense model as reference, equal those of a model with the first run really pruned
    (its block indices shifted), with targets taken from the dense model by hand."""
    dense = tiny_model("qwen2")
    x = token_windows()
    first = fit_runs(dense, capture_repair_stats(dense, [x], [(1, 1)], progress=False))
    work = copy.deepcopy(dense)
    fold(work, first)
    seq = capture_repair_stats(work, [x], [(3, 4)], reference=dense, dropped=[1], progress=False)

    pruned = copy.deepcopy(work)
    drop_layers(pruned, [1])  # original block 2 is now block 1, the run's s-1
    with torch.no_grad():
        H = dense(input_ids=x, output_hidden_states=True, use_cache=False).hidden_states
        target = H[5].reshape(-1, 64).double()  # output of block 4 = input of block 5
        got = {}
        block = decoder_blocks(pruned)[1]
        h1 = block.mlp.register_forward_hook(lambda m, a, o: got.setdefault("M", o))
        h2 = block.register_forward_hook(lambda m, a, o: got.setdefault("out", o))
        pruned(input_ids=x, use_cache=False)
        h1.remove(), h2.remove()
    M = got["M"].reshape(-1, 64).double()
    out = (got["out"][0] if isinstance(got["out"], tuple) else got["out"]).reshape(-1, 64)
    D = target - out.double() + M
    torch.testing.assert_close(seq.gram[3], M.T @ M, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(seq.cross[(3, 4)], M.T @ D, rtol=1e-5, atol=1e-3)
    # ... and differ from the one-pass (dense-input) sums, which the first run's error moves.
    dense_pass = capture_repair_stats(dense, [x], [(3, 4)], progress=False)
    assert (dense_pass.cross[(3, 4)] - seq.cross[(3, 4)]).abs().max() > 1e-2


def test_sequential_and_one_pass_repairs_agree_on_a_single_run() -> None:
    x = token_windows(n=8, T=24)
    a, b = tiny_model("llama"), tiny_model("llama")
    fa = prune_and_repair(a, x, [2, 3], sequential=True)
    fb = prune_and_repair(b, x, [2, 3], sequential=False)
    torch.testing.assert_close(fa[0].matrix, fb[0].matrix)
    torch.testing.assert_close(logits(a, x[:2]), logits(b, x[:2]))


@pytest.mark.parametrize(("family", "layers"), [("gemma3_text", [2, 3]), ("llama", [0, 1, 4])])
def test_repaired_checkpoint_is_its_twin_in_shape_and_reloads_with_the_same_logits(
    family: str, layers: list[int], tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """Same config.json and parameter count as the unrepaired twin; transformers reloads it
    with the in-memory repaired model's logits (Gemma: the normed fold into the norm's
    weight; Llama: a run from block 0 folded into the untied embeddings)."""
    import json

    from transformers import AutoModelForCausalLM

    from lorp.models.surgery import save_pruned

    x = token_windows(n=8, T=24)
    twin, repaired = tiny_model(family), tiny_model(family)
    drop_layers(twin, layers)
    fits = prune_and_repair(repaired, x, layers)
    a = save_pruned(twin, None, tmp_path / "twin", {"pruned": layers})
    b = save_pruned(repaired, None, tmp_path / "rep", {"repair": [f.record() for f in fits]})
    assert json.loads((a / "config.json").read_text()) == json.loads(
        (b / "config.json").read_text()
    )
    back = AutoModelForCausalLM.from_pretrained(b).eval()
    assert sum(p.numel() for p in back.parameters()) == sum(p.numel() for p in twin.parameters())
    probe = token_windows(seed=3, n=2)
    torch.testing.assert_close(logits(back, probe), logits(repaired, probe))
    assert (logits(back, probe) - logits(twin, probe)).abs().max() > 1e-2


def _reference_normed_fit(A, B, T0, ridge, rounds):  # type: ignore[no-untyped-def]
    """The normed descent as first written, diag(Q^T A' Q) formed twice per try: scale
    and objective each computed their own."""
    d = A.shape[0]
    lam = ridge * float(torch.trace(A)) / d
    eye = torch.eye(d, dtype=A.dtype)
    Ar, Br = A + lam * eye, B + lam * T0

    def obj(Q, g):  # type: ignore[no-untyped-def]
        return float((g * g * (Q * (Ar @ Q)).sum(0) - 2 * g * (Q * Br).sum(0)).sum())

    def scale(Q):  # type: ignore[no-untyped-def]
        return (Q * Br).sum(0) / (Q * (Ar @ Q)).sum(0)

    U, _, Vh = torch.linalg.svd(torch.linalg.solve(Ar, Br))
    Q = min([eye, U @ Vh], key=lambda q: obj(q, scale(q)))
    g, top = scale(Q), float(torch.linalg.eigvalsh(Ar)[-1])
    f, c, svds, done = obj(Q, g), top / 64, 0, 0
    for done in range(1, rounds + 1):  # noqa: B007
        while True:
            U, _, Vh = torch.linalg.svd((Br + (c * eye - Ar) @ (Q * g)) * g)
            svds += 1
            Q_new = U @ Vh
            g_new = scale(Q_new)
            f_new = obj(Q_new, g_new)
            if f_new <= f or c >= top:
                break
            c = min(2 * c, top)
        gain = f - f_new
        Q, g, f = (Q_new, g_new, f_new) if f_new <= f else (Q, g, f)
        c = max(c / 2, top / 4096)
        if gain <= 1e-6 * abs(f) or gain <= 0:
            break
    return Q, g, svds, done


@pytest.mark.parametrize("seed", [0, 1])
def test_normed_fit_reads_the_quadratic_once_per_try_and_keeps_its_iterates(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each try of the descent costs one SVD and one diag(Q^T A' Q) (shared by the scale
    and the objective), and the iterates are the written-out descent's: the same tries
    (the step rule decides the result: halving c only after a first-try success would
    skip tries and, on seed 1, end at another map) and the same map."""
    g = torch.Generator().manual_seed(seed)
    d, n, rounds = 24, 3000, 40
    u = torch.randn(n, d, generator=g, dtype=torch.float64)
    u = u * torch.linspace(0.2, 3, d, dtype=torch.float64)
    D = u @ torch.randn(d, d, generator=g, dtype=torch.float64)
    D = D + torch.randn(n, d, generator=g, dtype=torch.float64)
    A, B, energy = u.T @ u, u.T @ D, float((D * D).sum())
    T0 = torch.eye(d, dtype=torch.float64)
    Q_ref, g_ref, svds_ref, rounds_ref = _reference_normed_fit(A, B, T0, 1e-3, rounds)

    import lorp.repair.normed as repair

    calls = {"svd": 0, "diag": 0}
    svd, diag = torch.linalg.svd, repair._diag_quad

    def counted_svd(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["svd"] += 1
        return svd(*args, **kwargs)

    def counted_diag(*args):  # type: ignore[no-untyped-def]
        calls["diag"] += 1
        return diag(*args)

    monkeypatch.setattr(torch.linalg, "svd", counted_svd)
    monkeypatch.setattr(repair, "_diag_quad", counted_diag)
    fit = fit_normed(A, B, energy, T0, ridge=1e-3, rounds=rounds)
    assert fit.rounds == rounds_ref == rounds  # the cap, as on the real models
    assert calls["svd"] == svds_ref + 1  # the same tries, plus the polar start
    assert calls["diag"] == calls["svd"] + 1  # both starts, then one per try
    torch.testing.assert_close(fit.matrix, Q_ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(fit.scale, g_ref, rtol=1e-9, atol=1e-9)


# -- validation on held-out windows --------------------------------------------------------


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
    with pytest.raises(ValueError, match="with and without held-out sums"):
        back.merge(_synthetic_stats(T_true, 80, seed=2, noise=1.0))
    with pytest.raises(ValueError, match="needs held-out sums"):
        fit_runs(model, _synthetic_stats(T_true, 80, seed=2, noise=1.0), ridge=None)


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
