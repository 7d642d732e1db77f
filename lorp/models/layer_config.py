"""A config's per-layer fields, rewritten for the blocks a cut keeps, and the check that the
rewritten config describes them.

Removing blocks leaves the kept ones as they are; their config must say what each of them
is, or the checkpoint reloads as another model. A text config holds its layers in four
ways, each rewritten over the kept blocks (in depth order):

- a list with one entry per layer (`layer_types`, `no_rope_layers`, `layers_block_type`,
  per-layer head counts or top-k): the kept blocks' entries;
- a list of layer indices (`mlp_only_layers`, `moe_layers`, `attn_layer_indices`,
  `full_attn_idxs`): the kept ones, renumbered;
- a count from the bottom ("the first k layers": `first_k_dense_replace`,
  `max_window_layers`, `moe_layer_start_index`): how many kept blocks it covered; an
  index from the bottom (`moe_layer_end_index`): the last kept block it covered;
- a repeating pattern (`decoder_sparse_step`: every k-th layer is a mixture of experts):
  written as the explicit list its family also takes (`mlp_only_layers`), the step set
  to 1. A pattern a family cannot state as a list (Jamba's `attn_layer_period` and
  `expert_layer_period`, ERNIE's `moe_layer_interval`) stays as it is.

Whatever the family, `check_cut` then builds the rewritten config's model on the meta
device (no weights) and compares each of its blocks with the kept block it stands for:
their classes, their parameters' names and shapes, and the settings each module keeps
(`attention_type`, `is_sliding`, ...). A cut the family's config cannot describe (Jamba's
pattern broken, say) is refused in one line naming the first block that differs.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from torch import nn

INDEX_LISTS = ("mlp_only_layers", "moe_layers", "attn_layer_indices", "full_attn_idxs")
BOTTOM_COUNTS = (
    "first_k_dense_replace",
    "max_window_layers",
    "moe_layer_start_index",
    "num_dense_layers",
)
BOTTOM_INDICES = ("moe_layer_end_index",)
SPARSE_STEPS = {"decoder_sparse_step": "mlp_only_layers"}
"""A step field -> the index list that states the same layers explicitly."""
NOT_PER_LAYER = ("architectures", "mrope_section")
"""Lists that may have N entries by chance without being per layer."""


class CutRefused(ValueError):
    """A cut the model's config cannot describe: one line naming what differs."""


def text_config(config: Any) -> Any:
    """The decoder's config: the text sub-config of a multimodal wrapper, else `config`."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def is_property(config: Any, name: str) -> bool:
    return isinstance(getattr(type(config), name, None), property)


def per_layer_fields(config: Any, n: int) -> list[str]:
    """The text config's attributes with one entry per layer (not index lists)."""
    out = []
    for key, value in vars(config).items():
        if key.startswith("_") or key in INDEX_LISTS or key in NOT_PER_LAYER:
            continue
        if isinstance(value, list | tuple) and len(value) == n and not is_property(config, key):
            out.append(key)
    return sorted(out)


def rewrite_layers(config: Any, kept: Sequence[int], n: int, *, strict: bool = True) -> list[str]:
    """Rewrite `config` (a text config, in place) for the kept blocks of an `n`-block
    model (module docstring); the fields it changed. A read-only field (a property the
    config derives) that would change raises `CutRefused`, or with `strict=False` is left
    as it is (a cut scored in memory, never saved: `lorp.models.surgery.blocks_dropped`)."""
    kept = list(kept)
    changed: list[str] = []

    def put(key: str, value: Any) -> None:
        if is_property(config, key):
            if strict:
                raise CutRefused(
                    f"config.{key} is derived by {type(config).__name__}: it cannot be set"
                )
            return
        setattr(config, key, value)
        changed.append(key)

    for step, listed in SPARSE_STEPS.items():
        if _explicit_step(config, step, listed, n):
            changed.append(step)
    for key in per_layer_fields(config, n):
        _set(config, key, [getattr(config, key)[i] for i in kept])
        changed.append(key)
    for key in INDEX_LISTS:
        value = getattr(config, key, None)
        if isinstance(value, list | tuple) and not is_property(config, key):
            _set(config, key, [kept.index(i) for i in value if i in kept])
            changed.append(key)
    for key in BOTTOM_COUNTS:
        if isinstance(getattr(config, key, None), int) and not isinstance(
            getattr(config, key), bool
        ):
            _set(config, key, sum(1 for i in kept if i < getattr(config, key)))
            changed.append(key)
    for key in BOTTOM_INDICES:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            _set(config, key, sum(1 for i in kept if i <= value) - 1)
            changed.append(key)
    config.num_hidden_layers = len(kept)
    return changed


def _explicit_step(config: Any, step: str, listed: str, n: int) -> bool:
    """A sparse step > 1 written as the explicit list (the layers it leaves dense)."""
    k = getattr(config, step, None)
    if not isinstance(k, int) or k <= 1 or not hasattr(config, listed):
        return False
    dense = set(getattr(config, listed) or [])
    dense |= {i for i in range(n) if (i + 1) % k != 0}
    _set(config, listed, sorted(dense))
    _set(config, step, 1)
    return True


def _set(config: Any, key: str, value: Any) -> None:
    if is_property(config, key):
        raise CutRefused(f"config.{key} is derived by {type(config).__name__}: it cannot be set")
    setattr(config, key, value)


def rewritten(config: Any, kept: Sequence[int], n: int) -> Any:
    """A copy of `config` (a whole model's, multimodal ones included) whose text config
    describes the kept blocks."""
    out = copy.deepcopy(config)
    rewrite_layers(text_config(out), kept, n)
    return out


def check_cut(
    config: Any,
    kept: Sequence[int],
    model_class: type | None = None,
    before: Sequence[nn.Module] | None = None,
) -> Any:
    """The rewritten config, once its model's blocks are the kept ones (module
    docstring); `CutRefused` otherwise. `model_class`: the class the checkpoint loads as
    (default: the causal LM transformers maps the config to); `before`: `config`'s
    `skeleton_blocks`, where the caller checks many cuts of one config."""
    n = int(text_config(config).num_hidden_layers)
    new = rewritten(config, kept, n)
    before = before if before is not None else skeleton_blocks(config, model_class)
    after = skeleton_blocks(new, model_class)
    for position, i in enumerate(kept):
        a, b = block_signature(before[i]), block_signature(after[position])
        if a != b:
            raise CutRefused(_difference(config, i, position, a, b))
    return new


def skeleton_blocks(config: Any, model_class: type | None = None) -> nn.ModuleList:
    """The decoder blocks of `config`'s model, built on the meta device (no weights)."""
    from lorp.models.architectures import decoder_blocks, skeleton

    return decoder_blocks(skeleton(config, model_class))


SETTINGS = (bool, int, float, str)


def block_signature(block: nn.Module) -> tuple[Any, ...]:
    """What a block is, whatever its weights' values: its modules' classes, its tensors'
    names and shapes, and the settings its modules keep (its index aside)."""
    modules = tuple((name, type(m).__name__) for name, m in block.named_modules())
    tensors = tuple(
        (name, tuple(t.shape)) for name, t in [*block.named_parameters(), *block.named_buffers()]
    )
    settings = tuple(
        (name, key, value)
        for name, m in block.named_modules()
        for key, value in sorted(vars(m).items())
        if isinstance(value, SETTINGS)
        and not key.startswith("_")
        and key not in ("layer_idx", "training")
    )
    return modules, tensors, settings


def _difference(config: Any, i: int, position: int, a: tuple, b: tuple) -> str:
    family = type(text_config(config)).__name__.removesuffix("Config")
    what = ("its modules", "its weights' shapes", "its settings")
    for part, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            first = next(((p, q) for p, q in zip(x, y, strict=False) if p != q), (x, y))
            return (
                f"{family}: kept block {i} would reload as another block at {position} "
                f"({what[part]} differ: {first[0]} != {first[1]}); its config cannot "
                "describe this cut"
            )
    return f"{family}: kept block {i} differs at {position}"
