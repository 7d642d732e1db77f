"""A model larger than memory, run with one weight matrix resident at a time.

`build_streamed` builds the model's modules without weights (accelerate's
`init_empty_weights`: parameters on the meta device, buffers such as the rotary
frequencies and Gemma's embedding scale computed as usual) and reads from the safetensors
files only the vectors (norms, biases: a few MB even at d = 8192, and what a repair's fit
reads). Every module that owns a matrix (a projection, the embeddings, the LM head) is a
*unit*: a forward pre-hook reads its matrices from the files just before it runs and a
forward hook returns them to the meta device as soon as it has, so at most one unit's
matrices are held at any time, whatever the model's depth, width or vocabulary. The
largest unit bounds the weights' memory (`lorp.models.memory.WeightSize.largest_unit`): at
d = 8192 an MLP projection (0.9 GiB in fp32) or the embeddings, where the whole block
(7 projections) and the embeddings and head together (2 x vocabulary x d) would have
been held.

A mixture of experts' unit is its experts module, which holds one bank per projection
(`gate_up_proj` [E, 2I, d], `down_proj` [E, d, I]) where most files keep one tensor per
expert: the files' tensors are placed by the names `from_pretrained` gives them
(`lorp.models.conversions`), and a bank is built from its experts' tensors by
transformers' own conversion as its unit loads, one bank after the other, and released
with it, so one layer's banks are held at a time (gpt-oss's files keep them whole). A
Mamba mixer that hands its `conv1d.weight` to a kernel without calling `conv1d` loads
that unit through accelerate's hook protocol (`_UnitHook`).

Every forward of the model is then the model's own code on the model's own weights, so
`capture_stats`, `capture_repair_stats`, `perplexity` and the loss methods run on it
unchanged and give the in-memory figures: a batch of B windows reads each matrix once, so
callers pass as many windows per batch as the stage's memory allows (`lorp.models.memory`).
Code that needs the device asks `device_of` (the first parameter, the embeddings, is on
the meta device between forwards).

Surgery works on the blocks as modules (`lorp.models.surgery.drop_layers`, `blocks_dropped`:
the hooks travel with the modules). A repair's fold (`lorp.repair.fold`) changes the
resident vectors in place and a matrix (`down_proj`, or the embeddings) by an override
the streamer serves instead of the file's (one matrix per run); the variant's checkpoint
is written from the files by `lorp.models.file_surgery`, which applies the same fold to the
tensors it changes.
"""

from __future__ import annotations

import logging
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lorp.models.architectures import model_class
from lorp.models.conversions import Entry, FusedEntry, assemble, model_entries
from lorp.models.safetensors_index import TORCH_DTYPES, TensorEntry, tensor_index

log = logging.getLogger(__name__)


def _place(root: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Put `tensor` as the parameter (or buffer) `name` of `root`, replacing what is there."""
    path, _, attr = name.rpartition(".")
    module = root.get_submodule(path) if path else root
    if attr in module._parameters:
        module._parameters[attr] = (
            tensor
            if isinstance(tensor, nn.Parameter)
            else nn.Parameter(tensor, requires_grad=False)
        )
    elif attr in module._buffers:
        module._buffers[attr] = tensor
    else:
        raise ValueError(f"checkpoint tensor {name!r} has no place in the model")


class Unit:
    """A module whose matrices are streamed: read before its forward, released after."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.tensors: list[tuple[str, Entry]] = []
        """(attribute, the file's tensor or the bank built from several) pairs."""


class BlockStreamer:
    """Reads the checkpoint's matrices on demand, one module's at a time."""

    def __init__(
        self, model: nn.Module, index: dict[str, TensorEntry], dtype: torch.dtype, device: str
    ) -> None:
        """The files' tensors `index` placed where `from_pretrained` would load them
        (`lorp.models.conversions`: renamed, expert banks built from their experts')."""
        # Weakly: the model holds the streamer, and a cycle would keep a finished point's
        # resident weights alive until the garbage collector next runs.
        self._model = weakref.ref(model)
        self.dtype = dtype
        self.device = torch.device(device)
        self.units: dict[int, Unit] = {}
        """id(module) -> its unit."""
        self.vectors: list[tuple[nn.Module, str, TensorEntry]] = []
        """Tensors held resident: (module, attribute, entry), the ones under 2 dimensions."""
        self.tied = False
        """The LM head reads the embeddings' matrix (the files hold no head of their own)."""
        self.overrides: dict[str, torch.Tensor] = {}
        """Checkpoint key (a bank's: the model's name) -> a tensor served instead of the
        file's (a repair's fold)."""
        self._meta: dict[str, nn.Parameter] = {}
        """Checkpoint key -> the meta parameter a released unit holds (one per key, so a
        tied head and the embeddings stay one parameter between forwards)."""
        self.loaded: set[int] = set()
        self.reads = 0
        """Unit loads so far (tests count them: each unit once per forward)."""
        for name, entry in model_entries(model, index).items():
            self._assign(model, name, entry)

    def _assign(self, model: nn.Module, name: str, entry: Entry) -> None:
        """Give the model's tensor `name` its entry: a vector to read now, or a matrix
        (or bank) of its module's unit."""
        mpath, _, attr = name.rpartition(".")
        if _legacy(attr):
            return  # computed by the modules themselves, as `from_pretrained` ignores it
        try:
            module = model.get_submodule(mpath) if mpath else model
        except AttributeError:
            raise ValueError(f"checkpoint tensor {entry.key!r} has no place in the model") from None
        if attr not in module._parameters and attr not in module._buffers:
            raise ValueError(f"checkpoint tensor {entry.key!r} has no place in the model")
        if len(entry.shape) < 2 or attr in module._buffers:
            if isinstance(entry, FusedEntry):
                raise ValueError(f"{name!r} is built from several of the files' tensors")
            self.vectors.append((module, attr, entry))
            return
        self.unit(module).tensors.append((attr, entry))

    def unit(self, module: nn.Module) -> Unit:
        u = self.units.get(id(module))
        if u is None:
            u = self.units[id(module)] = Unit(module)
        return u

    def read(self, entry: Entry, convert: bool = True) -> torch.Tensor:
        """One tensor from its file on the streamer's device, floating ones at the model's
        dtype (`convert=False`: at the file's); a bank built from its experts' tensors,
        each read so, by transformers' own conversion (`lorp.models.conversions`)."""
        if isinstance(entry, FusedEntry):
            model = self._model()
            assert model is not None
            built = assemble(entry, lambda part: self.read(part, convert), model)
            return built[entry.key]
        return self._read_file(entry, convert)

    def _read_file(self, entry: TensorEntry, convert: bool) -> torch.Tensor:
        from safetensors import safe_open

        # The file is opened for this tensor only, and the tensor returned owns its
        # memory: a handle kept open would keep every page the forwards touched mapped
        # into this process, and a streamed model would end up holding its whole file
        # (as resident memory a container's limit counts) after one pass.
        with safe_open(str(entry.file), framework="pt") as handle:
            t = handle.get_tensor(entry.key)
            if convert and t.is_floating_point() and t.dtype != self.dtype:
                return t.to(self.dtype).to(self.device)  # a copy already
            if self.device.type != "cpu":
                return t.to(self.device)
            return t.clone()

    def load_vectors(self) -> None:
        """The vectors (norms, biases), once, and the model's computed buffers moved to
        the streamer's device."""
        model = self._model()
        assert model is not None
        for module, attr, entry in self.vectors:
            _place(module, attr, self.read(entry))
        for name, buf in list(model.named_buffers()):
            if buf.device != self.device and buf.device.type != "meta":
                _place(model, name, buf.to(self.device))

    def load(self, u: Unit) -> None:
        """Make unit `u`'s matrices resident (an override, else the file's)."""
        if id(u.module) in self.loaded:
            return
        for attr, entry in u.tensors:
            t = self.overrides.get(entry.key)
            _place(u.module, attr, self.read(entry) if t is None else t)
        self.loaded.add(id(u.module))
        self.reads += 1

    def unload(self, u: Unit) -> None:
        """Return unit `u`'s matrices to the meta device (memory freed)."""
        for attr, entry in u.tensors:
            _place(u.module, attr, self.placeholder(entry))
        self.loaded.discard(id(u.module))

    def placeholder(self, entry: TensorEntry) -> nn.Parameter:
        p = self._meta.get(entry.key)
        if p is None:
            meta = torch.empty(entry.shape, dtype=self.dtype, device="meta")
            p = self._meta[entry.key] = nn.Parameter(meta, requires_grad=False)
        return p

    def streams(self, module: nn.Module, attr: str) -> bool:
        """Whether `attr` of `module` is a streamed matrix (read as its module runs)."""
        u = self.units.get(id(module))
        return u is not None and any(a == attr for a, _ in u.tensors)

    def _entry(self, module: nn.Module, attr: str) -> Entry:
        u = self.units.get(id(module))
        for a, entry in u.tensors if u is not None else ():
            if a == attr:
                return entry
        raise KeyError(f"{attr!r} of {type(module).__name__} is not a streamed matrix")

    def stored(self, module: nn.Module, attr: str) -> torch.Tensor:
        """The matrix `attr` of `module` as its file stores it (the file's dtype); an
        error once it has an override (a fold folds a matrix once: another fold of it
        would start from the file, not from the first)."""
        entry = self._entry(module, attr)
        if entry.key in self.overrides:
            raise ValueError(f"{entry.key!r} is already folded: a matrix is folded once")
        return self.read(entry, convert=False)

    def stored_dtype(self, module: nn.Module, attr: str) -> torch.dtype | None:
        """The floating dtype the files store `attr` of `module` in (a vector's or a
        matrix's); None where they do not have it or it is not floating."""
        names = [e.dtype for m, a, e in self.vectors if m is module and a == attr]
        if not names and id(module) in self.units:
            names = [e.dtype for a, e in self.units[id(module)].tensors if a == attr]
        dtype = TORCH_DTYPES.get(names[0]) if names else None
        return dtype if dtype is not None and dtype.is_floating_point else None

    def override(self, module: nn.Module, attr: str, tensor: torch.Tensor) -> None:
        """From now on `module` runs with `tensor` as `attr` (held in memory: a fold
        changes one matrix per run, so this stays a few matrices)."""
        entry = self._entry(module, attr)
        self.overrides[entry.key] = tensor
        if id(module) in self.loaded:
            _place(module, attr, tensor)

    def overridden(self, module: nn.Module, attr: str) -> torch.Tensor | None:
        """The tensor `module` runs with as `attr` in place of the file's (a fold's), None
        where it has none."""
        return self.overrides.get(self._entry(module, attr).key)

    def attach(self) -> None:
        """Every unit to its placeholder, and the hooks that load and release it: its
        forward's, and accelerate's (`_UnitHook`) for a parent that uses its weight
        without calling it."""
        for u in self.units.values():
            self.unload(u)
            u.module.register_forward_pre_hook(self._loader(u), prepend=True)
            u.module.register_forward_hook(self._releaser(u), always_call=True)
            u.module._hf_hook = _UnitHook(self, u)

    def _loader(self, u: Unit):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: tuple) -> None:
            self.load(u)

        return hook

    def _releaser(self, u: Unit):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            self.unload(u)

        return hook


class _UnitHook:
    """A unit's load and release under accelerate's hook protocol. A Mamba mixer (Bamba,
    Jamba, Nemotron-H, Qwen3-Next, LFM2, ...) passes its `conv1d.weight` to a kernel
    without calling `conv1d`, so the unit's forward hooks never fire; transformers'
    `force_accelerate_hooks` fires a child's `_hf_hook` around the parent's forward for
    exactly that (offloaded weights), and this one reads the unit there."""

    def __init__(self, streamer: BlockStreamer, unit: Unit) -> None:
        self.streamer = streamer  # as the forward hooks' closures hold it
        self.unit = unit

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple:
        self.streamer.load(self.unit)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        self.streamer.unload(self.unit)
        return output


def _legacy(attr: str) -> bool:
    """A tensor old checkpoints carry that today's modules compute (the rotary
    frequencies): `from_pretrained` ignores it with a warning, so does the streamer."""
    return attr == "inv_freq"


def streamer_of(model: nn.Module) -> BlockStreamer | None:
    """The streamer of a model `build_streamed` made, None for a model held whole."""
    return getattr(model, "_lorp_streamer", None)


def device_of(model: nn.Module) -> torch.device:
    """Where `model` computes: its streamer's device, else its first parameter's."""
    streamer = streamer_of(model)
    return streamer.device if streamer is not None else next(model.parameters()).device


def build_streamed(
    path: Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    trust_remote_code: bool = False,
    head: bool = True,
) -> nn.Module:
    """The causal LM of checkpoint directory `path` with its matrices streamed from disk.
    `head=False` gives the LM head no unit (it stays on the meta device): enough for
    capture, which runs the decoder stack only."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    cls = model_class(config)
    with init_empty_weights(include_buffers=False):
        if cls is not None:
            model = cls._from_config(config, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_config(
                config, dtype=dtype, trust_remote_code=trust_remote_code
            )
    index = tensor_index(path)
    if not head:
        index = {k: e for k, e in index.items() if not k.startswith("lm_head.")}
    streamer = BlockStreamer(model, index, dtype, device)
    streamer.load_vectors()
    _tie_or_check(model, streamer, head)
    streamer.attach()
    model._lorp_streamer = streamer  # type: ignore[assignment]
    return model.eval()


def _tie_or_check(model: nn.Module, streamer: BlockStreamer, head: bool) -> None:
    """Give the LM head the embeddings' matrix where transformers ties them (Mistral 3
    ties in its top config, not its text config) and the files hold no head of their own;
    then every parameter must be resident or streamed."""
    lm_head = getattr(model, "lm_head", None)
    embed = model.get_input_embeddings()
    if head and lm_head is not None and id(lm_head) not in streamer.units and _ties_head(model):
        source = streamer.units.get(id(embed))
        if source is not None:
            streamer.unit(lm_head).tensors.append(("weight", source.tensors[0][1]))
            streamer.tied = True
    covered = {(id(u.module), a) for u in streamer.units.values() for a, _ in u.tensors}
    covered |= {(id(m), a) for m, a, _ in streamer.vectors}
    missing = [
        f"{name}.{attr}".lstrip(".")
        for name, m in model.named_modules()
        for attr, p in m._parameters.items()
        if p is not None
        and (id(m), attr) not in covered
        and (head or not name.startswith("lm_head"))
    ]
    if missing:
        raise ValueError(f"checkpoint has no tensor for {missing[0]!r} ({len(missing)} missing)")


def _ties_head(model: nn.Module) -> bool:
    """Whether `from_pretrained` gives the LM head the input embeddings' weight: the head
    among transformers' own tied weights (from the top config's `tie_word_embeddings`)."""
    tied = model.get_expanded_tied_weights_keys(all_submodels=True)  # type: ignore[operator]
    return "lm_head.weight" in tied
