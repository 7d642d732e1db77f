"""Token windows cut from a corpus's documents: calibration windows (one corpus, or a
weighted mixture), evaluation windows, the BOS policy, and the calibration fingerprint
that keys cached statistics.

Calibration windows of `seq_len` tokens are cut at seeded random offsets from documents
long enough, the way the paper (and GPTQ before it) samples C4.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from lorp.data.corpora import Corpus

# auto: a BOS exactly when the tokenizer adds one itself; always: the tokenizer's BOS;
# never: no BOS.
BOS_POLICIES: tuple[str, ...] = ("auto", "always", "never")


def calibration_windows(
    token_docs: list[np.ndarray], n_samples: int, seq_len: int, seed: int = 0, name: str = "corpus"
) -> torch.Tensor:
    """`n_samples` windows of `seq_len` tokens at seeded random offsets: [n_samples, seq_len].

    A document contributes in proportion to the windows it can hold; documents shorter
    than `seq_len` are skipped. Fails when the long-enough documents hold fewer tokens than
    requested in all.
    """
    return cut(token_docs, window_offsets(token_docs, n_samples, seq_len, seed, name), seq_len)


def window_offsets(
    token_docs: list[np.ndarray],
    n_samples: int,
    seq_len: int,
    seed: int = 0,
    name: str = "corpus",
    avoid: np.ndarray | None = None,
) -> np.ndarray:
    """(document, start) of each of `calibration_windows`' windows, [n_samples, 2]. With
    `avoid` (offsets of other windows of the same length), every window is drawn apart
    from all of them: no token of one is a token of another, by construction (candidates
    that overlap are drawn again, from the same seeded stream)."""
    if n_samples < 1 or seq_len < 2:
        raise ValueError(f"need n_samples >= 1 and seq_len >= 2, got {n_samples} x {seq_len}")
    lengths = np.array([len(d) for d in token_docs])
    eligible = np.flatnonzero(lengths >= seq_len)
    available = int(lengths[eligible].sum())
    if available < n_samples * seq_len:
        raise ValueError(
            f"{name} is too small: {available:,} tokens in documents of >= {seq_len} tokens, "
            f"{n_samples} x {seq_len} = {n_samples * seq_len:,} requested"
        )
    rng = np.random.default_rng(seed)
    room = (lengths[eligible] - seq_len + 1).astype(np.float64)
    if avoid is None:
        docs = rng.choice(eligible, size=n_samples, p=room / room.sum())
        starts = [int(rng.integers(0, lengths[d] - seq_len + 1)) for d in docs]
        return np.array(list(zip(docs, starts, strict=True)), dtype=np.int64).reshape(-1, 2)
    taken = [tuple(int(x) for x in row) for row in np.asarray(avoid).reshape(-1, 2)]
    out: list[tuple[int, int]] = []
    p = room / room.sum()
    for _ in range(100 * n_samples):
        d = int(rng.choice(eligible, p=p))
        start = int(rng.integers(0, lengths[d] - seq_len + 1))
        if all(d != e or abs(start - s) >= seq_len for e, s in taken):
            out.append((d, start))
            taken.append((d, start))
            if len(out) == n_samples:
                return np.array(out, dtype=np.int64)
    raise ValueError(
        f"{name} is too small to hold {n_samples} windows of {seq_len} tokens apart from the "
        f"{len(taken) - len(out)} it must avoid (give it more text or fewer samples)"
    )


def cut(token_docs: list[np.ndarray], offsets: np.ndarray, seq_len: int) -> torch.Tensor:
    """The windows at `offsets` ((document, start) rows): [len(offsets), seq_len]."""
    windows = np.empty((len(offsets), seq_len), dtype=np.int64)
    for i, (d, start) in enumerate(offsets):
        windows[i] = token_docs[int(d)][int(start) : int(start) + seq_len]
    return torch.from_numpy(windows)


def mixture_counts(weights: list[float], n_samples: int) -> list[int]:
    """Windows per corpus of a calibration mix: `n_samples` split in proportion to
    `weights` (largest remainder; ties to the earlier corpus), each at least one."""
    if not weights or any(not w > 0 for w in weights):
        raise ValueError(f"mix weights must be > 0, got {weights}")
    if n_samples < len(weights):
        raise ValueError(f"{n_samples} windows cannot hold a mix of {len(weights)} corpora")
    total = float(sum(weights))
    exact = [w / total * n_samples for w in weights]
    counts = [max(1, int(x)) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - int(exact[i])), i))
    i = 0
    while sum(counts) < n_samples:
        counts[order[i % len(order)]] += 1
        i += 1
    while sum(counts) > n_samples:  # the at-least-one rule took a window from the largest
        j = max(range(len(counts)), key=lambda k: (counts[k], -k))
        counts[j] -= 1
    return counts


def mixed_windows(
    parts: list[tuple[list[np.ndarray], float, str]], n_samples: int, seq_len: int, seed: int = 0
) -> torch.Tensor:
    """Calibration windows from several corpora at once: `parts` are (token documents,
    weight, name); each corpus gives its share of `n_samples` (`mixture_counts`), cut with
    `seed + i` for the i-th corpus, and the windows are interleaved by a seeded shuffle so
    every shard of the set holds the mix."""
    counts = mixture_counts([w for _, w, _ in parts], n_samples)
    offsets = [
        window_offsets(docs, k, seq_len, seed + i, name=name)
        for i, ((docs, _, name), k) in enumerate(zip(parts, counts, strict=True))
    ]
    return interleave([cut(p[0], o, seq_len) for p, o in zip(parts, offsets, strict=True)], seed)[0]


def interleave(blocks: list[torch.Tensor], seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """The windows of every block in one seeded shuffle, and the block each came from."""
    windows = torch.cat(blocks)
    source = np.concatenate([np.full(len(b), i) for i, b in enumerate(blocks)])
    order = np.random.default_rng(seed).permutation(len(windows))
    return windows[torch.from_numpy(order)], source[order]


def by_label(windows: np.ndarray, labels: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Label -> the windows [n, T] carrying it (`labels`: one per window), labels in the
    order first met."""
    mine = np.array(labels)
    return {label: windows[mine == label] for label in dict.fromkeys(labels)}


def eval_windows(
    tokens: np.ndarray | torch.Tensor, seq_len: int, max_windows: int | None = None
) -> torch.Tensor:
    """Non-overlapping windows for perplexity: numel // seq_len of them (the paper's protocol)."""
    t = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
    n = t.numel() // seq_len
    if n == 0:
        raise ValueError(f"evaluation text has {t.numel()} tokens, fewer than seq_len={seq_len}")
    if max_windows is not None:
        n = min(n, max_windows)
    return t[: n * seq_len].reshape(n, seq_len)


def resolve_bos(tokenizer: Any, policy: str = "auto") -> int | None:
    """The BOS id to prepend to windows under `policy` (`BOS_POLICIES`), or None.

    auto: the tokenizer's bos_token_id when it adds one by default, i.e. when
    `tokenizer("a")["input_ids"]` starts with it, so windows look like what the model saw
    in training (checked here: the packaged Gemma 3 does once converted by lorp.models.loading,
    which keeps its GGUF's add_bos_token; the packaged SmolLM2 does not).
    always: bos_token_id, an error if the tokenizer has none. never: None.
    """
    if policy not in BOS_POLICIES:
        raise ValueError(f"bos must be one of {', '.join(BOS_POLICIES)}, got {policy!r}")
    bos = getattr(tokenizer, "bos_token_id", None)
    if policy == "never":
        return None
    if policy == "always":
        if bos is None:
            raise ValueError("bos 'always': the tokenizer has no bos_token_id")
        return int(bos)
    if bos is None:
        return None
    ids = list(tokenizer("a")["input_ids"])
    return int(bos) if ids and ids[0] == bos else None


def prepend_bos(windows: torch.Tensor, bos_id: int | None) -> torch.Tensor:
    """[n, T] -> [n, T + 1] with `bos_id` first; unchanged when `bos_id` is None."""
    if bos_id is None:
        return windows
    if windows.ndim != 2:
        raise ValueError(f"windows must be [n, T], got shape {tuple(windows.shape)}")
    bos = torch.full((windows.shape[0], 1), int(bos_id), dtype=windows.dtype)
    return torch.cat([bos.to(windows.device), windows], dim=1)


def calibration_fingerprint(
    corpus: Corpus, n_samples: int, seq_len: int, seed: int, *, bos_id: int | None = None
) -> str:
    """Names the calibration set: corpus content, split, sampling and the BOS prepended to
    each window, if any (statistics of BOS windows are never served for plain ones, or the
    other way round). Without a BOS the name is the one earlier versions gave."""
    name = Path(corpus.name).name
    key = f"{name}:{corpus.split}:{corpus.fingerprint}:{n_samples}x{seq_len}:seed{seed}"
    return key if bos_id is None else f"{key}:bos{int(bos_id)}"
