"""LinearPatch (Chen et al., NeurIPS 2025, "A Simple Linear Patch Revives Layer-Pruned
Large Language Models").

Selection: the contiguous run i+1..i+n whose input h_i and output h_{i+n} agree most
by the token mean cosine (the windows of `streamline`, which the paper prunes by).

Repair, at the cut (their Eq. 6-8): rotate the stream by H, the normalised Hadamard
matrix of size d (Sylvester's construction; for a d that is not a power of two the
stream is padded with zeros to the next one, D, and the patch is the top-left d x d
block of the D x D one), scale each rotated channel c by

    s_c = RMS_c(H h_{i+n}) / RMS_c(H h_i)     (RMS over the calibration tokens)

and rotate back: P = H^T diag(s) H. The rotation spreads the few massive-activation
channels over all of them, so one scale per rotated channel matches the magnitudes
the blocks after the cut expect.

Where it folds: into every projection block i writes the stream with, its attention's
`o_proj` and its MLP's `down_proj` (W <- P^T W, b <- b P; `lorp.repair.fold`), so the
checkpoint keeps its family's shapes. The patch then multiplies what block i adds, not
the stream h_{i-1} it adds it to, and the MLP reads the patched attention output: the
state leaving block i becomes x + MLP_i(norm(x)) P with x = h_{i-1} + A_i P (A_i the
attention's output), not h_i P. No weight of the family holds the residual connection,
so no fold gives h_i P; the record keeps the cosine to h_{i+n} of h_i, of h_i P and of
the folded state. A family that puts a norm after its attention and MLP (Gemma 2/3, OLMo
2/3) takes no full matrix there: refused in one line.

Optional distillation (the paper's "+ light training"): P, initialised as above, is
trained towards the dense model's next-token distribution on the calibration windows
and kept at its best held-out epoch, exactly as `lorp.repair.distill` trains lorp's maps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lorp.locality.similarity import LayerSimilarity
from lorp.methods.registry import Selection, register_method
from lorp.methods.streamline import streamline
from lorp.models.architectures import architecture_of, decoder_blocks, text_config
from lorp.models.blocks import Stage
from lorp.models.surgery import blocks_dropped
from lorp.peers.states import mean_cosine, stream_rows
from lorp.repair.fold import fold_into
from lorp.repair.maps import RepairRefused, RunFit
from lorp.repair.stats import contiguous_runs

REPAIR = "hadamard-patch"


@register_method("linear-patch", needs_output_state=True, peer=REPAIR)
def linear_patch(
    similarity: LayerSimilarity, budget: int, *, last_block: bool = False
) -> Selection:
    """LinearPatch: the contiguous run whose input and output agree most."""
    return streamline(similarity, budget, last_block=last_block)


def padded_size(d: int) -> int:
    """The power of two a Hadamard matrix of the stream needs: d itself, or the next."""
    return 1 << max(0, math.ceil(math.log2(d)))


def hadamard(size: int) -> torch.Tensor:
    """Sylvester's Hadamard matrix of `size` (a power of two), over sqrt(size): H H^T = I."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power of two, got {size}")
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < size:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return H / math.sqrt(size)


def rotated(h: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """Rows h [tokens, d] as H h, each padded with zeros to H's size."""
    x = torch.nn.functional.pad(h.double(), (0, H.shape[0] - h.shape[1]))
    return x @ H.T.to(x.device)


def patch_scales(h_in: torch.Tensor, h_out: torch.Tensor) -> torch.Tensor:
    """s_c = RMS_c(H h_out) / RMS_c(H h_in) over the tokens (1 where h_in's is 0)."""
    H = hadamard(padded_size(h_in.shape[1]))
    rms_in = rotated(h_in, H).pow(2).mean(0).sqrt()
    rms_out = rotated(h_out, H).pow(2).mean(0).sqrt()
    return torch.where(rms_in > 0, rms_out / rms_in.clamp_min(1e-300), torch.ones_like(rms_in))


def patch_matrix(s: torch.Tensor, d: int) -> torch.Tensor:
    """P = H^T diag(s) H, restricted to the stream's d channels (float64, rows act: h P)."""
    H = hadamard(len(s)).to(s.device)
    return (H.T @ torch.diag(s.double()) @ H)[:d, :d]


def writers(model: nn.Module, i: int) -> Stage:
    """Block i's every branch (attention and MLP) as one stage, or one line saying why a
    full patch cannot fold into what it writes."""
    arch = architecture_of(model)
    block = decoder_blocks(model)[i]
    layout = arch.layout(block)
    stage = Stage(block, layout.branches, arch.norm_offset)
    refused = arch.repair_refusal or layout.unreadable() or stage.refusal()
    if refused is None and any(b.post_norm for b in layout.branches):
        refused = "it puts a norm after its attention and MLP outputs, where P cannot fold"
    if refused is not None:
        fam = text_config(model.config).model_type
        raise RepairRefused(f"hadamard-patch: family {fam!r}, block {i}: {refused}")
    return stage


def repair_linear_patch(
    model: nn.Module,
    layers: Sequence[int],
    windows: torch.Tensor,
    held: torch.Tensor | Mapping[str, torch.Tensor] | None = None,
    *,
    options: Mapping[str, Any] | None = None,
    batch_size: int = 8,
    skip_prefix: int = 0,
) -> dict[str, Any]:
    """P from the dense `model`'s states on `windows` at the cut `layers` (one run), then
    (`options["distill"]` epochs > 0, with `held`) distilled, folded into block i's
    `o_proj` and `down_proj` in place (the caller drops the blocks). Returns the record."""
    runs = contiguous_runs(layers, len(decoder_blocks(model)))
    if len(runs) != 1 or runs[0][0] == 0:
        raise RepairRefused(f"hadamard-patch: layers must be one run after block 0, got {runs}")
    (s, e), opts = runs[0], {"distill": 0, "lr": 1e-4, **(options or {})}
    stage = writers(model, s - 1)
    kw = {"batch_size": batch_size, "skip_prefix": skip_prefix}
    r = stream_rows(model, windows, [s - 1, e], **kw)
    h_i, h_out = r[f"h{s - 1}"], r[f"h{e}"]
    scales = patch_scales(h_i, h_out)
    P = patch_matrix(scales, h_i.shape[1])
    record: dict[str, Any] = {
        "run": [s, e],
        "repair": REPAIR,
        "padded_to": len(scales),
        "scale_range": [round(float(scales.min()), 6), round(float(scales.max()), 6)],
        "cos_unrepaired": round(mean_cosine(h_i, h_out), 6),
        "cos_patched_stream": round(mean_cosine(h_i.double() @ P, h_out), 6),
    }
    fit = RunFit((s, e), "full", P.cpu(), None, 0.0, 0.0, 0.0)
    if int(opts["distill"]) > 0 and held is not None:
        fit = _distilled(model, layers, stage, fit, windows, held, opts)
        record["distilled"] = fit.distilled
    fold_into(None, stage, fit)
    folded = stream_rows(model, windows, [s - 1], **kw)[f"h{s - 1}"]
    record["cos_folded"] = round(mean_cosine(folded, h_out), 6)
    return record


def _distilled(
    model: nn.Module,
    layers: Sequence[int],
    stage: Stage,
    fit: RunFit,
    windows: torch.Tensor,
    held: torch.Tensor | Mapping[str, torch.Tensor],
    opts: Mapping[str, Any],
) -> RunFit:
    """P trained by `lorp.repair.distill` at both of block i's writing sites."""
    from lorp.repair.distill import Cut, distill_fits

    sites = [site for site, _ in stage.sites()]
    cut = Cut(lambda: blocks_dropped(model, layers), lambda _: sites)
    return distill_fits(
        model, [fit], cut, windows, held, epochs=int(opts["distill"]), lr=float(opts["lr"])
    )[0]
