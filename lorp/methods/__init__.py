"""Layer-selection methods. Importing this package registers every built-in method; a new
method is one new module here, decorated with `register_method`, imported below."""

from lorp.methods import angular, lorp_method, random_layers, shortgpt, streamline  # noqa: F401
from lorp.methods.lorp_method import LorpExplanation, explain
from lorp.methods.registry import (
    Evaluator,
    MethodSpec,
    PruningMethod,
    Selection,
    available_methods,
    get_method,
    register_method,
    resolve_budget,
    select_layers,
    unregister_method,
)

__all__ = [
    "Evaluator",
    "LorpExplanation",
    "MethodSpec",
    "PruningMethod",
    "Selection",
    "available_methods",
    "explain",
    "get_method",
    "register_method",
    "resolve_budget",
    "select_layers",
    "unregister_method",
]
