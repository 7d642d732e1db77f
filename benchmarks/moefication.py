"""MoEfication: a real-weight mixture-of-experts checkpoint made from a packaged dense model,
for expert pruning to be measured on (no MoE checkpoint can be installed here).

    python benchmarks/moefication.py --model smollm2-135m --experts 8 --top-k 2 --out DIR
        [--eval-windows 32] [--seq-len 256] [--calibration-windows 16] [--json FILE]

Each decoder block's SwiGLU MLP (`gate_proj`, `up_proj` [I, d], `down_proj` [d, I]) is cut
into E experts of I/E neurons: balanced spherical k-means on the neurons' normalised
`gate_proj` rows (the gate decides when a neuron fires, so neurons whose gates point alike
fire together), equal sizes kept by a greedy assignment. Expert e holds its neurons' gate
and up rows and down columns, so the E experts summed with weight 1 are the dense MLP.

The router is fitted on calibration text (PTB train and the code corpus's train files,
half each): a least-squares map from the MLP's input to each expert's share of the
token's summed expert-output norms (`||y_e|| / sum_e' ||y_e'||`), so the top-k experts are
the ones predicted to carry most of the token's MLP output. A share, not the norm: it is
scale-free per token, so the few tokens whose MLP output is huge (the first of a window)
do not dominate the fit, and per token it ranks the experts as the norms do.

The family is Qwen2-MoE, not Qwen3-MoE: Qwen3-MoE always RMS-normalises every query and
key head (`q_norm`, `k_norm`), which no weight undoes (SmolLM2's PTB perplexity goes from
84 to 510 with the least-squares-best norm weights), while Qwen2-MoE's attention is
Llama's with Qwen2's optional q/k/v biases, so attention, norms, embeddings and head copy
exactly. Its shared expert is given zero width (and a zero gate): it adds exactly nothing.

Weighting: `norm_topk_prob=True` and every `down_proj` multiplied by k, with the router's
logits scaled to an RMS of `ROUTER_SPREAD` on calibration text, so the top-k softmax
weights are all ~1/k (within about 1%) and each chosen expert adds ~what it adds in the
dense MLP; the ranking (which experts) is that of the fitted router, unchanged by the
scale. With k = E and a zero router, every expert gets exactly 1/E times E: the dense
model, checked on logits (`all_experts_gap`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FAMILIES = ("llama", "qwen2")
"""Dense families whose attention Qwen2-MoE reproduces exactly (qwen2: with q/k/v biases)."""
ROUTER_SPREAD = 1e-2
"""RMS of the saved router's logits on calibration text: small enough that the top-k
softmax weights are flat (each ~1/k), large enough to stay normal numbers in float16."""
RIDGE = 1e-3
"""Ridge of the router's least squares, relative to the mean diagonal of X^T X."""
CALIBRATION = ("ptb", "code")
"""Corpora whose train split the router is fitted on, `--calibration-windows` each."""
EVALUATION = {"prose": "ptb", "code": "code"}
"""Domain -> corpus whose test split perplexity is measured on."""


@dataclass
class ExpertSplit:
    """One MLP cut into experts, in Qwen2-MoE's stored layout: `neurons` [E, I/E] (each
    expert's dense neuron indices, ascending), `gate_up` [E, 2 I/E, d] (gate rows then up
    rows), `down` [E, d, I/E]."""

    neurons: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


# ---- clustering -------------------------------------------------------------------------


def balanced_assign(scores: torch.Tensor, size: int) -> torch.Tensor:
    """Each row of `scores` [n, k] (a neuron) to one column (an expert), exactly `size`
    rows per column: pairs taken best score first, a pair skipped once its neuron is placed
    or its expert full. Deterministic: ties go to the lower flat index."""
    n, k = scores.shape
    if n != size * k:
        raise ValueError(f"{n} neurons do not split into {k} experts of {size}")
    labels, counts, placed = [-1] * n, [0] * k, 0
    for flat in torch.argsort(scores.flatten(), descending=True, stable=True).tolist():
        i, e = divmod(flat, k)
        if labels[i] < 0 and counts[e] < size:
            labels[i], counts[e], placed = e, counts[e] + 1, placed + 1
            if placed == n:
                break
    return torch.tensor(labels)


def balanced_kmeans(
    features: torch.Tensor, clusters: int, seed: int = 0, iterations: int = 30
) -> torch.Tensor:
    """Labels [n] of spherical k-means on `features` [n, f] with every cluster exactly
    n / clusters rows: cosine to unit centroids, `balanced_assign`, centroids re-meaned,
    until the labels stop changing. Starts from `clusters` rows drawn at `seed`."""
    x = F.normalize(features.double(), dim=-1)
    start = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))[:clusters]
    centroids, labels = x[start], None
    for _ in range(iterations):
        new = balanced_assign(x @ centroids.T, len(x) // clusters)
        if labels is not None and torch.equal(new, labels):
            break
        labels = new
        centroids = F.normalize(torch.stack([x[labels == c].mean(0) for c in range(clusters)]))
    assert labels is not None
    return labels


def expert_neurons(labels: torch.Tensor, experts: int) -> torch.Tensor:
    """[E, I/E]: each expert's neurons, ascending; experts ordered by their lowest neuron,
    so the split does not depend on k-means' arbitrary cluster numbering."""
    groups = [torch.nonzero(labels == e).flatten() for e in range(experts)]
    return torch.stack(sorted(groups, key=lambda g: int(g[0])))


def split_mlp(mlp: Any, experts: int, seed: int = 0) -> ExpertSplit:
    """`mlp` (a SwiGLU `gate_proj`/`up_proj`/`down_proj`) cut into `experts` experts by
    `balanced_kmeans` of its `gate_proj` rows."""
    gate, up, down = (
        p.weight.detach().float() for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    )
    neurons = expert_neurons(balanced_kmeans(gate, experts, seed), experts)
    gate_up = torch.cat([gate[neurons], up[neurons]], dim=1)
    return ExpertSplit(neurons, gate_up, down[:, neurons].permute(1, 0, 2).contiguous())


def expert_outputs(x: torch.Tensor, split: ExpertSplit, act: Any) -> torch.Tensor:
    """[E, N, d]: each expert's output (weight 1) on `x` [N, d]; their sum is the MLP's."""
    gate, up = torch.einsum("nd,eid->eni", x, split.gate_up.to(x.dtype)).chunk(2, dim=-1)
    return torch.einsum("eni,edi->end", act(gate) * up, split.down.to(x.dtype))


# ---- router -----------------------------------------------------------------------------


class RouterFit:
    """The least-squares sums of one block's router: X^T X [d, d] and X^T T [d, E] over
    calibration tokens, T each expert's share of the token's summed expert-output norms."""

    def __init__(self, split: ExpertSplit, act: Any) -> None:
        self.split, self.act = split, act
        d = split.gate_up.shape[-1]
        self.xtx = torch.zeros(d, d, dtype=torch.float64)
        self.xtt = torch.zeros(d, len(split.neurons), dtype=torch.float64)
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        """Fold in the MLP inputs `x` [..., d]."""
        x = x.detach().reshape(-1, x.shape[-1]).float()
        norms = expert_outputs(x, self.split, self.act).norm(dim=-1)  # [E, N]
        shares = (norms / norms.sum(0).clamp_min(1e-12)).T
        xd = x.double()
        self.xtx += xd.T @ xd
        self.xtt += xd.T @ shares.double()
        self.tokens += len(x)

    def solve(self) -> torch.Tensor:
        """The router [E, d], its logits' RMS over the calibration tokens `ROUTER_SPREAD`."""
        ridge = RIDGE * self.xtx.diagonal().mean() * torch.eye(len(self.xtx), dtype=torch.float64)
        w = torch.linalg.solve(self.xtx + ridge, self.xtt).T  # [E, d]
        rms = torch.sqrt(torch.einsum("ed,df,ef->", w, self.xtx, w) / (self.tokens * len(w)))
        return (w * (ROUTER_SPREAD / rms)).float()


def fit_routers(model: Any, splits: list[ExpertSplit], windows: torch.Tensor) -> list[torch.Tensor]:
    """Every block's router, fitted on the dense `model`'s MLP inputs over `windows`."""
    fits = [RouterFit(s, layer.mlp.act_fn) for s, layer in zip(splits, blocks(model), strict=True)]
    hooks = [
        layer.mlp.register_forward_pre_hook(lambda _m, args, fit=fit: fit.add(args[0]))
        for fit, layer in zip(fits, blocks(model), strict=True)
    ]
    try:
        with torch.inference_mode():
            for start in range(0, len(windows), 4):
                model(input_ids=windows[start : start + 4], use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return [fit.solve() for fit in fits]


def blocks(model: Any) -> list[Any]:
    """The decoder blocks of a Llama or Qwen2 causal LM."""
    return list(model.model.layers)


# ---- checkpoint -------------------------------------------------------------------------


def moe_config(dense: Any, experts: int, top_k: int) -> Any:
    """The Qwen2-MoE config of `dense` (a Llama or Qwen2 config) cut into `experts` experts,
    `top_k` per token; refused where Qwen2-MoE cannot reproduce its attention exactly."""
    from transformers import Qwen2MoeConfig

    if dense.model_type not in FAMILIES:
        raise ValueError(f"{dense.model_type}: MoEfication takes {', '.join(FAMILIES)} only")
    if getattr(dense, "mlp_bias", False) or (
        dense.model_type == "llama" and getattr(dense, "attention_bias", False)
    ):
        raise ValueError("an MLP or o_proj bias has no place in Qwen2-MoE")
    if getattr(dense, "use_sliding_window", False) or getattr(dense, "sliding_window", None):
        raise ValueError("sliding-window attention is not carried over")
    if dense.intermediate_size % experts:
        raise ValueError(f"{dense.intermediate_size} neurons do not split into {experts}")
    names = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    names += ("num_attention_heads", "num_key_value_heads", "hidden_act", "rms_norm_eps")
    names += ("max_position_embeddings", "tie_word_embeddings", "rope_parameters")
    names += ("pad_token_id", "bos_token_id", "eos_token_id")
    same = {n: getattr(dense, n) for n in names}
    head_dim = getattr(dense, "head_dim", None)
    if head_dim and head_dim != dense.hidden_size // dense.num_attention_heads:
        same["head_dim"] = head_dim
    return Qwen2MoeConfig(
        **same,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=dense.intermediate_size // experts,
        shared_expert_intermediate_size=0,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        qkv_bias=dense.model_type == "qwen2",
        use_sliding_window=False,
        architectures=["Qwen2MoeForCausalLM"],
    )


def moe_state_dict(
    dense: Any, splits: list[ExpertSplit], routers: list[torch.Tensor], top_k: int
) -> dict[str, torch.Tensor]:
    """`dense`'s weights with each block's MLP replaced by its router, its experts (their
    `down` times `top_k`, which the top-k weights of ~1/k undo) and a zero-width shared
    expert whose gate is zero."""
    state = {k: v for k, v in dense.state_dict().items() if ".mlp." not in k}
    d = dense.config.hidden_size
    for i, (split, router) in enumerate(zip(splits, routers, strict=True)):
        p = f"model.layers.{i}.mlp."
        state[p + "gate.weight"] = router
        state[p + "experts.gate_up_proj"] = split.gate_up
        state[p + "experts.down_proj"] = split.down * top_k
        state[p + "shared_expert.gate_proj.weight"] = torch.zeros(0, d)
        state[p + "shared_expert.up_proj.weight"] = torch.zeros(0, d)
        state[p + "shared_expert.down_proj.weight"] = torch.zeros(d, 0)
        state[p + "shared_expert_gate.weight"] = torch.zeros(1, d)
    return state


def build_moe(
    dense: Any, splits: list[ExpertSplit], routers: list[torch.Tensor], top_k: int
) -> Any:
    """The Qwen2-MoE model (float32, eval mode): every weight but the MLPs' is `dense`'s,
    loaded strictly, so a weight Qwen2-MoE has no place for fails here."""
    from transformers import Qwen2MoeForCausalLM

    config = moe_config(dense.config, len(splits[0].neurons), top_k)
    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(config).float()
    model.load_state_dict(moe_state_dict(dense, splits, routers, top_k), strict=True)
    model.generation_config = dense.generation_config
    return model.eval()


def all_experts_gap(dense: Any, splits: list[ExpertSplit], windows: torch.Tensor) -> float:
    """Largest |logit difference| between `dense` and its MoE with every expert chosen
    (top-k = E) under a zero router: weights exactly 1/E, `down` times E, so the MoE is the
    dense model up to float rounding."""
    experts = len(splits[0].neurons)
    zero = [torch.zeros(experts, dense.config.hidden_size) for _ in splits]
    moe = build_moe(dense, splits, zero, experts)
    with torch.inference_mode():
        a = dense(input_ids=windows, use_cache=False).logits
        b = moe(input_ids=windows, use_cache=False).logits
    return float((a - b).abs().max())


def save_checkpoint(moe: Any, tokenizer: Any, out: Path, provenance: dict[str, Any]) -> Path:
    """`moe` (safetensors, its generation config), `tokenizer` and `moefication.json` (how
    it was made) into `out`: a directory AutoModelForCausalLM and AutoTokenizer load."""
    out.mkdir(parents=True, exist_ok=True)
    moe.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "moefication.json").write_text(json.dumps(provenance, indent=2) + "\n")
    return out


# ---- the run ----------------------------------------------------------------------------


def moefy(
    dense: Any, calibration: torch.Tensor, experts: int, top_k: int, seed: int = 0
) -> tuple[Any, list[ExpertSplit]]:
    """`dense` (a Llama or Qwen2 causal LM) as a Qwen2-MoE of `experts` experts per block,
    `top_k` per token, its routers fitted on `calibration` [n, T] token windows."""
    splits = [split_mlp(layer.mlp, experts, seed) for layer in blocks(dense)]
    routers = fit_routers(dense, splits, calibration)
    return build_moe(dense, splits, routers, top_k), splits


def calibration_set(tokenizer: Any, windows: int, seq_len: int) -> torch.Tensor:
    """`windows` windows of `seq_len` tokens from each `CALIBRATION` corpus's train split
    (seed 0's offsets), BOS first where the tokenizer adds one."""
    from lorp.data.corpora import load_corpus, tokenize_documents
    from lorp.data.windows import calibration_windows, prepend_bos, resolve_bos

    parts = [
        calibration_windows(
            tokenize_documents(tokenizer, load_corpus(c, "train")), windows, seq_len, 0, c
        )
        for c in CALIBRATION
    ]
    return prepend_bos(torch.cat(parts), resolve_bos(tokenizer))


def evaluation_set(tokenizer: Any, windows: int, seq_len: int) -> dict[str, torch.Tensor]:
    """Domain -> `windows` consecutive test windows of its `EVALUATION` corpus."""
    from benchmarks.inputs import evaluation_windows
    from lorp.data.windows import resolve_bos

    bos = resolve_bos(tokenizer)
    return {
        d: evaluation_windows(tokenizer, c, windows, seq_len, bos) for d, c in EVALUATION.items()
    }


@contextmanager
def expert_load(moe: Any) -> Iterator[list[torch.Tensor]]:
    """Counts, per block, of the token slots routed to each expert while the context runs
    (k per token): how balanced the fitted routers are."""
    counts = [torch.zeros(moe.config.num_experts) for _ in blocks(moe)]

    def count(i: int) -> Any:
        def hook(_m: Any, _args: Any, out: Any) -> None:  # None: the output is kept
            counts[i] += torch.bincount(out[2].flatten(), minlength=len(counts[i]))

        return hook

    hooks = [layer.mlp.gate.register_forward_hook(count(i)) for i, layer in enumerate(blocks(moe))]
    try:
        yield counts
    finally:
        for h in hooks:
            h.remove()


def load_summary(counts: list[torch.Tensor]) -> dict[str, float]:
    """The least and most used expert's share of its block's slots, over all blocks (1/E
    each where routing is perfectly balanced)."""
    shares = torch.stack([c / c.sum() for c in counts])
    return {"min_share": round(float(shares.min()), 4), "max_share": round(float(shares.max()), 4)}


def measure(dense: Any, moe: Any, evals: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Perplexity of `dense` and `moe` on each domain's windows, the seconds each took, and
    how evenly `moe` routed them."""
    from lorp.models.perplexity import perplexity

    out: dict[str, Any] = {}
    for domain, windows in evals.items():
        for name, model in (("dense", dense), ("moe", moe)):
            start = time.perf_counter()
            with expert_load(moe) as counts:
                out.setdefault(domain, {})[name] = perplexity(model, windows, batch_size=4)
            out[domain][f"{name}_s"] = round(time.perf_counter() - start, 1)
        out[domain]["ratio"] = out[domain]["moe"] / out[domain]["dense"]
        out[domain]["expert_load"] = load_summary(counts)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Load `args.model`, MoEfy it, check the all-experts MoE is the dense model, save the
    top-k checkpoint to `args.out` and measure dense against it."""
    from lorp.models.loading import load_model

    lm = load_model(args.model)
    dense, tokenizer = lm.model, lm.tokenizer
    calibration = calibration_set(tokenizer, args.calibration_windows, args.seq_len)
    evals = evaluation_set(tokenizer, args.eval_windows, args.seq_len)
    start = time.perf_counter()
    moe, splits = moefy(dense, calibration, args.experts, args.top_k, args.seed)
    took = time.perf_counter() - start
    made = {
        "model": args.model,
        "family": "qwen2_moe",
        "experts": args.experts,
        "top_k": args.top_k,
        "clustering": f"balanced spherical k-means of gate_proj rows, seed {args.seed}",
        "router": "least squares onto each expert's share of the output norms, "
        f"logits scaled to RMS {ROUTER_SPREAD}",
        "calibration": f"{args.calibration_windows} x {args.seq_len} tokens of each of "
        + ", ".join(f"{c} train" for c in CALIBRATION),
    }
    save_checkpoint(moe, tokenizer, Path(args.out), made)
    gap = all_experts_gap(dense, splits, evals["prose"][:1])
    result = made | {"moefy_s": round(took, 1), "all_experts_max_logit_gap": gap}
    result["perplexity"] = measure(dense, moe, evals)
    result["eval"] = f"{args.eval_windows} x {args.seq_len} tokens per domain"
    return result


def report(result: dict[str, Any]) -> str:
    """The figures, a line each."""
    lines = [
        f"{result['model']}: {result['experts']} experts, top-{result['top_k']} "
        f"(MoEfied in {result['moefy_s']} s; all experts vs dense: max |logit gap| "
        f"{result['all_experts_max_logit_gap']:.2e})"
    ]
    for domain, p in result["perplexity"].items():
        lines.append(
            f"  {domain}: dense {p['dense']:.2f} ({p['dense_s']} s), MoE {p['moe']:.2f} "
            f"({p['moe_s']} s), {p['ratio']:.2f}x; expert load {p['expert_load']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--out", required=True, help="directory the checkpoint is saved to")
    parser.add_argument("--seed", type=int, default=0, help="k-means' starting centroids")
    parser.add_argument("--calibration-windows", type=int, default=16, help="per corpus")
    parser.add_argument("--eval-windows", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--json", help="write the result here too")
    args = parser.parse_args(argv)
    result = run(args)
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
