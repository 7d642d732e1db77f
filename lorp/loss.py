"""Calibration loss of a model with candidate block sets removed: the `Losses` callable that
the loss-guided methods (`sleb`, `ppl`, `lorp-loss`) consume, in one process.

The loss is the mean NLL per predicted token over calibration windows [n, T], the same
convention as `lorp.perplexity` (position 0 of each window is never a target), so
exp(loss) is that perplexity. `LossEvaluator` scores each candidate on the one loaded
model: `lorp.surgery.blocks_dropped` removes the blocks in memory for the duration of the
forward passes and restores the model after, so no weights are copied or written. The
pipeline builds the same callable over several actors to score a batch in parallel.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from lorp.architectures import decoder_blocks
from lorp.perplexity import window_nll
from lorp.surgery import blocks_dropped

log = logging.getLogger(__name__)


def calibration_loss(model: nn.Module, windows: torch.Tensor, batch_size: int = 8) -> float:
    """Mean NLL per predicted token of `model` over `windows` [n, T] (token ids)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if windows.ndim != 2 or windows.shape[0] == 0 or windows.shape[1] < 2:
        raise ValueError(f"windows must be [n >= 1, T >= 2] token ids, got {tuple(windows.shape)}")
    device = next(model.parameters()).device
    total, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(windows), batch_size):
            nll, n = window_nll(model, windows[start : start + batch_size].to(device))
            total += nll
            count += n
    return total / count


class LossEvaluator:
    """`losses(candidates) -> list[float]` over one in-memory model (see `Losses`).

    Each candidate is a set of 0-based block indices to drop (empty: the model as it is);
    its value is `calibration_loss` of the model without them. The model runs in eval mode
    and is left exactly as it was found. `n_evals` counts the candidates scored.
    """

    def __init__(
        self,
        model: nn.Module,
        windows: torch.Tensor,
        *,
        batch_size: int = 8,
        progress: bool = False,
    ) -> None:
        self.model = model
        self.windows = torch.as_tensor(windows, dtype=torch.long)
        self.batch_size = int(batch_size)
        self.progress = progress
        self.n_evals = 0

    @property
    def n_blocks(self) -> int:
        return len(decoder_blocks(self.model))

    def __call__(self, candidates: Sequence[Iterable[int]]) -> list[float]:
        out = []
        was_training = self.model.training
        self.model.eval()
        try:
            for cand in tqdm(candidates, disable=not self.progress, desc="candidates"):
                with blocks_dropped(self.model, cand):
                    out.append(calibration_loss(self.model, self.windows, self.batch_size))
                self.n_evals += 1
                log.debug("loss without blocks %s: %.6f", list(cand), out[-1])
        finally:
            self.model.train(was_training)
        return out
