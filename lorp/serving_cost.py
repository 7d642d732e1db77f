"""What a variant costs to serve, counted from its config and kept blocks: no timing.

A depth-pruned variant keeps some blocks of its dense model and nothing else changes, so
its serving cost follows from the config (`config.json`, the text model's part) and
which blocks it keeps:

- `weight_bytes`: every parameter at the serving dtype (the exact parameter count);
- `kv_bytes_per_token`: the K and V cache one token adds, 2 x kv_heads x head_dim per
  kept block;
- `prefill_flops_per_token`: matmul FLOPs (2 per multiply-add) of one token of a causal
  prefill of `seq_len` tokens, as a plain forward runs it: every kept block's q, k, v, o
  and gated-MLP projections, its attention scores and weighted values over the token's
  context (averaged over the `seq_len` positions; a sliding-window layer sees at most
  its window), and the LM head once per sequence (a prefill needs the last position's
  logits only, as `generate` and vLLM compute them: 2 x d x vocab / `seq_len` per
  token). Counting the head at every position (a scoring forward) made Gemma 3 270M's
  prediction at 8 of 18 blocks 1.21x against 1.70x measured: its 262k-row head then
  outweighs all 18 blocks;
- `decode_bytes_per_token`: what one generated token reads at a context of `context`
  tokens: every weight once (of an untied input embedding only the token's row) and
  every kept block's KV cache of the keys it attends to: all `context` of them, a
  sliding-window layer at most its window. Counting the whole context there put 15 of
  Gemma 3's 18 KV caches (window 512) at 8 times their reads at 4k.

A sub-layer variant (`lorp.models.sublayers`) keeps every block but not every block's
attention or MLP: `kept` then names the blocks that keep their attention (the ones with
a KV cache and attention scores) and `kept_mlp` those that keep their MLP; without
`kept_mlp` a block keeps both or neither.

The predicted speed-ups are dense over variant: prefill when compute-bound, decode when
memory-bound. They are predictions; what a machine measures is in the speed columns.
"""

from __future__ import annotations

from collections.abc import Sequence

from lorp.models.loading import DTYPES
from lorp.models.shape import ModelShape


def mean_context(seq_len: int, window: int | None) -> float:
    """The keys a query attends to, averaged over the positions 1..seq_len of a causal
    prefill: min(t, window) at position t."""
    w = seq_len if window is None else min(window, seq_len)
    return (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len


def prefill_flops_per_token(
    shape: ModelShape, kept: Sequence[int], seq_len: int, kept_mlp: Sequence[int] | None = None
) -> float:
    """Matmul FLOPs per token of a causal prefill of `seq_len` tokens (module docstring);
    `kept`: the blocks keeping their attention, `kept_mlp` their MLP (default: `kept`)."""
    scores = 2 * 2 * shape.heads * shape.head_dim  # q.k and the weighted v, per key
    attention = sum(
        2 * shape.attention_matmul_weights + scores * mean_context(seq_len, shape.windows[b])
        for b in kept
    )
    mlp = 2 * shape.mlp_matmul_weights * len(kept if kept_mlp is None else kept_mlp)
    return attention + mlp + 2 * shape.hidden * shape.vocab / seq_len  # the head: last only


def kv_bytes_per_token(shape: ModelShape, kept: Sequence[int], dtype_bytes: int) -> int:
    """K and V of one token in every block of `kept` that attends (the blocks that keep
    attention; a hybrid's Mamba, linear-attention and convolution blocks keep none)."""
    attending = sum(1 for b in kept if shape.has_kv(b))
    return attending * 2 * shape.kv_heads * shape.head_dim * dtype_bytes


def decode_bytes_per_token(
    shape: ModelShape, kept: Sequence[int], params: int, dtype_bytes: int, context: int
) -> int:
    """Weights read once (an untied embedding table: one row; a mixture of experts: the
    experts a token runs through), the KV cache of the keys each kept block attends to
    at `context` (the whole context, or its window), and the recurrent state each kept
    Mamba, linear-attention or convolution block reads and writes."""
    unread = 0 if shape.tied else (shape.vocab - 1) * shape.hidden
    weights = (params - unread - shape.idle_expert_params(kept)) * dtype_bytes
    keys = sum(min(context, shape.windows[b] or context) for b in kept if shape.has_kv(b))
    per_key = 2 * shape.kv_heads * shape.head_dim * dtype_bytes
    state = sum(shape.state[b] for b in kept) * dtype_bytes if shape.state else 0
    return weights + keys * per_key + 2 * state


def cost_columns(
    shape: ModelShape,
    kept: Sequence[int],
    params: int,
    params_dense: int,
    dtype: str,
    seq_len: int,
    kept_mlp: Sequence[int] | None = None,
    dense_shape: ModelShape | None = None,
) -> dict[str, float]:
    """The catalog's cost columns of a variant keeping `kept` blocks (`params` of its
    dense model's `params_dense`), served in `dtype`, prefill and decode context
    `seq_len`; the predicted speed-ups are dense over this variant. A sub-layer variant:
    `kept` keep their attention, `kept_mlp` their MLP. An expert cut: `shape` has the
    variant's experts, `dense_shape` the dense model's (default: `shape`)."""
    b = DTYPES[dtype].itemsize  # the same names a model spec's `dtype` takes
    dense = range(shape.n_blocks)
    dense_shape = dense_shape or shape
    flops = prefill_flops_per_token(shape, kept, seq_len, kept_mlp)
    decode = decode_bytes_per_token(shape, kept, params, b, seq_len)
    return {
        "weight_bytes": float(params * b),
        "kv_bytes_per_token": float(kv_bytes_per_token(shape, kept, b)),
        "prefill_flops_per_token": flops,
        "decode_bytes_per_token": float(decode),
        "predicted_prefill_speedup": prefill_flops_per_token(dense_shape, dense, seq_len) / flops,
        "predicted_decode_speedup": decode_bytes_per_token(
            dense_shape, dense, params_dense, b, seq_len
        )
        / decode,
    }
