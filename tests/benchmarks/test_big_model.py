"""benchmarks/big_model.py writes its random checkpoint (here at a tiny shape) as one shard
per block plus one for the embeddings and head, with the tests' PTB tokenizer beside it,
and it loads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.helpers.paths import REPO

sys.path.insert(0, str(REPO))

from benchmarks.big_model import write_checkpoint  # noqa: E402

TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": 300,
}


def test_writes_a_loadable_sharded_checkpoint(tmp_path: Path) -> None:
    from lorp.models.loading import load_model

    total = write_checkpoint(tmp_path / "big", TINY)
    index = json.loads((tmp_path / "big" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3 + 1
    per_block = (4 * 32 * 32 + 3 * 32 * 64 + 2 * 32) * 2  # bf16
    assert total == 3 * per_block + (2 * 300 * 32 + 32) * 2
    lm = load_model(str(tmp_path / "big"), dtype="float32", with_tokenizer=False)
    assert lm.n_blocks == 3
