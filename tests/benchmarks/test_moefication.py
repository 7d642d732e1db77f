"""benchmarks/moefication.py on a tiny random Llama (hidden 64, intermediate 128, 2 blocks)
cut into 4 experts: the clusters, the exactness of the split, and the saved checkpoint
(the script's run on the packaged models measures the routers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from tests.helpers.benchmark_scripts import load_benchmark, torch_threads
from tests.helpers.tiny_models import ptb_tokenizer

mf = load_benchmark("moefication")
EXPERTS = 4


def tiny_llama(**extra):  # type: ignore[no-untyped-def]
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **extra,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def moefied():  # type: ignore[no-untyped-def]
    with torch_threads(1):
        dense = tiny_llama()
        calibration = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
        moe, splits = mf.moefy(dense, calibration, EXPERTS, top_k=2)
    return dense, moe, splits


def test_the_clusters_are_balanced_and_partition_the_neurons(moefied) -> None:  # type: ignore[no-untyped-def]
    dense, _, splits = moefied
    for split, layer in zip(splits, dense.model.layers, strict=True):
        assert split.neurons.shape == (EXPERTS, 128 // EXPERTS)
        assert sorted(split.neurons.flatten().tolist()) == list(range(128))
        gate = layer.mlp.gate_proj.weight
        assert torch.equal(split.gate_up[2, :32], gate[split.neurons[2]])
    scores = torch.tensor([[3.0, 2.0], [2.9, 0.0], [2.8, 0.0], [0.0, 1.0]])
    assert mf.balanced_assign(scores, 2).tolist() == [0, 0, 1, 1]  # the third neuron spills


def test_all_experts_at_weight_one_are_the_dense_mlp(moefied) -> None:  # type: ignore[no-untyped-def]
    dense, _, splits = moefied
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(2))
    every = mf.build_moe(dense, splits, [torch.zeros(EXPERTS, 64)] * 2, top_k=EXPERTS)
    with torch.no_grad():
        layers = zip(splits, dense.model.layers, every.model.layers, strict=True)
        for split, layer, moe_layer in layers:
            want = layer.mlp(x)
            summed = mf.expert_outputs(x.reshape(-1, 64), split, layer.mlp.act_fn).sum(0)
            assert torch.allclose(summed.reshape(x.shape), want, atol=1e-5)
            assert torch.allclose(moe_layer.mlp(x), want, atol=1e-5)
    assert mf.all_experts_gap(dense, splits, torch.randint(0, 256, (1, 12))) < 1e-4


def test_the_saved_checkpoint_reloads_with_four_experts_top_two(moefied, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _, moe, _ = moefied
    out = mf.save_checkpoint(moe, ptb_tokenizer(), tmp_path / "moe", {"model": "tiny"})
    again = AutoModelForCausalLM.from_pretrained(out).eval()
    assert (again.config.model_type, again.config.num_experts) == ("qwen2_moe", EXPERTS)
    assert again.config.num_experts_per_tok == 2 and again.config.norm_topk_prob
    ids = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, moe(input_ids=ids).logits)
    assert AutoTokenizer.from_pretrained(out)("the")["input_ids"]
    weights = moe.model.layers[0].mlp.gate(torch.randn(6, 64))[1]
    assert torch.allclose(weights, torch.full_like(weights, 0.5), atol=0.01)  # flat top-2


def test_a_bias_qwen2_moe_has_no_place_for_is_refused() -> None:
    with pytest.raises(ValueError, match="o_proj bias"):
        mf.moe_config(tiny_llama(attention_bias=True).config, EXPERTS, 2)
