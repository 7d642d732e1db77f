"""Seeded random token windows for the tiny models (token ids from 3 up, clear of the
special tokens)."""

from __future__ import annotations

import torch

from tests.helpers.tiny_models import VOCAB


def token_windows(n: int = 8, T: int = 24, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    """[n, T] token ids, the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, T), generator=g)
