"""The memory policy per stage: held whole when it fits, streamed with as many windows per
forward as fit, held whole with fewer copies, or refused in one line, on a tiny Llama."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lorp.models.memory import GIB, stage_activations, weight_size
from lorp.models.safetensors_index import tensor_index
from lorp.models.shape import ModelShape
from pipeline.cluster.decisions import TooLargeError, decide
from tests.helpers.tiny_models import save_tiny


def test_decide_memory_streamed_refused(tmp_path: Path) -> None:
    path = save_tiny("llama", tmp_path / "llama")
    size = weight_size(tensor_index(path), torch.float32)
    shape = ModelShape.from_config(json.loads((path / "config.json").read_text()))
    kw = {"batch": 2, "seq_len": 32, "itemsize": 4, "label": "tiny"}
    roomy = decide("capture", size, shape, worker_bytes=GIB, **kw)
    assert roomy.mode == "memory" and roomy.need_bytes == roomy.memory_bytes
    # Enough for the resident parts, two blocks and the activations, not the whole model.
    streamed_need = roomy.memory_bytes - size.total + size.resident + 2 * size.largest_unit
    tight = int(streamed_need / 0.8) + 1
    d = decide("capture", size, shape, worker_bytes=tight, **kw)
    assert (d.mode, d.need_bytes, d.batch) == ("streamed", streamed_need, 2)
    # With room for three more windows per forward (activations are linear in the
    # batch), a streamed stage takes them: each forward reads every block once.
    per_window = stage_activations("capture", shape, 1, 32, 4)
    roomier = int((streamed_need + 3 * per_window) / 0.8) + 1
    assert (streamed_need + 3 * per_window) < roomy.memory_bytes  # still streamed
    wide = decide("capture", size, shape, worker_bytes=roomier, max_batch=64, **kw)
    assert (wide.mode, wide.batch) == ("streamed", 5)
    assert decide("capture", size, shape, worker_bytes=roomier, max_batch=4, **kw).batch == 4
    # Held whole with one copy where two do not fit (a CPU point then loads its own).
    one = decide("evaluate", size, shape, worker_bytes=GIB, copies=2, **kw)
    assert (one.mode, one.copies) == ("memory", 2)
    acts = one.memory_bytes - 2 * size.total
    only_one = int((size.total + acts) / 0.8) + 1
    d = decide("evaluate", size, shape, worker_bytes=only_one, copies=2, **kw)
    assert (d.mode, d.copies, d.memory_bytes) == ("memory", 1, size.total + acts)
    with pytest.raises(TooLargeError, match=r"model 'tiny' cannot run its capture even streamed"):
        decide("capture", size, shape, worker_bytes=tight - 8, **kw)
