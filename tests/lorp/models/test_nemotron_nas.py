"""A sub-layer variant written in Nemotron-NAS form reloads in transformers from its own
files (no hub) with the in-memory variant's logits, generates with its KV cache, and a
family the form cannot carry is refused before anything is written."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lorp.models.nemotron_nas import NotServable, nemotron_nas_config, save_sublayer_variant
from lorp.models.sublayers import remove_sublayers
from tests.helpers.repair_runs import logits
from tests.helpers.tiny_models import tiny_config, tiny_model
from tests.helpers.windows import token_windows

UNITS = [2, 6, 9]  # attn.1, attn.3, mlp.4


def full_attention_qwen2() -> torch.nn.Module:
    """The tiny Qwen2 as Qwen2.5-Coder-0.5B ships: no sliding window."""
    config = tiny_config("qwen2")
    config.use_sliding_window = False
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed" not in name:
                p.mul_(8.0)
    return model.eval()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_checkpoint_reloads_with_the_variants_logits(family: str, tmp_path: Path) -> None:
    model = tiny_model(family) if family == "llama" else full_attention_qwen2()
    if family == "qwen2":  # non-zero q/k/v biases, which the form must carry
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                    proj.bias.normal_()
    variant = copy.deepcopy(model)
    remove_sublayers(variant, UNITS)
    out = save_sublayer_variant(variant, None, tmp_path / "v", UNITS, {"method": "shortgpt"})
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "nemotron-nas"
    assert [b["attention"]["no_op"] for b in config["block_configs"]] == [
        False,
        True,
        False,
        True,
        False,
        False,
    ]
    assert [b["ffn"]["no_op"] for b in config["block_configs"]][4] is True
    assert config["qkv_bias"] is (family == "qwen2")
    assert json.loads((out / "lorp_pruning.json").read_text())["granularity_units"] == [
        "attn.1",
        "attn.3",
        "mlp.4",
    ]
    loaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    layer1 = loaded.model.layers[1]
    assert not hasattr(layer1, "self_attn") and not hasattr(layer1, "input_layernorm")
    assert not hasattr(loaded.model.layers[4], "mlp")
    x = token_windows(n=2, T=20)
    torch.testing.assert_close(logits(loaded, x), logits(variant, x), rtol=1e-5, atol=1e-5)
    prompt = token_windows(n=1, T=8, seed=3)
    a = loaded.generate(prompt, max_new_tokens=4, do_sample=False, use_cache=True)
    b = variant.generate(prompt, max_new_tokens=4, do_sample=False, use_cache=True)
    assert a.tolist() == b.tolist()


@pytest.mark.parametrize(
    ("family", "edit", "message"),
    [
        ("gemma3_text", {}, "model_type 'gemma3_text': sub-layer variants are served by vLLM"),
        ("olmo2", {}, "model_type 'olmo2'"),
        ("mistral", {}, "model_type 'mistral'"),
        ("qwen2", {"use_sliding_window": True}, "sliding-window"),
    ],
)
def test_a_family_the_form_cannot_carry_is_refused(
    family: str, edit: dict, message: str, tmp_path: Path
) -> None:
    config = tiny_model(family).config.to_dict() | edit
    with pytest.raises(NotServable, match=message):
        nemotron_nas_config(config, UNITS)
    assert not (tmp_path / "v").exists()


def test_a_sub_layer_still_in_the_model_is_refused(tmp_path: Path) -> None:
    model = tiny_model("llama")
    remove_sublayers(model, [2])
    with pytest.raises(ValueError, match="sub-layer mlp.1 is still in the model"):
        save_sublayer_variant(model, None, tmp_path / "v", [2, 3], {})
    assert not (tmp_path / "v").exists()
