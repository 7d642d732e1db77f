"""What a decoder block adds to the residual stream, read from its modules: its branches
(attention, Mamba, linear attention, short convolution, MLP, mixture of experts), the
norm each may apply to its output before the add, the linear layers that write that
output (where a linear repair folds), and how the branches are arranged.

A block is read by its direct children, not by a family's name, so a family transformers
adds is read the same way: norms are the children whose class is a norm; every other
child with parameters is a branch, its kind told by what it holds:

- a mixture of experts holds an expert bank (`lorp.models.experts`);
- a state-space mixer holds `A_log` (Mamba's class says so; else linear attention);
- a short convolution holds a `conv` and its in and out projections;
- an attention holds its query projection (`q_proj`, `qkv_proj`, `q_a_proj`, ...);
- an MLP holds an output projection (`down_proj`, `c_proj`, `w2`, `output_linear`).

Branches that mix tokens run first (stage 1), those that mix channels after (stage 2).
A block is `parallel` when both stages read the same normed input (Cohere 2, StableLM
with `use_parallel_residual`: one pre-norm for both): then no state lies between them.

A branch's post-norm is the norm the block applies to its output before the add:
`post_self_attn_layernorm` (GLM-4), or `post_attention_layernorm` in a block that also
has `post_feedforward_layernorm` (Gemma 2/3, OLMo 2/3, EXAONE 4, FlexOlmo: elsewhere
that name is the MLP's input norm); `post_feedforward_layernorm` or `post_mlp_layernorm`
after the MLP. Granite's blocks scale every branch by `residual_multiplier`; Falcon-H1's
by `ssm_out_multiplier` and `attn_out_multiplier` (its MLP scales inside itself).

A stage of a block is the branches that add to the residual stream at one step: its
token mixing, or its channel mixing (`Stage`). A repair's map replaces what a stage adds,
M, by M T: the sum of its branches' outputs, each scaled as the block scales it, and T
folds exactly into every linear that writes a branch's output (an output projection,
every routed expert's down projection and every shared expert's, or the latent
projection a MoE sums its experts through), and through the norm where the stage's one
branch normalises its output before the add (`post_norm`).

Families whose block is not `input + sum of its branches' outputs` are named in
`NOT_ADDITIVE`: they are pruned by whole blocks, never repaired or split.

A mixture of experts keeps its routed experts as one module (`experts`) holding fused
banks (transformers 5.19): `gate_up_proj` [E, 2I, d] (or `up_proj` [E, I, d] without a
gate) and `down_proj` [E, d, I], applied as `x @ W[e]^T`; gpt-oss and Llama 4 store them
transposed ([E, d, 2I] and [E, I, d], applied as `x @ W[e]`), gpt-oss with biases. Its
output is `sum_j g_j(x) E_j(x) + shared(x)` (`ExpertBank`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

TOKEN_KINDS = ("attention", "mamba", "linear_attention", "conv")
"""Branches that mix tokens: each keeps a cache (KV) or a state while decoding."""
CHANNEL_KINDS = ("mlp", "moe")
ATTENTION_INPUTS = ("q_proj", "qkv_proj", "q_a_proj", "query_key_value", "c_attn", "Wqkv")
ATTENTION_OUTPUTS = ("o_proj", "out_proj", "dense", "c_proj")
MIXER_OUTPUTS = ("out_proj",)
MLP_OUTPUTS = ("down_proj", "c_proj", "w2", "output_linear", "fc2", "dense_4h_to_h")
SHARED_EXPERTS = ("shared_expert", "shared_experts", "shared_mlp")
"""The attributes a MoE keeps its shared (always-on) experts under."""
ROUTERS = ("gate", "router")
"""The attributes a MoE keeps its router under."""
NOT_ADDITIVE = {
    "minimax": "its residual stream carries the normed state scaled by alpha and beta "
    "(DeepNorm-like), not input + the branches' outputs",
}
"""model_type -> why its blocks are not a sum of branches (no repair, no sub-layers)."""
BRANCH_SCALES = {
    "mamba": ("ssm_out_multiplier",),
    "attention": ("attn_out_multiplier",),
}
"""A branch kind -> the block attributes that may scale its output (Falcon-H1)."""


@dataclass(frozen=True)
class Branch:
    """One thing a block adds to the residual stream."""

    name: str
    """The block's attribute (`self_attn`, `mlp`, `mamba`, `feed_forward`, `mixer`, ...)."""
    kind: str
    """attention, mamba, linear_attention, conv, mlp or moe."""
    post_norm: str | None = None
    """The block's norm applied to the branch's output before the add; None: none."""
    out: str | None = None
    """The linear inside the branch that writes its output (`o_proj`, `down_proj`, ...);
    None for a mixture of experts (its banks and shared experts write it)."""
    scale: str | None = None
    """The block attribute the branch's output is multiplied by before the add."""

    @property
    def mixes_tokens(self) -> bool:
        return self.kind in TOKEN_KINDS


@dataclass(frozen=True)
class BlockLayout:
    """A block's branches, in the order they run, and how they combine."""

    branches: tuple[Branch, ...]
    parallel: bool = False
    """Token and channel mixing read the same normed input: no state lies between."""
    additive: bool = True
    """The block's output is its input plus its branches' (scaled) outputs."""
    unread: tuple[str, ...] = ()
    """Children with weights that are neither a norm nor a branch lorp reads (BART's
    inline `fc1`, `fc2`): what the block adds is not known, so it is not repaired."""

    @property
    def token_mixers(self) -> tuple[Branch, ...]:
        return tuple(b for b in self.branches if b.mixes_tokens)

    @property
    def channel_mixers(self) -> tuple[Branch, ...]:
        return tuple(b for b in self.branches if not b.mixes_tokens)

    @property
    def last_stage(self) -> tuple[Branch, ...]:
        """What the block adds last (its channel mixers, else its token mixers): the
        output a repair's map replaces."""
        return self.channel_mixers or self.token_mixers

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(b.kind for b in self.branches)

    @property
    def kind(self) -> str:
        """The block's kind for a catalog row: its token mixers', `+moe` where its
        channel mixer is a mixture of experts (`attention+moe`, `mamba`, `mlp`)."""
        tokens = "+".join(dict.fromkeys(b.kind for b in self.token_mixers))
        moe = any(b.kind == "moe" for b in self.channel_mixers)
        if not tokens:
            return "+".join(dict.fromkeys(self.kinds)) or "empty"
        return f"{tokens}+moe" if moe else tokens

    def unreadable(self) -> str | None:
        """Why what the block adds is not known (one line), or None."""
        if not self.additive:
            return "its output is not its input plus its branches' outputs"
        if self.unread:
            return f"it holds weights lorp cannot read as a branch ({', '.join(self.unread)})"
        return None

    def splittable(self) -> str | None:
        """Why the block cannot be split into its token and its channel mixing (one line),
        or None: it can (one branch each, run one after the other, adding to the stream)."""
        if self.unreadable():
            return self.unreadable()
        if len(self.token_mixers) != 1 or len(self.channel_mixers) != 1:
            what = "+".join(self.kinds) or "nothing"
            return f"its block is {what}, not one token mixer then one channel mixer"
        if self.parallel:
            return "its attention and MLP read the same input: no state lies between them"
        return None


class Removed(nn.Module):
    """A sub-layer that adds nothing to the residual stream: zeros of its input's shape,
    as a tuple with no weights where the module it stands for returns one."""

    def __init__(self, kind: str, returns_tuple: bool = False) -> None:
        super().__init__()
        self.kind, self.returns_tuple = kind, returns_tuple

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        x = args[0] if args else kwargs["hidden_states"]
        zeros = torch.zeros_like(x)
        return (zeros, None) if self.returns_tuple else zeros

    def extra_repr(self) -> str:
        return f"removed {self.kind}"


def is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def branch_kind(module: nn.Module, name: str = "") -> str | None:
    """What a block's child `name` does (module docstring), None when it is none of them."""
    if find_bank(module) is not None:
        return "moe"
    children = dict(module.named_children())
    if any(p == "A_log" for p, _ in module.named_parameters()):
        mamba = "mamba" in f"{type(module).__name__} {name}".lower()
        return "mamba" if mamba else "linear_attention"
    if "conv" in children and "out_proj" in children and "in_proj" in children:
        return "conv"
    if any(name in children for name in ATTENTION_INPUTS):
        return "attention"
    if _linear(module, MLP_OUTPUTS) is not None:
        return "mlp"
    return None


def _linear(module: nn.Module, names: tuple[str, ...]) -> str | None:
    """The first of `names` that is a Linear child of `module`."""
    children = dict(module.named_children())
    return next((n for n in names if isinstance(children.get(n), nn.Linear)), None)


def output_linear(module: nn.Module, kind: str) -> str | None:
    """The linear that writes a branch's output (None for a mixture of experts)."""
    if kind == "moe":
        return None
    if kind == "attention":
        return _linear(module, ATTENTION_OUTPUTS)
    if kind == "mlp":
        return _linear(module, MLP_OUTPUTS)
    return _linear(module, MIXER_OUTPUTS)


def post_norms(block: nn.Module) -> dict[str, str]:
    """Branch kind group ("token", "channel") -> the block's post-norm after it."""
    names = {n for n, m in block.named_children() if m is not None}
    out = {}
    if "post_self_attn_layernorm" in names:
        out["token"] = "post_self_attn_layernorm"
    elif "post_attention_layernorm" in names and "post_feedforward_layernorm" in names:
        out["token"] = "post_attention_layernorm"
    for name in ("post_feedforward_layernorm", "post_mlp_layernorm"):
        if name in names:
            out["channel"] = name
    return out


def read_block(block: nn.Module, model_type: str = "") -> BlockLayout:
    """The layout of one block (module docstring)."""
    norms = post_norms(block)
    branches, unread = [], []
    for name, child in block.named_children():
        if isinstance(child, Removed):  # a removed sub-layer keeps its place and its kind
            group = "token" if child.kind in TOKEN_KINDS else "channel"
            branches.append(
                Branch(name, child.kind, norms.get(group), None, _scale(block, child.kind))
            )
            continue
        if child is None or is_norm(child) or not any(True for _ in child.parameters()):
            continue
        kind = branch_kind(child, name)
        if kind is None:
            unread.append(name)
            continue
        group = "token" if kind in TOKEN_KINDS else "channel"
        branches.append(
            Branch(name, kind, norms.get(group), output_linear(child, kind), _scale(block, kind))
        )
    post = set(norms.values())
    pre_norms = [n for n, m in block.named_children() if m is not None and is_norm(m)]
    pre_norms = [n for n in pre_norms if n not in post]
    tokens = [b for b in branches if b.mixes_tokens]
    parallel = bool(tokens) and len(tokens) < len(branches) and len(pre_norms) == 1
    return BlockLayout(tuple(branches), parallel, model_type not in NOT_ADDITIVE, tuple(unread))


def _scale(block: nn.Module, kind: str) -> str | None:
    for attr in ("residual_multiplier", *BRANCH_SCALES.get(kind, ())):
        if isinstance(getattr(block, attr, None), int | float):
            return attr
    return None


def block_layouts(blocks: nn.ModuleList, model_type: str = "") -> list[BlockLayout]:
    """Each block's layout, in depth order."""
    return [read_block(b, model_type) for b in blocks]


# -- mixtures of experts --------------------------------------------------------------


@dataclass(frozen=True)
class ExpertBank:
    """Where a MoE branch's experts write their output."""

    experts: str
    """The experts module, relative to the branch (`experts`)."""
    n_experts: int
    transposed: bool
    """The bank is stored [E, I, d] and applied as `x @ W[e]` (gpt-oss, Llama 4)."""
    down_bias: bool
    """The bank has a `down_proj_bias` [E, d] (gpt-oss)."""
    shared: tuple[str, ...] = ()
    """Each shared expert's output linear, relative to the branch."""
    latent_out: str | None = None
    """The linear that projects the experts' sum up from a latent, relative to the branch:
    a map folds there, not into the bank."""

    def out_linears(self) -> tuple[str, ...]:
        """The plain linears a map folds into besides the bank (shared experts, latent)."""
        return (*self.shared, *([self.latent_out] if self.latent_out else []))


def find_bank(branch: nn.Module) -> ExpertBank | None:
    """The expert bank of a MoE branch, None when `branch` holds none."""
    experts = getattr(branch, "experts", None)
    down = getattr(experts, "down_proj", None)
    if not isinstance(down, torch.Tensor) or down.dim() != 3:
        return None
    transposed = _transposed(experts)
    shared = []
    for name in SHARED_EXPERTS:
        module = getattr(branch, name, None)
        if isinstance(module, nn.Module):
            out = output_linear(module, "mlp")
            if out is not None:
                shared.append(f"{name}.{out}")
    latent = "fc2_latent_proj"
    if not isinstance(getattr(branch, latent, None), nn.Linear):
        latent = None
    bias = isinstance(getattr(experts, "down_proj_bias", None), torch.Tensor)
    return ExpertBank("experts", int(down.shape[0]), transposed, bias, tuple(shared), latent)


def _transposed(experts: nn.Module) -> bool:
    """Whether the bank is stored [E, I, d]: the decorator's flag where transformers sets
    it, else from the gate-up bank, whose concatenated 2I side is its last dimension
    when stored transposed (Llama 4: [E, d, 2I])."""
    flag = getattr(experts, "is_transposed", None)
    if isinstance(flag, bool):
        return flag
    gate_up = getattr(experts, "gate_up_proj", None)
    down = experts.down_proj
    if isinstance(gate_up, torch.Tensor) and gate_up.dim() == 3:
        return gate_up.shape[1] == down.shape[2]  # [E, d, 2I] and [E, I, d] share d
    return False


def router_of(branch: nn.Module) -> nn.Module | None:
    for name in ROUTERS:
        module = getattr(branch, name, None)
        if isinstance(module, nn.Module):
            return module
    return None


# -- stages --------------------------------------------------------------------------


@dataclass(frozen=True)
class FoldTarget:
    """A tensor a map folds into, and how: `linear` (an nn.Linear's weight [d, i] or bias
    [d]), `bank` (a routed-expert bank [E, d, I]), `bank_t` (one stored [E, I, d]) or
    `bank_bias` ([E, d])."""

    module: nn.Module
    attr: str
    how: str


@dataclass(frozen=True)
class Stage:
    """One stage of one block: the branches that add to the residual stream at one step."""

    block: nn.Module
    branches: tuple[Branch, ...]
    norm_offset: float = 0.0
    """1 where the family's norms scale by `1 + w`."""

    def module(self, branch: Branch) -> nn.Module:
        return getattr(self.block, branch.name)

    def scale(self, branch: Branch) -> float:
        return float(getattr(self.block, branch.scale)) if branch.scale else 1.0

    @property
    def post_norm(self) -> nn.Module | None:
        """The norm the stage's one branch applies to its output before the add, if any."""
        if len(self.branches) != 1 or self.branches[0].post_norm is None:
            return None
        return getattr(self.block, self.branches[0].post_norm)

    def sites(self) -> list[tuple[nn.Module, float]]:
        """(module, scale): each module whose output, times its scale, the stage adds."""
        out = []
        for b in self.branches:
            site = getattr(self.block, b.post_norm) if b.post_norm else self.module(b)
            out.append((site, self.scale(b)))
        return out

    def fold_targets(self) -> list[FoldTarget]:
        """Every tensor a map on the stage's output folds into (module docstring)."""
        out: list[FoldTarget] = []
        for b in self.branches:
            module = self.module(b)
            if b.kind == "moe":
                out += _moe_targets(module)
            elif b.out is not None:
                linear = getattr(module, b.out)
                out.append(FoldTarget(linear, "weight", "linear"))
                if linear.bias is not None:
                    out.append(FoldTarget(linear, "bias", "linear"))
        return out

    def refusal(self) -> str | None:
        """Why a map on this stage cannot fold exactly (one line), or None."""
        if not self.branches:
            return "it adds nothing to fold a map into"
        if len(self.branches) > 1 and any(b.post_norm for b in self.branches):
            return "its branches normalise their outputs apart"
        missing = [b.name for b in self.branches if b.kind != "moe" and b.out is None]
        if missing:
            return f"{', '.join(missing)} has no output projection to fold a map into"
        return None


def _moe_targets(module: nn.Module) -> list[FoldTarget]:
    bank = find_bank(module)
    assert bank is not None
    out: list[FoldTarget] = []
    if bank.latent_out is not None:  # the experts' sum goes up through one linear
        linear = module.get_submodule(bank.latent_out)
        out.append(FoldTarget(linear, "weight", "linear"))
    else:
        experts = module.get_submodule(bank.experts)
        out.append(FoldTarget(experts, "down_proj", "bank_t" if bank.transposed else "bank"))
        if bank.down_bias:
            out.append(FoldTarget(experts, "down_proj_bias", "bank_bias"))
    for path in bank.shared:
        linear = module.get_submodule(path)
        out.append(FoldTarget(linear, "weight", "linear"))
        if linear.bias is not None:
            out.append(FoldTarget(linear, "bias", "linear"))
    return out
