"""What lorp does with a family, read from its config alone: which kinds of block its model
holds, whether they are removed, split into sub-layers and repaired, and whether a cut's
config reloads the kept blocks. Everything here builds the model on the meta device (no
weights); `docs/reference/families.md` is this, run over transformers' causal-LM mapping
(`benchmarks/families.py`).

Each answer is `yes`, or one line saying why not (`Support`). A cut is checked at every
single-block removal of the config's model: a family whose config derives its layers
from a repeating pattern (Jamba) takes the cuts that keep its phase and refuses the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from lorp.models.architectures import (
    UnsupportedArchitectureError,
    architecture_of,
    block_stage,
    decoder_blocks,
    model_class,
    skeleton,
    text_config,
)
from lorp.models.blocks import BlockLayout
from lorp.models.layer_config import CutRefused, check_cut

YES = "yes"


@dataclass(frozen=True)
class Support:
    """What lorp does with one family (each field `yes` or one line why not)."""

    model_type: str
    family: str
    kinds: tuple[str, ...]
    """The kinds of block its model holds (`attention`, `mamba+moe`, ...), bottom first."""
    blocks: str
    """Blocks are read and removed in memory."""
    reload: str
    """A cut's rewritten config describes the kept blocks, so the variant reloads."""
    sublayers: str
    """Every block splits into its token mixing and its channel mixing."""
    repair: str
    """A linear map folds exactly into every block's last stage."""
    multimodal: bool = False

    @property
    def refused(self) -> str | None:
        """Why lorp takes no cut of this family (one line), or None."""
        for answer in (self.blocks, self.reload):
            if answer != YES and not answer.startswith("some cuts"):
                return answer
        return None


def support(config: Any) -> Support:
    """What lorp does with the model `config` describes (module docstring)."""
    text = text_config(config)
    model_type = str(getattr(text, "model_type", "<none>"))
    family = type(text).__name__.removesuffix("Config")
    try:
        if getattr(config, "is_encoder_decoder", False):
            raise UnsupportedArchitectureError(model_type, "it is an encoder-decoder model")
        model = skeleton(config, model_class(config))
        arch = architecture_of(model)
    except UnsupportedArchitectureError as exc:
        return Support(model_type, family, (), f"no: {exc.why}", "-", "-", "-")
    blocks = decoder_blocks(model)
    return Support(
        model_type,
        family,
        tuple(dict.fromkeys(arch.layout(block).kind for block in blocks)),
        YES,
        _cuts(config, blocks),
        _answer(split_refusal(model)),
        _answer(repair_refusal(model)),
        arch.multimodal,
    )


def cut_refusals(
    config: Any, before: nn.ModuleList, positions: Sequence[int] | None = None
) -> dict[int, str]:
    """Block -> why its config cannot describe the model without it (one line), for each
    of `positions` (default: every block) whose removal alone is refused; `before`: the
    blocks of `config`'s model (`skeleton`)."""
    refused: dict[int, str] = {}
    cls, n = model_class(config), len(before)
    for i in range(n) if positions is None else positions:
        try:
            check_cut(config, [j for j in range(n) if j != i], cls, before)
        except CutRefused as exc:
            refused[i] = str(exc)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            refused[i] = f"its config cannot be rewritten ({str(exc).splitlines()[0]})"
    return refused


def repair_refusal(model: nn.Module) -> str | None:
    """Why some block of `model` takes no linear repair (one line), or None."""
    arch = architecture_of(model)
    if arch.repair_refusal is not None:
        return arch.repair_refusal
    for k, block in enumerate(decoder_blocks(model)):
        refused = arch.layout(block).unreadable() or block_stage(model, k).refusal()
        if refused is not None:
            return f"block {k}: {refused}"
    return None


def split_refusal(model: nn.Module) -> str | None:
    """Why some block of `model` cannot lose its sub-layers (one line), or None."""
    arch = architecture_of(model)
    layouts = (arch.layout(block) for block in decoder_blocks(model))
    return arch.repair_refusal or next((w for w in map(BlockLayout.splittable, layouts) if w), None)


def _cuts(config: Any, before: nn.ModuleList) -> str:
    """`yes` when every single-block cut reloads; which do where only some do."""
    n, refused = len(before), cut_refusals(config, before)
    if not refused:
        return YES
    first = refused[min(refused)]
    if len(refused) == n:
        return f"no: {first}"
    taken = [str(i) for i in range(n) if i not in refused]
    alone = ", ".join(taken[:-1]) + " or " + taken[-1] if len(taken) > 1 else taken[0]
    return f"some cuts: removing block {alone} of {n} reloads; {first}"


def _answer(why: str | None) -> str:
    return YES if why is None else f"no: {why}"
