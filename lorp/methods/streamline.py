"""LLM-Streamline, drop-only (Chen et al., 2025, "Streamlining Redundant Layers to
Compress Large Language Models").

Rule: prune the contiguous window [s, s+n) of n = budget blocks that maximises the
token-mean cos(h_s, h_{s+n}) between the window's input and output (ties: shallower s).
The original then trains a light replacement layer for the window; this is the
training-free variant the LoRP paper compares against, so the window is simply removed.

Windows: s >= 1 (the embedding-facing block stays) and, by default, s + n <= N - 1: the
window ends before the last block, which stays too. That is how the LoRP authors'
released code ran it for the paper's tables (`lib/layer_select.py`,
`get_pruned_layer_streamline` with `latter_barrier=1`, in
github.com/daniel-eai/LoRP-Locality-Aware-Redundancy-Pruning). `last_block=True` also
allows windows that include block N-1 (s + n = N, scored against the output state).
"""

from __future__ import annotations

from lorp.locality.similarity import LayerSimilarity
from lorp.methods.registry import Selection, best_window, register_method


def window_starts(n_blocks: int, budget: int, first: int, last_block: bool) -> list[int]:
    """Starts s >= `first` of the windows [s, s+budget) allowed: ending before block N-1
    unless `last_block`."""
    end = n_blocks if last_block else n_blocks - 1  # the largest allowed s + budget
    return list(range(first, end - budget + 1))


@register_method("streamline", needs_output_state=True)
def streamline(similarity: LayerSimilarity, budget: int, *, last_block: bool = False) -> Selection:
    """LLM-Streamline (drop-only): the contiguous window whose input and output agree most."""
    S, n = similarity.matrix, similarity.n_blocks
    starts = window_starts(n, budget, 1, last_block)
    cos = [float(S[s, s + budget]) for s in starts]
    s = best_window(cos, starts)
    return Selection(
        layers=tuple(range(s, s + budget)),
        details={"window_start": s, "window_cos": dict(zip(starts, cos, strict=True))},
    )
