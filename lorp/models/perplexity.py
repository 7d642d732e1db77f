"""Perplexity with plain forward passes (the paper's protocol, Sec. 5.1).

Non-overlapping windows of `seq_len` tokens; every token after the first of each window is
predicted from its window prefix; PPL = exp(mean negative log-likelihood over all
predicted tokens). The same definition is what the vLLM backend computes from prompt
log-probabilities, so the two agree on the same checkpoint.

A window with a BOS prepended (`lorp.data.windows.prepend_bos`, [n, T + 1]) needs nothing special:
position 0 is never a target, so exactly its T text tokens are scored, the first one
predicted from the BOS alone.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from tqdm.auto import tqdm

from lorp.models.streaming import device_of


def window_nll(model: nn.Module, windows: torch.Tensor) -> tuple[float, int]:
    """Summed NLL (float64) and number of predicted tokens, B * (T - 1), for a batch [B, T]:
    every position but the first is a target. Each NLL is logsumexp(logits) minus the
    target's logit, in float32: log_softmax would write a vocabulary-wide copy of the
    logits only to read one entry per row back."""
    logits = model(input_ids=windows, use_cache=False).logits[:, :-1].float()
    targets = windows[:, 1:]
    nll = torch.logsumexp(logits, dim=-1) - logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return float(nll.double().sum()), int(targets.numel())


def perplexity(
    model: nn.Module, windows: torch.Tensor, *, batch_size: int = 1, progress: bool = False
) -> float:
    """exp(mean NLL) over `windows` [n, seq_len] (see `lorp.data.windows.eval_windows`)."""
    device = device_of(model)
    total, count = 0.0, 0
    with torch.inference_mode():
        for start in tqdm(range(0, len(windows), batch_size), disable=not progress, desc="ppl"):
            nll, n = window_nll(model, windows[start : start + batch_size].to(device))
            total += nll
            count += n
    return math.exp(total / count)


def calibration_loss(model: nn.Module, windows: torch.Tensor, batch_size: int = 8) -> float:
    """Mean NLL per predicted token of `model` over `windows` [n, T] (token ids)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if windows.ndim != 2 or windows.shape[0] == 0 or windows.shape[1] < 2:
        raise ValueError(f"windows must be [n >= 1, T >= 2] token ids, got {tuple(windows.shape)}")
    device = device_of(model)
    total, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(windows), batch_size):
            nll, n = window_nll(model, windows[start : start + batch_size].to(device))
            total += nll
            count += n
    return total / count
