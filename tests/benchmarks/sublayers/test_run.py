"""benchmarks/sublayers/run.py: an extended run keeps the earlier run's settings."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.sublayers.run import extended


def test_an_extended_run_must_share_the_earlier_runs_settings(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    args = SimpleNamespace(
        extend=tmp_path,
        dtype="float32",
        max_windows=8,
        loss_samples=8,
        sequential=False,
        distill_epochs=0,
        zero_shot_limit=50,
    )
    with pytest.raises(SystemExit, match="--extend: no run of m at"):
        extended(args, "m")
    base = {
        "model": "m",
        "dtype": "float32",
        "max_windows": 16,
        "loss_samples": 8,
        "sequential": False,
        "distill_epochs": 0,
        "zero_shot_limit": 50,
    }
    (tmp_path / "m.json").write_text(json.dumps(base))
    with pytest.raises(SystemExit, match="max_windows differs \\(16 vs 8\\)"):
        extended(args, "m")
    args.max_windows = 16
    assert extended(args, "m") == base
    assert extended(SimpleNamespace(extend=None), "m") is None
