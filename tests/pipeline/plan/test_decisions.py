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
from pipeline.plan.decisions import TooLargeError, decide
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
    # Its need is the worker's own: the module's file pages it is read from are not.
    assert (d.mode, d.need_bytes, d.batch) == ("streamed", streamed_need - size.largest_unit, 2)
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


def test_loading_a_converted_model_is_planned_for(tmp_path: Path) -> None:
    """A float32 file loaded as bfloat16 maps the file's pages beside the converted weights
    at the end of the load: a worker with room for two bfloat16 copies and the batch, but
    not for that moment, streams the model (its loader converts one module at a time); a
    GPU worker, whose load is in host memory, holds it whole."""
    path = save_tiny("llama", tmp_path / "llama")
    size = weight_size(tensor_index(path), torch.bfloat16)
    shape = ModelShape.from_config(json.loads((path / "config.json").read_text()))
    kw = {"batch": 1, "seq_len": 8, "itemsize": 2, "label": "tiny", "copies": 2}
    acts = stage_activations("evaluate", shape, 1, 8, 2)
    assert 2 * size.total + acts < size.load_peak == 3 * size.total  # float32 file
    roomy = decide("evaluate", size, shape, worker_bytes=GIB, **kw)
    assert (roomy.mode, roomy.copies, roomy.memory_bytes) == ("memory", 2, size.load_peak)
    # What the worker holds of its own: the file's pages are the page cache's.
    assert roomy.need_bytes == 2 * size.total + acts
    between = int((2 * size.total + acts + size.load_peak) / 2 / 0.8)
    d = decide("evaluate", size, shape, worker_bytes=between, **kw)
    assert (d.mode, d.memory_bytes) == ("streamed", size.load_peak)
    # A GPU worker loads in host memory: its own holds the two copies and the batch.
    gpu = decide("evaluate", size, shape, worker_bytes=between, loads_here=False, **kw)
    assert (gpu.mode, gpu.copies, gpu.need_bytes) == ("memory", 2, 2 * size.total + acts)
