"""The README's Python example, run as written on a tiny PTB-vocabulary model: the public
API it shows keeps working (only the model and the window counts are swapped for tiny
ones)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers.paths import REPO
from tests.helpers.tiny_models import N_BLOCKS, save_tiny_ptb

pytestmark = [pytest.mark.integration]


def readme_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    assert len(blocks) == 1, "the README has one Python example"
    return blocks[0]


def test_the_readme_example_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = save_tiny_ptb("llama", tmp_path / "tiny")
    code = readme_example()
    for real, tiny in (
        ('load_model("smollm2-135m")', f"load_model({str(model)!r})"),
        ("calibration_windows(docs, 32, 256, seed=0)", "calibration_windows(docs, 8, 32, seed=0)"),
        ("select_layers(stats, 8,", "select_layers(stats, 2,"),
        ("explain(stats, 8)", "explain(stats, 2)"),
    ):
        assert real in code, f"the README example no longer says {real}"
        code = code.replace(real, tiny)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    sel, stats = scope["sel"], scope["stats"]
    rls = scope["explain"](stats, 2).rls
    assert capsys.readouterr().out.strip() == f"{sel.layers} {rls}"
    assert len(sel.layers) == 2 and rls > 0
    assert len(scope["lm"].model.model.layers) == N_BLOCKS - 2  # pruned in place
    assert scope["fits"] and all(f.run[0] in sel.layers for f in scope["fits"])
