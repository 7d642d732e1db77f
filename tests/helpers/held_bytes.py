"""The most tensor memory a piece of code holds at once, counted op by op: every CPU
tensor an operator returns is followed by a weak reference to its storage, and the peak
is the largest sum of live storages seen after any operator. Deterministic where the
process's resident memory is not (the allocator keeps freed pages), and it counts only
what torch allocates (a safetensors file's mapped pages are the page cache's)."""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class HeldBytes(TorchDispatchMode):
    """Inside `with HeldBytes() as held:`, `held.peak` is the most bytes of tensors that
    were alive at once among those made inside (tensors made before are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                self.live.setdefault(
                    storage.data_ptr(), (StorageWeakRef(storage), storage.nbytes())
                )
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out
