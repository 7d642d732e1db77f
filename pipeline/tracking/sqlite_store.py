"""A new sqlite tracking store, made as a copy of an empty one.

MLflow makes a sqlite store by running every one of its schema migrations (about 70, some
1,700 statements, each its own transaction): about a second of CPU, and on a busy disk
ten seconds or more, for every new run directory a job or a test starts. The result is
the same file each time for one MLflow version, so lorp migrates an empty store once per
version into the cache (`$LORP_CACHE/mlflow/`) and copies it. The one row that depends on
where it was made, the Default experiment's artifact location, is set as MLflow sets it
(the store's default artifact root, `./mlruns` resolved here, then `/0`); its times are
now. An existing store is never touched: MLflow opens it and migrates it as ever.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import tempfile
import time
from pathlib import Path

from lorp.cache import cache_root

DEFAULT_EXPERIMENT = "0"
SERVER_ARTIFACT_ROOT = "_MLFLOW_SERVER_ARTIFACT_ROOT"
"""Where MLflow takes the root from inside a tracking server's process (as MLflow does)."""


def sqlite_path(uri: str) -> Path | None:
    """The file of a `sqlite:///` tracking URI, SQLAlchemy's form: `sqlite:///rel.db`,
    `sqlite:////abs.db` (None: another kind of store, or one in memory)."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix):
        return None
    path = uri[len(prefix) :].split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


def seed_sqlite_store(uri: str) -> None:
    """Where `uri` is a sqlite store that does not exist yet, make it from the empty store
    of this MLflow version (made once, in the cache); anything else is left to MLflow."""
    path = sqlite_path(uri)
    if path is None or path.exists() or not path.parent.is_dir():
        return
    template = empty_store()
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    shutil.copyfile(template, partial)
    _set_default_experiment(partial)
    try:
        os.link(partial, path)  # never over a store another process made meanwhile
    except FileExistsError:
        pass
    finally:
        partial.unlink()


def empty_store() -> Path:
    """The migrated empty store of this MLflow version, made once per cache."""
    import mlflow

    template = cache_root() / "mlflow" / f"empty-{mlflow.__version__}.db"
    if template.is_file():
        return template
    template.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=template.parent) as tmp:
        made = Path(tmp) / "empty.db"
        from mlflow.tracking import MlflowClient

        MlflowClient(tracking_uri=f"sqlite:///{made}").search_experiments()
        os.replace(made, template)  # atomic: a reader sees no store or a whole one
    return template


def _set_default_experiment(store: Path) -> None:
    """The Default experiment as MLflow would have made it here, now."""
    from mlflow.store.tracking import DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH
    from mlflow.utils.uri import append_to_uri_path, resolve_uri_if_local

    root = resolve_uri_if_local(
        os.environ.get(SERVER_ARTIFACT_ROOT, DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH)
    )
    location = append_to_uri_path(root, DEFAULT_EXPERIMENT)
    now = int(time.time() * 1000)
    with sqlite3.connect(store) as db:
        db.execute(
            "UPDATE experiments SET artifact_location = ?, creation_time = ?,"
            " last_update_time = ? WHERE experiment_id = ?",
            (location, now, now, int(DEFAULT_EXPERIMENT)),
        )
    db.close()
