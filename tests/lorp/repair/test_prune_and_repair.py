"""Prune and repair in one call: lower calibration loss than the unrepaired twin, in its shape
and config; sequential and one-pass agree on one run."""

from __future__ import annotations

import copy

import pytest
import torch

from lorp.models.surgery import drop_layers
from lorp.repair.capture import capture_repair_stats
from lorp.repair.fit import fit_runs
from lorp.repair.fold import applied_by_hooks
from lorp.repair.prune_and_repair import full_fits, prune_and_repair
from tests.helpers.repair_runs import LAYERS, RUNS, batches, logits
from tests.helpers.tiny_models import N_BLOCKS, tiny_model
from tests.helpers.windows import token_windows


def test_prune_and_repair_lowers_calibration_loss() -> None:
    """The whole call on a loaded model and a windows tensor: the repaired model fits the
    calibration tokens' next-token loss better than the unrepaired twin."""
    from lorp.models.perplexity import calibration_loss

    x = token_windows(n=16, T=32)
    dense = tiny_model("mistral")
    pruned = copy.deepcopy(dense)
    drop_layers(pruned, [1, 2, 3])
    repaired = copy.deepcopy(dense)
    fits = prune_and_repair(repaired, x, [1, 2, 3])
    assert [f.run for f in fits] == [(1, 3)]
    assert repaired.config.num_hidden_layers == N_BLOCKS - 3
    assert calibration_loss(repaired, x) < calibration_loss(pruned, x)


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
