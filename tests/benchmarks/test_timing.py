"""benchmarks/timing.py: the median of timed calls after a warm-up (the device synchronised
around each), the bare forward a capture is timed against, and the blocks a timed variant
lacks."""

from __future__ import annotations

import torch

from benchmarks.timing import bare_forward, deep_blocks, median_time, timed
from tests.helpers.tiny_models import tiny_model
from tests.helpers.windows import token_windows


def test_a_timing_warms_up_then_takes_the_median_of_its_repeats() -> None:
    calls: list[str] = []

    def fn() -> int:
        calls.append("fn")
        return len(calls)

    seconds, last = timed(fn, 3, warmup=2, sync=lambda: calls.append("sync"))
    assert seconds >= 0 and last == 2 + 3 * 3 - 1  # the last call's result
    assert calls == ["fn"] * 2 + ["sync", "fn", "sync"] * 3
    calls.clear()
    assert median_time(fn, 2) >= 0 and calls == ["fn"] * 3


def test_the_bare_forward_runs_the_stack_and_a_variant_lacks_the_deep_blocks() -> None:
    model = tiny_model("llama")
    with torch.inference_mode():
        bare_forward(model, [token_windows(2)])
    assert deep_blocks(10, 3) == [6, 7, 8]  # the last block kept
    assert deep_blocks(30, 0) == []
