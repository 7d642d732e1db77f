"""Followers (`fit_followers`): one map cannot replace what several blocks did, and the
blocks kept after the cut see a stream they were not trained on. The first `count` kept
blocks after each run can take a map of their own, folded the same way into their
`down_proj` (a run of no blocks, (k + 1, k), in `lorp.repair.stats`): fitted in depth
order on the states the model pruned and repaired so far gives block k, towards the
dense model's state after block k, validated on the held-out windows as every run is.
Measured on SmolLM2-135M (window 12-19 of 30, PTB + wiki 32k, `lee` news 32 x 512): one
follower took the repaired variant from 2.32x to 2.20x dense on held-out news (PTB 1.76x
to 1.52x); a map on the last block instead, aimed at the final state, made news worse
(2.70x) although it left less on the held-out windows, which is why followers stop at the
blocks right after each cut.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lorp.models.architectures import decoder_blocks
from lorp.models.surgery import blocks_dropped, check_layers
from lorp.repair.fit import check_stage, fit_runs
from lorp.repair.fold import applied_by_hooks
from lorp.repair.maps import MAX_ROUNDS, RunFit
from lorp.repair.stats import contiguous_runs


def follower_blocks(n_blocks: int, layers: Sequence[int], count: int) -> list[int]:
    """The first `count` kept blocks after each run of `layers`, in depth order: those a
    follower map goes into. A block that already carries a later run's map (the block
    before it) is not one, nor any block past it: followers stop at the next cut."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count!r}")
    runs = contiguous_runs(check_layers(layers, n_blocks), n_blocks)
    carriers = {s - 1 for s, _ in runs}
    out = []
    for _, e in runs:
        for k in range(e + 1, min(e + 1 + count, n_blocks)):
            if k in carriers:
                break
            out.append(k)
    return out


def fit_followers(
    model: nn.Module,
    fits: Sequence[RunFit],
    layers: Sequence[int],
    windows: torch.Tensor,
    held: torch.Tensor | Mapping[str, torch.Tensor],
    count: int,
    *,
    ridge: float | None = None,
    rounds: int = MAX_ROUNDS,
    batch_size: int = 8,
    skip_prefix: int = 0,
    progress: bool = False,
) -> list[RunFit]:
    """The follower maps (module docstring) of the dense `model` pruned of `layers` and
    repaired by `fits` (not folded yet: applied here by hooks, the blocks dropped in
    memory, so the model is left as it was found, a streamed one included). Each is
    fitted on `windows`, validated on `held` (`fit_runs`, `ridge` None: chosen there; or
    domain -> its held-out windows, each domain's sums apart: kept only where it helps all)
    and applied while the next one is captured. Returns them in depth order, to fold
    with `fits`; each costs a dense and a repaired forward of the windows, up to it."""
    from lorp.repair.capture import capture_follower_stats

    followers: list[RunFit] = []

    def split(w: torch.Tensor) -> list[torch.Tensor]:
        return [w[i : i + batch_size] for i in range(0, len(w), batch_size)]

    @contextmanager
    def repaired() -> Iterator[None]:
        maps = [*fits, *followers]
        with blocks_dropped(model, layers) as kept, applied_by_hooks(model, maps, kept):
            yield

    kw: dict[str, Any] = {"skip_prefix": skip_prefix, "progress": progress}
    parts = dict(held) if isinstance(held, Mapping) else {"": held}
    for k in follower_blocks(len(decoder_blocks(model)), layers, count):
        check_stage(model, k)
        stats = capture_follower_stats(model, split(windows), [(k + 1, k)], repaired, **kw)
        stats.held_domains = {
            d: capture_follower_stats(model, split(h), [(k + 1, k)], repaired, **kw)
            for d, h in parts.items()
        }
        followers += fit_runs(model, stats, ridge=ridge, rounds=rounds)
    return followers
