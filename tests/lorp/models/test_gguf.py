"""The GGUF conversion passes on the BOS flag transformers' GGUF tokenizer loader drops
(on the packaged models, which `make test` installs)."""

from __future__ import annotations

from tests.helpers.packaged import require


def test_gguf_bos_flags_for_the_tokenizer() -> None:
    """transformers' GGUF tokenizer loader drops add_bos_token; the conversion passes it on
    (Gemma's GGUF asks for a BOS, SmolLM2's does not), so `auto` finds Gemma's BOS."""
    require("gemma3-270m")
    require("smollm2-135m")
    from lorp.models.gguf import gguf_tokenizer_flags
    from lorp.models.packaged import packaged_gguf

    assert gguf_tokenizer_flags(packaged_gguf("gemma3-270m")) == {"add_bos_token": True}
    assert gguf_tokenizer_flags(packaged_gguf("smollm2-135m")) == {"add_bos_token": False}
