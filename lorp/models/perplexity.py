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

NLL_CHUNK = 1 << 24
"""Logits scored at once (64 MiB in float32): whole rows, at least one. Scoring a batch's
logits whole would hold two float32 copies beside the model's own (Qwen2.5's 151,936-token
vocabulary, 2 x 256 tokens: 0.6 GiB more than the model's logits)."""


def window_nll(model: nn.Module, windows: torch.Tensor) -> tuple[float, int]:
    """Summed NLL (float64) and number of predicted tokens, B * (T - 1), for a batch [B, T]:
    every position but the first is a target."""
    nll = sum(row_nlls(model, windows))
    return float(nll), windows[:, 1:].numel()


def row_nlls(model: nn.Module, windows: torch.Tensor) -> list[float]:
    """Summed NLL (float64) of each window of a batch [B, T], in order."""
    logits = model(input_ids=windows, use_cache=False).logits
    targets = windows[:, 1:]
    return [nll_rows(row[:-1], t) for row, t in zip(logits, targets, strict=True)]


def nll_rows(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Summed NLL (float64) of `targets` [n] under `logits` [n, V] in any float dtype, each
    logsumexp(row) minus the target's logit in float32, `NLL_CHUNK` logits at a time:
    log_softmax would write a vocabulary-wide copy of the logits only to read one entry per
    row back, and a whole batch's float32 copy can outweigh the model."""
    rows = max(1, NLL_CHUNK // max(logits.shape[-1], 1))
    total = torch.zeros((), dtype=torch.float64, device=logits.device)
    for start in range(0, logits.shape[0], rows):
        chunk = logits[start : start + rows].float()
        want = targets[start : start + rows, None]
        nll = torch.logsumexp(chunk, dim=-1) - chunk.gather(-1, want).squeeze(-1)
        total += nll.double().sum()
        del chunk  # before the next chunk's copy: one float32 chunk held, not two
    return float(total)  # one device sync per window


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


def window_losses(model: nn.Module, windows: torch.Tensor, *, batch_size: int = 1) -> list[float]:
    """Mean NLL per predicted token of each window [n, T], in order: what a paired
    comparison of two variants on the same windows resamples. Every window predicts T - 1
    tokens, so `perplexity` is exp of their mean."""
    device = device_of(model)
    out: list[float] = []
    with torch.inference_mode():
        for start in range(0, len(windows), batch_size):
            out += row_nlls(model, windows[start : start + batch_size].to(device))
    return [nll / (windows.shape[1] - 1) for nll in out]


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
