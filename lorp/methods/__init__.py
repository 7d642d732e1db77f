"""Layer-selection methods. Importing this package registers every built-in method; a new
method is one new module here, decorated with `register_method`, imported below."""

from lorp.methods import (  # noqa: F401
    angular,
    finercut,
    lorp_loss,
    lorp_method,
    ppl,
    random_layers,
    shortgpt,
    sleb,
    streamline,
    window,
)
from lorp.methods.lorp_method import LorpExplanation, explain
from lorp.methods.registry import (
    Losses,
    PruningMethod,
    RegisteredMethod,
    RepairScores,
    Selection,
    available_methods,
    get_method,
    register_method,
    resolve_budget,
    select_layers,
    unregister_method,
    validate_options,
)

__all__ = [
    "LorpExplanation",
    "Losses",
    "PruningMethod",
    "RegisteredMethod",
    "RepairScores",
    "Selection",
    "available_methods",
    "explain",
    "get_method",
    "register_method",
    "resolve_budget",
    "select_layers",
    "unregister_method",
    "validate_options",
]
