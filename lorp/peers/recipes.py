"""One entry to the peers' repairs: `repair_peer` runs the repair a peer selection is
paired with (the registry's ``peer`` flag names it) on the dense model, in place, and
says which blocks to drop and which tensors it changed, so a caller stores the variant
as it stores lorp's own repaired ones (by its changed tensors, or whole).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lorp.peers.linear_patch import REPAIR as LINEAR_PATCH
from lorp.peers.linear_patch import repair_linear_patch
from lorp.peers.prune_and_comp import REPAIR as MAGNITUDE_COMP
from lorp.peers.prune_and_comp import apply_steps
from lorp.peers.replaceme import REPAIR as REPLACEME
from lorp.peers.replaceme import repair_replaceme
from lorp.peers.streamline_layer import REPAIR as REPLACEMENT_FFN
from lorp.peers.streamline_layer import repair_streamline_layer

PEER_REPAIRS = (REPLACEME, LINEAR_PATCH, MAGNITUDE_COMP, REPLACEMENT_FFN)
REPAIR_OPTIONS: dict[str, dict[str, Any]] = {
    REPLACEME: {"epochs": 5, "lr": 1e-4},
    LINEAR_PATCH: {"distill": 0, "lr": 1e-4},
    MAGNITUDE_COMP: {},
    REPLACEMENT_FFN: {"epochs": 10, "lr": 1e-4},
}
"""Each peer repair's options (a job's `repair_options` of the method entry) and defaults."""


@dataclass(frozen=True)
class PeerRepair:
    """What a peer point's repair needs beyond the model and the windows."""

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)
    steps: tuple[Mapping[str, Any], ...] = ()
    """Prune&Comp: the selection's steps (block, alpha), replayed on the dense model."""


@dataclass(frozen=True)
class PeerResult:
    record: dict[str, Any]
    dropped: tuple[int, ...]
    """The blocks to drop (the replacement layer keeps the run's last block)."""
    changed: tuple[str, ...]
    """Names of the parameters the repair changed (`model.named_parameters()`)."""


def check_repair_options(name: str, options: Mapping[str, Any]) -> None:
    """ValueError naming the option and value a peer repair does not take."""
    known = REPAIR_OPTIONS.get(name)
    if known is None:
        raise ValueError(f"repair {name!r}: not a peer repair (one of {', '.join(PEER_REPAIRS)})")
    for key, value in options.items():
        if key not in known:
            raise ValueError(f"option {key!r}: {name} takes {', '.join(known) or 'none'}")
        ok = value >= 0 if key in ("epochs", "distill") else 0 < value < 1
        if isinstance(value, bool) or not isinstance(value, int | float) or not ok:
            raise ValueError(f"option {key!r}: out of range for {name}, got {value!r}")


def repair_peer(
    model: nn.Module,
    layers: Sequence[int],
    windows: torch.Tensor,
    held: Mapping[str, torch.Tensor],
    peer: PeerRepair,
    *,
    batch_size: int = 8,
    skip_prefix: int = 0,
) -> PeerResult:
    """Run `peer`'s repair for the cut `layers` of the dense `model`, in place; `held`:
    domain -> held-out windows (early stopping, distillation, the record)."""
    check_repair_options(peer.name, peer.options)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    kw = {"options": peer.options, "batch_size": batch_size, "skip_prefix": skip_prefix}
    every = torch.cat(list(held.values())) if held else windows
    run: dict[str, Callable[[], dict[str, Any]]] = {
        REPLACEME: lambda: repair_replaceme(model, layers, windows, every, **kw),
        LINEAR_PATCH: lambda: repair_linear_patch(model, layers, windows, dict(held), **kw),
        MAGNITUDE_COMP: lambda: apply_steps(model, peer.steps),
        REPLACEMENT_FFN: lambda: repair_streamline_layer(model, layers, windows, every, **kw),
    }
    record = run[peer.name]()
    dropped = tuple(record.get("dropped", layers))
    changed = tuple(n for n, p in model.named_parameters() if not torch.equal(p, before[n]))
    return PeerResult(record, dropped, changed)
