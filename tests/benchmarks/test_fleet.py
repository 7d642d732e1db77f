"""benchmarks/fleet.py builds its fleet from the tests' tiny-model builders: the models it
makes load, with the family, depth and width their names say (the script's imports broke
once when the builders moved)."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.helpers.paths import REPO

sys.path.insert(0, str(REPO))

from benchmarks.fleet import build_models  # noqa: E402


def test_build_models_makes_the_named_checkpoints(tmp_path: Path) -> None:
    from transformers import AutoConfig

    models = build_models(tmp_path, 2)
    assert [name for name, _ in models] == ["llama-6x64-00", "qwen2-8x128-01"]
    for name, path in models:
        config = AutoConfig.from_pretrained(str(path))
        family, shape = name.split("-")[:2]
        blocks, width = (int(x) for x in shape.split("x"))
        assert (config.model_type, config.num_hidden_layers, config.hidden_size) == (
            family, blocks, width,
        )  # fmt: skip
    assert build_models(tmp_path, 2) == models  # built once: a second call reuses them
