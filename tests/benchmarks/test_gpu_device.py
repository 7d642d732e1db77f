"""benchmarks/gpu_device.py on a CPU: the shapes built tiny (Gemma 3's sliding-window
pattern kept), and the device's timer and peak memory where there is no device."""

from __future__ import annotations

from benchmarks.gpu_device import SHAPES, TINY, build, cuda, peak_gib, timed


def test_tiny_shapes_keep_their_family_s_layout() -> None:
    llama = build("llama-8b", tiny=True, device="cpu")
    assert llama.config.hidden_size == TINY["hidden_size"] and not llama.training
    assert llama.config.num_hidden_layers == TINY["num_hidden_layers"]
    assert llama.config.vocab_size == TINY["vocab_size"]
    gemma = build("gemma3-4b", tiny=True, device="cpu")
    assert gemma.config.sliding_window == TINY["sliding_window"]
    types = gemma.config.layer_types
    assert [i for i, t in enumerate(types) if t == "full_attention"] == [5, 11]
    assert SHAPES["gemma3-4b"]["num_hidden_layers"] == 34  # the real shape is untouched


def test_without_a_device_nothing_is_synchronised_or_measured() -> None:
    assert not cuda("cpu") and cuda("cuda:0")
    assert peak_gib("cpu", lambda: 7) == (None, 7)
    seconds, out = timed(lambda: 3, "cpu", 2)
    assert seconds >= 0 and out == 3
