"""A model's decoder read from its modules: a family transformers adds is read and
pruned with no change to lorp; a model with no decoder blocks is refused in one line
naming what is missing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)

from lorp.models.architectures import (
    UnsupportedArchitectureError,
    architecture_for,
    architecture_of,
    decoder_blocks,
    final_norm,
    tied_embeddings,
)
from lorp.models.surgery import drop_layers
from tests.helpers.family_models import BASE, family_model, multimodal_model


class FleetConfig(LlamaConfig):
    model_type = "fleet_llama"


class FleetForCausalLM(LlamaForCausalLM):
    config_class = FleetConfig


def test_a_llama_shaped_family_under_a_new_model_type_is_pruned_with_no_change(
    tmp_path: Path,
) -> None:
    AutoConfig.register("fleet_llama", FleetConfig, exist_ok=True)
    AutoModelForCausalLM.register(FleetConfig, FleetForCausalLM, exist_ok=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FleetConfig(**BASE)).eval()
    arch = architecture_of(model)
    assert (arch.family, arch.model_type, arch.decoder_path) == ("Fleet", "fleet_llama", "model")
    assert (arch.blocks_attr, arch.final_norm_attr, arch.norm_offset) == ("layers", "norm", 0.0)
    assert drop_layers(model, [1, 2]) == [0, 3]
    ids = torch.tensor([[5, 7, 9, 11]])
    with torch.no_grad():
        pruned = model(ids).logits
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is FleetForCausalLM and reloaded.config.num_hidden_layers == 2
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, pruned)


def test_a_model_without_decoder_blocks_beside_its_embeddings_is_refused_in_one_line() -> None:
    small = {"hidden_size": 64, "intermediate_size": 128, "vocab_size": 128}
    config = AutoConfig.for_model(
        "bert", num_hidden_layers=2, num_attention_heads=2, is_decoder=True, **small
    )
    with pytest.raises(UnsupportedArchitectureError) as refused:
        architecture_of(AutoModelForCausalLM.from_config(config))
    assert str(refused.value) == (
        "model_type 'bert' cannot be pruned by lorp: no list of decoder blocks sits beside "
        "its token embeddings"
    )


def test_an_encoder_decoder_is_refused_in_one_line() -> None:
    heads = {"encoder_attention_heads": 2, "decoder_attention_heads": 2}
    config = AutoConfig.for_model(
        "bart", d_model=64, encoder_layers=1, decoder_layers=1, vocab_size=128, **heads
    )
    with pytest.raises(UnsupportedArchitectureError, match="it is an encoder-decoder model$"):
        architecture_for(config)


@pytest.mark.parametrize(
    ("family", "norm", "offset", "blocks"),
    [("llama", "norm", 0.0, 4), ("gemma3_text", "norm", 1.0, 4), ("nemotron_h", "norm_f", 0.0, 4)],
)
def test_the_stack_its_blocks_and_its_final_norm_are_read(
    family: str, norm: str, offset: float, blocks: int
) -> None:
    model = family_model(family)
    arch = architecture_of(model)
    assert arch.final_norm_attr == norm and arch.norm_offset == offset
    assert len(decoder_blocks(model)) == blocks and final_norm(model) is model.model.get_submodule(
        norm
    )
    assert architecture_for(model.config) == arch  # the same, from the config alone


def test_a_multimodal_models_decoder_is_its_text_tower() -> None:
    model = multimodal_model("gemma3")
    arch = architecture_of(model)
    assert arch.decoder_path == "model.language_model" and arch.multimodal
    assert decoder_blocks(model) is model.model.language_model.layers
    assert tied_embeddings(model) and not tied_embeddings(family_model("llama"))
