"""The registry's aliases (`pipeline.tracking.aliases.move_aliases`) over versions
of two jobs, on a real sqlite MLflow store."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipeline.tracking.aliases import move_aliases
from pipeline.tracking.registry import tag_value
from pipeline.tracking.runs import GRID_KEY

pytestmark = [pytest.mark.integration]


def test_alias_rule_on_a_real_store(tmp_path: Path) -> None:
    """Over every version, whichever job made it: `best-<b>-<protocol>` is the lowest
    perplexity among the protocol's non-degraded variants (else the highest acc_avg);
    `best-<b>` is the reference protocol's (the oldest row's, unless a job claims it);
    `dense` the oldest dense version; a stale alias with no qualifying variant goes."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    client.create_registered_model("lorp-unit")
    p, q = "ptb48-00000000", "ptb32-11111111"
    rows = {
        "dense-q": {"method": "dense", "budget": 0, "protocol": q, "t": 5},
        "dense-p": {"method": "dense", "budget": 0, "protocol": p, "t": 1},
        "a": {"budget": 1, "ppl_ptb": 10.0, "protocol": p, "t": 2},
        "b": {"budget": 1, "ppl_ptb": 12.0, "protocol": p, "t": 3},
        "c": {"budget": 2, "ppl_ptb": 40.0, "degraded": True, "protocol": p, "t": 4},
        "d": {"budget": 1, "ppl_ptb": 11.0, "protocol": q, "t": 6},
        "e": {"budget": 3, "acc_avg": 40.0, "protocol": p, "t": 7},
        "f": {"budget": 3, "acc_avg": 55.0, "protocol": p, "t": 8},
        "g": {"budget": 2, "ppl_ptb": 9.0, "protocol": q, "t": 9},
    }
    ids = {}
    for key, row in rows.items():
        (tmp_path / key).mkdir()
        job = "k" if row["protocol"] == q else "j"  # two jobs, one protocol each
        tags = {
            "method": row.get("method", "lorp"),
            "method_label": key,
            "job": job,
            "created_at": f"2026-12-01T00:00:0{row['t']}",
            "rank_by": "ppl_ptb",
            GRID_KEY: key,
        } | {k: tag_value(v) for k, v in row.items() if k != "t"}
        mv = client.create_model_version("lorp-unit", (tmp_path / key).as_uri(), tags=tags)
        ids[key] = str(mv.version)
    client.set_registered_model_alias("lorp-unit", "best-2", ids["c"])  # stale
    client.set_registered_model_alias("lorp-unit", "champion", ids["b"])  # not lorp's
    wanted, moves = move_aliases(client, "lorp-unit", "job-x")
    expect = {
        "dense": ids["dense-q"],  # the lower version number: created first
        "best-1": ids["a"],
        f"best-1-{p}": ids["a"],
        f"best-1-{q}": ids["d"],
        f"best-2-{q}": ids["g"],
        "best-3": ids["f"],
        f"best-3-{p}": ids["f"],
    }
    assert wanted == expect
    aliases = client.get_registered_model("lorp-unit").aliases
    assert {a: str(v) for a, v in aliases.items()} == expect | {"champion": ids["b"]}
    assert {m.alias for m in moves} == set(expect) | {"best-2"}
    tags = client.get_registered_model("lorp-unit").tags
    assert tags["lorp.alias.best-2"].startswith("removed by job-x")
    client.set_model_version_tag("lorp-unit", ids["d"], "reference_claim", "true")  # job k
    wanted, moves = move_aliases(client, "lorp-unit", "job-y")
    assert wanted["best-1"] == ids["d"] and wanted["best-2"] == ids["g"] and "best-3" not in wanted
    assert {m.alias for m in moves} == {"best-1", "best-2", "best-3"}
