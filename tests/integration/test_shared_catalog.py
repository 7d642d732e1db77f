"""One catalog for the organisation, on real components: a `mlflow server` process
(tracking and registry over HTTP, its own backend store and artifact root) shared by two
jobs that run at once (two `lorp run` processes on one local Ray), both publishing to one
shared catalog directory, with different evaluation protocols and methods. The aliases
are checked by value against the rows, and again after each job is rerun last."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from pipeline.catalog.shared import SharedCatalog, open_catalog
from pipeline.driver.run import run_job
from pipeline.events.log import read_events
from pipeline.spec.parse import parse_spec
from tests.helpers.cli_runner import lorp
from tests.helpers.job_specs import tiny_job, write_job
from tests.helpers.local_servers import (
    AWS_TEST_ENV,
    create_bucket,
    free_port,
    s3_location,
    start_moto,
    wait_for_port,
)
from tests.helpers.ray_cluster import local_ray
from tests.helpers.tiny_models import save_tiny_ptb

pytestmark = [pytest.mark.integration]

NAME = "lorp-tiny"


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> str:  # type: ignore[no-untyped-def]
    """`mlflow server` with a sqlite backend and a served artifact root, on loopback."""
    root = tmp_path_factory.mktemp("server")
    port = free_port()
    log = root / "server.log"
    cmd = [
        str(Path(sys.executable).parent / "mlflow"),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--backend-store-uri",
        f"sqlite:///{root / 'backend.db'}",
        "--artifacts-destination",
        str(root / "artifacts"),
    ]
    env = os.environ | {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no huey workers
    proc = subprocess.Popen(
        cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True, env=env
    )
    wait_for_port(port, proc, log, "mlflow server")
    yield f"http://127.0.0.1:{port}"
    os.killpg(proc.pid, signal.SIGTERM)  # the server and its uvicorn worker
    proc.wait(timeout=30)


def raw_job(root: Path, model: Path, name: str, seq_len: int, methods: list[str]) -> dict:  # type: ignore[type-arg]
    evaluation = {"perplexity": ["ptb"], "seq_len": seq_len, "max_windows": 2, "speed": False}
    spec = tiny_job(root, model, name=name, budgets=[1, 2], evaluation=evaluation)
    spec["methods"] = [{"name": m} for m in methods]
    spec["calibration"] |= {"samples": 8, "shards": 1, "batch_size": 4}  # one capture worker
    spec["storage"] = str(root / f"storage-{name}")
    spec["catalog"] = str(root / "shared")
    spec["cache_dir"] = str(root / "cache")
    return spec


@pytest.fixture(scope="module")
def fleet(server: str, tmp_path_factory) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """Two jobs at once, each a `lorp run` process of its own joining one local Ray:
    `a` measures perplexity on 48-token windows with lorp and shortgpt, `b` on 32-token
    windows with shortgpt and angular."""
    root = tmp_path_factory.mktemp("org")
    model = save_tiny_ptb("llama", root / "model")
    raw = {
        "a": raw_job(root, model, "team-a", 48, ["lorp", "shortgpt"]),
        "b": raw_job(root, model, "team-b", 32, ["shortgpt", "angular"]),
    }
    specs = {k: parse_spec(v) for k, v in raw.items()}
    with local_ray() as context:  # the two jobs join it through RAY_ADDRESS
        env = os.environ | {
            "MLFLOW_TRACKING_URI": server,
            "RAY_ADDRESS": context.address_info["gcs_address"],
        }
        lorp_bin = str(Path(sys.executable).parent / "lorp")
        procs = {
            k: subprocess.Popen(
                [lorp_bin, "run", str(write_job(root, raw[k])), "-q"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for k in specs
        }
        outputs = {k: p.communicate(timeout=600)[0] for k, p in procs.items()}
        codes = {k: p.returncode for k, p in procs.items()}
        yield {
            "root": root,
            "model": model,
            "specs": specs,
            "outputs": outputs,
            "codes": codes,
            "server": server,
        }


def aliases(server: str) -> dict[str, str]:
    client = MlflowClient(tracking_uri=server, registry_uri=server)
    return {a: str(v) for a, v in client.get_registered_model(NAME).aliases.items()}


def expected(rows: list[dict[str, Any]]) -> dict[str, str]:
    """The alias rule by brute force over the rows: per protocol and budget the lowest
    ppl_ptb of the non-degraded variants, ties to the first method label (shortgpt and
    angular often remove the same blocks); `best-<b>` in the protocol of the oldest row."""
    version = {r["grid_key"]: r["model_uri"].rsplit("/", 1)[1] for r in rows}
    reference = min(rows, key=lambda r: r["created_at"])["protocol"]
    out = {}
    for p in {r["protocol"] for r in rows}:
        for b in (1, 2):
            ok = [r for r in rows if r["protocol"] == p and r["budget"] == b and not r["degraded"]]
            if ok:
                best = min(ok, key=lambda r: (r["ppl_ptb"], r["method_label"]))
                out[f"best-{b}-{p}"] = version[best["grid_key"]]
                if p == reference:
                    out[f"best-{b}"] = version[best["grid_key"]]
    return out


def test_two_jobs_at_once_share_one_catalog_and_one_server(fleet) -> None:  # type: ignore[no-untyped-def]
    specs = fleet["specs"]
    for key, out in fleet["outputs"].items():
        assert fleet["codes"][key] == 0, out
        assert "grid points  5 done, 0 already done, 0 failed" in out  # dense + 2 x 2
    rows = open_catalog(str(fleet["root"] / "shared"))
    assert len(rows) == 10
    assert len({(r["job"], r["grid_key"]) for r in rows}) == 10
    spans = []
    for spec in specs.values():
        own = open_catalog(spec.output_dir)
        events = read_events(Path(spec.output_dir) / "events.jsonl")
        spans.append([e["time"] for e in events if e["event"] in ("start", "end")])
        mine = [r for r in rows if r["job"] == spec.name]
        assert sorted(r["grid_key"] for r in mine) == sorted(r["grid_key"] for r in own)
    assert spans[0][0] < spans[1][-1] and spans[1][0] < spans[0][-1]  # they overlapped
    by_job = {j: {r["protocol"] for r in rows if r["job"] == j} for j in {r["job"] for r in rows}}
    assert all(len(p) == 1 for p in by_job.values())
    assert by_job["team-a"] != by_job["team-b"]
    assert all(r["model_uri"] and r["storage"] for r in rows)
    assert aliases(fleet["server"]) | {"dense": "-"} == expected(rows) | {"dense": "-"}
    dense = [r for r in rows if r["method"] == "dense"]
    assert aliases(fleet["server"])["dense"] == str(
        min(int(r["model_uri"].rsplit("/", 1)[1]) for r in dense)
    )
    status = lorp("status", specs["a"].output_dir).stdout
    a_protocol = by_job["team-a"].pop()
    assert f"protocol     {a_protocol} (calibration ptb-" in status
    assert f"shared catalog {fleet['root'] / 'shared'}" in status


def test_catalog_ls_and_best_agree_with_the_aliases(fleet) -> None:  # type: ignore[no-untyped-def]
    shared = str(fleet["root"] / "shared")
    out = lorp("catalog", "ls", shared, "--json")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(rows) == 10 and all("protocol" in r for r in rows)
    some = lorp("catalog", "ls", shared, "--json", "--method", "shortgpt", "--budget", "2")
    assert [json.loads(x)["method"] for x in some.stdout.splitlines()] == ["shortgpt"] * 2
    now = aliases(fleet["server"])
    by_version = {r["model_uri"].rsplit("/", 1)[1]: r for r in rows}
    for alias, version in now.items():
        if not alias.startswith("best-"):
            continue
        parts = alias.split("-", 2)
        args = ["catalog", "best", shared, "--model", "tiny", "--budget", parts[1], "--json"]
        if len(parts) == 3:
            args += ["--protocol", parts[2]]
        best = lorp(*args)
        assert best.returncode == 0, best.stderr
        assert json.loads(best.stdout)["grid_key"] == by_version[version]["grid_key"], alias
    bad = lorp("catalog", "best", shared, "--model", "tiny", "--budget", "1", "--protocol", "x")
    assert bad.returncode != 0 and "--protocol: 'x'" in bad.stderr


def test_whichever_job_ends_last_the_aliases_are_the_same(fleet) -> None:  # type: ignore[no-untyped-def]
    """Each job again, alone, so that it ends last: nothing to redo, the aliases are
    recomputed and do not move. Then `b` claims the reference: `best-<b>` follows it."""
    server, specs = fleet["server"], fleet["specs"]
    before = aliases(server)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", server)
        for key in ("b", "a"):
            again = run_job(specs[key])
            assert again.done == 0 and again.skipped == 5
            assert aliases(server) == before, key
        claim = specs["b"].tracking.__class__(reference=True)
        run_job(parse_spec_with(specs["b"], tracking=claim))
    rows = open_catalog(str(fleet["root"] / "shared"))
    b_protocol = {r["protocol"] for r in rows if r["job"] == "team-b"}.pop()
    now = aliases(server)
    for b in (1, 2):
        assert now[f"best-{b}"] == now[f"best-{b}-{b_protocol}"]
    assert all(r["reference_claim"] == (r["job"] == "team-b") for r in rows)
    client = MlflowClient(tracking_uri=server, registry_uri=server)
    tags = client.get_registered_model(NAME).tags
    assert "by team-" in tags["lorp.alias.best-1"]


def parse_spec_with(spec: Any, **changes: Any) -> Any:
    import dataclasses

    return dataclasses.replace(spec, **changes)


def test_another_job_of_the_same_name_is_another_job(fleet, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Another team's job named like `team-a` (its own run directory and storage) mints
    its own run id: both jobs' rows stay in the shared catalog, each under its own."""
    spec = fleet["specs"]["a"]
    other = parse_spec_with(
        spec, output_dir=str(tmp_path / "run"), storage=str(tmp_path / "their-storage")
    )
    shared = SharedCatalog(str(fleet["root"] / "shared"))
    before = sorted((r["run_id"], r["grid_key"], r["ppl_ptb"]) for r in shared.rows_of("team-a"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", fleet["server"])
        summary = run_job(other)
    assert summary.done == 5 and not summary.failed
    rows = shared.rows_of("team-a")
    ours = json.loads((tmp_path / "their-storage" / "lorp_run.json").read_text())["run_id"]
    assert (
        sorted((r["run_id"], r["grid_key"], r["ppl_ptb"]) for r in rows if r["run_id"] != ours)
        == before
    )
    theirs = [r for r in rows if r["run_id"] == ours]
    assert len(theirs) == 5 and {r["storage"] for r in theirs} == {
        str((tmp_path / "their-storage").resolve())
    }
    assert len({r["run_id"] for r in rows}) == 2


def test_a_new_storage_gets_every_point(fleet, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The same job (same output_dir, its working copy left there) with `storage:`
    changed: nothing is skipped as done elsewhere; every point lands in the new one."""
    spec = fleet["specs"]["a"]
    moved = parse_spec_with(spec, storage=str(tmp_path / "new-storage"), catalog=None)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", fleet["server"])
        summary = run_job(moved)
    assert summary.done == 5 and summary.skipped == 0 and not summary.failed
    rows = open_catalog(str(tmp_path / "new-storage"))
    assert len(rows) == 5
    for r in rows:
        assert r["storage"] == str((tmp_path / "new-storage").resolve())
        if r["method"] != "dense":
            assert Path(r["checkpoint"]).is_dir()
            assert r["checkpoint"].startswith(r["storage"])
    first = json.loads((Path(spec.storage) / "lorp_run.json").read_text())["run_id"]
    old = SharedCatalog(str(fleet["root"] / "shared")).read()
    assert {r["storage"] for r in old if r["run_id"] == first} == {
        str(Path(spec.storage).resolve())
    }  # the shared catalog was not named: the first storage's rows stand


def test_a_catalog_unreachable_at_the_start_never_stops_the_job(  # type: ignore[no-untyped-def]
    fleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job whose shared catalog is an S3 endpoint nothing serves: every point lands in
    its own catalog (it was a traceback after 60 s); with the endpoint served, its next
    start publishes all of them."""
    port = free_port()
    for key, value in AWS_TEST_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", fleet["server"])
    spec = parse_spec_with(
        fleet["specs"]["a"],
        name="team-c",
        output_dir=str(tmp_path / "run"),
        storage=str(tmp_path / "storage"),
        catalog=s3_location(port, "org", "catalog"),
    )
    summary = run_job(spec)
    assert summary.done == 5 and not summary.failed
    own = sorted(r["grid_key"] for r in open_catalog(str(tmp_path / "storage")))
    assert len(own) == 5
    moto = start_moto(port, tmp_path / "moto.log")
    try:
        create_bucket(port, "org")
        again = run_job(spec)
        assert again.done == 0 and again.skipped == 5
        shared = SharedCatalog(spec.catalog)
        assert sorted(r["grid_key"] for r in shared.rows_of("team-c")) == own
        assert {r["run_id"] for r in shared.rows_of("team-c")} == {
            json.loads((tmp_path / "storage" / "lorp_run.json").read_text())["run_id"]
        }
    finally:
        moto.terminate()
        moto.wait(timeout=30)
