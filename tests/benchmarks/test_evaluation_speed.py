"""benchmarks/evaluation_speed.py, section 6 of benchmarks/run.py: the prefill speed-ups
of a tiny model's pruned copies (the whole section runs in tests/benchmarks/test_run.py),
and the vLLM child's code, a string no linter reads, compiles."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.evaluation_speed import VLLM_CHILD, prefill_speedups
from lorp.models.loading import load_model
from tests.helpers.benchmark_scripts import torch_threads
from tests.helpers.paths import REPO
from tests.helpers.tiny_models import save_tiny, word_tokenizer


@pytest.fixture
def one_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


def test_prefill_speedups_at_three_shares_of_the_blocks(tmp_path: Path, one_thread: None) -> None:
    path = save_tiny("llama", tmp_path / "tiny")  # 6 blocks: 10, 20, 30% are 1, 1 and 2
    word_tokenizer(["a", "b"], add_bos=False).save_pretrained(path)
    dense = load_model(str(path), with_tokenizer=False).model
    got = prefill_speedups(dense, str(path), 16, tiny=True)
    keys = {f"prefill_speedup{s}.removed_{k}_of_6" for k in (1, 2) for s in ("", "_std")}
    assert set(got) == keys
    assert got["prefill_speedup.removed_1_of_6"] > 0 and got["prefill_speedup.removed_2_of_6"] > 0
    assert dense.config.num_hidden_layers == 6  # dense itself is never pruned


def test_the_vllm_child_s_code_compiles() -> None:
    code = VLLM_CHILD.format(root=str(REPO), windows="w.json", ckpt="ckpt", seq_len=32)
    compile(code, "vllm_child", "exec")
