"""The catalog in MLflow's own terms: the Model Registry, and loading a variant back.

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
old version, whose run lorp has deleted, is deleted too: one version per directory.

Aliases are recomputed when a job ends, over every version of the registered model,
whichever job made it (`pipeline.records.ranking` is the rule): `best-<budget>-<protocol>`
for each protocol, `best-<budget>` for the model's reference protocol, `dense` at the
model's oldest dense version (stable). A version's figures are its row in the shared
catalog when the job has one (`catalog:`), else its own tags, which repeat its row. Two
jobs that end together cannot leave a stale view behind: after moving the aliases a job
reads the versions again and recomputes until nothing changed under it, so whichever job
ends last, the aliases are the same. Each move is logged with the job that made it (the
job's events, and a tag `lorp.alias.<alias>` on the registered model). The catalog's
`model_uri` column names each row's version.

`load_variant` and `pull` read a version back (a checkpoint in remote storage is fetched
to a local directory first, and refused without its completion marker); they live here,
not in `lorp/`, because `lorp/` never imports MLflow.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from lorp.atomic import atomic_dir
from lorp.models.surgery import PROVENANCE_FILE
from pipeline.records import ranking
from pipeline.records.protocol import rank_column
from pipeline.records.tracking import GRID_KEY, redact
from pipeline.storage import Storage, is_remote

if TYPE_CHECKING:
    from pipeline.plan import GridPoint, ModelPlan

PREFIX = "lorp-"
DENSE = "dense"
TAG_COLUMNS = (
    "job", "model", "model_ref", "family", "fingerprint", "dtype", "n_blocks", "method",
    "method_label", "variant", "options", "budget", "pruned_layers", "kept_layers", "rls",
    "k", "stats_file", "calibration", "checkpoint", "params", "eval_backend", "acc_avg",
    "speedup", "ppl_ratio", "degraded", "judged_on", "fits_calibration_only", "repair",
    "repair_residual", "repair_kept", "protocol", "calibration_id", "reference_claim",
    "created_at", "storage",
)  # fmt: skip


def registered_name(label: str) -> str:
    """`lorp-<label>`: letters, digits, '_' and '-' kept, anything else (/, :, @, spaces,
    dots) becomes '-', so the name is valid in MLflow and in a `models:/` URI."""
    stem = re.sub(r"[^A-Za-z0-9_-]+", "-", label).strip("-")
    return PREFIX + (stem or "model")


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
    """A pruned row's version, when its checkpoint was saved completely (save_checkpoints)."""
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
            "job": job, "model": plan.label, "model_ref": plan.spec.ref,
            "family": plan.family, "fingerprint": plan.fingerprint, "dtype": plan.spec.dtype,
            "n_blocks": plan.n_blocks, "method": DENSE, "method_label": DENSE, "budget": 0,
            "pruned_layers": [], "kept_layers": list(range(plan.n_blocks)),
        }  # fmt: skip
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
    date). The catalog's `model_uri` is the caller's to write, then `move_aliases`."""
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
        return client.create_model_version(
            name, source_uri(e.source), e.run_id, tags=e.tags, description=description
        )
    except MlflowException as exc:
        if "Invalid model version source" not in str(exc):
            raise
    with Storage(str(e.source)).fetched() as path:
        source = publish_checkpoint(client, e.run_id, path)
    return client.create_model_version(name, source, e.run_id, tags=e.tags, description=description)


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


def version_records(
    versions: list[ModelVersion], shared: Mapping[tuple[str, str], Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Each version as a row for `pipeline.records.ranking`: its row in the shared
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
    (`pipeline.records.ranking.wanted_aliases`)."""
    out = {a: str(r["version"]) for a, r in ranking.wanted_aliases(records).items()}
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


# -- reading a version back ---------------------------------------------------------------

URI_FORMS = "models:/<name>/<version> or models:/<name>@<alias>"


def parse_models_uri(uri: str) -> tuple[str, str | None, str | None]:
    """(name, version, alias) of `models:/<name>/<version>` or `models:/<name>@<alias>`."""
    m = re.fullmatch(r"models:/([^/@]+)(?:/(\d+)|@([\w-]+))/?", uri.strip())
    if not m:
        raise ValueError(f"not a model version URI: {uri!r} (expected {URI_FORMS})")
    return m.group(1), m.group(2), m.group(3)


def store_uri(tracking_uri: str | None) -> str:
    """`tracking_uri`, else MLFLOW_TRACKING_URI; never MLflow's default (a new
    ./mlflow.db), which would hide a missing setting behind an empty registry."""
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise ValueError("no tracking URI: pass --tracking-uri or set MLFLOW_TRACKING_URI")
    return uri


def resolve_version(client: MlflowClient, uri: str, store: str) -> ModelVersion:
    """The model version a `models:/` URI names in `store` (an alias resolves to its
    version)."""
    name, version, alias = parse_models_uri(uri)
    try:
        if alias is not None:
            return client.get_model_version_by_alias(name, alias)
        return client.get_model_version(name, version)
    except MlflowException as exc:
        if exc.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            raise
        cause = str(exc).splitlines()[0]
        raise ValueError(f"{uri!r} not found in {redact(store)}: {cause}") from None


@contextmanager
def version_files(client: MlflowClient, mv: ModelVersion, store: str) -> Iterator[Path]:
    """The directory holding a version's files: the checkpoint itself for a local source
    (nothing copied), else a temporary copy (from the job's storage, or MLflow's artifact
    store), removed on exit."""
    from mlflow.artifacts import download_artifacts
    from mlflow.utils.file_utils import local_file_uri_to_path

    source = client.get_model_version_download_uri(mv.name, str(mv.version))
    if source.startswith("file:") or os.path.isabs(source):
        path = Path(local_file_uri_to_path(source))
        if not path.is_dir():
            raise FileNotFoundError(f"version {mv.name}/{mv.version}: {str(path)!r} is gone")
        yield path
        return
    if is_remote(source) and Storage(source).complete():  # a checkpoint lorp stored
        with Storage(source).fetched() as path:
            yield path
        return
    with tempfile.TemporaryDirectory(prefix="lorp-pull-") as tmp:
        got = download_artifacts(source, dst_path=tmp, tracking_uri=store)
        yield Path(got)


def check_provenance(path: Path, mv: ModelVersion) -> dict[str, Any] | None:
    """The checkpoint's `lorp_pruning.json`, checked against the version's tags: a
    checkpoint redone since it was registered no longer matches and is refused."""
    file = path / PROVENANCE_FILE
    prov = json.loads(file.read_text()) if file.is_file() else None
    if mv.tags.get("method") == DENSE:  # a base model may be an earlier lorp checkpoint
        return prov
    want = mv.tags.get("pruned_layers")
    have = (prov or {}).get("pruned", [])
    if want is not None and json.loads(want) != have:
        raise ValueError(
            f"{mv.name}/{mv.version}: {str(path)!r} prunes {have}, the version says {want}"
        )
    if prov and mv.tags.get(GRID_KEY) not in (None, prov.get("grid_key")):
        raise ValueError(f"{mv.name}/{mv.version}: {str(path)!r} is another grid point's")
    return prov


@dataclass
class Variant:
    """A registered version, loaded: the transformers model and tokenizer, the version and
    the checkpoint's `lorp_pruning.json` (None for a dense model that has none)."""

    model: Any
    tokenizer: Any
    version: ModelVersion
    provenance: dict[str, Any] | None


def load_variant(uri: str, *, tracking_uri: str | None = None, **kwargs: Any) -> Variant:
    """Load `models:/<name>@best-8` (or `models:/<name>/<version>`) as a transformers model
    and tokenizer; `kwargs` go to `from_pretrained` (dtype, device_map, ...)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    store = store_uri(tracking_uri)
    client = MlflowClient(tracking_uri=store, registry_uri=store)
    mv = resolve_version(client, uri, store)
    with version_files(client, mv, store) as path:
        prov = check_provenance(path, mv)
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(path)
    return Variant(model.eval(), tokenizer, mv, prov)


def pull(uri: str, out: str | os.PathLike[str], *, tracking_uri: str | None = None,
         overwrite: bool = False) -> tuple[Path, ModelVersion]:  # fmt: skip
    """Copy the checkpoint directory a version points at into `out`, atomically."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise ValueError(f"--out {str(out)!r} already exists (pass --overwrite to replace it)")
    store = store_uri(tracking_uri)
    client = MlflowClient(tracking_uri=store, registry_uri=store)
    mv = resolve_version(client, uri, store)
    with version_files(client, mv, store) as path:
        check_provenance(path, mv)
        with atomic_dir(out, overwrite=overwrite) as tmp:
            shutil.copytree(path, tmp, dirs_exist_ok=True)
    return out, mv
