"""ReplaceMe, cosine variant (Shopkhoev et al., NeurIPS 2025, "ReplaceMe: Network
Simplification via Depth Pruning and Transformer Block Linearization").

Selection (their Eq. 1): the run i+1..i+n of n = budget blocks whose input h_i and
output h_{i+n} are closest, by the token mean of the cosine distance 1 - cos(h_i,
h_{i+n}); in S's numbering (S[j, k]: block inputs) the window [s, s+n) of largest
S[s, s+n], s = i+1. That is LLM-Streamline's rule, so the windows are `streamline`'s:
s >= 1, ending before block N-1 unless `last_block`.

Repair: one d x d map T on what block i's MLP adds, M_i, so the pruned model's h_i
becomes M_i T + Y_i (Y_i = h_i - M_i):

- the L2 variant (their Eq. 3): T = argmin ||M_i T - (h_{i+n} - Y_i)||^2, closed form;
- the cosine variant (their Eq. 4-5), the one reported at 93.1% of dense: T minimising
  the token mean of 1 - cos(M_i T + Y_i, h_{i+n}), started from the L2 solution and
  moved by Adam over batches of calibration tokens (`epochs`, `lr`).

T folds into block i's `down_proj` (W <- T^T W, b <- b T: `lorp.repair.fold`), so the
checkpoint has its family's shapes. A family with a norm after its MLP (Gemma 2/3, OLMo
2/3) takes no full map there: refused in one line.

lorp's own `linear` repair is the L2 variant plus a ridge towards the unrepaired map,
validated on held-out windows: with the ridge taken to 0 it is the same T on the same
tokens (`tests/lorp/peers/test_replaceme.py`), so the L2 variant is not added twice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lorp.locality.similarity import LayerSimilarity
from lorp.methods.registry import Selection, best_window, register_method
from lorp.methods.streamline import window_starts
from lorp.models.architectures import text_config
from lorp.peers.states import stream_rows
from lorp.repair.fold import fold
from lorp.repair.maps import RepairRefused, RunFit
from lorp.repair.stats import contiguous_runs, run_form

REPAIR = "cosine-map"
DEFAULT_EPOCHS = 5
DEFAULT_LR = 1e-4
BATCH_TOKENS = 1024


@register_method("replaceme", needs_output_state=True, peer=REPAIR)
def replaceme(similarity: LayerSimilarity, budget: int, *, last_block: bool = False) -> Selection:
    """ReplaceMe: the run of least cosine distance between its input and output."""
    S, n = similarity.matrix, similarity.n_blocks
    starts = window_starts(n, budget, 1, last_block)
    distance = [1.0 - float(S[s, s + budget]) for s in starts]
    s = best_window([-d for d in distance], starts)
    return Selection(
        layers=tuple(range(s, s + budget)),
        details={"window_start": s, "cosine_distance": dict(zip(starts, distance, strict=True))},
    )


def l2_map(M: torch.Tensor, Y: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """T = argmin ||M T - (H - Y)||^2 (Eq. 3), float64, by least squares."""
    return torch.linalg.lstsq(M.double(), (H - Y).double()).solution


def cosine_distance(M: torch.Tensor, Y: torch.Tensor, H: torch.Tensor, T: torch.Tensor) -> float:
    """The token mean of 1 - cos(M T + Y, H) (Eq. 4)."""
    out = M.double() @ T.double() + Y.double()
    return float((1 - torch.nn.functional.cosine_similarity(out, H.double(), dim=-1)).mean())


def fit_cosine(
    M: torch.Tensor,
    Y: torch.Tensor,
    H: torch.Tensor,
    *,
    epochs: int = DEFAULT_EPOCHS,
    lr: float = DEFAULT_LR,
    batch_tokens: int = BATCH_TOKENS,
    seed: int = 0,
) -> torch.Tensor:
    """T minimising the mean cosine distance (Eq. 4-5): the L2 map, then `epochs` passes
    of Adam at `lr` over shuffled batches of `batch_tokens` tokens. Float64 result."""
    T = nn.Parameter(l2_map(M, Y, H).float())
    opt = torch.optim.Adam([T], lr=lr)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for idx in torch.randperm(len(M), generator=gen).split(batch_tokens):
            idx = idx.to(M.device)
            out = M[idx] @ T + Y[idx]
            loss = (1 - torch.nn.functional.cosine_similarity(out, H[idx], dim=-1)).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return T.detach().double()


def check_run(model: nn.Module, layers: Sequence[int], n_blocks: int) -> tuple[int, int]:
    """The one run of `layers`, or one line saying why ReplaceMe's map cannot fold."""
    runs = contiguous_runs(layers, n_blocks)
    if len(runs) != 1 or runs[0][0] == 0:
        raise RepairRefused(f"cosine-map: layers must be one run after block 0, got {runs}")
    if run_form(model, runs[0]) != "full":
        family = text_config(model.config).model_type
        raise RepairRefused(
            f"cosine-map: family {family!r} puts a norm after block {runs[0][0] - 1}'s "
            "MLP, where a full map cannot fold"
        )
    return runs[0]


def repair_replaceme(
    model: nn.Module,
    layers: Sequence[int],
    windows: torch.Tensor,
    held: torch.Tensor | None = None,
    *,
    options: Mapping[str, Any] | None = None,
    batch_size: int = 8,
    skip_prefix: int = 0,
) -> dict[str, Any]:
    """Fit T on `windows` for the dense `model`'s run `layers` and fold it into block i's
    `down_proj`, in place (the caller drops the blocks). Returns the record: the cosine
    distance of no map, the L2 map and the fitted one, on `windows` and on `held`."""
    from lorp.models.architectures import decoder_blocks

    s, e = check_run(model, layers, len(decoder_blocks(model)))
    opts = {"epochs": DEFAULT_EPOCHS, "lr": DEFAULT_LR, **(options or {})}
    i = s - 1

    def sample(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        r = stream_rows(model, w, [i, e], mlp_of=i, batch_size=batch_size, skip_prefix=skip_prefix)
        return r["M"], r[f"h{i}"] - r["M"], r[f"h{e}"]

    M, Y, H = sample(windows)
    T = fit_cosine(M, Y, H, epochs=int(opts["epochs"]), lr=float(opts["lr"]))
    eye = torch.eye(T.shape[0], dtype=torch.float64, device=T.device)
    l2 = l2_map(M, Y, H)
    record: dict[str, Any] = {"run": [s, e], "repair": REPAIR, **opts}
    parts = {"calibration": (M, Y, H)}
    if held is not None:
        parts["held"] = sample(held)
    for name, (m, y, h) in parts.items():
        record[name] = {
            "unrepaired": round(cosine_distance(m, y, h, eye), 6),
            "l2": round(cosine_distance(m, y, h, l2), 6),
            "cosine": round(cosine_distance(m, y, h, T), 6),
        }
    fold(model, [RunFit((s, e), "full", T.cpu(), None, 0.0, 0.0, 0.0)])
    return record
