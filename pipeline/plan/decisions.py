"""The pipeline's memory policy, per model and stage: hold the model whole in a worker's
memory (the fastest way, when it fits with `HEADROOM` to spare), stream it a module at a
time (`lorp.models.streaming`), or refuse it in one line when even the largest module's
matrices do not fit. The sizes it weighs come from `lorp.models.memory`.
"""

from __future__ import annotations

from lorp.models.memory import Decision, Stage, WeightSize, gib, stage_activations
from lorp.models.shape import ModelShape

# Share of a worker's memory a stage may plan to use: the rest is the process itself
# (Python, torch, the tokenizer) and the allocator's slack.
HEADROOM = 0.8


class TooLargeError(ValueError):
    """Even one module's matrices at a time do not fit the largest worker; `need_bytes`
    is what the stage needs streamed."""

    def __init__(self, message: str, need_bytes: int) -> None:
        super().__init__(message)
        self.need_bytes = need_bytes


def decide(
    stage: Stage,
    size: WeightSize,
    shape: ModelShape,
    *,
    worker_bytes: int,
    batch: int,
    seq_len: int,
    itemsize: int,
    label: str = "model",
    max_batch: int | None = None,
    kept_bytes: tuple[int, int] = (0, 0),
    copies: int = 1,
    states: int | None = None,
    loads_here: bool = True,
) -> Decision:
    """In memory when loading the model (`WeightSize.load_peak`) and then holding it with
    the stage's activations fit `HEADROOM` of the worker (the decision's `need_bytes`:
    what it holds then, its copies, activations and what is kept); else streamed, when the resident
    vectors, the largest module twice and the activations fit, with as many windows per
    forward as fit (up to `max_batch`); else `TooLargeError` naming the model, the need and
    the worker. `kept_bytes` (most, least): what the stage holds besides, as much as it may
    and at least what it must (a capture worker's repair sums); the decision's `kept_bytes`
    is what it gets. `copies`: the whole copies the in-memory path would like (a CPU grid
    worker keeps the model it loaded and works on a copy), fewer where only those fit;
    `states`, those a capture keeps; `loads_here`: the model loads in this memory (a CPU
    worker's; a GPU worker loads in host memory, then moves the weights over)."""
    most, least = kept_bytes
    load = size.load_peak if loads_here else 0
    acts = stage_activations(stage, shape, batch, seq_len, itemsize, states)
    budget = int(worker_bytes * HEADROOM)
    for n in range(copies, 0, -1):  # the copies asked for, else fewer; loading comes first
        # The worker's own memory holds the copies, the batch and what is kept; loading
        # maps the file's pages beside one copy (the page cache's): they must fit too.
        held = n * size.total + acts + most
        whole = max(held, load)
        if whole <= budget:
            return Decision(stage, "memory", held, whole, worker_bytes, batch, most, n)
    # The largest module's matrices twice: the ones in use and, while they are read, the
    # file's pages they are read (and converted) from. Those pages are the page cache's:
    # the worker's own memory holds the matrices once (a fold's override is kept).
    weights = size.resident + 2 * size.largest_unit
    if weights + acts + least <= budget:
        room = budget - weights
        bounds = (batch, max_batch or batch)
        args = (stage, shape, bounds, seq_len, itemsize, room, kept_bytes, states)
        batch, acts, kept = _streamed(*args)
        need = size.resident + size.largest_unit + acts + kept
        return Decision(stage, "streamed", need, whole, worker_bytes, batch, kept)
    raise _too_large(label, stage, size, acts, least, worker_bytes)


def _too_large(
    label: str, stage: str, size: WeightSize, acts: int, least: int, worker_bytes: int
) -> TooLargeError:
    """What a stage needs streamed and the largest worker has, in one line."""
    need = size.resident + 2 * size.largest_unit + acts + least
    return TooLargeError(
        f"model {label!r} cannot run its {stage} even streamed a module at a time: it needs "
        f"{gib(need)} (resident {gib(size.resident)}, largest module's "
        f"matrices {gib(size.largest_unit)} twice, activations {gib(acts)}"
        f"{f', repair sums {gib(least)}' if least else ''}) and the largest worker has "
        f"{gib(worker_bytes)} ({HEADROOM:.0%} usable)",
        need,
    )


def _streamed(
    stage: Stage,
    shape: ModelShape,
    batches: tuple[int, int],
    seq_len: int,
    itemsize: int,
    room: int,
    kept_bytes: tuple[int, int],
    states: int | None = None,
) -> tuple[int, int, int]:
    """(windows per forward, their activations, what is kept) of a streamed stage with
    `room` bytes beside the weights. Activations grow linearly with the batch: the largest
    that fits beside the least kept, up to the most (a worker's shard; more would only be
    padding), since every batch reads the files once; then as much kept as is left.
    (Evaluation's logits are scored a chunk at a time, the same for any batch: counted
    per window they only make the batch smaller than it could be.)"""
    (batch, max_batch), (most, least) = batches, kept_bytes
    per_window = stage_activations(stage, shape, 1, seq_len, itemsize, states)
    larger = int(max(batch, min(max_batch, (room - least) // max(per_window, 1))))
    acts = stage_activations(stage, shape, larger, seq_len, itemsize, states)
    return larger, acts, min(most, room - acts)
