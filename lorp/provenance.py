"""The provenance record of a pruned checkpoint: `lorp_pruning.json`.

One function builds it for every writer (`lorp prune`, the pipeline's grid points), so
every checkpoint carries the same keys whoever wrote it: where it came from (model
reference and content fingerprint), how its blocks were chosen (method, options, budget),
what was removed and what stayed, and the lorp version. Extras that do not apply are
null rather than absent, so readers never branch on the writer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from lorp.methods.registry import jsonable
from lorp.models.surgery import kept_layers
from lorp.version import __version__


def provenance(
    *,
    source_model: str,
    source_fingerprint: str | None,
    method: str,
    options: Mapping[str, Any],
    budget: int,
    n_blocks: int,
    pruned: Iterable[int],
    stats_hash: str | None = None,
    details: Mapping[str, Any] | None = None,
    grid_key: str | None = None,
    job: str | None = None,
    calibration: Mapping[str, Any] | None = None,
    repair: Mapping[str, Any] | None = None,
    experts: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The `lorp_pruning.json` record (plain JSON types; `kept` derived from `pruned`).

    `method` is a registered method's name, or "manual" for an explicit block list;
    `stats_hash` is `lorp.locality.similarity_stats.stats_hash` of the statistics the selection
    used; `repair` says how the gaps were closed (`lorp.repair`: method, ridge, one record per
    run with its fit's residual), null for a plainly pruned checkpoint; `experts` the
    routed experts removed (`lorp.experts`: selector, and per block the experts' original
    indices), absent where none were.
    """
    layers = sorted({int(i) for i in pruned})
    bad = [i for i in layers if not 0 <= i < n_blocks]
    if bad:
        raise ValueError(f"pruned blocks must be in [0, {n_blocks - 1}], got {bad}")
    return jsonable(
        {
            "lorp_version": __version__,
            "source_model": source_model,
            "source_fingerprint": source_fingerprint,
            "method": method,
            "options": dict(options),
            "budget": int(budget),
            "n_blocks": int(n_blocks),
            "pruned": layers,
            "kept": kept_layers(n_blocks, layers),
            "stats_hash": stats_hash,
            "details": dict(details) if details is not None else None,
            "grid_key": grid_key,
            "job": job,
            "calibration": dict(calibration) if calibration is not None else None,
            "repair": dict(repair) if repair is not None else None,
            **({"experts": dict(experts)} if experts is not None else {}),
        }
    )


def with_repair_runs(
    record: Mapping[str, Any], runs: Iterable[Mapping[str, Any]]
) -> dict[str, Any]:
    """`record` with each repaired run's fit (`lorp.repair.maps.RunFit.record()`) under
    `repair.runs`: what only the worker that fitted the maps knows."""
    repair = dict(record.get("repair") or {})
    return {**record, "repair": {**repair, "runs": [dict(r) for r in runs]}}
