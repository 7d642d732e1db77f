"""Angular distance (Gromov et al., "The Unreasonable Ineffectiveness of the Deeper Layers",
ICLR 2025, arXiv:2403.17887).

Rule: prune the contiguous window [s, s+n) of n = budget blocks minimising the angular
distance d(s, n) = arccos(cos(h_s^(T), h_{s+n}^(T))) / pi between the window's input and
output at the last token T of each sequence, averaged over sequences (the paper's
pruning algorithm; the public implementation it inspired, arcee-ai/PruneMe, likewise
takes each sequence's last non-padded token and averages the angle, not the cosine).
Ties go to the shallower start. No healing fine-tune.

Windows: s >= 0 and, by default, s + n <= N - 1, ending before the last block like the
LoRP authors' released Streamline baseline (`latter_barrier=1`), so every window method
here keeps block N-1 unless told otherwise; `last_block=True` allows s + n = N (against
the last block's output before the final norm).

It reads the last-token statistics a `SimilarityStats` captures beside S
(`LayerSimilarity.last_token_angular`), so it shares the one calibration pass.
"""

from __future__ import annotations

from lorp.locality.similarity import LayerSimilarity
from lorp.methods.registry import Selection, best_window, register_method
from lorp.methods.streamline import window_starts


@register_method("angular", needs_last_token=True)
def angular(similarity: LayerSimilarity, budget: int, *, last_block: bool = False) -> Selection:
    """Angular distance (Gromov et al.): the window of smallest last-token arccos(cos)/pi."""
    D = similarity.last_token_angular
    assert D is not None  # needs_last_token: select_layers refused stats without it
    starts = window_starts(similarity.n_blocks, budget, 0, last_block)
    dist = [float(D[s, s + budget]) for s in starts]
    s = best_window([-d for d in dist], starts)
    return Selection(
        layers=tuple(range(s, s + budget)),
        details={"window_start": s, "angular_distance": dict(zip(starts, dist, strict=True))},
    )
