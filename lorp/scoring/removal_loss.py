"""Calibration loss of a model with candidate block sets removed: the `Losses` callable that
the loss-guided methods (`sleb`, `ppl`, `lorp-loss`; `finercut` with ``measure="js"``)
consume, in one process.

The loss is the mean NLL per predicted token over calibration windows [n, T], the same
convention as `lorp.models.perplexity` (position 0 of each window is never a target), so
exp(loss) is that perplexity. `LossEvaluator` scores each candidate on the one loaded
model: `lorp.models.surgery.blocks_dropped` removes the blocks in memory for the duration of the
forward passes and restores the model after, so no weights are copied or written. The
pipeline builds the same callable over several actors to score a batch in parallel.

With ``measure="js"`` a candidate's value is instead how far its output moved: the mean
Jensen-Shannon divergence (nats) per position between the dense model's next-token
distribution and the candidate's, on the same windows, FinerCut's criterion (Zhang et al.,
2024). The dense model's logits are computed once per window batch and call, and kept as
the model returns them (its dtype: exact, and no larger than the candidates' own logits);
both sides' log-probabilities are taken a few rows at a time, so the measure needs about
the memory of the NLL, whatever the vocabulary.

With ``units=True`` a candidate is a set of sub-layer units instead
(`lorp.models.sublayers`: unit 2i is block i's attention, 2i + 1 its MLP), the losses the
sub-layer forms of the loss-guided methods read (`lorp.methods.sublayer_selection`): a
block that loses both units is dropped, one that loses one runs without it
(`sublayers_removed`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from lorp.models.architectures import decoder_blocks, decoder_stack
from lorp.models.perplexity import window_nll
from lorp.models.streaming import device_of
from lorp.models.sublayers import check_units, sublayers_removed
from lorp.models.surgery import blocks_dropped, check_layers, kept_layers

Step = tuple[int, int]
"""One block a candidate keeps, as the trie sees it: (block, its units removed as a mask:
0 none, 1 its attention, 2 its MLP)."""

log = logging.getLogger(__name__)


MEASURES = ("nll", "js")
"""What a `Losses` value is: the calibration NLL, or the JS divergence from dense outputs."""


class LossEvaluator:
    """`losses(candidates) -> list[float]` over one in-memory model (see `Losses`).

    Each candidate is a set of 0-based block indices to drop (empty: the model as it is),
    or with ``units=True`` a set of sub-layer units; its value is `calibration_loss` of the
    model without them (``measure="js"``: the mean JS divergence per position of its
    outputs from the dense model's; `measure` says which). The model runs in eval mode
    and is left exactly as it was found. `n_evals` counts the candidates scored.

    Candidates share work: the blocks each one keeps, in depth order, form a trie, and the
    hidden state at every branch point is computed once per window batch and handed to the
    next block (a forward pre-hook replaces that block's input). SLEB's step over N blocks
    then costs about N^2/2 block passes instead of N^2, plus one LM head per candidate. Each
    block sees exactly the input it would in a full forward, so the losses are those of
    `calibration_loss` on the pruned model.
    """

    def __init__(
        self,
        model: nn.Module,
        windows: torch.Tensor,
        *,
        batch_size: int = 8,
        progress: bool = False,
        units: bool = False,
        measure: str = "nll",
    ) -> None:
        if measure not in MEASURES:
            raise ValueError(f"measure: must be one of {', '.join(MEASURES)}, got {measure!r}")
        self.model = model
        self.units = bool(units)
        self.measure = measure
        self._dense: torch.Tensor | None = None  # js: the batch's dense logits
        self.windows = torch.as_tensor(windows, dtype=torch.long)
        self.batch_size = int(batch_size)
        self.progress = progress
        self.n_evals = 0
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        w = self.windows
        if w.ndim != 2 or w.shape[0] == 0 or w.shape[1] < 2:
            raise ValueError(f"windows must be [n >= 1, T >= 2] token ids, got {tuple(w.shape)}")

    @property
    def n_blocks(self) -> int:
        return len(decoder_blocks(self.model))

    def __call__(self, candidates: Sequence[Iterable[int]]) -> list[float]:
        cands = [tuple(c) for c in candidates]
        # One entry per distinct kept sequence: (2, 1), (1, 2) and repeats are scored once.
        kept = [self._steps(c) for c in cands]
        distinct = list(dict.fromkeys(kept))
        root = _Node()
        for i, seq in enumerate(distinct):
            node = root
            for b in seq[:-1]:
                node = node.children.setdefault(b, _Node())
            node.ends.append((i, seq[-1]))
        nll, count = [0.0] * len(distinct), [0] * len(distinct)
        device = device_of(self.model)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                starts = range(0, len(self.windows), self.batch_size)
                for start in tqdm(starts, disable=not self.progress, desc="loss batches"):
                    batch = self.windows[start : start + self.batch_size].to(device)
                    if self.measure == "js":
                        self._dense = None  # the last batch's logits go before the next's
                        self._dense = self.model(input_ids=batch, use_cache=False).logits
                    for i, (total, m) in self._visit(root, [], batch).items():
                        nll[i] += total
                        count[i] += m
        finally:
            self._dense = None
            self.model.train(was_training)
        self.n_evals += len(cands)
        loss = {seq: t / m for seq, t, m in zip(distinct, nll, count, strict=True)}
        out = [loss[seq] for seq in kept]
        what = "sub-layers" if self.units else "blocks"
        for cand, loss in zip(cands, out, strict=True):
            log.debug("%s without %s %s: %.6f", self.measure, what, list(cand), loss)
        return out

    def _steps(self, candidate: tuple[int, ...]) -> tuple[Step, ...]:
        """The blocks `candidate` keeps, in depth order, each with the units it loses."""
        n = self.n_blocks
        if not candidate:
            return tuple((b, 0) for b in range(n))
        if not self.units:
            return tuple((b, 0) for b in kept_layers(n, check_layers(candidate, n)))
        mask = [0] * n
        for u in check_units(candidate, n):
            mask[u // 2] |= 1 << (u % 2)
        return tuple((b, m) for b, m in enumerate(mask) if m != 3)

    def _visit(
        self, node: _Node, handed: list[torch.Tensor], batch: torch.Tensor
    ) -> dict[int, tuple[float, int]]:
        """(NLL or JS sum, count) of every candidate under `node`, whose blocks so far left the
        state in `handed` (empty: the embeddings). The state comes in a list that this
        call empties, so only this frame holds it and it is freed before the last subtree:
        a SLEB trie is a spine N deep, and N live states of [B, T, d] would add up."""
        state = handed.pop() if handed else None
        out = {i: self._finish(state, last, batch) for i, last in node.ends}
        children = sorted(node.children.items(), key=lambda kv: kv[1].size)
        for j, (block, child) in enumerate(children):
            chain = [block]
            while not child.ends and len(child.children) == 1:
                ((block, child),) = child.children.items()
                chain.append(block)
            box = [self._advance(state, chain, batch)]
            if j == len(children) - 1:
                state = None  # the last subtree does not need this state kept alive
            out.update(self._visit(child, box, batch))
        return out

    def _advance(
        self, state: torch.Tensor | None, chain: list[Step], batch: torch.Tensor
    ) -> torch.Tensor:
        """The residual stream after blocks `chain`, entered with `state`."""
        blocks = decoder_blocks(self.model)
        captured: list[torch.Tensor] = []

        def keep(module: nn.Module, args: Any, output: Any) -> None:
            captured.append(output[0] if isinstance(output, tuple) else output)

        with ExitStack() as undo:
            hook = blocks[chain[-1][0]].register_forward_hook(keep)
            undo.callback(hook.remove)
            self._only(chain, state, undo)
            decoder_stack(self.model)(input_ids=batch, use_cache=False)
        return captured[-1]

    def _finish(
        self, state: torch.Tensor | None, last: Step, batch: torch.Tensor
    ) -> tuple[float, int]:
        """NLL (or JS sum) of the candidate that runs block `last` on `state`, then the LM
        head."""
        with ExitStack() as undo:
            self._only([last], state, undo)
            if self._dense is None:
                return window_nll(self.model, batch)
            logits = self.model(input_ids=batch, use_cache=False).logits
            return js_divergence_sum(self._dense, logits), batch.numel()

    def _only(self, chain: list[Step], state: torch.Tensor | None, undo: ExitStack) -> None:
        """Until `undo` closes, the model runs the blocks of `chain` alone (each without
        the units its mask names), the first of them on `state` (None: the embeddings)."""
        blocks = decoder_blocks(self.model)
        if state is not None:
            undo.callback(_inject(blocks[chain[0][0]], state).remove)
        units = [2 * b + k for b, m in chain for k in (0, 1) if m >> k & 1]
        if units:  # on the whole stack: unit indices are the original blocks'
            undo.enter_context(sublayers_removed(self.model, units))
        inside = {b for b, _ in chain}
        undo.enter_context(
            blocks_dropped(self.model, [b for b in range(len(blocks)) if b not in inside])
        )


def js_divergence_sum(p: torch.Tensor, q: torch.Tensor) -> float:
    """Sum over positions of JS(P || Q) in nats, from logits [..., V] of any float dtype:
    64 positions at a time, so the float32 temporaries stay a few rows wide. A -inf logit
    (a masked token) adds nothing: its log-probability is clamped to the float32 minimum,
    where 0 * (-inf) would be NaN."""
    total = 0.0
    floor = torch.finfo(torch.float32).min
    rows = zip(p.flatten(0, -2).split(64), q.flatten(0, -2).split(64), strict=True)
    for a, b in rows:
        lp = torch.log_softmax(a.float(), dim=-1).clamp_(min=floor)
        lq = torch.log_softmax(b.float(), dim=-1).clamp_(min=floor)
        m = torch.logaddexp(lp, lq) - math.log(2.0)
        kl = lp.exp() * (lp - m) + lq.exp() * (lq - m)
        total += float(0.5 * kl.sum(dim=-1).double().sum())
    return total


class _Node:
    """A trie node: the blocks kept so far; `ends` are the candidates whose only block
    left is `last`."""

    __slots__ = ("children", "ends")

    def __init__(self) -> None:
        self.children: dict[Step, _Node] = {}
        self.ends: list[tuple[int, Step]] = []

    @property
    def size(self) -> int:
        return len(self.ends) + sum(c.size for c in self.children.values())


def _inject(block: nn.Module, state: torch.Tensor) -> Any:
    """Make `block` run on `state` instead of the hidden states it is handed."""

    def swap(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        given = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(given, torch.Tensor) or given.shape != state.shape:
            shape = tuple(given.shape) if isinstance(given, torch.Tensor) else None
            raise RuntimeError(f"block input {shape} is not the {tuple(state.shape)} state")
        if args:
            return (state, *args[1:]), kwargs
        return args, kwargs | {"hidden_states": state}

    return block.register_forward_pre_hook(swap, with_kwargs=True)
