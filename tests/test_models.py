"""Capture, surgery and saving on tiny random models of every supported family."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from lorp import NonFiniteActivationError
from lorp.locality.capture import capture_stats
from lorp.models.architectures import UnsupportedArchitectureError, architecture_of, decoder_stack
from lorp.models.fingerprint import fingerprint_checkpoint
from lorp.models.surgery import PROVENANCE_FILE, drop_layers, save_pruned
from tests.helpers.states import brute_force_S, brute_last_token, last_positions
from tests.helpers.tiny_models import FAMILIES, N_BLOCKS, VOCAB, save_tiny, tiny_config, tiny_model

FAMILY_IDS = list(FAMILIES)


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0  # right padding on the second sequence
    return {"input_ids": ids, "attention_mask": mask}


def independent_states(model: nn.Module, b: dict[str, torch.Tensor]) -> np.ndarray:
    """Block inputs from transformers' own output_hidden_states, and the last block's
    output with the final norm swapped for the identity: no lorp hook involved."""
    stack = decoder_stack(model)
    norm = stack.norm
    stack.norm = nn.Identity()
    try:
        with torch.no_grad():
            hs = model(**b, output_hidden_states=True).hidden_states
    finally:
        stack.norm = norm
    assert len(hs) == N_BLOCKS + 1
    return torch.stack(hs).double().numpy()


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_capture_equals_brute_force(family: str) -> None:
    model = tiny_model(family)
    batches = [batch(0), batch(1)]
    stats = capture_stats(model, batches, progress=False)
    states = np.concatenate([independent_states(model, b) for b in batches], axis=1)
    states = states.reshape(N_BLOCKS + 1, -1, states.shape[-1])
    mask = torch.cat([b["attention_mask"] for b in batches]).reshape(-1).numpy().astype(bool)
    expected = brute_force_S(states, mask)
    np.testing.assert_allclose(stats.matrix(include_output=True), expected, rtol=1e-5, atol=1e-5)
    assert stats.tokens == int(mask.sum()) == 2 * (24 + 17)
    # Real structure, not a degenerate matrix: neighbours differ from each other.
    assert np.ptp(expected[np.triu_indices(N_BLOCKS + 1, 1)]) > 0.05


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_last_token_gram_equals_brute_force(family: str) -> None:
    """Right padding on the second sequence: its last real token is position 16, not 23."""
    model = tiny_model(family)
    batches = [batch(0), batch(1)]
    stats = capture_stats(model, batches, progress=False)
    parts = [
        brute_last_token(independent_states(model, b), last_positions([23, 16], 24))
        for b in batches
    ]
    cos, ang = ((parts[0][i] + parts[1][i]) / 2 for i in (0, 1))
    assert stats.sequences == 4
    np.testing.assert_allclose(stats.last_gram / 4, cos, rtol=0, atol=1e-6)
    np.testing.assert_allclose(stats.last_token_matrix(), cos, rtol=0, atol=1e-6)
    np.testing.assert_allclose(stats.last_token_angular(), ang, rtol=0, atol=1e-5)


def test_capture_skips_the_bos_position_from_S_only() -> None:
    model = tiny_model("llama")
    b = batch(0)
    ids = torch.cat([torch.ones(2, 1, dtype=torch.long), b["input_ids"]], dim=1)
    mask = torch.cat([torch.ones(2, 1, dtype=torch.long), b["attention_mask"]], dim=1)
    bos = {"input_ids": ids, "attention_mask": mask}
    stats = capture_stats(model, [bos], progress=False, skip_prefix=1)
    states = independent_states(model, bos)
    keep = mask.bool().clone()
    keep[:, 0] = False
    flat = states.reshape(N_BLOCKS + 1, -1, states.shape[-1])
    expected = brute_force_S(flat, keep.reshape(-1).numpy())
    np.testing.assert_allclose(stats.matrix(include_output=True), expected, rtol=1e-5, atol=1e-5)
    assert stats.tokens == 24 + 17
    np.testing.assert_allclose(
        stats.last_token_matrix(),
        brute_last_token(states, last_positions([24, 17], states.shape[2]))[0],
        rtol=0,
        atol=1e-6,
    )


def test_capture_never_runs_the_lm_head() -> None:
    model = tiny_model("llama")
    calls = []
    model.lm_head.register_forward_hook(lambda *a: calls.append(1))
    decoder_stack(model).norm.register_forward_hook(lambda *a: calls.append(2))
    capture_stats(model, [batch()["input_ids"]], progress=False)
    assert calls == []  # neither the vocabulary projection nor the final norm ran
    assert not model.model.layers[0]._forward_pre_hooks  # hooks removed afterwards


def test_capture_names_the_layer_on_overflow() -> None:
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[3].mlp.down_proj.weight.fill_(float("inf"))
    with pytest.raises(NonFiniteActivationError, match="layer 4 \\(the input of block 4\\)"):
        capture_stats(model, [batch()["input_ids"]], progress=False)


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_drop_save_reload_generate(family: str, tmp_path: Path) -> None:
    model = tiny_model(family)
    original_types = list(getattr(model.config, "layer_types", None) or [])
    kept = drop_layers(model, [1, 4])
    assert kept == [0, 2, 3, 5]
    assert model.config.num_hidden_layers == 4 and len(model.model.layers) == 4
    assert [blk.self_attn.layer_idx for blk in model.model.layers] == [0, 1, 2, 3]
    if original_types:
        assert model.config.layer_types == [original_types[i] for i in kept]

    out = save_pruned(model, None, tmp_path / "pruned", {"pruned": [1, 4], "kept": kept})
    assert json.loads((out / PROVENANCE_FILE).read_text())["kept"] == kept
    assert not list(tmp_path.glob(".*partial"))
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert reloaded.config.num_hidden_layers == 4
    assert reloaded.config.tie_word_embeddings == tiny_config(family).tie_word_embeddings
    if original_types:
        assert reloaded.config.layer_types == [original_types[i] for i in kept]

    ids = batch()["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)
        # generate() with the KV cache: fails with an IndexError if layer_idx is stale.
        gen = reloaded.generate(ids[:1, :8], max_new_tokens=6, do_sample=False, use_cache=True)
        ref = model.generate(ids[:1, :8], max_new_tokens=6, do_sample=False, use_cache=True)
    assert gen.shape == (1, 14) and torch.equal(gen, ref)


def test_safetensors_keys_are_contiguous(tmp_path: Path) -> None:
    from safetensors import safe_open

    model = tiny_model("llama")
    drop_layers(model, [2, 3])
    save_pruned(model, None, tmp_path / "p", {})
    with safe_open(str(tmp_path / "p" / "model.safetensors"), "pt") as f:
        idx = {int(k.split(".")[2]) for k in f.keys() if k.startswith("model.layers.")}  # noqa: SIM118
    assert idx == {0, 1, 2, 3}


def test_qwen_max_window_layers_recounted() -> None:
    model = tiny_model("qwen2")  # max_window_layers = 3: blocks 0-2 full, 3-5 sliding
    drop_layers(model, [0, 4])
    assert model.config.max_window_layers == 2
    assert model.config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2


def test_drop_layers_bad_input() -> None:
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"layers must be in \[0, 5\], got \[6\]"):
        drop_layers(model, [2, 6])
    with pytest.raises(ValueError, match="cannot drop all 6 blocks"):
        drop_layers(model, range(6))
    assert len(model.model.layers) == 6  # untouched


def test_unsupported_architecture_one_line() -> None:
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("gpt2", n_layer=2, n_embd=64, n_head=2, vocab_size=128)
    )
    with pytest.raises(
        UnsupportedArchitectureError, match="unsupported model_type 'gpt2' \\(supported: gemma2"
    ):
        architecture_of(model)


def test_save_is_atomic(tmp_path: Path) -> None:
    model = tiny_model("llama")

    class Broken:
        def save_pretrained(self, path: str) -> None:
            (Path(path) / "tokenizer.json").write_text("{")
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        save_pruned(model, Broken(), tmp_path / "out", {})
    assert list(tmp_path.iterdir()) == []  # nothing partial, nothing that looks complete
    save_pruned(model, None, tmp_path / "out", {"v": 1})
    with pytest.raises(FileExistsError, match="already exists"):
        save_pruned(model, None, tmp_path / "out", {"v": 2})
    save_pruned(model, None, tmp_path / "out", {"v": 3}, overwrite=True)
    assert json.loads((tmp_path / "out" / PROVENANCE_FILE).read_text()) == {"v": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_fingerprint_is_content_not_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORP_CACHE", str(tmp_path / "cache"))
    a = save_tiny("llama", tmp_path / "a")
    b = save_tiny("llama", tmp_path / "b")
    c = save_tiny("llama", tmp_path / "c", seed=1)
    assert fingerprint_checkpoint(a) == fingerprint_checkpoint(b) != fingerprint_checkpoint(c)
    # Sharded differently: same tensors, same fingerprint.
    tiny_model("llama").save_pretrained(tmp_path / "d", max_shard_size="100KB")
    assert len(list((tmp_path / "d").glob("*.safetensors"))) > 1
    assert fingerprint_checkpoint(tmp_path / "d") == fingerprint_checkpoint(a)


def _lorp_capture(model_dir: Path, data: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    from tests.helpers.cli_runner import lorp

    args = ["capture", str(model_dir), "--data", data, "--samples", "2",
            "--seq-len", "16", "--out", "s.npz"]  # fmt: skip
    return lorp(*args, cwd=cwd)


def test_cli_bad_models_and_corpora(tmp_path: Path) -> None:
    """Through the CLI: one line, exit 2, no stats file written."""
    from tests.helpers.tiny_models import save_tiny_ptb

    gpt2 = tmp_path / "gpt2"
    AutoModelForCausalLM.from_config(
        AutoConfig.for_model("gpt2", n_layer=2, n_embd=64, n_head=2, vocab_size=128)
    ).save_pretrained(gpt2)
    out = _lorp_capture(gpt2, "ptb", tmp_path)
    assert out.returncode == 2 and "unsupported model_type 'gpt2'" in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1

    llama = save_tiny_ptb("llama", tmp_path / "llama")
    (tmp_path / "empty.txt").write_text("\n  \n")
    out = _lorp_capture(llama, str(tmp_path / "empty.txt"), tmp_path)
    assert out.returncode == 2 and "is empty" in out.stderr and out.stderr.count("\n") == 1

    broken = AutoModelForCausalLM.from_pretrained(llama)
    with torch.no_grad():
        broken.model.layers[2].mlp.down_proj.weight.fill_(float("inf"))
    broken.save_pretrained(tmp_path / "broken")
    shutil.copy(llama / "tokenizer.json", tmp_path / "broken")
    shutil.copy(llama / "tokenizer_config.json", tmp_path / "broken")
    out = _lorp_capture(tmp_path / "broken", "ptb", tmp_path)
    assert out.returncode == 2 and "non-finite activations at layer 3" in out.stderr, out.stderr
    assert "float32 or bfloat16" in out.stderr and out.stderr.count("\n") == 1
    assert not (tmp_path / "s.npz").exists()
