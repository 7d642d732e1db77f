"""Sub-layer variants as checkpoints that serve: the Nemotron-NAS form vLLM loads natively.

vLLM's `DeciLMForCausalLM` (model_type `nemotron-nas`) reads a `block_configs` list with
`attention.no_op` and `ffn.no_op` per block, builds neither the module nor its norm for a
no-op, and allocates KV cache only for the blocks that keep attention. A Llama-family or
Qwen2-family variant without some sub-layers maps onto it exactly:

- the kept tensors keep their names (`model.layers.i.self_attn.q_proj.weight`, ...); a
  block without attention loses its `input_layernorm`, one without MLP its
  `post_attention_layernorm` (the MLP's input norm in these families);
- Qwen2's q/k/v biases are kept (`qkv_bias: true`, `attention_bias: false`: o_proj has
  none, as Qwen2's); a tied LM head stays tied (`tie_word_embeddings`);
- the configuration and modelling code (`lorp/models/nemotron_nas_code/`) are written into
  the checkpoint with an `auto_map`, so transformers loads it without the hub behind
  `trust_remote_code=True`, and vLLM reads the same configuration.

Families vLLM cannot serve this way (a post-norm family such as Gemma 3 or OLMo 2, a
sliding-window model, fused-qkv families) are refused with one line naming the family:
their sub-layer variants are evaluated in memory with transformers.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from lorp.atomic import atomic_dir
from lorp.models.architectures import decoder_blocks
from lorp.models.sublayers import Removed, check_units, unit_label

log = logging.getLogger(__name__)

ATTENTION, MLP = "self_attn", "mlp"
"""The sub-layers of the Llama and Qwen2 blocks this form is written for."""

CODE_DIR = Path(__file__).with_name("nemotron_nas_code")
CODE_FILES = ("configuration_decilm.py", "modeling_decilm.py")
SERVED_FAMILIES = ("llama", "qwen2")
"""Source model_types whose sub-layer variants are written in Nemotron-NAS form."""
PROVENANCE_FILE = "lorp_pruning.json"
CONFIG_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_parameters",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "initializer_range",
)


class NotServable(ValueError):
    """A source this form cannot carry, with the reason in one line."""


def check_servable(config: Mapping[str, Any]) -> None:
    """NotServable unless a Nemotron-NAS checkpoint carries this source exactly."""
    family = config.get("model_type")
    if family not in SERVED_FAMILIES:
        raise NotServable(
            f"model_type {family!r}: sub-layer variants are served by vLLM only for "
            f"{', '.join(SERVED_FAMILIES)}; evaluate this family with transformers"
        )
    sliding = config.get("use_sliding_window") or any(
        t == "sliding_attention" for t in config.get("layer_types") or []
    )
    if sliding and config.get("sliding_window"):
        raise NotServable(f"model_type {family!r} with sliding-window layers: not in this form")
    if config.get("mlp_bias") or (family == "llama" and config.get("attention_bias")):
        raise NotServable(f"model_type {family!r} with biases this form does not map")


def nemotron_nas_config(config: Mapping[str, Any], units: Iterable[int]) -> dict[str, Any]:
    """The `config.json` of a variant of `config` (the source's, a dict) without `units`."""
    check_servable(config)
    n = int(config["num_hidden_layers"])
    gone = set(check_units(units, n))
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    out = {k: config[k] for k in CONFIG_KEYS if config.get(k) is not None}
    blocks = [
        {
            "attention": {
                "no_op": 2 * i in gone,
                "n_heads_in_group": heads // kv,
                "replace_with_linear": False,
            },
            "ffn": {
                "no_op": 2 * i + 1 in gone,
                "intermediate_size": int(config["intermediate_size"]),
                "replace_with_linear": False,
            },
        }
        for i in range(n)
    ]
    return out | {
        "architectures": ["DeciLMForCausalLM"],
        "model_type": "nemotron-nas",
        "auto_map": {
            "AutoConfig": "configuration_decilm.DeciLMConfig",
            "AutoModelForCausalLM": "modeling_decilm.DeciLMForCausalLM",
        },
        "block_configs": blocks,
        "qkv_bias": config["model_type"] == "qwen2",
        "attention_bias": False,
        "mlp_bias": False,
        "dtype": str(config.get("dtype") or config.get("torch_dtype") or "float32"),
    }


def variant_tensors(model: nn.Module, units: Iterable[int]) -> dict[str, Any]:
    """The tensors the checkpoint holds: the in-memory variant's (its removed sub-layers
    hold none) less the norms of removed sub-layers and a tied LM head."""
    blocks = decoder_blocks(model)
    gone = set(check_units(units, len(blocks)))
    for u in sorted(gone):
        module = getattr(blocks[u // 2], ATTENTION if u % 2 == 0 else MLP)
        if not isinstance(module, Removed):
            raise ValueError(
                f"sub-layer {unit_label(u)} is still in the model: remove_sublayers first"
            )
    dropped = {f"model.layers.{u // 2}.input_layernorm." for u in gone if u % 2 == 0}
    dropped |= {f"model.layers.{u // 2}.post_attention_layernorm." for u in gone if u % 2 == 1}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    out = {}
    for name, tensor in model.state_dict().items():
        if any(name.startswith(p) for p in dropped) or (tied and name == "lm_head.weight"):
            continue
        out[name] = tensor.detach().contiguous().cpu()
    return out


def save_sublayer_variant(
    model: nn.Module,
    tokenizer: Any,
    out_dir: str | os.PathLike[str],
    units: Iterable[int],
    provenance: Mapping[str, Any],
    *,
    overwrite: bool = False,
) -> Path:
    """Write the in-memory variant `model` (sub-layers `units` removed, maps folded) as a
    Nemotron-NAS checkpoint with its modelling code, tokenizer and `lorp_pruning.json`,
    atomically. NotServable, before anything is written, for a family it cannot carry."""
    wanted = list(units)
    config = nemotron_nas_config(model.config.to_dict(), wanted)
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"output directory already exists: {str(out)!r}")
    tensors = variant_tensors(model, wanted)
    with atomic_dir(out, overwrite=overwrite) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _write_form(tmp, config, wanted, provenance)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    log.info("saved a sub-layer variant (%d removed) to %s", len(wanted), out)
    return out


def write_sublayer_files(
    src: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    units: Iterable[int],
    provenance: Mapping[str, Any],
    *,
    changed: Mapping[str, torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """The same checkpoint written from the dense checkpoint `src`'s files, tensor by
    tensor (peak memory: one tensor, whatever the model's size), with `changed` (key ->
    the tensor a repair's fold gave) in place of the source's: how a sub-layer manifest is
    written out (`lorp.models.variant_manifest.materialize_variant`). Tensor for tensor
    what `save_sublayer_variant` writes from the same variant in memory, in `dtype` (by
    default each tensor keeps the checkpoint's)."""
    from transformers import AutoConfig

    from lorp.models.disk_names import DiskLayout
    from lorp.models.file_surgery import copy_side_files, write_shards
    from lorp.models.safetensors_index import tensor_index

    src, out = Path(src), Path(out_dir)
    source = AutoConfig.from_pretrained(str(src))
    wanted = list(units)
    text = source.to_dict()
    if dtype is not None:
        text["dtype"] = str(dtype).removeprefix("torch.")
    config = nemotron_nas_config(text, wanted)
    if out.exists() and not overwrite:
        raise FileExistsError(f"output directory already exists: {str(out)!r}")
    gone = _unit_prefixes(wanted)
    tied = bool(config.get("tie_word_embeddings"))
    index = {
        k: e
        for k, e in tensor_index(src).items()
        if not k.startswith(gone) and not (tied and k == "lm_head.weight")
    }
    folds = {k: (lambda t, v=v: v.to(t.dtype)) for k, v in (changed or {}).items()}
    with atomic_dir(out, overwrite=overwrite) as tmp:
        n = int(config["num_hidden_layers"])
        layout = DiskLayout("model.layers.", n)  # the Llama and Qwen2 forms it writes
        write_shards(tmp, index, layout, {b: b for b in range(n)}, folds, dtype)
        _write_form(tmp, config, wanted, provenance)
        copy_side_files(src, tmp, source)
    log.info("wrote a sub-layer variant (%d removed) to %s from %s's files", len(wanted), out, src)
    return out


def _unit_prefixes(units: Iterable[int]) -> tuple[str, ...]:
    """The checkpoint keys a removed unit takes with it: its module and its input norm."""
    out = []
    for u in units:
        b = u // 2
        parts = (
            ("self_attn", "input_layernorm") if u % 2 == 0 else ("mlp", "post_attention_layernorm")
        )
        out += [f"model.layers.{b}.{p}." for p in parts]
    return tuple(out)


def _write_form(
    tmp: Path, config: Mapping[str, Any], units: list[int], provenance: Mapping[str, Any]
) -> None:
    """The Nemotron-NAS config, its modelling code and the provenance file."""
    meta = {
        "granularity_units": [unit_label(u) for u in sorted(units)],
        "trust_remote_code": True,
        **dict(provenance),
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    for name in CODE_FILES:
        shutil.copyfile(CODE_DIR / name, tmp / name)
    (tmp / PROVENANCE_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
