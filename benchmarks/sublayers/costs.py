"""What a sub-layer variant is predicted to cost in serving (`lorp.serving_cost`): its
decode bytes per generated token at a 4k context, and the cost columns of its row."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

CONTEXT = 4096
"""The decode context the costs are compared at."""


def dense_parameters(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


def decode_bytes(shape: Any, units: list[int], params: int, dtype: str, context: int) -> float:
    """Predicted decode bytes per token at `context` of a variant without `units`."""
    from lorp.models.loading import DTYPES
    from lorp.models.sublayers import kept_attention_blocks
    from lorp.serving_cost import decode_bytes_per_token

    kept = kept_attention_blocks(shape.n_blocks, units)
    return float(decode_bytes_per_token(shape, kept, params, DTYPES[dtype].itemsize, context))


def unit_cost(model: Any, shape: Any, dtype: str) -> Callable[[Iterable[int]], float]:
    """units -> predicted decode bytes per token at 4k of the model without them."""
    from lorp.models.sublayers import sublayer_parameters

    dense = dense_parameters(model)
    return lambda units: decode_bytes(
        shape, list(units), dense - sublayer_parameters(model, units), dtype, CONTEXT
    )


def costs(shape: Any, units: list[int], params: int, dense_params: int, dtype: str) -> dict:
    """A variant's cost columns (`lorp.serving_cost.cost_columns`), with its decode bytes
    per token at 4k and dense's."""
    from lorp.models.sublayers import kept_attention_blocks, kept_mlp_blocks
    from lorp.serving_cost import cost_columns

    n = shape.n_blocks
    out = cost_columns(
        shape,
        kept_attention_blocks(n, units),
        params,
        dense_params,
        dtype,
        512,
        kept_mlp_blocks(n, units),
    )
    out["decode_bytes_4k"] = decode_bytes(shape, units, params, dtype, CONTEXT)
    out["decode_bytes_4k_dense"] = decode_bytes(shape, [], dense_params, dtype, CONTEXT)
    return out
