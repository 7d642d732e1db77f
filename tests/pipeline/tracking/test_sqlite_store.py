"""A new sqlite tracking store made as a copy of an empty one (`pipeline.tracking.sqlite_store`)
is the store MLflow makes itself, and an existing one is never touched."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipeline.tracking.sqlite_store import empty_store, seed_sqlite_store, sqlite_path


def schema(db: Path) -> dict[str, set]:
    """Every table's columns and every index's columns; the rows of the small tables."""
    with sqlite3.connect(db) as c:
        names = c.execute("SELECT type, name, tbl_name FROM sqlite_master").fetchall()
        out: dict[str, set] = {}
        for kind, name, table in names:
            pragma = "table_info" if kind == "table" else "index_info"
            if kind in ("table", "index"):
                cols = c.execute(f"PRAGMA {pragma}('{name}')").fetchall()
                out[f"{kind}:{name}:{table}"] = {tuple(col) for col in cols}
        out["alembic"] = set(c.execute("SELECT * FROM alembic_version").fetchall())
        out["experiments"] = set(
            c.execute(
                "SELECT experiment_id, name, artifact_location, lifecycle_stage FROM experiments"
            )
        )
    return out


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LORP_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_seeded_store_is_the_store_mlflow_makes(
    here: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (here / "elsewhere").mkdir()
    monkeypatch.chdir(here / "elsewhere")
    empty_store()  # made where another job ran: its Default experiment's location is not ours
    monkeypatch.chdir(here)
    (here / "mlflow").mkdir()
    (here / "seeded").mkdir()
    made, seeded = here / "mlflow" / "m.db", here / "seeded" / "m.db"
    MlflowClient(tracking_uri=f"sqlite:///{made}").search_experiments()
    seed_sqlite_store(f"sqlite:///{seeded}")
    expected = schema(made)
    assert len(expected) > 40  # tables and indexes: the whole schema, not an empty file
    assert schema(seeded) == expected
    (default,) = expected["experiments"]
    assert default == (0, "Default", str(here / "mlruns" / "0"), "active")  # as MLflow sets it here
    client = MlflowClient(tracking_uri=f"sqlite:///{seeded}")  # MLflow opens it, runs in it
    exp = client.create_experiment("job", artifact_location=(here / "art").as_uri())
    run = client.create_run(exp)
    client.log_metric(run.info.run_id, "ppl", 3.5)
    assert client.get_run(run.info.run_id).data.metrics == {"ppl": 3.5}
    assert not list((here / "seeded").glob(".*partial"))


def test_an_existing_store_and_other_stores_are_left_to_mlflow(here: Path) -> None:
    existing = here / "old.db"
    existing.write_bytes(b"not a store lorp would overwrite")
    seed_sqlite_store(f"sqlite:///{existing}")
    assert existing.read_bytes() == b"not a store lorp would overwrite"
    assert sqlite_path("http://127.0.0.1:5000") is None
    assert sqlite_path("sqlite:///:memory:") is None
    assert sqlite_path(f"sqlite:///{existing}") == existing
    seed_sqlite_store(f"sqlite:///{here / 'absent' / 'm.db'}")  # no directory: MLflow's to say
    assert not (here / "absent").exists()
    assert not (here / "cache").exists()  # nothing made for stores it does not seed


def test_the_empty_store_is_made_once_per_mlflow_version(here: Path) -> None:
    first = empty_store()
    stamp = first.stat().st_mtime_ns
    seed_sqlite_store(f"sqlite:///{here / 'a.db'}")
    seed_sqlite_store(f"sqlite:///{here / 'b.db'}")
    assert empty_store() == first and first.stat().st_mtime_ns == stamp
    assert first.parent == here / "cache" / "mlflow" and first.name.startswith("empty-")
    assert schema(here / "a.db") == schema(here / "b.db")
