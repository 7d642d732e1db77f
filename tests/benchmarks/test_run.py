"""benchmarks/run.py in its tiny mode (`--tiny`: a random 10-block model, 4 x 32 tokens,
no vLLM): capture, selection, repair and evaluation run in this process and their figures
are checked where they have a known value; the speed-up rule keeps a broken timing off the
page. Timings are checked for what they are made of, never for how large they are: beside
another test process a 10-block forward is as slow as it likes, and the rule then fails the
run (the last test holds that on set figures). The memory section's two child interpreters
and the Ray section's cluster and actors cost more to start than the suite's share for this
file (about 14 s and 11 s more): the memory child's code runs in-process instead
(tests/benchmarks/test_overheads.py), and the Ray section is not run."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lorp import available_methods
from tests.helpers.benchmark_scripts import load_benchmark

BEGIN, END = "<!-- benchmarks:begin -->", "<!-- benchmarks:end -->"


def load_script():  # type: ignore[no-untyped-def]
    return load_benchmark("run")


@pytest.fixture
def threads_back() -> Iterator[None]:
    """The script sets torch's thread count (one with --tiny): the process's own back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def page_with_markers(path: Path) -> Path:
    path.write_text(f"# Benchmarks\n\nprose\n\n{BEGIN}\nstale figures\n{END}\n\nafter\n")
    return path


def test_tiny_run_measures_every_in_process_section(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], threads_back: None
) -> None:
    run = load_script()
    out, page = tmp_path / "bench.json", page_with_markers(tmp_path / "benchmarks.md")
    args = ["--tiny", "--skip", "memory", "ray", "--json", str(out), "--page", str(page)]
    rc = run.main(args)
    f = json.loads(out.read_text())
    violations = run.speedup_violations(f)  # timings beside another test: either may happen
    assert rc == (1 if violations else 0)
    assert f["tiny"] is True and f["quick"] is False and f["tokens"] == 4 * 32
    assert not any(k.startswith(("peak_rss", "memory", "ray_", "vllm")) for k in f)
    # 1-2: S from capture_stats is the usual way's S, on both models.
    for label in ("tiny", "wide_d128"):
        assert f[f"{label}.s_max_abs_diff_vs_usual"] <= 1e-5
        assert min(f[f"{label}.{x}_s"] for x in ("bare", "capture", "usual")) > 0
    assert f["capture_overhead"] == max(f["tiny.capture_overhead"], f["wide_d128.capture_overhead"])
    assert f["vs_usual_speedup"] == min(f["tiny.vs_usual_speedup"], f["wide_d128.vs_usual_speedup"])
    # 5: every method that selects from S alone, at every N.
    from benchmarks.overheads import selects_from_s_alone

    timed = list(filter(selects_from_s_alone, available_methods()))
    assert {"lorp", "shortgpt", "streamline"} <= set(timed)
    for n in (32, 64, 128):
        for m in [*timed, "spectral_clustering_k4"]:
            assert f[f"select_ms.{m}.n{n}"] > 0
    assert f["select_ms_lorp_n128"] == f["select_ms.lorp.n128"]
    # 5b: the sums' memory is one d x d float64 per start and per run (d = 64, then 4096).
    runs, starts = f["repair_runs"], f["repair_starts"]
    assert 1 <= starts <= runs and f["repair_ratio"] > 0
    assert f["repair_sums_mib"] == 8 * 64 * 64 * (starts + runs) / 2**20
    assert f["repair_sums_gib_at_d4096"] == 8 * 4096**2 * (starts + runs) / 2**30
    # 6: 10, 20 and 30% of the 10 blocks removed, each at most N/(N-k) (+5%) faster.
    speedups = {k: v for k, v in f.items() if k.startswith("prefill_speedup.")}
    assert sorted(speedups) == [f"prefill_speedup.removed_{k}_of_10" for k in (1, 2, 3)]
    assert all(value > 0 for value in speedups.values())
    assert math.isfinite(f["hf_ppl"]) and f["hf_ppl"] > 1 and f["hf_tokens_per_s"] > 0
    table = capsys.readouterr().out
    assert "(`s_max_abs_diff_vs_usual`)" in table and "removed 3 of 10 (interleaved" in table
    # The page: the table between the markers, the rest kept, the command that made it (or,
    # where the timing broke the rule, the old figures kept).
    text = page.read_text()
    if violations:
        assert "stale figures" in text
        return
    assert "stale figures" not in text and text.startswith("# Benchmarks\n\nprose\n\n")
    assert text.endswith(f"{END}\n\nafter\n")
    block = text[text.index(BEGIN) : text.index(END)]
    assert "Reproduce: `python benchmarks/run.py --tiny --json bench.json" in block
    assert "(tiny random model: the suite's check, not a result)" in block


def test_a_speedup_above_the_bound_fails_the_run_and_keeps_the_page(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], threads_back: None
) -> None:
    """More than 5% above N/(N-k) is a broken timing: flagged, the run fails, the page
    keeps its old figures; at the bound (+5%) it passes."""
    run = load_script()
    page = page_with_markers(tmp_path / "benchmarks.md")
    figures = {
        "prefill_speedup.removed_3_of_30": 30 / 27 * 1.05,
        "prefill_speedup.removed_6_of_30": 30 / 24 * 1.06,
    }
    [line] = run.speedup_violations(figures)
    assert line.startswith("prefill_speedup.removed_6_of_30 = 1.325x exceeds N/(N-k) = 1.250x")
    run.measure = lambda *args: figures  # the sections, as a broken timing would leave them
    assert run.main(["--skip", "capture", "--page", str(page)]) == 1
    assert "stale figures" in page.read_text()
    said = capsys.readouterr()
    assert "check failed: prefill_speedup.removed_6_of_30" in said.err
    row = "| 1.325x ± 0.000 | <= N/(N-k) = 1.250x | **no: above the bound** |"
    assert f"removed 6 of 30 (interleaved, median) {row}" in said.out
    # At the bound (+5%) the run passes and the page gets the new table.
    figures["prefill_speedup.removed_6_of_30"] = 30 / 24 * 1.05
    assert run.main(["--skip", "capture", "--page", str(page)]) == 0
    text = page.read_text()
    assert "stale figures" not in text and text.endswith("after\n")
    assert "removed 6 of 30 (interleaved, median) | 1.312x" in text
