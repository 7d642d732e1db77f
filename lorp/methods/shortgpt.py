"""ShortGPT (Men et al., 2024, "ShortGPT: Layers in Large Language Models are More
Redundant Than You Expect").

Rule: Block Influence BI_l = 1 - E_tokens[cos(h_l, h_{l+1})], with h_l the input of block l
and h_{l+1} its output; prune the `budget` blocks with the lowest BI (ties: lower index).
Every block, the first and last included, is a candidate, as in the original. The
token-mean cosine is S[l, l+1] of the (N + 1)-state matrix, so no extra pass is needed.
"""

from __future__ import annotations

import numpy as np

from lorp.methods.registry import Selection, register_method
from lorp.similarity import LayerSimilarity


def block_influence(similarity: LayerSimilarity) -> np.ndarray:
    S, n = similarity.matrix, similarity.n_blocks
    return 1.0 - np.array([S[i, i + 1] for i in range(n)])


@register_method("shortgpt", needs_output_state=True)
def shortgpt(similarity: LayerSimilarity, budget: int) -> Selection:
    """ShortGPT: prune the blocks of lowest Block Influence 1 - cos(input, output)."""
    bi = block_influence(similarity)
    order = sorted(range(similarity.n_blocks), key=lambda i: (bi[i], i))
    return Selection(layers=tuple(sorted(order[:budget])), details={"block_influence": bi})
