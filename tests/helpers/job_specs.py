"""Job specs for the pipeline tests: one small grid over a tiny model, overridable."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def tiny_job(root: Path, model: Path, name: str = "grid", **overrides: Any) -> dict[str, Any]:
    """3 budgets x 3 methods on PTB windows of 48 tokens; evaluation off unless overridden.
    One capture worker takes the three shards in turn: every worker a job starts is a
    process that imports torch and transformers and loads the model (about 7 CPU-seconds
    here), and only the tests of sharding itself need more (they say so)."""
    spec = {
        "name": name,
        "output_dir": str(root / name),
        "cache_dir": str(root / f"cache-{name}"),
        "models": [{"ref": str(model), "name": "tiny"}],
        "budgets": [1, 2, 3],
        "methods": [{"name": "lorp"}, {"name": "shortgpt"}, {"name": "streamline"}],
        "calibration": {
            "dataset": "ptb",
            "samples": 12,
            "seq_len": 48,
            "shards": 3,
            "batch_size": 2,
        },
        "evaluation": {"enabled": False},
        "repair": ["none"],  # repaired twins are the repair tests' (test_pipeline_repair.py)
        "resources": {"capture_workers": 1},
    }
    return spec | overrides


def write_job(root: Path, spec: dict[str, Any]) -> Path:
    """The spec as a job YAML whose first line says how to run it."""
    path = root / f"{spec['name']}.yaml"
    path.write_text(f"# lorp run {path}\n" + yaml.safe_dump(spec))
    return path
