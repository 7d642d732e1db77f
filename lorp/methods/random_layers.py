"""Random selection, the floor every method must beat.

Rule: `budget` distinct blocks drawn uniformly from 1..N-2 (boundary blocks kept, as for
LoRP) with numpy's PCG64 seeded by `seed`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from lorp.locality.similarity import LayerSimilarity
from lorp.methods.registry import Selection, check_seed, register_method


def _check(options: Mapping[str, Any], n_blocks: int | None) -> None:
    check_seed("seed", options["seed"])


@register_method("random", check=_check)
def random_layers(similarity: LayerSimilarity, budget: int, *, seed: int = 0) -> Selection:
    """Random: uniformly drawn non-boundary blocks (seeded), a floor."""
    rng = np.random.default_rng(int(seed))
    picks = rng.choice(np.arange(1, similarity.n_blocks - 1), size=budget, replace=False)
    return Selection(layers=tuple(sorted(int(i) for i in picks)))
