"""benchmarks/fleet.py builds its fleet from the tests' tiny-model builders: the models it
makes load, with the family, depth and width their names say (the script's imports broke
once when the builders moved)."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.helpers.paths import REPO

sys.path.insert(0, str(REPO))

from benchmarks.fleet import build_models, main, page_block  # noqa: E402


def test_build_models_makes_the_named_checkpoints(tmp_path: Path) -> None:
    from transformers import AutoConfig

    models = build_models(tmp_path, 2)
    assert [name for name, _ in models] == ["llama-6x64-00", "qwen2-8x128-01"]
    for name, path in models:
        config = AutoConfig.from_pretrained(str(path))
        family, shape = name.split("-")[:2]
        blocks, width = (int(x) for x in shape.split("x"))
        assert (config.model_type, config.num_hidden_layers, config.hidden_size) == (
            family,
            blocks,
            width,
        )
    assert build_models(tmp_path, 2) == models  # built once: a second call reuses them


def test_the_page_block_says_each_target_met_or_missed(tmp_path: Path) -> None:
    run = {
        "makespan_s": 168.0,
        "busy_over_slots_s": 151.0,
        "longest_chain_s": 92.0,
        "lower_bound_s": 151.0,
        "makespan_ratio": 1.113,
        "utilization": 0.899,
        "points": 84,
        "driver_ms_per_point": 45.0,
    }
    result = {
        "machine": {"cpus": 2},
        "slots": 8,
        "models": 12,
        "quick": True,
        "seconds": 370.0,
        "fleet": run,
        "serial": run | {"makespan_ratio": 4.16},
        "fleet_makespan_ratio": 1.16,
        "fleet_utilization": 0.899,
        "serial_over_fleet_makespan": 1.01,
    }
    block = page_block(result)
    assert "`fleet_makespan_ratio` 1.160 (target <= 1.15: MISSED)" in block
    assert "`fleet_utilization` 0.899 (target >= 0.75: met)" in block
    assert "| fleet (all models in flight) | 168 s | 151 s | 92 s | 151 s | **1.11** |" in block


def test_a_fleet_of_fewer_than_12_models_is_refused_in_one_line(capsys) -> None:  # type: ignore[no-untyped-def]
    import pytest

    with pytest.raises(SystemExit):
        main(["--models", "3"])
    assert "--models: a fleet is at least 12 models, got 3" in capsys.readouterr().err
