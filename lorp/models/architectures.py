"""Where a model keeps its decoder blocks, read from the model itself, not from a list of
families: a family transformers knows is pruned the way its modules say.

- The decoder stack is the module that holds the token embeddings (`get_input_embeddings`):
  `model` for a causal LM, `model.language_model` or `language_model.model` for the text
  tower of a multimodal model, whose vision tower and projector surgery never touches.
- Its blocks are its `nn.ModuleList` child (the one of `num_hidden_layers` entries).
- Its final norm is its norm child (`norm`, `final_layernorm`, `norm_f`, `ln_f`, ...);
  a norm that scales by `1 + w` (Gemma, Qwen3-Next) has `norm_offset` 1.
- What each block adds to the residual stream, and where a repair folds, is read from the
  block's modules (`lorp.models.blocks`).

`architecture_of(model)` reads a loaded model; `architecture_for(config)` reads the model
its config describes, built on the meta device (no weights: a checkpoint's files are
pruned without loading them). A model lorp cannot read is refused in one line naming what
is missing (`UnsupportedArchitectureError`).
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lorp.models.blocks import BlockLayout, Stage, is_norm, read_block

FINAL_NORMS = ("norm", "final_layernorm", "norm_f", "ln_f", "final_norm", "embedding_norm")
"""Names a decoder stack's final norm goes by, in the order preferred when it has more."""


class UnsupportedArchitectureError(ValueError):
    """A model lorp cannot prune by depth: one line naming the model type and what is
    missing."""

    def __init__(self, model_type: str, why: str) -> None:
        super().__init__(f"model_type {model_type!r} cannot be pruned by lorp: {why}")
        self.model_type, self.why = model_type, why


@dataclass(frozen=True)
class Architecture:
    """How one model keeps its decoder: where the stack, its blocks, its final norm and its
    embeddings are, and what kind of norm it uses."""

    family: str
    """The text config's class less `Config` (`Llama`, `Qwen3Moe`, `NemotronH`)."""
    model_type: str
    """The text config's `model_type`."""
    decoder_path: str
    """The stack's path from the model (`model`, `model.language_model`)."""
    blocks_attr: str = "layers"
    final_norm_attr: str = "norm"
    embed_attr: str = "embed_tokens"
    norm_offset: float = 0.0
    """1 where a norm scales by `1 + w` (Gemma, Qwen3-Next), else 0."""
    multimodal: bool = False
    """The stack is the text tower of a model with other towers (vision), left as they are."""

    def layout(self, block: nn.Module) -> BlockLayout:
        """What `block` adds to the residual stream (`lorp.models.blocks`)."""
        return read_block(block, self.model_type)

    @property
    def repair_refusal(self) -> str | None:
        """Why no block of this family takes a linear repair or is split (one line)."""
        from lorp.models.blocks import NOT_ADDITIVE

        return NOT_ADDITIVE.get(self.model_type)


def text_config(config: Any) -> Any:
    """The decoder's config: a multimodal config's text sub-config, else `config`."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def family_name(config: Any) -> str:
    return type(text_config(config)).__name__.removesuffix("Config")


_READ: weakref.WeakKeyDictionary[nn.Module, Architecture] = weakref.WeakKeyDictionary()


def architecture_of(model: nn.Module) -> Architecture:
    """The architecture of a loaded model (read once per model object)."""
    arch = _READ.get(model)
    if arch is None:
        arch = _READ[model] = read_architecture(model)
    return arch


def read_architecture(model: nn.Module) -> Architecture:
    """Read where `model` keeps its decoder (module docstring); one line when it cannot."""
    config = getattr(model, "config", None)
    text = text_config(config)
    model_type = str(getattr(text, "model_type", "<none>"))
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedArchitectureError(model_type, "it is an encoder-decoder model")
    stack_path, stack = _stack(model, model_type)
    blocks_attr = _blocks_attr(stack, text, model_type)
    norm_attr = _final_norm(stack, model_type)
    embed_attr = next(n for n, m in stack.named_children() if m is model.get_input_embeddings())
    offset = norm_offset(getattr(stack, norm_attr))
    multimodal = text is not config and config is not None
    family = family_name(config)
    return Architecture(
        family, model_type, stack_path, blocks_attr, norm_attr, embed_attr, offset, multimodal
    )


def _stack(model: nn.Module, model_type: str) -> tuple[str, nn.Module]:
    """The module that holds the input embeddings, and its path."""
    try:
        embed = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embed = None
    if embed is None:
        raise UnsupportedArchitectureError(model_type, "it has no input embeddings")
    for path, module in model.named_modules():
        if any(child is embed for child in module.children()):
            return path, module
    raise UnsupportedArchitectureError(model_type, "its embeddings are not in a decoder stack")


def _blocks_attr(stack: nn.Module, text: Any, model_type: str) -> str:
    lists = [(n, m) for n, m in stack.named_children() if isinstance(m, nn.ModuleList)]
    n = getattr(text, "num_hidden_layers", None)
    sized = [name for name, m in lists if n is None or len(m) == n]
    if not sized:
        raise UnsupportedArchitectureError(
            model_type, "no list of decoder blocks sits beside its token embeddings"
        )
    return "layers" if "layers" in sized else sized[0]


def _final_norm(stack: nn.Module, model_type: str) -> str:
    norms = [n for n, m in stack.named_children() if is_norm(m)]
    if not norms:
        raise UnsupportedArchitectureError(model_type, "its decoder stack has no final norm")
    return next((n for n in FINAL_NORMS if n in norms), norms[-1])


def norm_offset(norm: nn.Module) -> float:
    """1 when `norm` scales by `1 + w` (its output is not zero with a zero weight)."""
    probe = copy.deepcopy(norm)
    if any(t.is_meta for t in probe.parameters()):
        probe = probe.to_empty(device="cpu")
    weight = getattr(probe, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return 0.0
    with torch.no_grad():
        for t in probe.parameters():
            t.zero_()
        x = torch.linspace(-1.0, 1.0, weight.shape[0], dtype=weight.dtype)[None]
        y = probe(x)
        y = y[0] if isinstance(y, tuple) else y
    return 1.0 if bool(y.abs().sum() > 0) else 0.0


def decoder_stack(model: nn.Module) -> nn.Module:
    """The embedding + blocks + final norm module, without the LM head."""
    return model.get_submodule(architecture_of(model).decoder_path)


def decoder_blocks(model: nn.Module) -> nn.ModuleList:
    return getattr(decoder_stack(model), architecture_of(model).blocks_attr)


def final_norm(model: nn.Module) -> nn.Module:
    return getattr(decoder_stack(model), architecture_of(model).final_norm_attr)


def input_embeddings(model: nn.Module) -> nn.Module:
    return getattr(decoder_stack(model), architecture_of(model).embed_attr)


def block_layout(model: nn.Module, index: int) -> BlockLayout:
    """What block `index` of `model` adds to the residual stream."""
    return architecture_of(model).layout(decoder_blocks(model)[index])


def block_stage(model: nn.Module, k: int, blocks: nn.ModuleList | None = None) -> Stage:
    """Block k's last stage: what bridges a run of removed blocks after it."""
    arch = architecture_of(model)
    block = (blocks if blocks is not None else decoder_blocks(model))[k]
    return Stage(block, arch.layout(block).last_stage, arch.norm_offset)


def unit_stage(model: nn.Module, unit: int, blocks: nn.ModuleList | None = None) -> Stage:
    """Sub-layer unit `unit`'s stage: block unit // 2's token mixing (even units) or its
    channel mixing (odd units; `lorp.models.sublayers`)."""
    arch = architecture_of(model)
    block = (blocks if blocks is not None else decoder_blocks(model))[unit // 2]
    layout = arch.layout(block)
    branches = layout.token_mixers if unit % 2 == 0 else layout.channel_mixers
    return Stage(block, branches, arch.norm_offset)


def tied_embeddings(model: nn.Module) -> bool:
    """The LM head reads the input embeddings' matrix (the same parameter)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embed = model.get_input_embeddings()
    return head is not None and getattr(head, "weight", None) is getattr(embed, "weight", None)


# -- from a config alone -----------------------------------------------------------------


def skeleton(config: Any, model_class: type | None = None) -> nn.Module:
    """`config`'s model on the meta device: its modules, no weights (nor the init
    functions' calls on them, which would take most of the time)."""
    from transformers.initialization import no_init_weights

    build = model_class._from_config if model_class is not None else _causal_lm  # type: ignore[attr-defined]
    with torch.device("meta"), no_init_weights():
        model = build(copy.deepcopy(config))
    model.tie_weights()  # init_weights ties them, and no_init_weights skips it
    return model


def _causal_lm(config: Any) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config)


def model_class(config: Any) -> type | None:
    """The class a checkpoint of `config` loads as: its `architectures`' first entry
    where transformers has it (a multimodal model keeps its towers), else None (the
    causal LM transformers maps the config to)."""
    import transformers

    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, str(name), None)
        if isinstance(cls, type):
            return cls
    return None


def architecture_for(config: Any) -> Architecture:
    """The architecture of the model `config` describes (a transformers config), read
    from its modules built on the meta device; one line when lorp cannot read it."""
    key = config.to_json_string() if hasattr(config, "to_json_string") else None
    if key is not None and key in _FOR_CONFIG:
        return _FOR_CONFIG[key]
    model_type = str(getattr(text_config(config), "model_type", "<none>"))
    if getattr(config, "is_encoder_decoder", False):  # its causal LM keeps the decoder only
        raise UnsupportedArchitectureError(model_type, "it is an encoder-decoder model")
    try:
        arch = read_architecture(skeleton(config, model_class(config)))
    except UnsupportedArchitectureError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UnsupportedArchitectureError(model_type, str(exc).splitlines()[0]) from None
    if key is not None:
        _FOR_CONFIG[key] = arch
    return arch


_FOR_CONFIG: dict[str, Architecture] = {}
"""A config's JSON -> its architecture (reading one builds its model on the meta device)."""


class StopForward(Exception):
    """Raised by a hook once it has every state the forward owes it: the blocks after it
    need not run (`forward_until_stopped`)."""


def forward_until_stopped(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
) -> bool:
    """One forward of the decoder stack (no LM head, no cache) until a hook raises
    `StopForward`; whether one did."""
    try:
        decoder_stack(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    except StopForward:
        return True
    return False
