"""The registry's aliases, recomputed over every version of a registered model, whichever
job made it (`pipeline.tracking.registry` registers the versions).

Aliases are recomputed when a job ends (`pipeline.catalog.ranking` is the rule):
`best-<budget>-<protocol>` for each protocol, `best-<budget>` for the model's reference
protocol, `dense` at the model's oldest dense version (stable). A version's figures are its
row in the shared catalog when the job has one (`catalog:`), else its own tags, which
repeat its row. Two jobs that end together cannot leave a stale view behind: after moving
the aliases a job reads the versions again and recomputes until nothing changed under it,
so whichever job ends last, the aliases are the same. Each move is logged with the job
that made it (the job's events, and a tag `lorp.alias.<alias>` on the registered model).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from pipeline.catalog import ranking
from pipeline.tracking.registry import DENSE, existing_versions
from pipeline.tracking.runs import GRID_KEY


def version_records(
    versions: list[ModelVersion], shared: Mapping[tuple[str, str], Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Each version as a row for `pipeline.catalog.ranking`: its row in the shared
    catalog (`shared`: (grid key, run id) -> row) when there is one, else its tags; with
    `version` added."""
    out = []
    for mv in versions:
        key = mv.tags.get(GRID_KEY, "")
        row = shared.get((key, mv.run_id or ""))
        record = dict(row) if row is not None else dict(mv.tags)
        record |= {"grid_key": key, "version": str(mv.version)}
        record.setdefault("rank_by", mv.tags.get("rank_by"))
        out.append(record)
    return out


def wanted_aliases(records: list[dict[str, Any]]) -> dict[str, str]:
    """alias -> version: `dense` at the oldest dense version, and the ranking's `best-*`
    (`pipeline.catalog.ranking.best_rows`)."""
    out = {a: str(r["version"]) for a, r in ranking.best_rows(records).items()}
    dense = [int(r["version"]) for r in records if r.get("method") == DENSE]
    return ({DENSE: str(min(dense))} if dense else {}) | out


def _view(versions: list[ModelVersion]) -> list[tuple[str, str, tuple]]:
    """What the aliases are computed from, to see whether it changed."""
    return sorted((str(v.version), v.run_id or "", tuple(sorted(v.tags.items()))) for v in versions)


@dataclass(frozen=True)
class Move:
    """An alias set (`version`), moved (`previous` another) or removed (`version` None)."""

    alias: str
    version: str | None
    previous: str | None


def move_aliases(
    client: MlflowClient,
    name: str,
    job: str,
    shared: Callable[[], Mapping[tuple[str, str], Mapping[str, Any]]] | None = None,
    attempts: int = 10,
) -> tuple[dict[str, str], list[Move]]:
    """Point `name`'s aliases where the ranking over all its versions says (see the
    module docstring); `shared` reads the shared catalog's rows by (grid key, run id).
    Returns alias -> version and the moves made, each also tagged on the model."""
    moves: list[Move] = []
    for attempt in range(attempts):
        versions = all_versions(client, name)
        wanted = wanted_aliases(version_records(versions, shared() if shared else {}))
        current = {a: str(v) for a, v in client.get_registered_model(name).aliases.items()}
        try:
            for alias in sorted(set(current) | set(wanted)):
                move = _move(client, name, alias, wanted.get(alias), current.get(alias), job)
                if move is not None:
                    moves.append(move)
        except MlflowException:  # another job moved it at the same moment: look again
            time.sleep(0.1 * (1 + attempt) * random.random())
            continue
        if _view(all_versions(client, name)) == _view(versions):
            break
    return wanted, moves


def _move(
    client: MlflowClient, name: str, alias: str, target: str | None, before: str | None, job: str
) -> Move | None:
    """One alias to `target` (None: removed), logged on the model; lorp's aliases only."""
    if target == before or not (alias == DENSE or alias.startswith("best-")):
        return None
    if target is None:
        client.delete_registered_model_alias(name, alias)
    else:
        client.set_registered_model_alias(name, alias, target)
    note = f"v{target} by {job} at {now()}" if target else f"removed by {job} at {now()}"
    client.set_registered_model_tag(name, f"lorp.alias.{alias}", note)
    return Move(alias, target, before)


def now() -> str:
    from datetime import UTC, datetime

    return datetime.now(UTC).isoformat(timespec="seconds")


def all_versions(client: MlflowClient, name: str) -> list[ModelVersion]:
    return list(existing_versions(client, name).values())
