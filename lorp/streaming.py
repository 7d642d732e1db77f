"""A model larger than memory, run with one block's weights resident at a time.

`load_streamed` builds the model's modules without weights (accelerate's
`init_empty_weights`: parameters on the meta device, buffers such as the rotary
frequencies and Gemma's embedding scale computed as usual), then reads from the
safetensors files what every forward needs whole: the embeddings, the LM head (or ties
it to the embeddings), the final norm, and every block's vectors (norms, biases: a few MB
even at d = 8192, and what a repair's fit reads). A block's matrices are read by a
forward pre-hook just before the block runs and replace the previous block's, which
return to the meta device: at most one block's matrices are held, whatever the depth.

Every forward of the model is then the model's own code on the model's own weights, so
`capture_stats`, `capture_repair_stats`, `perplexity` and the loss methods run on it
unchanged and give the in-memory figures: a batch of B windows reads each block once, so
callers pass as many windows per batch as the stage's memory allows (`lorp.sizing`).
Weights are read through the files' memory maps: the pages are the kernel's file cache,
not the process's anonymous memory, and it can drop them.

Surgery works on the blocks as modules (`lorp.surgery.drop_layers`, `blocks_dropped`:
the hooks travel with the blocks). A repair's fold (`lorp.repair.fold`) changes resident
tensors in place and a block's `down_proj` by an override the streamer serves instead of
the file's (one matrix per run); the variant's checkpoint is written from the files by
`lorp.file_surgery`, which applies the same fold to the tensors it changes.
"""

from __future__ import annotations

import logging
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lorp.architectures import architecture_for, decoder_blocks
from lorp.sizing import TensorEntry, block_of, split_block_key, tensor_index

log = logging.getLogger(__name__)


def _place(root: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Put `tensor` as the parameter (or buffer) `name` of `root`, replacing what is there."""
    path, _, attr = name.rpartition(".")
    module = root.get_submodule(path) if path else root
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
    elif attr in module._buffers:
        module._buffers[attr] = tensor
    else:
        raise ValueError(f"checkpoint tensor {name!r} has no place in the model")


class BlockStreamer:
    """Reads the checkpoint's tensors on demand and keeps one block's matrices resident."""

    def __init__(
        self, model: nn.Module, index: dict[str, TensorEntry], dtype: torch.dtype, device: str
    ) -> None:
        # Weakly: the model holds the streamer, and a cycle would keep a finished point's
        # resident weights alive until the garbage collector next runs.
        self._model = weakref.ref(model)
        self.dtype = dtype
        self.device = torch.device(device)
        self.blocks = list(decoder_blocks(model))
        self._files: dict[Path, Any] = {}
        self.streamed: list[list[tuple[str, TensorEntry]]] = [[] for _ in self.blocks]
        self.outside: list[TensorEntry] = []
        self.small: list[tuple[int, str, TensorEntry]] = []
        for key, entry in index.items():
            b = block_of(key)
            if b is None:
                self.outside.append(entry)
                continue
            if b >= len(self.blocks):
                raise ValueError(
                    f"checkpoint tensor {key!r} is past the model's {len(self.blocks)} blocks"
                )
            rel = split_block_key(key)[2]  # type: ignore[index]
            if len(entry.shape) < 2:
                self.small.append((b, rel, entry))
            else:
                self.streamed[b].append((rel, entry))
        self.overrides: dict[tuple[int, str], torch.Tensor] = {}
        """(block, name) -> a tensor that replaces the file's (a repair's fold)."""
        self.resident: int | None = None
        self.reads = 0
        """Block loads so far (tests count them: one per block per forward)."""

    def read(self, entry: TensorEntry) -> torch.Tensor:
        """One tensor from its file, at the model's dtype (floating ones) on its device."""
        from safetensors import safe_open

        handle = self._files.get(entry.file)
        if handle is None:
            handle = self._files[entry.file] = safe_open(str(entry.file), framework="pt")
        t = handle.get_tensor(entry.key)
        if t.is_floating_point() and t.dtype != self.dtype:
            t = t.to(self.dtype)
        return t.to(self.device)

    def load_resident(self, head: bool = True) -> None:
        """Everything outside the blocks' matrices, once (`head=False`: not the LM head,
        for a worker that only runs the decoder stack: capture)."""
        model = self._model()
        assert model is not None
        for entry in self.outside:
            if head or not entry.key.startswith("lm_head."):
                _place(model, entry.key, self.read(entry))
        for b, rel, entry in self.small:
            _place(self.blocks[b], rel, self.read(entry))
        for name, buf in list(model.named_buffers()):
            if buf.device != self.device and buf.device.type != "meta":
                _place(model, name, buf.to(self.device))

    def load(self, i: int) -> None:
        """Make block `i`'s matrices resident, releasing the previous block's first."""
        if self.resident == i:
            return
        self.release()
        for rel, entry in self.streamed[i]:
            t = self.overrides.get((i, rel))
            _place(self.blocks[i], rel, self.read(entry) if t is None else t)
        self.resident = i
        self.reads += 1

    def tensor(self, i: int, rel: str) -> torch.Tensor:
        """Block `i`'s matrix `rel` as the model runs it (an override, else the file's)."""
        if (i, rel) in self.overrides:
            return self.overrides[(i, rel)]
        for name, entry in self.streamed[i]:
            if name == rel:
                return self.read(entry)
        raise KeyError(f"block {i} has no streamed tensor {rel!r}")

    def override(self, i: int, rel: str, tensor: torch.Tensor) -> None:
        """From now on block `i` runs with `tensor` as `rel` (held in memory: a fold
        changes one matrix per run, so this stays a few matrices)."""
        self.tensor(i, rel)  # the name must be one the files have
        self.overrides[(i, rel)] = tensor
        if self.resident == i:
            _place(self.blocks[i], rel, tensor)

    def release(self) -> None:
        """Return the resident block's matrices to the meta device (memory freed)."""
        if self.resident is None:
            return
        block = self.blocks[self.resident]
        for rel, entry in self.streamed[self.resident]:
            _place(block, rel, torch.empty(entry.shape, dtype=self.dtype, device="meta"))
        self.resident = None

    def attach(self) -> None:
        for i, block in enumerate(self.blocks):
            block.register_forward_pre_hook(self._hook(i), prepend=True)

    def _hook(self, i: int):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: tuple) -> None:
            self.load(i)

        return hook


def streamer_of(model: nn.Module) -> BlockStreamer | None:
    """The streamer of a model `load_streamed` made, None for a model held whole."""
    return getattr(model, "_lorp_streamer", None)


def build_streamed(
    path: Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    trust_remote_code: bool = False,
    head: bool = True,
) -> nn.Module:
    """The causal LM of checkpoint directory `path` with its blocks streamed from disk.
    `head=False` leaves the LM head unread (on the meta device): enough for capture,
    which runs the decoder stack only, and one embedding matrix less in memory."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    architecture_for(getattr(config, "model_type", "<none>"))
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, trust_remote_code=trust_remote_code
        )
    streamer = BlockStreamer(model, tensor_index(path), dtype, device)
    streamer.load_resident(head)
    _tie_or_check(model, config, streamer, head)
    streamer.attach()
    model._lorp_streamer = streamer  # type: ignore[assignment]
    return model.eval()


def _tie_or_check(model: nn.Module, config: Any, streamer: BlockStreamer, head: bool) -> None:
    """Tie the LM head to the embeddings where the config says so and the files hold no
    head of their own; then every parameter must be loaded or streamed from the files."""
    lm_head = getattr(model, "lm_head", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    tied = text.tie_word_embeddings
    if head and lm_head is not None and lm_head.weight.device.type == "meta" and tied:
        lm_head.weight = model.get_input_embeddings().weight
    names = {id(m): n for n, m in model.named_modules()}
    streamed = {
        f"{names[id(block)]}.{rel}"
        for block, entries in zip(streamer.blocks, streamer.streamed, strict=True)
        for rel, _ in entries
    }
    missing = [
        n
        for n, p in model.named_parameters()
        if p.device.type == "meta" and n not in streamed and (head or not n.startswith("lm_head."))
    ]
    if missing:
        raise ValueError(f"checkpoint has no tensor for {missing[0]!r} ({len(missing)} missing)")
