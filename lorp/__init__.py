"""lorp: Locality-Aware Redundancy Pruning, the pure method.

Tensors and arrays in, arrays and layer lists out. Nothing here imports Ray, MLflow or
vLLM: the fleet orchestration lives in `pipeline/`.
"""

from lorp.locality.allocation import Allocation, allocate, allocate_detailed, redundancy_scores
from lorp.locality.clustering import affinity, cluster_layers
from lorp.locality.profile import Profile, profile
from lorp.locality.rls import k_for_rls, off_diagonal_mean, rls
from lorp.locality.similarity import LayerSimilarity, NonFiniteActivationError
from lorp.locality.similarity_stats import FORMAT_VERSION, SimilarityStats, load_similarity
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
from lorp.models.surgery import kept_layers
from lorp.provenance import provenance
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

import lorp.peers  # noqa: E402, F401  (registers the peers' selections: `lorp.peers`)
