"""Registering a job's checkpoints as MLflow Model Registry versions: what to register
(one entry per saved variant, and the dense model), their tags, and the versions made or
found again.

One registered model per base model, named `lorp-<label>` (the catalog's `model` label with
every character MLflow or a URI would trip on turned into '-'). Each saved checkpoint is a
model version whose `source` is where the checkpoint lives (its directory's file:// URI,
or its URI in the job's remote storage) and whose run is the point's MLflow run, so
multi-GB weights are never copied: a sqlite or file store takes any source as it is. (A
tracking server accepts a local source only inside the run's artifact directory; then the
checkpoint's files are hard-linked there, which copies bytes only across filesystems, or
uploaded when the artifact store is remote.) The dense model is a version too, pointing
at the model's local directory.

Version tags repeat the catalog row (method, options, budget, blocks, RLS, K, stats file,
perplexities, accuracy, speed-up, `degraded`), plus `lorp.grid_key`, which together with the
version's run id is how a rerun finds a version instead of creating it again (tags follow
the row: figures added later, a new `degraded` flag). A point redone under a new run
(`--force`, changed evaluation settings) rewrites the same checkpoint directory, so its
old version, whose run lorp has deleted, is deleted too: one version per directory. The
catalog's `model_uri` column names each row's version.

The aliases over every job's versions are `pipeline.tracking.aliases`'s; reading
a version back (`load_variant`, `lorp pull`) is `pipeline.tracking.registry_loading`'s.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from lorp.atomic import atomic_dir
from pipeline.catalog.protocol import rank_column
from pipeline.spec.names import registry_stem
from pipeline.storage.store import Storage, is_remote
from pipeline.tracking.runs import GRID_KEY

if TYPE_CHECKING:
    from pipeline.plan.grid import GridPoint, ModelPlan

PREFIX = "lorp-"
DENSE = "dense"
TAG_COLUMNS = (
    "job",
    "model",
    "model_ref",
    "family",
    "fingerprint",
    "dtype",
    "n_blocks",
    "method",
    "method_label",
    "variant",
    "options",
    "budget",
    "pruned_layers",
    "kept_layers",
    "rls",
    "k",
    "stats_file",
    "calibration",
    "checkpoint",
    "params",
    "eval_backend",
    "acc_avg",
    "speedup",
    "ppl_ratio",
    "degraded",
    "judged_on",
    "fits_calibration_only",
    "repair",
    "repair_residual",
    "repair_kept",
    "protocol",
    "calibration_id",
    "reference_claim",
    "created_at",
    "storage",
    "granularity",
    "sublayers",
    "experts",
    "expert_method",
    "expert_budget",
    "active_params",
)


def registered_name(label: str) -> str:
    """`lorp-<label>`: letters, digits, '_' and '-' kept, anything else (/, :, @, spaces,
    dots) becomes '-', so the name is valid in MLflow and in a `models:/` URI."""
    return PREFIX + (registry_stem(label) or "model")


def tag_value(value: Any) -> str | None:
    """A catalog value as a version tag: JSON for lists, true/false, repr for floats."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return None
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple | dict):
        return json.dumps(list(value) if not isinstance(value, dict) else value)
    return str(value)


def version_tags(row: Mapping[str, Any], key: str) -> dict[str, str]:
    """The tags of a row's version: the row's columns (`TAG_COLUMNS`, every `ppl_*`) and
    `rank_by`, the column its protocol ranks by."""
    columns = [*TAG_COLUMNS, *sorted(c for c in row if c.startswith("ppl_"))]
    tags = {c: tag_value(row.get(c)) for c in columns} | {"rank_by": rank_column(row)}
    if row.get("sublayers"):  # a Nemotron-NAS checkpoint carries lorp's modelling code
        tags["trust_remote_code"] = "true"
    return {GRID_KEY: key} | {c: v for c, v in tags.items() if v is not None}


# -- what to register ---------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One version a job should have: its identity (grid key, run), source and tags."""

    key: str
    run_id: str
    source: Path | str
    """A local directory, or a checkpoint's location in remote storage."""
    tags: dict[str, str]
    budget: int
    label: str
    in_catalog: bool = True


def source_uri(source: Path | str) -> str:
    """A version's source: a local directory as a file:// URI, a storage URI as it is."""
    text = str(source)
    return text if is_remote(text) else Path(text).resolve().as_uri()


def variant_entry(point: GridPoint, row: Mapping[str, Any]) -> Entry | None:
    """A pruned row's version, when its checkpoint was saved completely (`checkpoints:`
    manifest or full)."""
    ckpt = row.get("checkpoint")
    if not ckpt or not Storage(ckpt).complete() or not row.get("mlflow_run_id"):
        return None
    tags = version_tags(row, point.key)
    return Entry(point.key, row["mlflow_run_id"], ckpt, tags, point.budget, point.label)


def dense_entry(
    job: str, plan: ModelPlan, row: Mapping[str, Any] | None, key: str | None, parent_run: str
) -> Entry:
    """The base model's version: the dense row's run when there is one (evaluation on;
    `key` is its grid key), else the model's parent run; the source is the model's local
    directory."""
    if row is None or key is None:
        row = {
            "job": job,
            "model": plan.label,
            "model_ref": plan.spec.ref,
            "family": plan.family,
            "fingerprint": plan.fingerprint,
            "dtype": plan.spec.dtype,
            "n_blocks": plan.n_blocks,
            "method": DENSE,
            "method_label": DENSE,
            "budget": 0,
            "pruned_layers": [],
            "kept_layers": list(range(plan.n_blocks)),
        }
        key, run_id, in_catalog = f"{DENSE}-{plan.fingerprint}", parent_run, False
    else:
        run_id, in_catalog = row["mlflow_run_id"], True
    tags = version_tags(row, key)
    path = Path(plan.path).resolve()
    return Entry(key, run_id, path, tags, 0, DENSE, in_catalog=in_catalog)


def model_entries(
    job: str,
    points: list[GridPoint],
    rows: Mapping[str, Mapping[str, Any]],
    parent_run: str,
) -> list[Entry]:
    """One model's versions from its points' catalog rows (`rows`: grid key -> row): the
    dense version first, then one per saved variant; nothing without a variant."""
    variants = [variant_entry(p, rows[p.key]) for p in points if not p.is_dense and p.key in rows]
    variants = [v for v in variants if v is not None]
    if not variants:
        return []
    dense = next((p for p in points if p.is_dense and p.key in rows), None)
    row = rows[dense.key] if dense else None
    key = dense.key if dense else None
    return [dense_entry(job, points[0].model, row, key, parent_run), *variants]


# -- registering --------------------------------------------------------------------------


@dataclass(frozen=True)
class Registered:
    """What registering one model's entries did."""

    name: str
    versions: dict[str, str]
    """grid key -> version, for every entry."""
    uris: dict[str, str]
    """grid key -> `models:/<name>/<version>`, for every entry that has a catalog row."""
    created: int


def register_model(client: MlflowClient, plan: ModelPlan, entries: list[Entry]) -> Registered:
    """Versions for `entries` (created, or found again and their tags brought up to
    date). The catalog's `model_uri` is the caller's to write, then the aliases
    (`pipeline.tracking.aliases.move_aliases`)."""
    name = registered_name(plan.label)
    ensure_registered_model(client, name, plan)
    existing = existing_versions(client, name)
    versions: dict[str, str] = {}
    created = 0
    for e in entries:
        mv = existing.get((e.key, e.run_id))
        if mv is None:
            retire_superseded(client, existing, e)
            mv = create_version(client, name, e)
            created += 1
        else:
            sync_tags(client, mv, e.tags)
        versions[e.key] = str(mv.version)
    uris = {e.key: f"models:/{name}/{versions[e.key]}" for e in entries if e.in_catalog}
    return Registered(name, versions, uris, created)


def ensure_registered_model(client: MlflowClient, name: str, plan: ModelPlan) -> None:
    try:
        client.get_registered_model(name)
        return
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
    tags = {"lorp.model": plan.label, "model_ref": plan.spec.ref, "family": plan.family}
    description = f"Depth-pruned variants of {plan.label} ({plan.spec.ref}), made by lorp."
    try:
        client.create_registered_model(name, tags=tags, description=description)
    except MlflowException as exc:  # another job created it first
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise


def existing_versions(client: MlflowClient, name: str) -> dict[tuple[str, str], ModelVersion]:
    """(grid key, run id) -> version, for every version of `name`."""
    found, token = {}, None
    while True:
        page = client.search_model_versions(f"name = '{name}'", max_results=1000, page_token=token)
        for mv in page:
            found[(mv.tags.get(GRID_KEY, ""), mv.run_id or "")] = mv
        token = page.token
        if not token:
            return found


def retire_superseded(
    client: MlflowClient, existing: dict[tuple[str, str], ModelVersion], e: Entry
) -> None:
    """Delete this job's versions that `e` replaces: a point redone (`--force`: same grid
    key, new run) or a slot re-keyed (new evaluation settings) reuses the checkpoint
    directory, so the old version would name files that are no longer its own, and its
    run is already deleted."""
    for (key, run_id), mv in list(existing.items()):
        same_place = mv.source == source_uri(e.source) or key == e.key
        if same_place and mv.tags.get("job") == e.tags.get("job") and run_id != e.run_id:
            client.delete_model_version(mv.name, str(mv.version))
            del existing[(key, run_id)]


def create_version(client: MlflowClient, name: str, e: Entry) -> ModelVersion:
    """A version whose source is the checkpoint directory itself; a tracking server that
    refuses a local source outside the run's artifacts gets the files published there."""
    description = f"{e.label} at budget {e.budget}" if e.budget else "the dense base model"
    try:
        mv = client.create_model_version(
            name, source_uri(e.source), e.run_id, tags=e.tags, description=description
        )
    except MlflowException as exc:
        if "Invalid model version source" not in str(exc):
            raise
        with Storage(str(e.source)).fetched() as path:
            source = publish_checkpoint(client, e.run_id, path)
        mv = client.create_model_version(
            name, source, e.run_id, tags=e.tags, description=description
        )
    if is_manifest_source(str(e.source)):  # says how to get a loadable checkpoint
        how = (
            f"{description}. Stored as a lorp manifest (its base by reference and the "
            f"tensors it changes): `lorp pull models:/{name}/{mv.version} --out DIR` writes "
            "it out as a standard checkpoint."
        )
        mv = client.update_model_version(name, mv.version, description=how)
    return mv


def is_manifest_source(source: str) -> bool:
    """Whether a version's source directory (a local path or storage URI) holds a variant
    manifest (`lorp.models.variant_manifest`) rather than a standard checkpoint."""
    from lorp.models.variant_manifest import MANIFEST_FILE

    storage = Storage(source)
    local = storage.local_path()
    if local is not None:
        return (local / MANIFEST_FILE).is_file()
    return storage.read_bytes(MANIFEST_FILE) is not None


def publish_checkpoint(client: MlflowClient, run_id: str, path: Path) -> str:
    """The checkpoint inside the run's artifacts (`checkpoint/`): hard links when the
    artifact root is a local directory (bytes copied only across filesystems), else an
    upload. Returns the source URI to register."""
    from mlflow.utils.file_utils import local_file_uri_to_path

    artifact_uri = client.get_run(run_id).info.artifact_uri
    if artifact_uri.startswith("file:"):
        dest = Path(local_file_uri_to_path(artifact_uri)) / "checkpoint"
        if not dest.exists():
            with atomic_dir(dest) as tmp:
                shutil.copytree(path, tmp, copy_function=_link_or_copy, dirs_exist_ok=True)
        return dest.as_uri()
    client.log_artifacts(run_id, str(path), "checkpoint")
    return f"runs:/{run_id}/checkpoint"


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def sync_tags(client: MlflowClient, mv: ModelVersion, tags: Mapping[str, str]) -> None:
    """Bring an existing version's tags up to date with its row (speed, quality gate)."""
    for key, value in tags.items():
        if mv.tags.get(key) != value:
            client.set_model_version_tag(mv.name, str(mv.version), key, value)
