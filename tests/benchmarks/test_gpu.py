"""`benchmarks/gpu.py` in its CPU mode (`--device cpu --tiny`): the script a lent GPU runs
cannot rot between devices, and its figures are checked where they have a known value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lorp.repair.stats import contiguous_runs
from tests.helpers.benchmark_scripts import load_benchmark
from tests.helpers.paths import REPO

ROOT = REPO


def load_script():  # type: ignore[no-untyped-def]
    return load_benchmark("gpu")


def test_tiny_cpu_run_writes_every_figure(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    gpu = load_script()
    out = tmp_path / "gpu.json"
    assert gpu.main(["--device", "cpu", "--tiny", "--repeats", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["env"]["tiny"] is True and report["env"]["device"] == "cpu"
    rows = {r["shape"]: r for r in report["shapes"]}
    assert set(rows) == {"llama-8b", "gemma3-4b"}
    for r in rows.values():
        n, k = r["blocks"], len(r["pruned_layers"])
        assert (n, k) == (12, 8)
        assert r["saved_blocks"] == n - k
        assert r["speedup_bound"] == pytest.approx(12 / 4)
        assert r["runs"] == [list(x) for x in contiguous_runs(r["pruned_layers"], n)]
        # bf16 rounding moves S, but only in its third digit or later.
        assert 0 < r["s_max_abs_diff_bf16_fp32"] < 2e-2
        for fit in r["fits"]:
            assert fit["residual"] < fit["unrepaired_residual"]
        assert r["repair_sums_gib"] == pytest.approx(
            8 * 64 * 64 * (len({s for s, _ in r["runs"]}) + len(r["runs"])) / 2**30
        )
    assert {f["form"] for f in rows["gemma3-4b"]["fits"]} == {"normed"}
    assert {f["form"] for f in rows["llama-8b"]["fits"]} == {"full"}
    # Section 6: the same S and perplexity from the model streamed from its files.
    streamed = report["streamed"]
    assert "error" not in streamed, streamed.get("error")
    assert streamed["s_max_abs_diff"] <= 1e-6 and streamed["ppl_rel_diff"] <= 1e-6
    assert streamed["tokens"] == 8 * 32 and streamed["memory_ppl"] > 1
    table = capsys.readouterr().out
    assert "| llama-8b" in table and "| gemma3-4b" in table
    assert "streamed (llama-8b, float32" in table
    # The results page is written from the report, between its markers, the rest kept.
    page = tmp_path / "gpu.md"
    page.write_text(f"# GPU\n\nprose\n\n{gpu.BEGIN}\nstale figures\n{gpu.END}\n\nafter\n")
    assert gpu.main(["--from-json", str(out), "--page", str(page)]) == 0
    text = page.read_text()
    assert "stale figures" not in text
    assert text.startswith("# GPU\n\nprose") and text.endswith("after\n")
    block = text[text.index(gpu.BEGIN) : text.index(gpu.END)]
    assert "on cpu" in block and "(tiny shapes: the CPU check, not a result)" in block
    assert "| llama-8b (0.0B) |" in block and "streamed (llama-8b, float32" in block


def test_the_recorded_device_run_is_the_page_s_table() -> None:
    """docs/results/gpu.md holds what the device's JSON renders to, byte for byte."""
    gpu = load_script()
    report = json.loads((ROOT / "docs/results/gpu-h200-2026-12-04.json").read_text())
    text = (ROOT / "docs/results/gpu.md").read_text()
    assert f"{gpu.BEGIN}\n{gpu.page(report)}\n{gpu.END}" in text
    assert report["env"]["device"] == "NVIDIA H200" and not report["env"]["tiny"]


def test_bad_sizes_fail_in_one_line() -> None:
    gpu = load_script()
    with pytest.raises(SystemExit, match="--from-json nowhere.json: no such file"):
        gpu.parse_args(["--from-json", "nowhere.json"])
    with pytest.raises(SystemExit, match="--samples must be >= 1, got 0"):
        gpu.parse_args(["--device", "cpu", "--tiny", "--samples", "0"])
