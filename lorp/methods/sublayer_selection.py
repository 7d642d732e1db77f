"""Selecting sub-layers: the methods at attention, MLP and mixed granularity.

All of them read one S over the 2N + 1 sub-layer boundaries
(`lorp.locality.capture.capture_stats(sublayers=True)`), whose unit u maps boundary u to
boundary u + 1 (`lorp.models.sublayers`). A budget counts units of the granularity; the
first and last block's units are never candidates, as for whole blocks.

- ``shortgpt``: ShortGPT's Block Influence per sub-layer, 1 - S[u, u + 1], the criterion
  LLM-Drop applies to attention and MLP layers; the lowest go (ties: lower unit).
- ``lorp``: LoRP on the 2N units (the paper's Sec. 4 with sub-layers for blocks): RLS of
  the unit S picks K, spectral clustering partitions all 2N units, and the two-stage
  allocation spends the budget on the granularity's units only, so an attention-only
  budget still sees which MLPs cluster with which attentions.
- ``sleb``: SLEB's greedy elimination with sub-layers for blocks: at each step the unit
  whose removal, with those gone so far, gives the lowest calibration loss goes. It reads no S; its
  `losses=` callable scores candidate unit sets
  (`lorp.scoring.removal_loss.LossEvaluator(units=True)`, or the pipeline's actors).
- ``finercut``: FinerCut's greedy removal by the change in output
  (`lorp.methods.finercut`): SLEB's search, each candidate scored by the JS divergence of
  its next-token distributions from the dense model's, so its `losses=` must measure that
  (`LossEvaluator(units=True, measure="js")`; `loss_measure` says which a method needs).
  At ``mixed`` granularity it is FinerCut as published: attention and FFN layers ranked
  together.
- ``window``: the repair-aware window (`lorp.methods.window`) with units for blocks, at
  ``mixed`` granularity only: a run of consecutive units is a contiguous stretch of the
  residual stream, where attentions or MLPs alone are not (the other kind lies between
  them). Every window of `budget` consecutive eligible units gets its map fitted from
  one pass of unit repair sums, and the one whose repaired variant does best by
  `score` goes; its `repair_scores=` callable scores unit runs
  (`lorp.scoring.window_scores.window_scores` of `lorp.repair.sublayer_repair.unit_stats`,
  or `window_losses(units=True)`).
- ``ppl``: Shortened LLaMA's one-shot criterion with sub-layers for blocks: each eligible
  unit is scored by the calibration loss of the model without it alone, and the
  `budget` lowest go (ties: lower unit). One round of |pool| candidates, where SLEB runs
  `budget` rounds; the same `losses=`, and the block form's `keep_first=4`,
  `keep_last=2` (units of those blocks are never candidates).

``block`` granularity runs any registered method on the block S (the even boundaries) and
returns the units of the blocks it chose, so every granularity is compared on the same
calibration pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from lorp.locality.allocation import allocate_detailed, tie_key
from lorp.locality.rls import DEFAULT_KS, DEFAULT_THRESHOLDS
from lorp.locality.similarity import LayerSimilarity
from lorp.methods.lorp_method import check_lorp_options, cluster_labels
from lorp.methods.loss_guided import CountedLosses, check_keep
from lorp.methods.registry import (
    Losses,
    RepairScores,
    Selection,
    check_choice,
    check_measure,
    get_method,
    resolve_budget,
    select_layers,
)
from lorp.methods.sleb import greedy_removal
from lorp.methods.window import SCORES, best_run
from lorp.models.sublayers import (
    block_units,
    budget_limit,
    candidate_units,
    check_granularity,
    eligible_units,
    unit_label,
)

SUBLAYER_METHODS = ("lorp", "shortgpt", "sleb", "ppl", "finercut", "window")
"""The methods with a sub-layer form; any registered method runs at `block` granularity."""
LOSS_METHODS = ("sleb", "ppl", "finercut")
"""The sub-layer methods that score candidate removals (`losses=` over unit sets)."""
WINDOW_GRANULARITIES = ("block", "mixed")
"""Where `window` runs: a contiguous run of units exists only where both kinds count."""


def loss_measure(method: str) -> str:
    """What a loss-guided method's `losses=` must return (`lorp.methods.registry.MEASURES`):
    the calibration NLL, or for FinerCut the JS divergence from the dense outputs."""
    return get_method(method).measure


def check_sublayer_method(method: str, granularity: str, field: str = "method") -> None:
    """One line naming the method when it has no form at `granularity`."""
    check_granularity(granularity)
    if granularity != "block" and method not in SUBLAYER_METHODS:
        raise ValueError(
            f"{field}: {method!r} has no sub-layer form (granularity {granularity!r} takes "
            f"{', '.join(SUBLAYER_METHODS)})"
        )
    if method == "window" and granularity not in WINDOW_GRANULARITIES:
        raise ValueError(
            f"{field}: 'window' removes a contiguous run, and {granularity!r} units are not "
            "contiguous (the other kind lies between them): it runs at 'block' or 'mixed'"
        )


def check_unit_budget(budget: int, granularity: str, n_blocks: int) -> int:
    limit = budget_limit(granularity, n_blocks)
    if isinstance(budget, bool) or not isinstance(budget, int | np.integer):
        raise ValueError(f"budget: must be an integer, got {budget!r}")
    if not 1 <= budget <= limit:
        raise ValueError(
            f"budget: {budget} {granularity} units, but a {n_blocks}-block model has {limit} "
            "to remove (its first and last blocks stay)"
        )
    return int(budget)


def resolve_unit_budget(budget: int | float, granularity: str, n_blocks: int) -> int:
    """A budget of `granularity` as a count: blocks as `resolve_budget` counts them, else
    units (a fraction: of the granularity's units, N for attention or MLP, 2N mixed),
    at most `budget_limit`."""
    if granularity == "block":
        return resolve_budget(budget, n_blocks)
    if isinstance(budget, float | np.floating):
        if not 0.0 < budget < 1.0:
            raise ValueError(f"budget fraction must be in (0, 1), got {budget}")
        budget = round(float(budget) * len(candidate_units(granularity, n_blocks)))
    return check_unit_budget(budget, granularity, n_blocks)


def select_units(
    similarity: LayerSimilarity,
    budget: int,
    granularity: str,
    method: str,
    *,
    losses: Losses | None = None,
    repair_scores: RepairScores | None = None,
    **options: Any,
) -> Selection:
    """The units (`lorp.models.sublayers`) `method` removes at `granularity` for `budget`
    units of it, from a sub-layer S (2N units). `Selection.layers` are units, its
    `n_blocks` 2N, its details name the granularity and the units' labels. A method of
    `LOSS_METHODS` scores candidate unit sets with `losses` (at `block` granularity too:
    a block is its two units). `window` ranks runs with `repair_scores`: runs of units
    at `mixed`, runs of blocks at `block` (there it is `select_layers`' argument)."""
    check_sublayer_method(method, granularity)
    if similarity.n_blocks % 2:
        raise ValueError("select_units needs the sub-layer S (capture_stats(sublayers=True))")
    n_blocks = similarity.n_blocks // 2
    check_unit_budget(budget, granularity, n_blocks)
    if method in LOSS_METHODS and losses is None:
        raise ValueError(
            f"method {method!r} scores candidate models: pass losses=, a callable from "
            "candidate sets of sub-layer units to drop to their calibration losses"
        )
    if method == "window" and repair_scores is None:
        raise ValueError(
            "method 'window' ranks runs by their linear repair: pass repair_scores=, a "
            "callable from candidate runs to their repaired scores"
        )
    if granularity == "block":
        asks = losses is not None and method in LOSS_METHODS
        scored: dict[str, Any] = {"losses": _as_blocks(losses)} if asks else {}
        if method == "window":
            scored["repair_scores"] = repair_scores
        chosen = select_layers(block_similarity(similarity), budget, method, **options, **scored)
        units = tuple(block_units(chosen.layers))
        details: dict[str, Any] = {"blocks": list(chosen.layers), **dict(chosen.details)}
    elif method == "shortgpt":
        units, details = _shortgpt(similarity, budget, granularity)
    elif method == "window":
        assert repair_scores is not None
        units, details = _window(n_blocks, budget, repair_scores, **options)
    elif method in LOSS_METHODS:
        assert losses is not None
        check_measure(method, loss_measure(method), losses)
        rule = _ppl if method == "ppl" else _sleb  # finercut: SLEB's search, its own measure
        units, details = rule(n_blocks, budget, granularity, losses, **options)
    else:
        units, details = _lorp(similarity, budget, granularity, **options)
    details = {"granularity": granularity, "sublayers": [unit_label(u) for u in units], **details}
    return Selection(
        layers=tuple(units),
        method=method,
        budget=int(budget),
        n_blocks=similarity.n_blocks,
        options=dict(options),
        details=details,
    )


def block_similarity(units: LayerSimilarity) -> LayerSimilarity:
    """The block S of a sub-layer S: its even boundaries are the blocks' inputs (and the
    last block's output), so one capture serves every granularity."""
    if units.n_blocks % 2:
        raise ValueError(f"a sub-layer S has an even number of units, got {units.n_blocks}")
    pick = lambda m: None if m is None else np.ascontiguousarray(m[::2, ::2])  # noqa: E731
    return LayerSimilarity(
        pick(units.matrix),
        units.n_blocks // 2,
        pick(units.last_token),
        pick(units.last_token_angular),
    )


def sublayer_influence(similarity: LayerSimilarity) -> np.ndarray:
    """1 - cos(input, output) of every unit, token-averaged: S[u, u + 1]."""
    if not similarity.has_output:
        raise ValueError("sub-layer ShortGPT needs the last block's output state")
    S = similarity.matrix
    return 1.0 - np.array([S[u, u + 1] for u in range(similarity.n_blocks)])


def _shortgpt(
    similarity: LayerSimilarity, budget: int, granularity: str
) -> tuple[tuple[int, ...], dict[str, Any]]:
    bi = sublayer_influence(similarity)
    pool = eligible_units(granularity, similarity.n_blocks // 2)
    order = sorted(pool, key=lambda u: (bi[u], u))
    return tuple(sorted(order[:budget])), {"influence": bi.tolist(), "candidates": pool}


def _lorp(
    similarity: LayerSimilarity,
    budget: int,
    granularity: str,
    *,
    variant: str = "paper",
    k: int | None = None,
    thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    ks: Sequence[int] = DEFAULT_KS,
    seed: int = 0,
) -> tuple[tuple[int, ...], dict[str, Any]]:
    options = {"variant": variant, "k": k, "thresholds": thresholds, "ks": ks, "seed": seed}
    check_lorp_options(options, similarity.n_blocks)  # the block method's checks
    S = similarity.blocks  # the 2N unit inputs
    score, chosen_k, labels = cluster_labels(S, k, thresholds, ks, int(seed), None)
    pool = eligible_units(granularity, similarity.n_blocks // 2)
    alloc = allocate_detailed(S, labels, budget, variant=variant, eligible=pool)  # type: ignore[arg-type]
    return alloc.layers, {
        "rls": score,
        "k": chosen_k,
        "labels": [int(x) for x in alloc.labels],
        "order": list(alloc.order),
        "stages": {str(u): s for u, s in alloc.stages.items()},
    }


def _as_blocks(losses: Losses) -> Losses:
    """A unit-set `losses` asked about block sets: each block is its two units."""
    return lambda cands: losses([tuple(block_units(c)) for c in cands])


def _sleb(
    n_blocks: int,
    budget: int,
    granularity: str,
    losses: Losses,
    *,
    keep_first: int = 1,
    keep_last: int = 1,
) -> tuple[tuple[int, ...], dict[str, Any]]:
    """SLEB over the granularity's units of blocks keep_first..N-1-keep_last."""
    pool = _unit_pool(n_blocks, granularity, keep_first, keep_last)
    order, details = greedy_removal(pool, budget, losses)
    details["order"] = [unit_label(u) for u in order]
    return tuple(sorted(order)), details


def _window(
    n_blocks: int,
    budget: int,
    repair_scores: RepairScores,
    *,
    score: str = "residual",
    last_block: bool = False,
) -> tuple[tuple[int, ...], dict[str, Any]]:
    """The `budget` consecutive eligible units (attn.1 to mlp.N-2) whose repaired variant
    scores lowest; ties go to the shallower window."""
    check_choice("score", score, SCORES)
    if last_block:
        raise ValueError("option 'last_block': a sub-layer window never takes the last block")
    pool = eligible_units("mixed", n_blocks)
    starts = pool[: len(pool) - budget + 1]
    s, scores = best_run(starts, budget, repair_scores, score)
    return tuple(range(s, s + budget)), {
        "window_start": unit_label(s),
        f"window_{score}": {unit_label(u): x for u, x in zip(starts, scores, strict=True)},
    }


def _ppl(
    n_blocks: int,
    budget: int,
    granularity: str,
    losses: Losses,
    *,
    keep_first: int = 4,
    keep_last: int = 2,
) -> tuple[tuple[int, ...], dict[str, Any]]:
    """Shortened LLaMA's PPL criterion over the granularity's units of blocks
    keep_first..N-1-keep_last: one round, each unit removed alone."""
    pool = _unit_pool(n_blocks, granularity, keep_first, keep_last)
    if budget > len(pool):
        raise ValueError(
            f"budget {budget} exceeds the {len(pool)} candidate {granularity} units "
            f"(keep_first={keep_first}, keep_last={keep_last}, N={n_blocks})"
        )
    counted = CountedLosses(losses)
    scores = dict(zip(pool, counted([(u,) for u in pool]), strict=True))
    order = sorted(pool, key=lambda u: (tie_key(scores[u]), u))
    return tuple(sorted(order[:budget])), {
        "scores": {unit_label(u): v for u, v in scores.items()},
        "order": [unit_label(u) for u in order],
        "candidates": list(pool),
        "n_evals": counted.n_evals,
    }


def _unit_pool(n_blocks: int, granularity: str, keep_first: int, keep_last: int) -> list[int]:
    """The granularity's eligible units of blocks keep_first..N-1-keep_last."""
    check_keep({"keep_first": keep_first, "keep_last": keep_last}, n_blocks)
    return [
        u
        for u in eligible_units(granularity, n_blocks)
        if keep_first <= u // 2 < n_blocks - keep_last
    ]
