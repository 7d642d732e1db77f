"""Peak memory of a variant, measured in a fresh process (`peak_memory_fresh`), the speed
pass's second figure (`pipeline.stages.speed_pass`); and a grid point's, phase by phase, on
its worker (`PhaseMarks`, `mark_phase`), the figure its memory plan bounds.

The process is forked from a server that has imported torch and transformers once. It
loads the variant's saved checkpoint (or the dense model, then drops and frees the
blocks), hands the heap's freed pages back, resets the high-water mark (CUDA:
`reset_peak_memory_stats`; Linux CPU: `/proc/self/clear_refs`), runs one prefill and
reads the peak. A reused worker's `ru_maxrss` only grows, so it cannot show what pruning
saves.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import resource
import sys
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any

import torch

from pipeline.evaluation.speed import _ids


def reset_peak_memory(device: torch.device) -> None:
    """Reset the high-water mark: the CUDA allocator's, or this process's resident set."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif Path("/proc/self/clear_refs").exists():
        release_free_heap()
        Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM := VmRSS


@functools.cache
def _libc_function(name: str) -> Any:
    """glibc's function `name` (`malloc_trim`, `mallopt`), None off glibc; the library
    looked up once per process."""
    import ctypes
    import ctypes.util

    path = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(path), name, None) if path else None


def release_free_heap() -> None:
    """Hand the heap's free pages back to the system (glibc's `malloc_trim`), so the
    resident set the mark starts from is what is alive: loading converts every tensor
    (float32 files to bfloat16, say), and the freed buffers would otherwise stay resident
    and count in every variant's figure alike, hiding what dropping blocks saves."""
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim(0)


MMAP_THRESHOLD = 4 << 20
"""Blocks of this many bytes or more get pages of their own, handed back when freed.
glibc's default raises its threshold to the largest block freed (up to 32 MiB) and keeps
up to twice that free at the heap's top: a forward's freed activations stayed resident
(20-60 MB more than the batch's own on Qwen2.5-Coder's evaluation), so a point held more
than its plan, by as much as the points before it had left."""


def fixed_malloc_thresholds() -> None:
    """glibc's mmap and trim thresholds fixed at `MMAP_THRESHOLD` (and twice it), its
    dynamic ones off (`mallopt`); nothing off glibc."""
    mallopt = _libc_function("mallopt")
    if mallopt is not None:
        mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD
        mallopt(-1, 2 * MMAP_THRESHOLD)  # M_TRIM_THRESHOLD


def resident_gib(device: torch.device) -> float:
    """What this process holds now: CUDA memory allocated, or the resident set (VmRSS on
    Linux, after the heap's free pages go back; elsewhere the high-water mark, the best
    figure there is)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**30
    status = Path("/proc/self/status")
    if status.exists():
        release_free_heap()
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20  # kB
    return peak_memory_gib(device)


def peak_memory_gib(device: torch.device) -> float:
    """CUDA peak allocated since the last reset; on CPU the resident high-water mark
    (VmHWM on Linux, reset by `reset_peak_memory`; ru_maxrss elsewhere)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20  # kB
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


SAMPLE_S = 0.002
"""How often a point's anonymous memory is read: what the plan counts lives longer (a
batch's logits for its whole scoring, tens of milliseconds at least)."""


def anonymous_gib() -> float | None:
    """This process's resident anonymous memory (`/proc/self/statm`: resident pages less
    the file-backed and shared ones), None off Linux. Not counted: a safetensors file's
    pages mapped while it loads (the page cache's, dropped under pressure, not this
    process's) and Ray's object store's shared pages."""
    try:
        fields = Path("/proc/self/statm").read_bytes().split()
    except OSError:
        return None
    return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE") / 2**30


class PhaseMarks:
    """The high-water mark of each phase of a grid point above `floor` (GiB): on a CPU
    the resident anonymous memory (`anonymous_gib`), read every `SAMPLE_S` by a thread
    while the point runs (the kernel keeps no anonymous high-water mark; off Linux, the
    process's high-water mark); on CUDA the allocator's peak, reset where a phase starts.
    The point's peak is its largest phase's."""

    def __init__(
        self, device: torch.device, floor: float, left: float = 0.0, resident: float = 0.0
    ) -> None:
        self.device, self.floor, self.resident_floor = device, floor, resident
        self.left = round(left, 4)
        """What earlier points left resident in the process above its floor (caches the
        first point filled), not counted in this point's marks."""
        self.marks: dict[str, float] = {}
        self._phase: str | None = None
        self._high = 0.0
        self._stop = threading.Event()

    def now(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        anon = anonymous_gib()
        return peak_memory_gib(self.device) if anon is None else anon

    def enter(self, phase: str) -> None:
        """End the current phase, its mark kept (the larger where it ran before), and
        start `phase`."""
        self.close()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._phase, self._high = phase, self.now()

    def close(self) -> None:
        if self._phase is not None:
            mark = round(max(0.0, max(self._high, self.now()) - self.floor), 4)
            self.marks[self._phase] = max(self.marks.get(self._phase, 0.0), mark)
        self._phase = None

    def sample(self) -> None:
        """The sampling thread's loop, until `measuring` ends."""
        while not self._stop.wait(SAMPLE_S):
            self._high = max(self._high, self.now())

    @property
    def peak(self) -> float:
        return max(self.marks.values(), default=0.0)

    def resident_peak(self) -> float | None:
        """The point's high-water mark of all its resident memory above `resident_floor`
        (the file pages a load maps too: what a container's limit counts before it
        reclaims them), since `reset_peak_memory`; None on CUDA."""
        if self.device.type == "cuda":
            return None
        return round(max(0.0, peak_memory_gib(self.device) - self.resident_floor), 4)


_MARKS: list[PhaseMarks] = []
"""The marks of the point this process is measuring, if any (`measuring`)."""


@contextmanager
def measuring(marks: PhaseMarks) -> Iterator[PhaseMarks]:
    """Collect the block's `mark_phase` calls into `marks` (the first phase: `start`)."""
    marks.enter("start")
    _MARKS.append(marks)
    sampler = threading.Thread(target=marks.sample, daemon=True, name="point-memory")
    if marks.device.type != "cuda":
        sampler.start()
    try:
        yield marks
    finally:
        marks._stop.set()
        if sampler.is_alive():
            sampler.join()
        _MARKS.remove(marks)
        marks.close()


def mark_phase(phase: str) -> None:
    """Where a point's phase starts (load, fit, gate, fold, save, perplexity ...): its own
    high-water mark from here on; nothing when no point is being measured."""
    if _MARKS:
        _MARKS[-1].enter(phase)


def peak_memory_fresh(
    model_path: str,
    layers: Sequence[int],
    dtype: str,
    device: str,
    seq_len: int,
    units: Sequence[int] = (),
) -> dict[str, float]:
    """`peak_mem_gib` of a variant, measured in a fresh process.

    The process is forked from a server that imported torch and transformers once
    (multiprocessing's forkserver), so each variant costs a fork, not an interpreter start
    and those imports (seconds per variant on a small machine). It starts as a fresh
    interpreter with the same imports would: no model, no CUDA context, no allocator
    history, and it ends after one measurement. `units`: sub-layers removed instead."""
    ctx = _fresh_processes()
    with ProcessPoolExecutor(1, mp_context=ctx, max_tasks_per_child=1) as pool:
        job = pool.submit(
            _peak_memory_here, model_path, list(layers), dtype, device, seq_len, list(units)
        )
        try:
            peak = job.result(timeout=1800)
        except Exception as exc:
            reason = str(exc).strip().splitlines()[-1:] or [type(exc).__name__]
            raise RuntimeError(f"peak-memory process failed: {reason[0]}") from None
    return {"peak_mem_gib": float(peak)}


@functools.cache
def _fresh_processes() -> BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["torch", "transformers", "lorp.models.loading", "pipeline.evaluation.peak_memory"]
    )
    return ctx


def _peak_memory_here(
    model_path: str, layers: list[int], dtype: str, device: str, n: int, units: list[int]
) -> float:
    import gc

    from lorp.models.loading import load_model
    from lorp.models.sublayers import remove_sublayers
    from lorp.models.surgery import drop_layers

    lm = load_model(model_path, dtype=dtype, device=device, with_tokenizer=False)
    if layers:
        drop_layers(lm.model, layers)
    if units:
        remove_sublayers(lm.model, units)
    gc.collect()  # the dropped blocks' tensors go before the mark is reset
    dev = torch.device(device)
    reset_peak_memory(dev)
    with torch.inference_mode():
        lm.model(input_ids=_ids(lm.model, n), use_cache=False, logits_to_keep=1)
    return peak_memory_gib(dev)
