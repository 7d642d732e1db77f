"""A family lorp does not support is refused in one line naming the ones it does."""

from __future__ import annotations

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from lorp.models.architectures import UnsupportedArchitectureError, architecture_of


def test_unsupported_architecture_one_line() -> None:
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("gpt2", n_layer=2, n_embd=64, n_head=2, vocab_size=128)
    )
    with pytest.raises(
        UnsupportedArchitectureError, match="unsupported model_type 'gpt2' \\(supported: gemma2"
    ):
        architecture_of(model)
