"""The registry of layer-selection methods and `select_layers`, the one way to run them.

A method is a plain function `fn(similarity, budget, *, option=default, ...) -> Selection`
registered under a name. Its keyword-only parameters are its options: the registry reads
them from the signature, and `validate_options` checks every option's name and value
before the method runs (see there). Flags on the registration say what the method needs
beyond the block-input matrix:

- ``needs_output_state``: the output of the last block (row N of a `SimilarityStats`);
  a bare N x N matrix cannot serve it.
- ``needs_last_token``: the last-token statistics (`LayerSimilarity.last_token*`), which
  only a `SimilarityStats` captured by `lorp.locality.capture` (format 2) carries.
- ``needs_repair``: the method ranks candidate runs of blocks by how well a linear repair
  (`lorp.repair`) closes the gap each would open. It then receives ``repair_scores=``, a
  `RepairScores` callable: ``repair_scores(runs, score) -> values``, each run an
  inclusive (s, e) pair of blocks, lower is better. `score` says which number:
  ``"residual"``, ||Y + X T - H_e||^2 / ||H_e||^2 of the run's fitted map on calibration
  tokens (`lorp.scoring.window_scores.window_scores`), or ``"loss"``, the held-out calibration loss
  of the model with the run removed and its map applied
  (`lorp.scoring.window_scores.window_losses`). One call is one batch: the caller sums every run's
  statistics in one calibration pass.
- ``needs_evaluator``: the method scores candidate pruned models itself (SLEB,
  Shortened-LLaMA's perplexity criterion, loss-guided LoRP). It then receives
  ``losses=``, a `Losses` callable supplied by whoever can build and run models (the
  pipeline, or `lorp.scoring.removal_loss.LossEvaluator` in one process); methods without the flag
  never see it. The method stays pure: it only hands candidate sets to the callable and reads
  back numbers. ``measure`` says which number (`MEASURES`):
  ``"nll"``, the calibration loss (SLEB, PPL, loss-guided LoRP), or ``"js"``, the
  Jensen-Shannon divergence of the candidate's next-token distributions from the dense
  model's (FinerCut).

`Losses`: ``losses(candidates) -> values``. Each candidate is a sorted tuple of distinct
0-based block indices to drop; its value is the mean calibration NLL per predicted token
of the model without those blocks, or for a method registered with ``measure="js"`` the
mean JS divergence per position of its outputs from the dense model's (lower is better).
One call is one batch: the caller may score its candidates in parallel (the pipeline
spreads them over several actors), so a method hands over every candidate it can decide
on at once, e.g. all single removals of one greedy step.

- ``peer``: the method is one half of a published recipe whose other half is its own
  repair (`lorp.peers`): a job runs its selection with that repair, named by the flag
  (``cosine-map``, ...), and never with lorp's `linear` repair.
- ``needs_model``: the method chooses blocks on the model itself, not from S (Prune&Comp
  removes one block at a time from a model it has compensated so far). It then receives
  ``model_steps=``, a `ModelSteps` callable: ``model_steps(budget, options) -> details``,
  run by whoever holds the model (`lorp.peers.prune_and_comp.model_steps` in one process,
  a Ray task in the pipeline); the details name the blocks in ``order``.

Two keyword parameters are not options: ``losses`` (above) and ``profile``, a
precomputed `lorp.Profile` of the same S that `select_layers` passes to any method whose
signature names it, so RLS, K and the clusters are computed once per model, not once per
selection.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from lorp.locality.profile import Profile
from lorp.locality.rls import is_int, is_real
from lorp.locality.similarity import LayerSimilarity
from lorp.locality.similarity_stats import SimilarityStats
from lorp.models.surgery import kept_layers
from lorp.scoring.removal_loss import MEASURES

# losses(candidates) -> one mean calibration NLL per candidate set of blocks to drop.
Losses = Callable[[list[tuple[int, ...]]], list[float]]
# repair_scores(runs, score) -> one value per (s, e) run after its linear repair, lower
# better: score "residual" (the error its map leaves) or "loss" (the repaired model's loss).
RepairScores = Callable[[list[tuple[int, int]], str], list[float]]
# check(options, n_blocks): raise ValueError("option 'x': ...") for a bad value. `options`
# holds every option (defaults filled in); n_blocks is None when not known yet.
OptionCheck = Callable[[Mapping[str, Any], int | None], None]
# model_steps(budget, options) -> the selection's details, "order" the blocks removed in turn.
ModelSteps = Callable[[int, Mapping[str, Any]], dict[str, Any]]
NOT_OPTIONS = ("losses", "profile", "repair_scores", "model_steps")


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
        return tuple(kept_layers(self.n_blocks, self.layers))

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "budget": self.budget,
            "n_blocks": self.n_blocks,
            "options": jsonable(dict(self.options)),
            "pruned": list(self.layers),
            "kept": list(self.kept),
            "details": jsonable(dict(self.details)),
        }


class PruningMethod(Protocol):
    def __call__(self, similarity: LayerSimilarity, budget: int, **options: Any) -> Selection: ...


@dataclass(frozen=True)
class RegisteredMethod:
    """A registry entry: the function, its options' defaults, its value check and flags."""

    name: str
    fn: PruningMethod
    defaults: Mapping[str, Any]
    needs_output_state: bool = False
    needs_evaluator: bool = False
    needs_last_token: bool = False
    takes_profile: bool = False
    needs_repair: bool = False
    check: OptionCheck | None = None
    measure: str = "nll"
    peer: str | None = None
    """The published recipe's own repair this selection is paired with (`lorp.peers`)."""
    needs_model: bool = False

    @property
    def summary(self) -> str:
        doc = inspect.getdoc(self.fn) or ""
        return doc.splitlines()[0] if doc else ""


_REGISTRY: dict[str, RegisteredMethod] = {}


def register_method(
    name: str,
    *,
    needs_output_state: bool = False,
    needs_evaluator: bool = False,
    needs_last_token: bool = False,
    needs_repair: bool = False,
    check: OptionCheck | None = None,
    measure: str = "nll",
    peer: str | None = None,
    needs_model: bool = False,
) -> Callable[[Callable[..., Selection]], Callable[..., Selection]]:
    """Decorator: register `fn` as method `name`; a second registration of a name fails.

    `check(options, n_blocks)` validates option values beyond what the defaults' types
    say (see `validate_options`)."""

    def decorator(fn: Callable[..., Selection]) -> Callable[..., Selection]:
        if name in _REGISTRY:
            raise ValueError(f"method {name!r} is already registered")
        params = list(inspect.signature(fn).parameters.values())[2:]
        defaults = _option_defaults(name, params)
        names = {p.name for p in params}
        if needs_evaluator and "losses" not in names:
            raise TypeError(f"method {name!r} needs an evaluator but takes no 'losses' argument")
        if measure not in MEASURES:
            raise ValueError(f"method {name!r}: measure must be one of {MEASURES}, got {measure!r}")
        if needs_repair and "repair_scores" not in names:
            raise TypeError(f"method {name!r} needs repair scores but takes no 'repair_scores'")
        if needs_model and "model_steps" not in names:
            raise TypeError(f"method {name!r} needs the model but takes no 'model_steps'")
        _REGISTRY[name] = RegisteredMethod(
            name,
            fn,
            defaults,
            needs_output_state=needs_output_state,
            needs_evaluator=needs_evaluator,
            needs_last_token=needs_last_token,
            takes_profile="profile" in names,
            needs_repair=needs_repair,
            check=check,
            measure=measure,
            peer=peer,
            needs_model=needs_model,
        )
        return fn

    return decorator


def _option_defaults(name: str, params: list[inspect.Parameter]) -> dict[str, Any]:
    """The options of a method: its keyword-only parameters, each with a default."""
    defaults = {}
    for p in params:
        if p.kind is not inspect.Parameter.KEYWORD_ONLY or p.default is inspect.Parameter.empty:
            raise TypeError(
                f"method {name!r}: option {p.name!r} must be keyword-only with a default"
            )
        if p.name not in NOT_OPTIONS:
            defaults[p.name] = p.default
    return defaults


def check_measure(method: str, measure: str, losses: Any) -> None:
    """One line when `losses` says it measures something other than what `method` ranks
    by (a callable without a ``measure`` attribute is taken at its word)."""
    given = getattr(losses, "measure", measure)
    if given != measure:
        raise ValueError(
            f"method {method!r} ranks by {measure!r}, but its losses= measure {given!r} "
            f"(e.g. LossEvaluator(..., measure={measure!r}))"
        )


def unregister_method(name: str) -> None:
    """Remove a method (for plugins and tests that register temporary ones)."""
    _REGISTRY.pop(name, None)


def get_method(name: str) -> RegisteredMethod:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown method {name!r} (known: {', '.join(sorted(_REGISTRY))})"
        ) from None


def available_methods() -> list[str]:
    return sorted(_REGISTRY)


def validate_options(
    method: str, options: Mapping[str, Any], n_blocks: int | None = None
) -> dict[str, Any]:
    """Check a method's options, names and values, without running it; return them with
    the defaults filled in.

    Every option must be one the method declares; a value must have its default's type
    (bool, int, float or str; an int serves a float option; None defaults are the
    method's check's business); then the method's own `check` runs, with `n_blocks` when
    known (bounds such as "k exceeds the number of blocks" need it). Raises ValueError:
    "method 'lorp' option 'variant': must be one of paper, released, got 'latest'".
    """
    spec = get_method(method)
    unknown = sorted(set(options) - set(spec.defaults))
    if unknown:
        known = ", ".join(sorted(spec.defaults)) or "none"
        raise ValueError(f"method {method!r} has no option {unknown[0]!r} (options: {known})")
    merged = {**spec.defaults, **options}
    try:
        for name, value in options.items():
            check_type_like(name, value, spec.defaults[name])
        if spec.check is not None:
            spec.check(merged, n_blocks)
    except ValueError as exc:
        raise ValueError(f"method {method!r} {exc}") from None
    return merged


def check_type_like(name: str, value: Any, default: Any) -> None:
    """Raise ValueError("option 'name': ...") unless `value` has the type of `default`."""
    if default is None or isinstance(default, list | tuple | Mapping):
        return
    if isinstance(default, bool):
        ok, what = isinstance(value, bool | np.bool_), "true or false"
    elif isinstance(default, int | np.integer):
        ok, what = is_int(value), "an integer"
    elif isinstance(default, float | np.floating):
        ok, what = is_real(value), "a number"
    elif isinstance(default, str):
        ok, what = isinstance(value, str), "a string"
    else:
        return
    if not ok:
        raise ValueError(f"option {name!r}: must be {what}, got {value!r}")


def check_choice(name: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"option {name!r}: must be one of {', '.join(choices)}, got {value!r}")


def check_seed(name: str, value: Any) -> None:
    """numpy's and scikit-learn's seeds: an integer in [0, 2**32)."""
    if not is_int(value) or not 0 <= value < 2**32:
        raise ValueError(f"option {name!r}: must be an integer in [0, 2**32), got {value!r}")


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
    losses: Losses | None = None,
    profile: Profile | None = None,
    repair_scores: RepairScores | None = None,
    model_steps: ModelSteps | None = None,
    **options: Any,
) -> Selection:
    """Choose `budget` blocks to prune with a registered method.

    `stats` is a `SimilarityStats` (every method), or an N x N block-input matrix (only the
    methods that need neither the output state nor last-token statistics). `budget` is a
    block count or a fraction of N. `losses` (a `Losses`) is required by, and only handed
    to, methods registered with ``needs_evaluator``. `profile` (`lorp.profile` of the same
    S) is handed to methods that take one and ignored by the others; the selection is the
    same with or without it. `repair_scores` (a `RepairScores`) is required by, and
    only handed to, methods registered with ``needs_repair``; `model_steps` (a
    `ModelSteps`) likewise for ``needs_model``.
    """
    spec = get_method(method)
    similarity = as_similarity(stats)
    merged = validate_options(method, options, similarity.n_blocks)
    _check_inputs(spec, similarity)
    n_budget = resolve_budget(budget, similarity.n_blocks)
    kwargs = dict(options)
    if spec.needs_evaluator:
        if losses is None:
            raise ValueError(
                f"method {method!r} scores candidate models: pass losses=, a callable from "
                "candidate sets of blocks to drop to their calibration losses"
            )
        check_measure(method, spec.measure, losses)
        kwargs["losses"] = losses
    if spec.needs_repair:
        if repair_scores is None:
            raise ValueError(
                f"method {method!r} ranks runs by their linear repair: pass repair_scores=, "
                "a callable from (s, e) runs and a score name to their values "
                "(lorp.scoring.window_scores.window_scores)"
            )
        kwargs["repair_scores"] = repair_scores
    if spec.needs_model:
        if model_steps is None:
            raise ValueError(
                f"method {method!r} chooses blocks on the model: pass model_steps= "
                "(lorp.peers.prune_and_comp.model_steps(model, windows))"
            )
        kwargs["model_steps"] = model_steps
    if spec.takes_profile and profile is not None:
        kwargs["profile"] = profile
    chosen = spec.fn(similarity, n_budget, **kwargs)
    layers = tuple(sorted(int(i) for i in chosen.layers))
    if len(set(layers)) != n_budget or any(not 0 <= i < similarity.n_blocks for i in layers):
        raise RuntimeError(f"method {method!r} returned an invalid selection {layers}")
    return Selection(
        layers=layers,
        method=method,
        budget=n_budget,
        n_blocks=similarity.n_blocks,
        options=merged,
        details=chosen.details,
    )


def _check_inputs(spec: RegisteredMethod, similarity: LayerSimilarity) -> None:
    """Refuse, in one line, statistics that lack what the method reads."""
    if spec.needs_output_state and not similarity.has_output:
        raise ValueError(
            f"method {spec.name!r} needs the last block's output state: give it a "
            "SimilarityStats file (.npz), not a bare N x N matrix"
        )
    if spec.needs_last_token and not similarity.has_last_token:
        raise ValueError(
            f"method {spec.name!r} needs last-token statistics: give it a SimilarityStats "
            "file (.npz) captured by lorp.locality.capture, not a bare matrix"
        )


def best_window(scores: Sequence[float], starts: Sequence[int]) -> int:
    """Start of the highest-scoring window; ties go to the shallower start."""
    return min(zip(starts, scores, strict=True), key=lambda sc: (-sc[1], sc[0]))[0]


def jsonable(value: Any) -> Any:
    """Plain JSON types; non-finite floats become None (JSON has no -inf)."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | np.ndarray):
        return [jsonable(v) for v in (value.tolist() if isinstance(value, np.ndarray) else value)]
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, float | np.floating):
        return float(value) if np.isfinite(value) else None
    return value
