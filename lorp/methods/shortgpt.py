"""ShortGPT (Men et al., 2024, "ShortGPT: Layers in Large Language Models are More
Redundant Than You Expect").

Rule: Block Influence BI_l = 1 - E_tokens[cos(h_l, h_{l+1})], with h_l the input of block l
and h_{l+1} its output; prune the `budget` blocks with the lowest BI (ties: lower index).
The token-mean cosine is S[l, l+1] of the (N + 1)-state matrix, so no extra pass is needed.

Candidates (`candidates`):

- ``"inner"`` (default): blocks 1..N-2, as the LoRP authors' released code ran ShortGPT
  for the paper's tables (`lib/layer_select.py`, `get_pruned_layer_shortgpt`, in
  github.com/daniel-eai/LoRP-Locality-Aware-Redundancy-Pruning): it scores blocks
  0..N-2 only (the last block has no score) and sets block 0's score to -inf ("protect
  layer 0").
- ``"all"``: every block, the first and last included, as ShortGPT's own description
  reads (the last block is scored against its output before the final norm).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

from lorp.locality.similarity import LayerSimilarity
from lorp.methods.registry import Selection, check_choice, register_method

CANDIDATES = ("inner", "all")


def block_influence(similarity: LayerSimilarity) -> np.ndarray:
    """BI of every block 0..N-1 (block N-1 against the output state)."""
    S, n = similarity.matrix, similarity.n_blocks
    return 1.0 - np.array([S[i, i + 1] for i in range(n)])


def candidate_blocks(n_blocks: int, candidates: str) -> range:
    """The blocks ShortGPT may prune under a `candidates` rule."""
    return range(1, n_blocks - 1) if candidates == "inner" else range(n_blocks)


def _check(options: Mapping[str, Any], n_blocks: int | None) -> None:
    check_choice("candidates", options["candidates"], CANDIDATES)


@register_method("shortgpt", needs_output_state=True, check=_check)
def shortgpt(
    similarity: LayerSimilarity, budget: int, *, candidates: Literal["inner", "all"] = "inner"
) -> Selection:
    """ShortGPT: prune the blocks of lowest Block Influence 1 - cos(input, output)."""
    bi = block_influence(similarity)
    pool = candidate_blocks(similarity.n_blocks, candidates)
    order = sorted(pool, key=lambda i: (bi[i], i))
    return Selection(
        layers=tuple(sorted(order[:budget])),
        details={"block_influence": bi, "candidates": list(pool)},
    )
