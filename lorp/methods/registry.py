"""The registry of layer-selection methods and `select_layers`, the one way to run them.

A method is a plain function `fn(similarity, budget, *, option=default, ...) -> Selection`
registered under a name. Its keyword-only parameters are its options: the registry reads
them from the signature, so an unknown option is refused before the method runs. Flags on
the registration say what the method needs beyond the block-input matrix:

- ``needs_output_state``: the output of the last block (row N of a `SimilarityStats`);
  a bare N x N matrix cannot serve it.
- ``needs_evaluator``: the method scores candidate pruned models itself (SLEB,
  Shortened-LLaMA's perplexity criterion). It then receives ``evaluator=``, a callable
  mapping a tuple of pruned block indices to a loss (lower is better), supplied by
  whoever can build and run models (the pipeline); methods without the flag never see it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from lorp.similarity import LayerSimilarity, SimilarityStats

Evaluator = Callable[[tuple[int, ...]], float]


@dataclass(frozen=True)
class Selection:
    """What a method chose: sorted 0-based block indices plus method-specific details."""

    layers: tuple[int, ...]
    method: str = ""
    budget: int = 0
    n_blocks: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)
    details: Mapping[str, Any] = field(default_factory=dict)

    @property
    def kept(self) -> tuple[int, ...]:
        pruned = set(self.layers)
        return tuple(i for i in range(self.n_blocks) if i not in pruned)

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "budget": self.budget,
            "n_blocks": self.n_blocks,
            "options": _jsonable(dict(self.options)),
            "pruned": list(self.layers),
            "kept": list(self.kept),
            "details": _jsonable(dict(self.details)),
        }


class PruningMethod(Protocol):
    def __call__(self, similarity: LayerSimilarity, budget: int, **options: Any) -> Selection: ...


@dataclass(frozen=True)
class MethodSpec:
    name: str
    fn: PruningMethod
    defaults: Mapping[str, Any]
    needs_output_state: bool
    needs_evaluator: bool

    @property
    def summary(self) -> str:
        doc = inspect.getdoc(self.fn) or ""
        return doc.splitlines()[0] if doc else ""


_REGISTRY: dict[str, MethodSpec] = {}


def register_method(
    name: str, *, needs_output_state: bool = False, needs_evaluator: bool = False
) -> Callable[[Callable[..., Selection]], Callable[..., Selection]]:
    """Decorator: register `fn` as method `name`; a second registration of a name fails."""

    def decorator(fn: Callable[..., Selection]) -> Callable[..., Selection]:
        if name in _REGISTRY:
            raise ValueError(f"method {name!r} is already registered")
        params = list(inspect.signature(fn).parameters.values())
        defaults = {}
        for p in params[2:]:
            if p.kind is not inspect.Parameter.KEYWORD_ONLY or p.default is inspect.Parameter.empty:
                raise TypeError(
                    f"method {name!r}: option {p.name!r} must be keyword-only with a default"
                )
            if p.name != "evaluator":
                defaults[p.name] = p.default
        if needs_evaluator and "evaluator" not in {p.name for p in params}:
            raise TypeError(f"method {name!r} needs an evaluator but takes no 'evaluator' argument")
        _REGISTRY[name] = MethodSpec(name, fn, defaults, needs_output_state, needs_evaluator)
        return fn

    return decorator


def unregister_method(name: str) -> None:
    """Remove a method (for plugins and tests that register temporary ones)."""
    _REGISTRY.pop(name, None)


def get_method(name: str) -> MethodSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown method {name!r} (known: {', '.join(sorted(_REGISTRY))})"
        ) from None


def available_methods() -> list[str]:
    return sorted(_REGISTRY)


def resolve_budget(budget: int | float, n_blocks: int) -> int:
    """A block count (int >= 1) or a fraction of N in (0, 1), as a block count in [1, N-2]."""
    if isinstance(budget, bool) or not isinstance(budget, int | float | np.integer | np.floating):
        raise ValueError(f"budget must be a block count or a fraction of N, got {budget!r}")
    if isinstance(budget, float | np.floating):
        if not 0.0 < budget < 1.0:
            raise ValueError(f"budget fraction must be in (0, 1), got {budget}")
        count = round(float(budget) * n_blocks)
    else:
        count = int(budget)
    if not 1 <= count <= n_blocks - 2:
        raise ValueError(
            f"budget must leave the 2 boundary blocks: 1 <= blocks <= {n_blocks - 2} "
            f"for N={n_blocks}, got {budget}" + (f" (= {count} blocks)" if count != budget else "")
        )
    return count


def as_similarity(stats: SimilarityStats | LayerSimilarity | np.ndarray) -> LayerSimilarity:
    if isinstance(stats, SimilarityStats):
        return stats.similarity()
    if isinstance(stats, LayerSimilarity):
        return stats
    return LayerSimilarity.from_matrix(np.asarray(stats, dtype=np.float64))


def select_layers(
    stats: SimilarityStats | LayerSimilarity | np.ndarray,
    budget: int | float,
    method: str = "lorp",
    *,
    evaluator: Evaluator | None = None,
    **options: Any,
) -> Selection:
    """Choose `budget` blocks to prune with a registered method.

    `stats` is a `SimilarityStats` (every method), or an N x N block-input matrix (only the
    methods that need no output state). `budget` is a block count or a fraction of N.
    """
    spec = get_method(method)
    similarity = as_similarity(stats)
    unknown = sorted(set(options) - set(spec.defaults))
    if unknown:
        known = ", ".join(sorted(spec.defaults)) or "none"
        raise ValueError(f"method {method!r} has no option {unknown[0]!r} (options: {known})")
    if spec.needs_output_state and not similarity.has_output:
        raise ValueError(
            f"method {method!r} needs the last block's output state: give it a SimilarityStats "
            "file (.npz), not a bare N x N matrix"
        )
    n_budget = resolve_budget(budget, similarity.n_blocks)
    kwargs = dict(options)
    if spec.needs_evaluator:
        if evaluator is None:
            raise ValueError(f"method {method!r} scores candidate models: pass evaluator=")
        kwargs["evaluator"] = evaluator
    chosen = spec.fn(similarity, n_budget, **kwargs)
    layers = tuple(sorted(int(i) for i in chosen.layers))
    if len(set(layers)) != n_budget or any(not 0 <= i < similarity.n_blocks for i in layers):
        raise RuntimeError(f"method {method!r} returned an invalid selection {layers}")
    return Selection(
        layers=layers,
        method=method,
        budget=n_budget,
        n_blocks=similarity.n_blocks,
        options={**spec.defaults, **options},
        details=chosen.details,
    )


def best_window(scores: Sequence[float], starts: Sequence[int]) -> int:
    """Start of the highest-scoring window; ties go to the shallower start."""
    return min(zip(starts, scores, strict=True), key=lambda sc: (-sc[1], sc[0]))[0]


def _jsonable(value: Any) -> Any:
    """Plain JSON types; non-finite floats become None (JSON has no -inf)."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | np.ndarray):
        return [_jsonable(v) for v in (value.tolist() if isinstance(value, np.ndarray) else value)]
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, float | np.floating):
        return float(value) if np.isfinite(value) else None
    return value
