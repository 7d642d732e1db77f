"""Block surgery on tiny models of every family: dropped, saved atomically, reloaded with the
same logits and KV cache; or dropped in memory only and restored bit for bit."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lorp import (
    kept_layers,
)
from lorp.models.architectures import (
    decoder_blocks,
)
from lorp.models.perplexity import calibration_loss
from lorp.models.surgery import PROVENANCE_FILE, blocks_dropped, drop_layers, save_pruned
from tests.helpers.model_checks import assert_unchanged, batch, snapshot
from tests.helpers.tiny_models import FAMILIES, tiny_config, tiny_model


def test_kept_layers() -> None:
    assert kept_layers(6, [4, 1, 1]) == [0, 2, 3, 5]
    assert kept_layers(3, []) == [0, 1, 2]


FAMILY_IDS = list(FAMILIES)


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_drop_save_reload_generate(family: str, tmp_path: Path) -> None:
    model = tiny_model(family)
    original_types = list(getattr(model.config, "layer_types", None) or [])
    kept = drop_layers(model, [1, 4])
    assert kept == [0, 2, 3, 5]
    assert model.config.num_hidden_layers == 4 and len(model.model.layers) == 4
    assert [blk.self_attn.layer_idx for blk in model.model.layers] == [0, 1, 2, 3]
    if original_types:
        assert model.config.layer_types == [original_types[i] for i in kept]

    out = save_pruned(model, None, tmp_path / "pruned", {"pruned": [1, 4], "kept": kept})
    assert json.loads((out / PROVENANCE_FILE).read_text())["kept"] == kept
    assert not list(tmp_path.glob(".*partial"))
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert reloaded.config.num_hidden_layers == 4
    assert reloaded.config.tie_word_embeddings == tiny_config(family).tie_word_embeddings
    if original_types:
        assert reloaded.config.layer_types == [original_types[i] for i in kept]

    ids = batch()["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)
        # generate() with the KV cache: fails with an IndexError if layer_idx is stale.
        gen = reloaded.generate(ids[:1, :8], max_new_tokens=6, do_sample=False, use_cache=True)
        ref = model.generate(ids[:1, :8], max_new_tokens=6, do_sample=False, use_cache=True)
    assert gen.shape == (1, 14) and torch.equal(gen, ref)


def test_safetensors_keys_are_contiguous(tmp_path: Path) -> None:
    from safetensors import safe_open

    model = tiny_model("llama")
    drop_layers(model, [2, 3])
    save_pruned(model, None, tmp_path / "p", {})
    with safe_open(str(tmp_path / "p" / "model.safetensors"), "pt") as f:
        idx = {int(k.split(".")[2]) for k in f.keys() if k.startswith("model.layers.")}  # noqa: SIM118
    assert idx == {0, 1, 2, 3}


def test_qwen_max_window_layers_recounted() -> None:
    model = tiny_model("qwen2")  # max_window_layers = 3: blocks 0-2 full, 3-5 sliding
    drop_layers(model, [0, 4])
    assert model.config.max_window_layers == 2
    assert model.config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2


def test_drop_layers_bad_input() -> None:
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"layers must be in \[0, 5\], got \[6\]"):
        drop_layers(model, [2, 6])
    with pytest.raises(ValueError, match="cannot drop all 6 blocks"):
        drop_layers(model, range(6))
    assert len(model.model.layers) == 6  # untouched


def test_save_is_atomic(tmp_path: Path) -> None:
    model = tiny_model("llama")

    class Broken:
        def save_pretrained(self, path: str) -> None:
            (Path(path) / "tokenizer.json").write_text("{")
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        save_pruned(model, Broken(), tmp_path / "out", {})
    assert list(tmp_path.iterdir()) == []  # nothing partial, nothing that looks complete
    save_pruned(model, None, tmp_path / "out", {"v": 1})
    with pytest.raises(FileExistsError, match="already exists"):
        save_pruned(model, None, tmp_path / "out", {"v": 2})
    save_pruned(model, None, tmp_path / "out", {"v": 3}, overwrite=True)
    assert json.loads((tmp_path / "out" / PROVENANCE_FILE).read_text()) == {"v": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen2"])
def test_blocks_dropped_is_drop_layers_then_undone(family: str, windows: torch.Tensor) -> None:
    model = tiny_model(family)
    dense = calibration_loss(model, windows, batch_size=2)
    before = snapshot(model)
    for dropped in [(1,), (2, 4), (0, 3, 5)]:
        pruned = copy.deepcopy(model)
        drop_layers(pruned, dropped)
        with blocks_dropped(model, dropped) as kept:
            assert len(decoder_blocks(model)) == model.config.num_hidden_layers == len(kept)
            if hasattr(pruned.config, "layer_types"):
                assert model.config.layer_types == pruned.config.layer_types
            inside = calibration_loss(model, windows, batch_size=2)
        assert inside == pytest.approx(calibration_loss(pruned, windows), abs=1e-6)
        assert_unchanged(model, before)
    with pytest.raises(RuntimeError, match="boom"), blocks_dropped(model, (2,)):
        raise RuntimeError("boom")
    assert_unchanged(model, before)
    assert calibration_loss(model, windows, batch_size=2) == dense  # bit-identical
