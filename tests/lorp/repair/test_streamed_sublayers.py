"""A sub-layer variant of a streamed model (one matrix resident at a time): its unit sums,
its `window` losses, its fold and its logits are the in-memory variant's, and its
checkpoint, written from the dense files with the folded tensors, reloads with those
logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lorp.models.nemotron_nas import save_sublayer_variant, write_sublayer_files
from lorp.models.streaming import build_streamed, streamer_of
from lorp.models.sublayers import remove_sublayers
from lorp.repair.sublayer_repair import (
    capture_unit_stats,
    fit_unit_runs,
    fold_units,
    folded_parameters,
    unit_runs,
)
from lorp.scoring.window_scores import window_losses
from tests.helpers.model_checks import in_memory
from tests.helpers.repair_runs import batches, logits
from tests.helpers.windows import token_windows

UNITS = [4, 7, 8]  # attn.2 (after mlp.1), and mlp.3 + attn.4 (after attn.3)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_a_streamed_sub_layer_variant_is_the_in_memory_one(
    family: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    path = checkpoints[family]
    dense, streamed = in_memory(path), build_streamed(path)
    x = token_windows(n=12, T=24)
    runs = unit_runs(dense, UNITS)
    a = capture_unit_stats(dense, batches(x), runs)
    b = capture_unit_stats(streamed, batches(x), runs)
    for key, value in a._arrays("").items():
        if value.dtype.kind == "f":
            assert abs(value - b._arrays("")[key]).max() <= 1e-5 * max(1.0, abs(value).max()), key
    # `window`'s score of each unit run: its repaired variant's loss, by hooks, so the
    # streamed model is scored as it stands (and left so).
    losses = window_losses(dense, a, x[:4], ridge=1e-3, units=True)
    assert window_losses(streamed, a, x[:4], ridge=1e-3, units=True) == pytest.approx(
        losses, rel=1e-5
    )
    fits = fit_unit_runs(dense, a, ridge=1e-3)
    assert [f.form for f in fits] == ["normed" if family == "gemma3_text" else "full"] * 2
    fold_units(dense, fits)
    fold_units(streamed, fits)
    # The folded matrices are the streamer's overrides; nothing else is held.
    streamer = streamer_of(streamed)
    assert streamer is not None and len(streamer.overrides) == len(fits)
    with pytest.raises(ValueError, match="folded once"):
        fold_units(streamed, fits)
    changed = folded_parameters(streamed, fits)
    held = folded_parameters(dense, fits)
    assert changed.keys() == held.keys() and len(changed) == (4 if family == "gemma3_text" else 2)
    for key, value in held.items():
        torch.testing.assert_close(changed[key], value, rtol=1e-6, atol=1e-6)
    remove_sublayers(dense, UNITS)
    remove_sublayers(streamed, UNITS)
    expect = logits(dense, x)
    torch.testing.assert_close(logits(streamed, x), expect, rtol=1e-5, atol=1e-5)
    if family == "gemma3_text":  # no Nemotron-NAS form: judged in memory, never written
        return
    # Written from the files, tensor by tensor: what the in-memory variant saves.
    ours = write_sublayer_files(path, tmp_path / "streamed", UNITS, {}, changed=changed)
    theirs = save_sublayer_variant(dense, None, tmp_path / "whole", UNITS, {})
    a_model = AutoModelForCausalLM.from_pretrained(str(ours), trust_remote_code=True).eval()
    b_model = AutoModelForCausalLM.from_pretrained(str(theirs), trust_remote_code=True).eval()
    for (name, p), (_, q) in zip(
        a_model.state_dict().items(), b_model.state_dict().items(), strict=True
    ):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)
    torch.testing.assert_close(logits(a_model, x), expect, rtol=1e-5, atol=1e-5)
