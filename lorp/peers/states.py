"""Token rows of the residual stream that the peer recipes fit on: the output of chosen
blocks and what one block's MLP adds, over calibration windows.

Notation of the peers (issue #76): h_i is the stream leaving block i (h_{-1}: the
embedding output), the run i+1..i+n is removed, M_i is what block i's last stage (its
MLP) adds and Y_i = h_i - M_i the stream it adds to. Windows are padding-free token ids
[n, T]; the first `skip_prefix` positions of each (a BOS) are left out, as S leaves them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lorp.models.architectures import (
    StopForward,
    block_stage,
    decoder_blocks,
    forward_until_stopped,
)


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def block_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """A block's input state, positional or keyword as the family's decoder passes it."""
    return args[0] if args else kwargs["hidden_states"]


def first(output: Any) -> torch.Tensor:
    """A module's output tensor (the first element of a tuple output)."""
    return output[0] if isinstance(output, tuple | list) else output


def rows(x: torch.Tensor, skip_prefix: int) -> torch.Tensor:
    """[batch, T, d] as float32 rows [batch * (T - skip_prefix), d]."""
    return x[:, skip_prefix:].reshape(-1, x.shape[-1]).float()


@torch.no_grad()
def stream_rows(
    model: nn.Module,
    windows: torch.Tensor,
    outputs: Sequence[int],
    *,
    mlp_of: int | None = None,
    batch_size: int = 8,
    skip_prefix: int = 0,
) -> dict[str, torch.Tensor]:
    """Rows [tokens, d] (float32, on the model's device) of h_j for every j of `outputs`
    (key f"h{j}"; j = -1 is block 0's input) and, with `mlp_of` = k, of M_k (key "M"): the
    sum of what block k's last stage adds, each site's output times its scale. Each
    forward stops after the deepest block it needs."""
    blocks = decoder_blocks(model)
    deepest = max([*outputs, mlp_of if mlp_of is not None else -1])
    seen: dict[str, list[torch.Tensor]] = {}
    store: Callable[[str, torch.Tensor], None] = lambda k, x: seen.setdefault(k, []).append(  # noqa: E731
        rows(x, skip_prefix)
    )
    handles = []

    def out_hook(j: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if j in outputs:
                store(f"h{j}", first(output))
            if j == deepest:
                raise StopForward

        return hook

    def embed_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        store("h-1", block_input(args, kwargs))
        if deepest == -1:
            raise StopForward

    def site_hook(scale: float) -> Callable[..., None]:
        return lambda module, args, output: store("M", first(output) * scale)

    try:
        if -1 in outputs:
            handles.append(blocks[0].register_forward_pre_hook(embed_hook, with_kwargs=True))
        if mlp_of is not None:
            for site, scale in block_stage(model, mlp_of).sites():
                handles.append(site.register_forward_hook(site_hook(scale)))
        for j in range(max(deepest, 0) + 1):
            handles.append(blocks[j].register_forward_hook(out_hook(j), with_kwargs=True))
        device = model_device(model)
        for batch in windows.split(batch_size):
            forward_until_stopped(model, batch.to(device), None)
    finally:
        for h in handles:
            h.remove()
    return _joined(seen, mlp_of, batch_size, windows)


def _joined(
    seen: dict[str, list[torch.Tensor]], mlp_of: int | None, batch: int, windows: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Each key's rows in one tensor; a stage of several sites has its parts summed."""
    out = {k: torch.cat(v) for k, v in seen.items() if k != "M"}
    if mlp_of is not None:
        parts = seen["M"]
        per = len(parts) // len(windows.split(batch))  # sites per forward
        out["M"] = torch.cat([sum(parts[i : i + per]) for i in range(0, len(parts), per)])
    return out


def mean_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """The token mean of cos(a_t, b_t) over rows [tokens, d]."""
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).mean())
