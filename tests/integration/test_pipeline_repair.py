"""Linear repair as a grid dimension: sums on Ray capture workers, fit and fold in the
point's task, and the repaired twin everywhere a variant shows (catalog, checkpoint,
provenance, MLflow, registry), on a real local Ray and sqlite MLflow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from transformers import AutoModelForCausalLM, AutoTokenizer

from lorp.models.perplexity import calibration_loss
from lorp.models.surgery import drop_layers
from lorp.repair.capture import capture_repair_stats
from lorp.repair.fit import fit_runs
from lorp.repair.fold import fold
from lorp.repair.followers import fit_followers, follower_blocks
from lorp.repair.maps import RIDGES
from lorp.repair.stats import contiguous_runs
from pipeline.catalog.table import read_catalog
from pipeline.cluster.faults import FAULT_MARKER_ENV, SITE_ENV
from pipeline.driver.run import run_job
from pipeline.events.log import EventLog
from pipeline.events.status import format_status, run_status
from pipeline.spec.parse import parse_spec
from pipeline.stages.calibration import heldout_windows, read_shard
from tests.helpers.job_specs import tiny_job
from tests.helpers.ray_cluster import local_ray
from tests.helpers.tiny_models import save_tiny_ptb

pytestmark = [pytest.mark.integration]


def test_repaired_twins_are_made_from_ray_sums_and_recorded_everywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma 3 (a norm after the MLP: the orthogonal fold, 1 + w weights, tied
    embeddings). A repair worker dies on its first shard and is retried; the repaired
    checkpoint still equals the dense model repaired in one process from the same
    windows, so the sharded, retried sums are exactly one pass's."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv(SITE_ENV["repair"], "shard-0000.parquet")
    monkeypatch.setenv(FAULT_MARKER_ENV, str(tmp_path / "fault"))
    model = save_tiny_ptb("gemma3_text", tmp_path / "gemma3")
    spec = tiny_job(
        tmp_path,
        model,
        "repair",
        budgets=[2],
        methods=[
            {"name": "shortgpt"},
            {"name": "streamline"},
            {"name": "window"},
            {"name": "window", "label": "window-loss", "options": {"score": "loss"}},
        ],
        repair=["none", "linear"],
        evaluation={"perplexity": ["ptb"], "seq_len": 48, "max_windows": 2, "speed": False},
        ray={"num_cpus": 2},
        checkpoints="full",  # each variant's config and weights read back below
    )
    with local_ray():
        summary = run_job(parse_spec(spec))
        again = run_job(parse_spec(spec))
    assert summary.done == 9 and not summary.failed and not summary.refused
    assert (tmp_path / "fault.repair").is_file()  # the worker did die once

    run_dir = tmp_path / "repair"
    rows = {r["method_label"]: r for r in read_catalog(run_dir / "catalog")}
    assert sorted(rows) == [
        "dense",
        "shortgpt",
        "shortgpt+linear",
        "streamline",
        "streamline+linear",
        "window",
        "window+linear",
        "window-loss",
        "window-loss+linear",
    ]
    # The window methods ranked their 3 candidate runs from one pass of sums (the second
    # from its cache); the repaired points then needed only the runs those sums lack,
    # deduplicated across methods.
    log = EventLog(run_dir / "events.jsonl").read()
    second = [i for i, e in enumerate(log) if e["event"] == "start"][1]
    events, later = log[:second], log[second:]
    ranked = [e for e in events if e["event"] == "repair_scores"]
    assert [(e["runs"], e["source"]) for e in ranked] == [(3, "computed"), (3, "cache")]
    candidates = {(1, 2), (2, 3), (3, 4)}
    scores = _window_scores(rows["window"])
    best = min(candidates, key=lambda r: (scores[r[0]], r[0]))
    assert _runs(rows["window"]["pruned_layers"]) == [best]
    # By loss: the lowest held-out loss of the repaired candidates wins, and the winner's
    # loss is its repaired variant's on the job's held-out windows (the run's map, folded
    # as the checkpoint folds it; followers come after the choice).
    losses = _window_scores(rows["window-loss"], "window_loss")
    best = min(candidates, key=lambda r: (losses[r[0]], r[0]))
    assert _runs(rows["window-loss"]["pruned_layers"]) == [best]
    held = heldout_windows(
        AutoTokenizer.from_pretrained(model), parse_spec(spec).calibration
    ).windows
    held = torch.from_numpy(held).long()
    windows = torch.cat(
        [read_shard(p) for p in sorted((run_dir / "calibration").glob("*/shard-*.parquet"))]
    )
    fits = json.loads(rows["window-loss+linear"]["repair_fits"])
    variant = _repaired(model, windows, held, fits, list(range(best[0], best[1] + 1)), 0)
    gate = fits[0]["gate"]
    if gate["kept"] == "unrepaired":  # the gate found the run's map within the noise: none
        unrepaired = gate["losses"]["unrepaired"]["prose"]
        assert calibration_loss(variant, held) == pytest.approx(unrepaired, rel=1e-4)
        assert gate["losses"]["runs only"]["prose"] == pytest.approx(losses[best[0]], rel=1e-4)
    else:
        assert losses[best[0]] == pytest.approx(calibration_loss(variant, held), rel=1e-4)
    needed = {
        r
        for m in ("shortgpt", "streamline", "window", "window-loss")
        for r in _runs(rows[m]["pruned_layers"])
    }
    captures = [e for e in events if e["event"] == "repair_capture"]
    assert [sorted(tuple(r) for r in e["runs"]) for e in captures] == (
        [sorted(needed - candidates)] if needed - candidates else []
    )
    assert all(e["source"] == "computed" and e["passes"] == 1 for e in captures)

    followed = 0
    for method in ("shortgpt", "streamline", "window", "window-loss"):
        twin, repaired = rows[method], rows[f"{method}+linear"]
        assert (twin["repair"], repaired["repair"]) == ("none", "linear")
        assert repaired["pruned_layers"] == twin["pruned_layers"]
        assert repaired["params"] == twin["params"] < twin["params_dense"]
        config = lambda r: json.loads(Path(r["checkpoint"], "config.json").read_text())  # noqa: E731
        assert config(repaired) == config(twin)
        records = json.loads(repaired["repair_fits"])
        fits = [f for f in records if "follower" not in f]
        followers = [f for f in records if "follower" in f]
        runs = _runs(twin["pruned_layers"])
        assert [tuple(f["run"]) for f in fits] == [tuple(r) for r in runs]
        # one follower (the job's default) on the kept block after each cut that has one,
        # in the records where the gate kept the maps with followers
        gate = records[0]["gate"]
        fitted = follower_blocks(6, twin["pruned_layers"], 1)
        kept_followers = gate["kept"] == "least squares"
        assert [f["follower"] for f in followers] == (fitted if kept_followers else [])
        followed += len(fitted)
        for f in records:  # validated on the held-out windows: never worse than unrepaired there
            assert f["form"] == "normed" and f["ridge"] in RIDGES
            assert f["held_residual"] <= f["held_unrepaired_residual"]
            assert f["ridges_tried"][f"{f['ridge']:g}"] == min(f["ridges_tried"].values())
            if f["kept"] == "fit":
                assert 0 <= f["residual"] < f["unrepaired_residual"]
            else:
                assert f["residual"] == f["unrepaired_residual"]
        assert repaired["repair_residual"] == max(f["residual"] for f in fits)
        kept = f"{sum(f['kept'] == 'fit' for f in fits)}/{len(fits)} runs"
        if followers:
            kept += f", {sum(f['kept'] == 'fit' for f in followers)}/{len(followers)} followers"
        # the gate: the kept maps' held-out loss is no worse than the unrepaired twin's
        tried = gate["tried"]
        assert tried == (["least squares", "runs only"] if fitted else ["runs only"])
        if gate["kept"] != tried[0]:
            kept += f"; gate kept {gate['kept']} (held-out loss per domain)"
        assert repaired["repair_kept"] == kept and repaired["repair_gate"] == gate["kept"]
        base = gate["losses"]["unrepaired"]["prose"]
        assert gate["losses"].get(gate["kept"], gate["losses"]["unrepaired"])["prose"] <= base
        _gate_losses_are_the_checkpoints(held, twin, repaired, gate)
        prov = json.loads(Path(repaired["checkpoint"], "lorp_pruning.json").read_text())
        assert prov["repair"]["method"] == "linear" and prov["repair"]["runs"] == records
        assert (
            json.loads(Path(twin["checkpoint"], "lorp_pruning.json").read_text())["repair"] is None
        )
        _same_logits(model, windows, held, records, twin["pruned_layers"], repaired)
    assert followed >= 2  # the windows inside the stack have one
    client = MlflowClient(summary.tracking_uri)
    run = client.get_run(rows["shortgpt+linear"]["mlflow_run_id"])
    assert run.data.params["repair"] == "linear" and run.info.run_name == "shortgpt+linear-b2"
    versions = client.search_model_versions("name='lorp-tiny'")
    tags = {v.tags["method_label"]: v.tags for v in versions}
    assert tags["streamline+linear"]["repair"] == "linear"
    assert float(tags["streamline+linear"]["repair_residual"]) == pytest.approx(
        rows["streamline+linear"]["repair_residual"]
    )

    status = format_status(run_status(run_dir))
    assert "repair       4 repaired variant(s) beside 4 pruned" in status

    # A rerun does nothing: the windows' scores come from the cached sums and losses,
    # and no repaired point is left to need any.
    assert (again.done, again.skipped) == (0, 9)
    assert not [e for e in later if e["event"] == "repair_capture"]
    assert [e["source"] for e in later if e["event"] == "repair_scores"] == ["cache"] * 2


def test_distilled_maps_are_what_the_checkpoint_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`repair_distill` (here one method's): the point distils its run's map and its
    follower's together on
    the model's calibration windows; the record says so per map, the checkpoint's KL to
    the dense model on the held-out windows is the record's best epoch's, below the
    least-squares maps' (the bf16 steps' figures, so within a few percent), and the row
    and the provenance say what was kept."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    model = save_tiny_ptb("qwen2", tmp_path / "qwen2")
    spec = tiny_job(
        tmp_path,
        model,
        "distill",
        budgets=[2],
        methods=[{"name": "shortgpt", "repair_distill": 3}, {"name": "streamline"}],
        repair=["linear"],
        repair_distill_lr=3e-3,
        repair_gate=False,
        evaluation={"perplexity": ["ptb"], "seq_len": 48, "max_windows": 2, "speed": False},
        ray={"num_cpus": 2},
        checkpoints="full",
    )
    with local_ray():
        summary = run_job(parse_spec(spec))
    assert summary.done == 3 and not summary.failed
    rows = {r["method_label"]: r for r in read_catalog(tmp_path / "distill" / "catalog")}
    row = rows["shortgpt+linear"]  # distilled: the method asks for it
    assert all("distilled" not in f for f in json.loads(rows["streamline+linear"]["repair_fits"]))
    records = json.loads(row["repair_fits"])
    assert len(records) == 2 and "follower" in records[1]  # the run's map and its follower
    distilled = records[0]["distilled"]
    assert all(f["distilled"] == distilled for f in records)
    assert distilled["epochs"] == 3 and len(distilled["held_kl"]) == 4
    best = distilled["best_epoch"]
    assert best >= 1 and [f["kept"] for f in records] == ["distilled"] * 2
    assert distilled["held_kl"][best] < distilled["held_kl"][0]
    assert row["repair_kept"] == f"1/1 runs, 1/1 followers; distilled, epoch {best} of 3"
    prov = json.loads(Path(row["checkpoint"], "lorp_pruning.json").read_text())
    assert prov["repair"]["distill"]["epochs"] == 3 and prov["repair"]["runs"] == records

    held = heldout_windows(
        AutoTokenizer.from_pretrained(model), parse_spec(spec).calibration
    ).windows
    held = torch.from_numpy(held).long()
    dense = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    got = AutoModelForCausalLM.from_pretrained(row["checkpoint"], dtype=torch.float32).eval()
    with torch.no_grad():
        p = torch.log_softmax(dense(held).logits, -1)
        q = torch.log_softmax(got(held).logits, -1)
    kl = float((p.exp() * (p - q)).sum(-1).mean())
    assert kl == pytest.approx(distilled["held_kl"][best], rel=0.05)


def _runs(layers: list[int]) -> list[tuple[int, int]]:
    return contiguous_runs(layers, 6)


def _window_scores(row: dict, key: str = "window_residual") -> dict[int, float]:
    """The window method's score per start, as its checkpoint's provenance records them."""
    prov = json.loads(Path(row["checkpoint"], "lorp_pruning.json").read_text())
    return {int(s): float(v) for s, v in prov["details"][key].items()}


def _repaired(
    model: Path,
    windows: torch.Tensor,
    held: torch.Tensor,
    records: list[dict],
    layers: list[int],
    followers: int,
) -> torch.nn.Module:
    """The dense model repaired here in one process: each run's map with its recorded
    ridge where the job kept it, then `followers` follower maps validated on `held`."""
    ref = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    batches = [windows[i : i + 4] for i in range(0, len(windows), 4)]
    stats = capture_repair_stats(ref, batches, _runs(layers), progress=False)
    fits = [
        fit_runs(ref, stats.subset([tuple(f["run"])]), ridge=f["ridge"])[0]
        for f in records
        if "follower" not in f and f["kept"] == "fit"
    ]
    fits += fit_followers(ref, fits, layers, windows, held, followers, batch_size=4)
    fold(ref, fits)
    drop_layers(ref, layers)
    return ref


@torch.no_grad()
def _gate_losses_are_the_checkpoints(held, twin, repaired, gate) -> None:  # type: ignore[no-untyped-def]
    """The gate's figures are the saved checkpoints' held-out losses."""
    windows = torch.as_tensor(held).long()
    load = lambda r: AutoModelForCausalLM.from_pretrained(r["checkpoint"], dtype=torch.float32)  # noqa: E731
    unrepaired = calibration_loss(load(twin).eval(), windows)
    assert unrepaired == pytest.approx(gate["losses"]["unrepaired"]["prose"], rel=1e-4)
    mine = calibration_loss(load(repaired).eval(), windows)
    assert mine <= unrepaired * (1 + 1e-5)
    assert mine == pytest.approx(
        gate["losses"].get(gate["kept"], {"prose": unrepaired})["prose"], rel=1e-4
    )
    assert repaired["repair_held_loss_ratio"] == pytest.approx(mine / unrepaired, rel=1e-3)


def _same_logits(
    model: Path,
    windows: torch.Tensor,
    held: torch.Tensor,
    records: list[dict],
    layers: list[int],
    row: dict,
) -> None:
    """The saved checkpoint's logits equal the dense model's, repaired here in one
    process from the same windows (`_repaired`, with the job's followers)."""
    followers = sum("follower" in f for f in records)
    ref = _repaired(model, windows, held, records, layers, 1 if followers else 0)
    got = AutoModelForCausalLM.from_pretrained(row["checkpoint"], dtype=torch.float32).eval()
    ids = windows[:2]
    expect = ref(ids).logits
    assert len(got.model.layers) == 6 - len(layers)
    assert torch.allclose(got(ids).logits, expect, atol=1e-4 * float(expect.abs().max()))
