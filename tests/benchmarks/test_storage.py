"""benchmarks/storage.py at its smallest, on tiny random models (a pre-norm Llama and a
post-norm Gemma 3, whose repair also rewrites a norm): the manifests stay within the
issue's bounds, are pulled back equal to the full copies, and the page says so."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.helpers.benchmark_scripts import torch_threads
from tests.helpers.paths import REPO
from tests.helpers.tiny_models import save_tiny

sys.path.insert(0, str(REPO))

from benchmarks.storage import layouts, main  # noqa: E402


def test_the_layouts_remove_a_quarter_as_one_run_and_as_single_blocks() -> None:
    assert layouts(30, 0.25) == {
        "one run": tuple(range(11, 19)),
        "spread": (7, 9, 11, 13, 15, 17, 19, 21),
    }
    assert layouts(6, 0.25) == {"one run": (2, 3), "spread": (1, 3)}


def test_manifests_are_small_and_pull_back_as_the_full_copy(tmp_path: Path) -> None:
    models = [save_tiny(f, tmp_path / f) for f in ("llama", "gemma3_text")]
    page = tmp_path / "storage.md"
    page.write_text("# Storage\n")
    out = tmp_path / "storage.json"
    args = [
        "--models",
        *map(str, models),
        "--work",
        str(tmp_path / "work"),
        "--json",
        str(out),
        "--page",
        str(page),
    ]
    with torch_threads(1):
        code = main(args)
    result = json.loads(out.read_text())
    for m in result["models"]:
        kinds = [(v["kind"], v["layout"]) for v in m["variants"]]
        assert kinds == [("unrepaired", "one run"), ("repaired", "one run"), ("repaired", "spread")]
        unrepaired, one_run, spread = m["variants"]
        assert unrepaired["maps"] == 0 and one_run["runs"] == 1 and one_run["maps"] == 2
        # every other block: each run's next block carries the next run's map, so only
        # the last run has a follower
        assert spread["runs"] == spread["removed"] and spread["maps"] == spread["runs"] + 1
        for v in m["variants"]:
            assert v["pulled_equals_full"] and v["manifest_bytes"] < v["full_bytes"]
            assert v["share"] == v["manifest_bytes"] / m["weights_bytes"]
        # a tiny model's maps are d x d against little else: the bound is a real model's
        assert unrepaired["manifest_bytes"] < 8 * 1024
        assert one_run["manifest_bytes"] > unrepaired["manifest_bytes"]
        # the base stored once, as its files (a directory), and a node that never had it
        # pulls the repaired variant from that copy, equal to the pull from the base
        files = sum(f.stat().st_size for f in (tmp_path / m["model"]).iterdir())
        assert m["base_stored_as"] == "files" and m["base_stored_bytes"] > files
        assert one_run["first_pull_same"] and "first_pull_same" not in spread
    assert code == (0 if all(v["within"] for m in result["models"] for v in m["variants"]) else 1)
    text = page.read_text()
    assert "<!-- storage:begin -->" in text and text.count("| llama |") == 4  # 3 variants, the base
    assert text.count("| gemma3_text |") == 4
    assert not list((tmp_path / "work").rglob("*.safetensors"))  # every variant removed
