"""benchmarks/plan_speed.py on a tiny job: each plan in a cache of its own that shares the
conversions and none of the plan's caches, every plan of the job printing the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.benchmark_scripts import load_benchmark
from tests.helpers.job_specs import tiny_job, write_job
from tests.helpers.tiny_models import save_tiny


def test_the_cache_shares_the_conversions_and_no_plan_cache(tmp_path: Path) -> None:
    bench = load_benchmark("plan_speed")
    real = tmp_path / "real"
    for name in ("models", "gguf", "plan-reads", "fingerprints"):
        (real / name).mkdir(parents=True)
    (real / "gguf" / "m.gguf").write_text("GGUF")
    (real / "gguf" / "m.gguf.verified").write_text("a stamp")
    (real / "fingerprints" / "file-1.json").write_text("{}")  # a GGUF's digest
    (real / "fingerprints" / "2.json").write_text("{}")  # a checkpoint's fingerprint
    root = bench.converted_cache(real, tmp_path / "fresh")
    assert (root / "models").resolve() == real / "models"
    assert [p.name for p in (root / "gguf").iterdir()] == ["m.gguf"]
    assert [p.name for p in (root / "fingerprints").iterdir()] == ["file-1.json"]
    assert not (root / "plan-reads").exists()


@pytest.mark.slow  # 20 s: lorp plan in processes of its own
def test_a_tiny_job_is_timed_first_and_second_and_says_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORP_CACHE", str(tmp_path / "real"))
    model = save_tiny("llama", tmp_path / "tiny")
    job = write_job(tmp_path, tiny_job(tmp_path, model, "timed"))
    out = tmp_path / "plan.json"
    result = load_benchmark("plan_speed").main([str(job), "--repeat", "1", "--json", str(out)])
    figures = result[str(job)]
    assert figures["identical"] and json.loads(out.read_text()) == result
    for key in ("first_wall_s", "second_wall_s", "first_cpu_s", "second_cpu_s"):
        assert figures[key]["min"] <= figures[key]["median"] <= figures[key]["max"]
