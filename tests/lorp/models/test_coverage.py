"""The families table: what lorp does with a family, read from its config alone, and the
committed docs page equal to what the code supports."""

from __future__ import annotations

from transformers import AutoConfig

from lorp.models.coverage import YES, support
from tests.helpers.family_models import family_config, multimodal_config


def test_a_llama_is_removed_reloaded_split_and_repaired() -> None:
    llama = support(family_config("llama"))
    assert (llama.family, llama.kinds, llama.refused) == ("Llama", ("attention",), None)
    assert {llama.blocks, llama.reload, llama.sublayers, llama.repair} == {YES}


def test_mixtures_and_hybrids_name_their_kinds_of_block() -> None:
    assert support(family_config("deepseek_v3")).kinds == ("attention", "attention+moe")
    nemotron = support(family_config("nemotron_h"))
    assert nemotron.kinds == ("mamba", "moe", "attention", "mlp")
    assert nemotron.sublayers.startswith("no: its block is mamba")
    assert nemotron.repair == YES and nemotron.refused is None


def test_a_pattern_takes_the_cuts_that_keep_its_phase() -> None:
    """Jamba (attention and experts every 2nd block of 4): only the top block goes alone."""
    jamba = support(family_config("jamba"))
    assert jamba.reload.startswith("some cuts: removing block 3 of 4 reloads; Jamba: kept block 1")
    assert jamba.refused is None


def test_refusals_say_what_is_missing_in_one_line() -> None:
    bert = support(AutoConfig.for_model("bert", num_hidden_layers=2))
    assert bert.refused == "no: no list of decoder blocks sits beside its token embeddings"
    minimax = support(AutoConfig.for_model("minimax", num_hidden_layers=4))
    assert minimax.repair.startswith("no: its residual stream carries the normed state")
    assert minimax.reload.startswith("no: MiniMax: kept block 1 would reload as another block")
    assert all("\n" not in a for a in (bert.blocks, minimax.repair, minimax.reload))


def test_a_multimodal_wrapper_is_read_by_its_text_tower() -> None:
    config = multimodal_config("mistral3")
    config.architectures = ["Mistral3ForConditionalGeneration"]
    mistral = support(config)
    assert mistral.multimodal and mistral.family == "Mistral" and mistral.refused is None
