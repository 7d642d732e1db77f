"""How much each routed expert contributes, as sums over calibration tokens that shard and
merge like S (REAP: router-weighted expert activation pruning).

For routed expert j of MoE layer l, over the calibration tokens X_j whose top-k holds j:

    S_j = (1 / |X_j|) * sum_{x in X_j} g_j(x) * ||E_j(x)||_2

g_j(x) is the weight the model applies to j for x (after its own normalisation and
scaling: what the router hands the experts module), E_j(x) the expert's output. Kept as
three sums per expert and one count per layer: |X_j| (`routed`), sum g_j (`gate`), sum
g_j ||E_j|| (`saliency`), and the tokens the layer saw (`tokens`), so the statistics of
two shards are their sums, and `frequency` = |X_j| / |X|. An expert no calibration token
reaches has S_j = 0: nothing measured says it matters.

`ExpertRecorder` installs the hooks (a forward pre-hook on every experts module: the
arguments are (x, top_k_index, top_k_weights) in every MoE family, `lorp.experts.layers`)
in the pass that captures S (`lorp.locality.capture.capture_stats(experts=True)`), on the
tokens S counts (padding and a BOS prefix left out).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from lorp.experts.layers import expert_outputs, moe_layers
from lorp.experts.stats import ExpertStats


class ExpertRecorder:
    """The hooks that add a batch's expert sums to `stats` (module docstring). `keep`:
    which of the batch's flattened tokens count (None: all), set before each forward."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = moe_layers(model)
        if not self.layers:
            raise ValueError("the model has no mixture-of-experts layer: no expert statistics")
        counts = {layer.n_experts for layer in self.layers}
        if len(counts) != 1:
            raise ValueError(f"MoE layers hold different numbers of experts: {sorted(counts)}")
        self.stats = ExpertStats([layer.block for layer in self.layers], counts.pop())
        self.keep: torch.Tensor | None = None
        self._handles: list[Any] = []

    def attach(self) -> ExpertRecorder:
        for row, layer in enumerate(self.layers):
            hook = self._hook(row, inspect.signature(layer.experts.forward))
            self._handles.append(layer.experts.register_forward_pre_hook(hook, with_kwargs=True))
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, row: int, signature: inspect.Signature):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            x, index, weights = signature.bind(*args, **kwargs).args[:3]
            if self.keep is not None:
                x, index, weights = x[self.keep], index[self.keep], weights[self.keep]
            if not len(index):
                return
            norms = expert_outputs(module, x, index).float().norm(dim=-1).transpose(0, 1)
            if weights.shape[1] != index.shape[1]:  # a family passing every expert's weight
                weights = torch.gather(weights, 1, index.clamp(max=weights.shape[1] - 1))
            self.stats.add(row, index, weights, norms)

        return hook
