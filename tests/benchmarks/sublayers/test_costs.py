"""benchmarks/sublayers/costs.py: a variant's predicted decode bytes at 4k on a tiny model,
as `lorp.serving_cost` counts them, and its row's cost columns."""

from __future__ import annotations

from benchmarks.sublayers.costs import CONTEXT, costs, decode_bytes, dense_parameters, unit_cost
from lorp.models.shape import ModelShape
from lorp.models.sublayers import block_units, sublayer_parameters
from tests.helpers.tiny_models import tiny_model


def test_a_variant_costs_its_units_less_than_dense() -> None:
    model = tiny_model("llama")
    shape = ModelShape.from_config(model.config.to_dict())
    dense = dense_parameters(model)
    assert dense == sum(p.numel() for p in model.parameters())
    cost = unit_cost(model, shape, "float32")
    units = block_units([1])
    left = dense - sublayer_parameters(model, units)
    assert cost(units) == decode_bytes(shape, units, left, "float32", CONTEXT)
    assert cost(units) < cost([2]) < cost([])  # a block saves more than its attention
    row = costs(shape, units, left, dense, "float32")
    assert row["decode_bytes_4k"] == cost(units) and row["decode_bytes_4k_dense"] == cost([])
    assert row["kv_bytes_per_token"] > 0
