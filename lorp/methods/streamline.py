"""LLM-Streamline, drop-only (Chen et al., 2025, "Streamlining Redundant Layers to
Compress Large Language Models").

Rule: prune the contiguous window [s, s+n) of n = budget blocks that maximises the
token-mean cos(h_s, h_{s+n}) between the window's input and output, for s >= 1
(the embedding-facing block stays). The original then trains a light replacement layer for
the window; this is the training-free variant the LoRP paper compares against, so the
window is simply removed.
"""

from __future__ import annotations

from lorp.methods.registry import Selection, best_window, register_method
from lorp.similarity import LayerSimilarity


@register_method("streamline", needs_output_state=True)
def streamline(similarity: LayerSimilarity, budget: int) -> Selection:
    """LLM-Streamline (drop-only): the contiguous window whose input and output agree most."""
    S, n = similarity.matrix, similarity.n_blocks
    starts = list(range(1, n - budget + 1))
    cos = [float(S[s, s + budget]) for s in starts]
    s = best_window(cos, starts)
    return Selection(
        layers=tuple(range(s, s + budget)),
        details={"window_start": s, "window_cos": dict(zip(starts, cos, strict=True))},
    )
