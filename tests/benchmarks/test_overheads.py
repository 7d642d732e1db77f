"""benchmarks/overheads.py, sections 1 to 5b of benchmarks/run.py, pieces of which run
here on tiny models (the whole script's tiny run is tests/benchmarks/test_run.py): the
capture's S against the usual way's, and the memory section's child, code in a string."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from benchmarks.overheads import MEMORY_CHILD, capture_benchmarks
from tests.helpers.benchmark_scripts import load_benchmark, torch_threads
from tests.helpers.paths import REPO
from tests.helpers.tiny_models import tiny_model
from tests.helpers.windows import token_windows


@pytest.fixture
def threads_back() -> Iterator[None]:
    """The memory child sets torch's thread count: the process's own back."""
    with torch_threads(torch.get_num_threads()):
        yield


def test_the_capture_s_s_is_the_usual_way_s(threads_back: None) -> None:
    torch.set_num_threads(1)
    model = tiny_model("llama")
    got = capture_benchmarks(model, [token_windows(2), token_windows(2, seed=1)], 1, "t")
    assert got["t.s_max_abs_diff_vs_usual"] <= 1e-5
    assert min(got[f"t.{x}_s"] for x in ("bare", "capture", "usual")) > 0
    assert got["t.capture_overhead"] == got["t.capture_s"] / got["t.bare_s"]


def test_the_memory_child_s_code_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], threads_back: None
) -> None:
    """The memory section's child is code in a string, which no linter reads: run here, in
    this process, on the tiny model, it captures and prints its peak RSS in KiB."""
    run = load_benchmark("run")
    model = run.tiny_model(tmp_path)
    code = MEMORY_CHILD.format(root=str(REPO), model=model, samples=4, seq_len=32)
    exec(compile(code, "memory_child", "exec"), {"__name__": "memory_child"})
    assert int(capsys.readouterr().out.strip().splitlines()[-1]) > 100 * 1024
