"""Angular distance (Gromov et al., 2024, "The Unreasonable Ineffectiveness of the Deeper
Layers").

Rule: prune the contiguous window [s, s+n) of n = budget blocks minimising the angular
distance arccos(cos(h_s, h_{s+n})) / pi between its input and output, any s >= 0. Gromov et
al. measure the cosine at the last token of each sequence; here it is the token-mean
cosine of S, so every method shares one calibration pass. No healing fine-tune.
"""

from __future__ import annotations

import numpy as np

from lorp.methods.registry import Selection, best_window, register_method
from lorp.similarity import LayerSimilarity


@register_method("angular", needs_output_state=True)
def angular(similarity: LayerSimilarity, budget: int) -> Selection:
    """Angular distance (Gromov et al.): the window of smallest arccos(cos)/pi."""
    S, n = similarity.matrix, similarity.n_blocks
    starts = list(range(0, n - budget + 1))
    dist = [float(np.arccos(np.clip(S[s, s + budget], -1.0, 1.0)) / np.pi) for s in starts]
    s = best_window([-d for d in dist], starts)
    return Selection(
        layers=tuple(range(s, s + budget)),
        details={"window_start": s, "angular_distance": dict(zip(starts, dist, strict=True))},
    )
