"""Capture `SimilarityStats` from a Hugging Face causal LM with hooks on its blocks.

A forward pre-hook on every block normalises the block's input into a per-batch fp32
buffer (Eq. 3), and a forward hook on the last block stores its output (before the final
norm: transformers' `hidden_states[-1]` is after it), then stops the forward. The decoder
stack is called directly, so the vocabulary projection (`lm_head`, 7-20% of a forward) is
never computed. One GEMM per batch then adds the buffer's Gram matrix (Eq. 4's sum).

The hooks also keep, per sequence, the state of its last real token at every one of the
N + 1 states (float64, a few KB), for the last-token statistics of the angular-distance
method. With a BOS prepended to every window, `skip_prefix=1` keeps its position out of S
(the BOS state is an attention sink with a norm far above the text's); the last token is
recorded regardless.

`sublayers=True` records the 2N + 1 sub-layer boundaries instead (`lorp.models.sublayers`):
block i's input as state 2i, and the stream between its attention and its MLP (its input
plus what its attention site adds) as state 2i + 1, so S is (2N + 1) x (2N + 1) over 2N
units, and its even rows and columns are the block S of the same tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from lorp.experts.saliency import ExpertRecorder
from lorp.locality.similarity import normalize_states, token_selection
from lorp.locality.similarity_stats import SimilarityStats
from lorp.models.architectures import (
    StopForward,
    decoder_blocks,
    forward_until_stopped,
)
from lorp.models.streaming import device_of
from lorp.models.sublayers import check_splittable, unit_sites

log = logging.getLogger(__name__)

Batch = torch.Tensor | Mapping[str, torch.Tensor]


def unpack_batch(batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(input_ids, attention_mask or None) of a token tensor or a dict batch."""
    if isinstance(batch, torch.Tensor):
        return batch, None
    return batch["input_ids"], batch.get("attention_mask")


class _Recorder:
    """Hook state for one batch: which tokens count, and the buffers they land in."""

    def __init__(self, n_states: int, skip_prefix: int) -> None:
        self.n_states = n_states
        self.skip_prefix = skip_prefix
        self.keep: torch.Tensor | None = None
        self.last: torch.Tensor | None = None
        self.buf: torch.Tensor | None = None
        self.last_buf: torch.Tensor | None = None

    def start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """Select the tokens of a new batch [B, T] and drop the previous buffers."""
        self.keep, self.last = token_selection(
            tuple(input_ids.shape), attention_mask, self.skip_prefix, input_ids.device
        )
        self.buf = self.last_buf = None

    def store(self, index: int, hidden: torch.Tensor) -> None:
        h = hidden.reshape(-1, hidden.shape[-1])
        last = normalize_states(h[self.last].double())
        f = normalize_states(h if self.keep is None else h[self.keep])
        if self.buf is None:
            self.buf = torch.empty((self.n_states, *f.shape), dtype=f.dtype, device=f.device)
            self.last_buf = torch.empty(
                (self.n_states, *last.shape), dtype=last.dtype, device=last.device
            )
        self.buf[index] = f
        self.last_buf[index] = last


def _hook_states(model: nn.Module, rec: _Recorder, sublayers: bool) -> list[Any]:
    """Hooks storing every state `rec` records: each block's input (state i, or 2i with
    `sublayers`, which adds its input plus what its token mixing adds as 2i + 1) and
    the last block's output, which stops the forward."""
    blocks = decoder_blocks(model)
    n, step = len(blocks), 2 if sublayers else 1
    block_input: list[torch.Tensor] = []  # sublayers: the current block's input

    def pre_hook(index: int):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            x = args[0] if args else kwargs["hidden_states"]
            rec.store(step * index, x)
            block_input[:] = [x]

        return hook

    def attention_hook(index: int, scale: float):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            added = output[0] if isinstance(output, tuple | list) else output
            rec.store(2 * index + 1, block_input[0] + scale * added.view_as(block_input[0]))

        return hook

    def last_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        block_input.clear()
        rec.store(step * n, output[0] if isinstance(output, tuple | list) else output)
        raise StopForward  # the last block's output: nothing after it is needed

    handles = [
        block.register_forward_pre_hook(pre_hook(i), with_kwargs=True)
        for i, block in enumerate(blocks)
    ]
    if sublayers:
        check_splittable(model)  # one token mixer, then one channel mixer, per block
        for i in range(n):
            ((site, scale),) = unit_sites(model, 2 * i, blocks)
            handles.append(site.register_forward_hook(attention_hook(i, scale)))
    handles.append(blocks[n - 1].register_forward_hook(last_hook, with_kwargs=True))
    return handles


def capture_stats(
    model: nn.Module,
    batches: Iterable[Batch],
    *,
    model_fingerprint: str | None = None,
    calibration_fingerprint: str | None = None,
    extra: dict[str, Any] | None = None,
    progress: bool = True,
    total: int | None = None,
    skip_prefix: int = 0,
    sublayers: bool = False,
    experts: bool = False,
) -> SimilarityStats:
    """Run `batches` (token tensors [B, T], or dicts with input_ids and attention_mask)
    through the decoder stack of `model` and return the similarity statistics.

    The model's dtype and device are the caller's (fp32 on CPU, bf16 on GPU);
    normalisation is always float32 or wider. Padding (attention_mask == 0) is excluded;
    so are the first `skip_prefix` real tokens of each sequence (1 for BOS windows,
    `lorp.data.windows.prepend_bos`), from S only. `sublayers`: the 2N + 1 sub-layer
    boundaries instead of the N + 1 block boundaries (module docstring). `experts`: the
    routed experts' sums over the same tokens in the same pass, as `stats.experts`
    (`lorp.experts.saliency`; ValueError for a model without experts).
    """
    blocks = decoder_blocks(model)
    n = len(blocks)
    device = device_of(model)
    step = 2 if sublayers else 1  # the state index of block i's input: step * i
    stats = SimilarityStats(
        step * n,
        model_fingerprint=model_fingerprint,
        calibration_fingerprint=calibration_fingerprint,
        extra={**(extra or {}), **({"sublayers": True} if sublayers else {})},
    )
    rec = _Recorder(step * n + 1, skip_prefix)
    handles = _hook_states(model, rec, sublayers)
    recorder = ExpertRecorder(model).attach() if experts else None
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            # disable=None: a bar on a terminal only, never in logs or before an error line.
            bar = tqdm(batches, total=total, disable=None if progress else True, desc="capture")
            for batch in bar:
                input_ids, attention_mask = unpack_batch(batch)
                input_ids = input_ids.to(device)
                if attention_mask is not None:
                    attention_mask = attention_mask.to(device)
                rec.start(input_ids, attention_mask)
                if recorder is not None:
                    recorder.keep = rec.keep
                if not forward_until_stopped(model, input_ids, attention_mask):
                    raise RuntimeError("the last block never ran: cannot capture its output")
                stats.add_normalized(rec.buf, last=rec.last_buf)
                rec.buf = rec.last_buf = None
    finally:
        for handle in handles:
            handle.remove()
        if recorder is not None:
            recorder.detach()
    stats.experts = recorder.stats if recorder is not None else None
    log.info(
        "captured %d tokens over %d blocks in %.1f s", stats.tokens, n, time.perf_counter() - start
    )
    return stats
