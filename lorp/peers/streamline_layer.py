"""LLM-Streamline's replacement layer (Chen et al., ICLR 2025, "Streamlining Redundant
Layers to Compress Large Language Models").

Selection (their Eq. 1): the contiguous run i+1..i+n whose input h_i and output h_{i+n}
have the largest token mean cosine (`streamline`'s windows).

Repair (their Eq. 2-3): the run is replaced by one lightweight network, the FFN the
paper found best, trained to map h_i to h_{i+n} with the mean squared error over the
calibration tokens, min E||f(h_i) - h_{i+n}||^2, by Adam at `lr`, the epoch kept that
leaves least error on the held-out calibration windows (early stopping after `patience`
epochs without a better one).

The construction, so that the checkpoint is of its own family's class and shapes (vLLM
and transformers load it as they load the model): the run's last block, i+n, carries the
FFN and the others go. Its attention's output projection is zeroed (with its bias), so
its attention adds nothing (where a norm follows the attention, as in Gemma, the norm of
a zero vector is zero); its MLP, with the norms around it, is the FFN, initialised from
that block's own MLP and trained in float32: f(h) = h + post(MLP(pre(h))), pre and post
the block's own norms before and after its MLP where it has them. The variant has
N - n + 1 blocks, one of which runs a zeroed attention: its cost is its twin's plus one
block's, its quality the recipe's. A block whose channel mixer is not an MLP (a mixture
of experts) is refused in one line.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lorp.locality.similarity import LayerSimilarity
from lorp.methods.registry import Selection, register_method
from lorp.methods.streamline import streamline
from lorp.models.architectures import architecture_of, decoder_blocks, text_config
from lorp.models.blocks import is_norm, post_norms
from lorp.peers.states import stream_rows
from lorp.repair.maps import RepairRefused
from lorp.repair.stats import contiguous_runs

REPAIR = "replacement-ffn"
DEFAULT_LR = 1e-4
DEFAULT_EPOCHS = 10
BATCH_TOKENS = 1024


@register_method("streamline-layer", needs_output_state=True, peer=REPAIR)
def streamline_layer(
    similarity: LayerSimilarity, budget: int, *, last_block: bool = False
) -> Selection:
    """LLM-Streamline with its replacement FFN: the run whose input and output agree most."""
    return streamline(similarity, budget, last_block=last_block)


def skipped_blocks(layers: Sequence[int]) -> tuple[int, ...]:
    """The blocks the variant's forward no longer runs: each run's blocks but its last,
    the carrier, which keeps a block's cost (its zeroed attention still runs). What the
    speed pass times, so a figure and its bound N/(N-k) count what the checkpoint runs."""
    runs = contiguous_runs(layers, max(layers, default=-1) + 1)
    return tuple(i for first, last in runs for i in range(first, last))


class FFN(nn.Module):
    """f(h) = h + post(MLP(pre(h))): a block's MLP with the norms around it, float32."""

    def __init__(self, mlp: nn.Module, pre: nn.Module | None, post: nn.Module | None) -> None:
        super().__init__()
        self.mlp = copy.deepcopy(mlp).float()
        self.pre = copy.deepcopy(pre).float() if pre is not None else nn.Identity()
        self.post = copy.deepcopy(post).float() if post is not None else nn.Identity()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.post(self.mlp(self.pre(h)))


def carrier_parts(
    block: nn.Module, model: nn.Module
) -> tuple[str, nn.Module | None, nn.Module | None]:
    """(the MLP's attribute, the norm before it, the norm after it) of `block`, or one
    line saying why its channel mixer is not an MLP this recipe can train."""
    layout = architecture_of(model).layout(block)
    mlps = [b for b in layout.channel_mixers if b.kind == "mlp"]
    if len(mlps) != 1 or len(layout.token_mixers) != 1 or layout.unreadable():
        fam = text_config(model.config).model_type
        raise RepairRefused(f"replacement-ffn: family {fam!r}: its blocks are not attention + MLP")
    post = set(post_norms(block).values())
    pre = [n for n, m in block.named_children() if m is not None and is_norm(m) and n not in post]
    pre_mlp = pre[-1] if len(pre) >= 2 or (pre and layout.parallel) else None
    post_mlp = mlps[0].post_norm
    get = lambda n: getattr(block, n) if n else None  # noqa: E731
    return mlps[0].name, get(pre_mlp), get(post_mlp)


@torch.no_grad()
def zero_attention(block: nn.Module, model: nn.Module) -> None:
    """The block's attention adds nothing: its output projection (and bias) zeroed."""
    for branch in architecture_of(model).layout(block).token_mixers:
        out = getattr(getattr(block, branch.name), branch.out or "")
        out.weight.zero_()
        if out.bias is not None:
            out.bias.zero_()


def train_ffn(
    ffn: FFN,
    fit: tuple[torch.Tensor, torch.Tensor],
    held: tuple[torch.Tensor, torch.Tensor],
    *,
    lr: float = DEFAULT_LR,
    epochs: int = DEFAULT_EPOCHS,
    patience: int = 2,
    batch_tokens: int = BATCH_TOKENS,
    seed: int = 0,
) -> dict[str, Any]:
    """Adam on the FFN's MLP (norms fixed) against MSE(f(h_i), h_{i+n}) on `fit` rows;
    the epoch of least held-out MSE is loaded back. Returns the per-epoch record."""
    for p in [*ffn.pre.parameters(), *ffn.post.parameters()]:
        p.requires_grad_(False)
    opt = torch.optim.Adam(ffn.mlp.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    mse = lambda x, y: float(torch.nn.functional.mse_loss(ffn(x), y))  # noqa: E731
    with torch.no_grad():
        held_mse = [mse(*held)]
    best, state = 0, copy.deepcopy(ffn.mlp.state_dict())
    for epoch in range(1, epochs + 1):
        for idx in torch.randperm(len(fit[0]), generator=gen).split(batch_tokens):
            idx = idx.to(fit[0].device)
            loss = torch.nn.functional.mse_loss(ffn(fit[0][idx]), fit[1][idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        with torch.no_grad():
            held_mse.append(mse(*held))
        if held_mse[-1] < held_mse[best]:
            best, state = epoch, copy.deepcopy(ffn.mlp.state_dict())
        elif epoch - best >= patience:
            break
    ffn.mlp.load_state_dict(state)
    return {"lr": lr, "held_mse": [round(m, 6) for m in held_mse], "best_epoch": best}


def repair_streamline_layer(
    model: nn.Module,
    layers: Sequence[int],
    windows: torch.Tensor,
    held: torch.Tensor,
    *,
    options: Mapping[str, Any] | None = None,
    batch_size: int = 8,
    skip_prefix: int = 0,
) -> dict[str, Any]:
    """Train the FFN for the run `layers` of the dense `model` on `windows` (early stopped
    on `held`) and put it in the run's last block, in place. The caller drops the
    record's `dropped` blocks (the run less its last), not the whole run."""
    runs = contiguous_runs(layers, len(decoder_blocks(model)))
    if len(runs) != 1 or runs[0][0] == 0:
        raise RepairRefused(f"replacement-ffn: layers must be one run after block 0, got {runs}")
    (s, e), opts = runs[0], {"lr": DEFAULT_LR, "epochs": DEFAULT_EPOCHS, **(options or {})}
    block = decoder_blocks(model)[e]
    name, pre, post = carrier_parts(block, model)
    kw = {"batch_size": batch_size, "skip_prefix": skip_prefix}
    fit, check = (
        stream_rows(model, windows, [s - 1, e], **kw),
        stream_rows(model, held, [s - 1, e], **kw),
    )
    ffn = FFN(getattr(block, name), pre, post).to(fit[f"h{e}"].device)
    pair = lambda r: (r[f"h{s - 1}"], r[f"h{e}"])  # noqa: E731
    record = train_ffn(
        ffn, pair(fit), pair(check), lr=float(opts["lr"]), epochs=int(opts["epochs"])
    )
    mlp = getattr(block, name)
    with torch.no_grad():
        for target, trained in zip(mlp.parameters(), ffn.mlp.parameters(), strict=True):
            target.copy_(trained.to(target.dtype))
    zero_attention(block, model)
    return {"run": [s, e], "repair": REPAIR, "carrier": e, "dropped": list(range(s, e)), **record}
