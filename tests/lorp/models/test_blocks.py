"""What a block adds to the residual stream, read from its children: branches, kinds,
post-norms, output linears, scales, stages, and every tensor a map folds into."""

from __future__ import annotations

import pytest
import torch

from lorp.models.architectures import architecture_of, block_stage, decoder_blocks, unit_stage
from lorp.models.blocks import Branch, Removed, find_bank, read_block
from tests.helpers.family_models import family_model


def layout(family: str, block: int = 1):  # type: ignore[no-untyped-def]
    model = family_model(family)
    return model, read_block(decoder_blocks(model)[block], architecture_of(model).model_type)


@pytest.mark.parametrize(
    ("family", "branches"),
    [
        ("llama", [("self_attn", "attention", None, "o_proj"), ("mlp", "mlp", None, "down_proj")]),
        (
            "gemma3_text",
            [
                ("self_attn", "attention", "post_attention_layernorm", "o_proj"),
                ("mlp", "mlp", "post_feedforward_layernorm", "down_proj"),
            ],
        ),
        (
            "glm4",
            [
                ("self_attn", "attention", "post_self_attn_layernorm", "o_proj"),
                ("mlp", "mlp", "post_mlp_layernorm", "down_proj"),
            ],
        ),
        (
            "starcoder2",
            [("self_attn", "attention", None, "o_proj"), ("mlp", "mlp", None, "c_proj")],
        ),
        ("qwen2_moe", [("self_attn", "attention", None, "o_proj"), ("mlp", "moe", None, None)]),
        (
            "lfm2",
            [("self_attn", "attention", None, "out_proj"), ("feed_forward", "mlp", None, "w2")],
        ),
        ("nemotron_h", [("mixer", "moe", None, None)]),
        ("qwen3_next", [("self_attn", "attention", None, "o_proj"), ("mlp", "moe", None, None)]),
    ],
)
def test_each_branch_its_kind_post_norm_and_output_linear(family: str, branches: list) -> None:
    _, got = layout(family)
    assert [(b.name, b.kind, b.post_norm, b.out) for b in got.branches] == branches
    assert got.additive and not got.unread


def test_granite_scales_every_branch_and_falcon_h1_each_mixer() -> None:
    _, granite = layout("granite")
    assert {b.scale for b in granite.branches} == {"residual_multiplier"}
    model, falcon = layout("falcon_h1")
    scales = {b.kind: b.scale for b in falcon.branches}
    assert scales == {
        "mamba": "ssm_out_multiplier",
        "attention": "attn_out_multiplier",
        "mlp": None,
    }
    assert falcon.kind == "mamba+attention" and "not one token mixer" in str(falcon.splittable())
    stage = block_stage(model, 1)
    assert [b.name for b in stage.branches] == ["feed_forward"] and stage.scale(
        stage.branches[0]
    ) == 1.0


def test_a_parallel_block_has_no_state_between_its_stages() -> None:
    _, cohere = layout("cohere2")
    assert cohere.parallel and "read the same input" in str(cohere.splittable())
    _, llama = layout("llama")
    assert not llama.parallel and llama.splittable() is None


def test_a_moe_stage_folds_into_every_expert_and_every_shared_expert() -> None:
    model = family_model("deepseek_v3")
    stage = block_stage(model, 2)
    mlp = decoder_blocks(model)[2].mlp
    targets = [(t.module, t.attr, t.how) for t in stage.fold_targets()]
    assert targets == [
        (mlp.experts, "down_proj", "bank"),
        (mlp.shared_experts.down_proj, "weight", "linear"),
    ]
    bank = find_bank(mlp)
    assert bank is not None and (bank.n_experts, bank.transposed, bank.down_bias) == (
        4,
        False,
        False,
    )


def test_gpt_oss_banks_are_transposed_with_biases() -> None:
    model = family_model("gpt_oss")
    hows = [(t.attr, t.how) for t in block_stage(model, 1).fold_targets()]
    assert hows == [("down_proj", "bank_t"), ("down_proj_bias", "bank_bias")]
    assert tuple(decoder_blocks(model)[1].mlp.experts.down_proj.shape) == (4, 128, 64)


def test_a_removed_branch_keeps_its_place_and_kind() -> None:
    model = family_model("qwen3_moe")
    block = decoder_blocks(model)[2]
    block.self_attn = Removed("attention", True)
    got = read_block(block)
    assert got.branches[0] == Branch("self_attn", "attention", None, None, None)
    assert unit_stage(model, 4).branches == (got.branches[0],)
    out = block.self_attn(torch.ones(1, 2, 64))
    assert isinstance(out, tuple) and not out[0].any() and out[1] is None


def test_a_block_with_weights_lorp_cannot_read_is_not_repaired() -> None:
    """OPT's block computes its MLP inline from two linears of its own: what it adds is
    not a branch's output, so no map is fitted or folded there."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lorp.repair.fit import check_repairable
    from lorp.repair.maps import RepairRefused

    config = AutoConfig.for_model(
        "opt",
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        vocab_size=128,
        word_embed_proj_dim=64,
    )
    model = AutoModelForCausalLM.from_config(config)
    got = read_block(decoder_blocks(model)[0])
    assert got.unread == ("fc1", "fc2") and "fc1, fc2" in str(got.unreadable())
    with pytest.raises(RepairRefused, match="^block 0: it holds weights lorp cannot read"):
        check_repairable(model, [1])
