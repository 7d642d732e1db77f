"""lorp: Locality-Aware Redundancy Pruning, the pure method.

Tensors and arrays in, arrays and layer lists out. Nothing here imports Ray, MLflow or
vLLM: the fleet orchestration lives in `pipeline/`.
"""

from lorp.allocation import Allocation, allocate, allocate_detailed, redundancy_scores
from lorp.clustering import affinity, cluster_layers
from lorp.locality import k_for_rls, off_diagonal_mean, rls
from lorp.methods import (
    LorpExplanation,
    RegisteredMethod,
    Selection,
    available_methods,
    explain,
    get_method,
    register_method,
    resolve_budget,
    select_layers,
    unregister_method,
    validate_options,
)
from lorp.model_profile import Profile, profile
from lorp.provenance import provenance
from lorp.similarity import (
    FORMAT_VERSION,
    LayerSimilarity,
    NonFiniteActivationError,
    SimilarityStats,
    load_similarity,
)
from lorp.surgery import kept_layers
from lorp.version import __version__

__all__ = [
    "FORMAT_VERSION",
    "Allocation",
    "LayerSimilarity",
    "LorpExplanation",
    "NonFiniteActivationError",
    "Profile",
    "RegisteredMethod",
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
    "kept_layers",
    "load_similarity",
    "off_diagonal_mean",
    "profile",
    "provenance",
    "redundancy_scores",
    "register_method",
    "resolve_budget",
    "rls",
    "select_layers",
    "unregister_method",
    "validate_options",
]
