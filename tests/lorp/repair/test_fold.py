"""The fold equals the map applied by hooks on every family (from block 0: into untied
embeddings), and on a streamed model the in-memory fold and its checkpoint."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from lorp.models.file_surgery import write_pruned_files
from lorp.models.perplexity import perplexity
from lorp.models.streaming import build_streamed, streamer_of
from lorp.models.surgery import drop_layers
from lorp.repair.capture import capture_repair_stats
from lorp.repair.fit import check_repairable, fit_runs
from lorp.repair.fold import applied_by_hooks, file_folds, fold
from lorp.repair.maps import RepairRefused
from lorp.repair.stats import contiguous_runs
from tests.helpers.model_checks import in_memory
from tests.helpers.repair_runs import LAYERS, RUNS, batches, logits
from tests.helpers.tiny_models import FAMILIES, N_BLOCKS, tiny_model
from tests.helpers.windows import token_windows


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


def test_a_fold_on_a_streamed_model_equals_the_in_memory_fold(
    checkpoints: dict[str, Path],
) -> None:
    """The fold changes the resident vectors in place and matrices by overrides:
    the repaired, pruned streamed model computes what the in-memory one does."""
    path = checkpoints["olmo2"]  # a normed fit: down_proj and the post-MLP norm change
    dense, streamed = in_memory(path), build_streamed(path)
    layers = [0, 3, 4]
    stats = capture_repair_stats(
        dense, [token_windows(8)], contiguous_runs(layers, N_BLOCKS), progress=False
    )
    fits = fit_runs(dense, stats)
    for model in (dense, streamed):
        fold(model, fits)
        drop_layers(model, layers)
    x = token_windows(4)
    assert perplexity(streamed, x) == pytest.approx(perplexity(dense, x), rel=1e-6)
    # Run 0-0 folds into the embeddings, run 3-4 into block 2's down_proj.
    overrides = streamer_of(streamed).overrides
    assert set(overrides) == {"model.embed_tokens.weight", "model.layers.2.mlp.down_proj.weight"}


@pytest.mark.parametrize("family", ["llama", "olmo2"])
def test_a_streamed_fold_evaluates_what_its_bf16_checkpoint_holds(
    family: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """A bf16 checkpoint's variant is written in bf16, the fold rounded there: the
    streamed model runs that rounded fold, so its perplexity is the written variant's
    (OLMo 2: its post-MLP norm's folded scale too)."""
    bf16 = tmp_path / "bf16"
    in_memory(checkpoints[family]).to(torch.bfloat16).save_pretrained(bf16)
    layers = [3, 4]
    stats = capture_repair_stats(
        in_memory(bf16), [token_windows(8)], contiguous_runs(layers, N_BLOCKS), progress=False
    )
    fits = fit_runs(in_memory(bf16), stats)
    streamed = build_streamed(bf16)
    fold(streamed, fits)
    drop_layers(streamed, layers)
    written = write_pruned_files(bf16, tmp_path / "variant", layers, {}, changes=file_folds(fits))
    x = token_windows(4)
    assert perplexity(streamed, x) == pytest.approx(perplexity(in_memory(written), x), rel=1e-6)
    # Held whole in fp32, the fold is not rounded: the figures differ, so the test can fail.
    dense = in_memory(bf16)
    fold(dense, fits)
    drop_layers(dense, layers)
    assert perplexity(dense, x) != pytest.approx(perplexity(streamed, x), rel=1e-6)
    # A matrix is folded once: a second fold of the same run would start from the file.
    again = build_streamed(bf16)
    fold(again, fits)
    with pytest.raises(ValueError, match="is already folded: a matrix is folded once"):
        fold(again, fits)


FOLD_FAMILIES = ["qwen3_moe", "gpt_oss", "deepseek_v3", "granitemoe", "flex_olmo", "nemotron_h"]
"""Mixtures of experts (plain, transposed with biases, with shared experts, scaled by the
block, behind a post-norm) and a hybrid whose blocks hold one mixer each."""


@pytest.mark.parametrize("family", FOLD_FAMILIES)
def test_a_map_folds_into_every_expert_bank_exactly(family: str, tmp_path: Path) -> None:
    """Block 1 bridges block 2 (a mixture of experts, or Nemotron-H's mixer): folding the
    map into its banks, shared experts and post-norm equals the map applied by a hook on
    what the stage adds, in memory and in the checkpoint written from the files."""
    from tests.helpers.family_models import family_model

    dense = family_model(family)
    x = torch.randint(3, 120, (8, 24), generator=torch.Generator().manual_seed(0))
    stats = capture_repair_stats(dense, list(x.split(4)), [(2, 2)], progress=False)
    fits = fit_runs(dense, stats)
    assert fits[0].residual < fits[0].unrepaired
    assert fits[0].form == ("normed" if family == "flex_olmo" else "full")
    folded = copy.deepcopy(dense)
    fold(folded, fits)
    drop_layers(folded, [2])
    hooked = copy.deepcopy(dense)
    drop_layers(hooked, [2])
    with applied_by_hooks(hooked, fits, kept=[0, 1, 3]):
        expected = logits(hooked, x)
    torch.testing.assert_close(logits(folded, x), expected, rtol=1e-4, atol=1e-4)
    dense.save_pretrained(tmp_path / "dense")
    write_pruned_files(tmp_path / "dense", tmp_path / "files", [2], {}, changes=file_folds(fits))
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "files").eval()
    torch.testing.assert_close(logits(reloaded, x), logits(folded, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"])
def test_a_fold_into_a_streamed_mixture_equals_in_memory_and_its_files(
    family: str, tmp_path: Path
) -> None:
    """Block 1's experts (and DeepSeek-V3's shared expert) take the map of run 2-2: the
    streamed model's folded banks are overrides built from its experts' tensors, and
    give the in-memory fold's logits; the variant's files, folded expert by expert
    (gpt-oss: bank by bank), reload with `from_pretrained` to the same logits."""
    from transformers import AutoModelForCausalLM

    from tests.helpers.family_models import family_model

    path = tmp_path / "dense"
    family_model(family).save_pretrained(path)
    dense, streamed = in_memory(path), build_streamed(path)
    x = torch.randint(3, 120, (8, 24), generator=torch.Generator().manual_seed(0))
    fits = fit_runs(dense, capture_repair_stats(dense, list(x.split(4)), [(2, 2)], progress=False))
    for model in (dense, streamed):
        fold(model, fits)
        drop_layers(model, [2])
    expected = logits(dense, x)
    torch.testing.assert_close(logits(streamed, x), expected, rtol=1e-5, atol=1e-5)
    overrides = streamer_of(streamed).overrides
    assert "model.layers.1.mlp.experts.down_proj" in overrides
    written = write_pruned_files(path, tmp_path / "files", [2], {}, changes=file_folds(fits))
    reloaded = AutoModelForCausalLM.from_pretrained(written).eval()
    torch.testing.assert_close(logits(reloaded, x), expected, rtol=1e-5, atol=1e-5)
    unrepaired = copy.deepcopy(in_memory(path))
    drop_layers(unrepaired, [2])
    assert (logits(unrepaired, x) - expected).abs().max() > 1e-2  # the fold changed it
