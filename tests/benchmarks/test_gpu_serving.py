"""benchmarks/gpu_serving.py: section 5's table, from figures set here (a lent device
measures them; the H200 image lent here has no vLLM), and the line that says it was
skipped."""

from __future__ import annotations

from benchmarks.gpu_serving import render_serving


def variant(removed: int, bound: float, **speedup: float) -> dict:
    return {
        "removed": removed,
        "bound": bound,
        "serve_output_tps": 12345.6,
        "serve_ttft_ms": 81.25,
        "serve_tpot_ms": 12.345,
        **speedup,
    }


def test_the_table_gives_each_variant_s_speedup_with_its_interval() -> None:
    interval = {"serve_speedup_low": 1.2, "serve_speedup_high": 1.4}
    section = {
        "settings": {
            "concurrency": 64,
            "prompt_len": 512,
            "output_len": 256,
            "requests": 256,
            "rounds": 5,
        },
        "variants": [
            variant(0, 1.0),
            variant(8, 1.333, serve_speedup=1.3, serve_resolved=True, **interval),
            variant(12, 1.6, serve_speedup_measured=1.7, serve_resolved=False, **interval),
        ],
    }
    lines = render_serving(section).splitlines()
    assert lines[0] == "serving (vLLM, concurrency 64, 512 in / 256 out, 256 requests x 5 rounds)"
    assert lines[1] == (
        "| blocks removed | output tok/s | TTFT ms | TPOT ms | speed-up [95% interval] | N/(N-k) |"
    )
    assert lines[2] == "| --- | --- | --- | --- | --- | --- |"
    assert lines[3] == "| 0 | 12,346 | 81.2 | 12.35 | 1 | 1.000 |"
    assert lines[4] == "| 8 | 12,346 | 81.2 | 12.35 | 1.300 [1.200, 1.400] | 1.333 |"
    assert "| not resolved (1.700 measured) [1.200, 1.400] | 1.600 |" in lines[5]
    skipped = render_serving({"skipped": "vllm is not installed"})
    assert skipped == "serving: skipped, vllm is not installed"
