"""benchmarks/retention.py: each pick evaluated as its row was distilled, and the table
reading the row that was picked."""

from __future__ import annotations

import sys

from tests.helpers.paths import REPO

sys.path.insert(0, str(REPO))

from benchmarks.retention import TASKS, as_picked, distillation, one_job_each, table  # noqa: E402


def test_retention_evaluates_each_pick_as_its_row_was_distilled() -> None:
    """One job per picked method (a job runs every method at every budget), each method
    distilled as its picked row's `repair_fits` say, whatever the spec says today."""
    import dataclasses
    import json

    from pipeline.spec.models import MethodSpec
    from pipeline.spec.parse import load_spec

    spec = load_spec(REPO / "jobs" / "quality.yaml")
    spec = dataclasses.replace(
        spec,
        methods=(
            MethodSpec("streamline", repair_distill=2),
            MethodSpec("window", repair_distill=2),
        ),
    )
    fits = [{"run": [1, 2], "kept": "distilled", "distilled": {"epochs": 3, "lr": 5e-5}}]
    picks = {
        4: {"method_label": "window+linear", "repair": "linear", "repair_fits": json.dumps(fits)},
        8: {"method_label": "streamline+linear", "repair": "linear", "repair_fits": []},
    }
    assert distillation(picks[4]) == (3, 5e-5) and distillation(picks[8]) == (0, None)
    assert [sorted(g) for g in one_job_each(picks)] == [[4], [8]]
    got = as_picked(spec, picks)
    assert [(m.key, m.repair_distill) for m in got.methods] == [("streamline", 0), ("window", 3)]
    assert got.repair_distill_lr == 5e-5


def test_retention_table_reads_the_row_distilled_as_picked() -> None:
    """The retention catalog keeps an earlier, undistilled twin of a pick beside the
    distilled one (another key): the table shows the one that was picked."""
    import json

    acc = {f"acc_{t}": 50.0 for t in TASKS} | {f"n_{t}": 500 for t in TASKS}
    fits = json.dumps([{"run": [1, 2], "distilled": {"epochs": 2, "lr": 1e-4}}])
    dense = {"method": "dense", "method_label": "dense", "budget": 0, **acc}
    old = {
        "method": "window",
        "method_label": "window+linear",
        "budget": 4,
        "n_blocks": 30,
        **acc,
        "acc_arc_easy": 30.0,
        "created_at": "2026-12-01",
    }
    new = old | {"acc_arc_easy": 40.0, "repair_fits": fits, "created_at": "2026-12-02"}
    for rows in ([dense, new, old], [dense, old, new]):
        line = table("m", {4: new}, rows)[-1]
        assert line.startswith("| window+linear @ 4/30 | 40.0 (80.0 ± ")
    assert table("m", {4: old}, [dense, new, old])[-1].startswith("| window+linear @ 4/30 | 30.0")


def test_a_peer_pick_keeps_its_own_repair_and_is_not_distilled() -> None:
    """A peer recipe's row (`repair` its own, e.g. cosine-map) makes a job whose points
    take that repair whatever the job's `repair` says: the job's is `none`, and its entry
    is left as `jobs/quality.yaml` has it."""
    from benchmarks.retention import retention_spec

    picks = {4: {"method_label": "replaceme+cosine-map", "repair": "cosine-map"}}
    spec = retention_spec("smollm2-135m", picks, None, "/tmp/unused")
    assert [m.key for m in spec.methods] == ["replaceme"] and spec.repair == ("none",)
    assert spec.evaluation.zero_shot == TASKS and spec.evaluation.zero_shot_limit is None
