"""benchmarks/gpu_streamed.py: section 6's line on the page, from the recorded device run
and from a CPU run or a failed one (the section itself runs in
tests/benchmarks/test_gpu.py)."""

from __future__ import annotations

import json

from benchmarks.gpu_streamed import gib, render_streamed
from tests.helpers.paths import REPO


def test_the_line_says_the_cap_the_times_and_the_agreement() -> None:
    report = json.loads((REPO / "docs/results/gpu-h200-2026-12-04.json").read_text())
    line = render_streamed(report["streamed"])
    assert line.startswith("streamed (llama-8b, bfloat16, 14.96 GiB, 11.2 GiB cap): capture ")
    assert "over 16,384 tokens; peak 5.1 GiB vs 20.0 GiB; max |dS| 0.0e+00" in line
    cpu = report["streamed"] | {"cap_gib": None, "streamed_peak_gib": None}
    assert "no cap (CPU)" in render_streamed(cpu) and "peak n/a (CPU) vs" in render_streamed(cpu)
    failed = {"shape": "llama-8b", "error": "RuntimeError: out of memory"}
    assert render_streamed(failed) == "streamed (llama-8b): failed, RuntimeError: out of memory"
    assert gib(None) == "n/a (CPU)" and gib(1.26) == "1.3 GiB"
