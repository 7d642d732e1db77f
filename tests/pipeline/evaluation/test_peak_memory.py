"""Peak memory of a variant (`pipeline.evaluation.peak_memory`): the mark resets and sees an
allocation; in a fresh process a variant's figure shows the blocks it dropped."""

from __future__ import annotations

import pytest
import torch

from lorp.models.loading import load_model
from pipeline.evaluation.peak_memory import peak_memory_fresh, peak_memory_gib, reset_peak_memory


def test_peak_memory_mark_resets_and_sees_an_allocation() -> None:
    cpu = torch.device("cpu")
    reset_peak_memory(cpu)
    before = peak_memory_gib(cpu)
    x = torch.ones(2**26)  # 0.25 GiB, every page written
    high = peak_memory_gib(cpu)
    del x
    reset_peak_memory(cpu)  # the mark falls back to what is resident now
    low = peak_memory_gib(cpu)
    assert high - before > 0.2 and high - low > 0.2, (before, high, low)


@pytest.mark.slow
def test_peak_memory_is_per_variant_in_a_fresh_process() -> None:
    """A third of SmolLM2's blocks removed: the variant's own peak is measurably lower."""
    lm = load_model("smollm2-135m", with_tokenizer=False)
    path = str(lm.path)
    del lm
    dense = peak_memory_fresh(path, [], "float32", "cpu", 128)["peak_mem_gib"]
    pruned = peak_memory_fresh(path, list(range(10, 20)), "float32", "cpu", 128)["peak_mem_gib"]
    # 10 of 30 blocks are about 0.13 GiB of fp32 weights.
    assert 0.08 < dense - pruned < 0.3, (dense, pruned)
    # Loaded in bfloat16 from the float32 files, the buffers the conversion freed are
    # handed back before the mark: 6 blocks (about 0.04 GiB) show, as they did not when
    # those buffers stayed resident in every variant alike.
    dense = peak_memory_fresh(path, [], "bfloat16", "cpu", 128)["peak_mem_gib"]
    pruned = peak_memory_fresh(path, [5, 6, 17, 26, 27, 28], "bfloat16", "cpu", 128)
    assert 0.025 < dense - pruned["peak_mem_gib"] < 0.1, (dense, pruned)
