"""lorp: Locality-Aware Redundancy Pruning, the pure method.

Tensors and arrays in, arrays and layer lists out. Nothing here imports Ray, MLflow or
vLLM: the fleet orchestration lives in `pipeline/`.
"""

__version__ = "0.1.0"

from lorp.allocation import Allocation, allocate, allocate_detailed, redundancy_scores  # noqa: E402
from lorp.clustering import affinity, cluster_layers  # noqa: E402
from lorp.locality import k_for_rls, off_diagonal_mean, rls  # noqa: E402
from lorp.methods import (  # noqa: E402
    LorpExplanation,
    MethodSpec,
    Selection,
    available_methods,
    explain,
    get_method,
    register_method,
    resolve_budget,
    select_layers,
    unregister_method,
)
from lorp.similarity import (  # noqa: E402
    LayerSimilarity,
    NonFiniteActivationError,
    SimilarityStats,
    load_similarity,
)

__all__ = [
    "Allocation",
    "LayerSimilarity",
    "LorpExplanation",
    "MethodSpec",
    "NonFiniteActivationError",
    "Selection",
    "SimilarityStats",
    "__version__",
    "affinity",
    "allocate",
    "allocate_detailed",
    "available_methods",
    "cluster_layers",
    "explain",
    "get_method",
    "k_for_rls",
    "load_similarity",
    "off_diagonal_mean",
    "redundancy_scores",
    "register_method",
    "resolve_budget",
    "rls",
    "select_layers",
    "unregister_method",
]
