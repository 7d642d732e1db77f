"""Why a measured prefill speed-up can exceed N/(N-k): the timing conditions, one at a time.

    python benchmarks/speed_bound.py [--model smollm2-135m] [--removed 4 8] [--rounds 40]
                                     [--json OUT.json]

Removing k of N identical blocks cannot speed a prefill up by more than N/(N-k). Every
condition below times two model objects alternately in one process (ABBA order, the
garbage collector off, one prefill of `--seq-len` tokens at batch 1, `logits_to_keep=1`)
and prints the ratio of the minima and the median of the per-round ratios, beside the
bound. Conditions:

- `A/A copies`: the dense model against a deep copy of itself (nothing removed). Anything
  but 1.00 is a bias of the conditions, not of pruning.
- `A/A file vs copy`: the dense model as `from_pretrained` made it against a deep copy.
- `copies`: both sides private deep copies, the variant made from the dense copy (the
  speed pass's way).
- `file vs copy`: the dense model as loaded against a pruned deep copy (the way the first
  release and issue 22's figures were made).
- `group rounds`: the speed pass's group timing (`timed_speedups`): the dense model once
  per round and every variant in the same round, both private copies.
- `under load`: `copies` again, 10 rounds at a time as the demo's speed pass, while a
  second process takes one core in bursts (busy 5-40 ms, idle 5-40 ms), as Ray's daemons,
  the driver and MLflow do on a 2-core laptop: the ratio of minima against the median of
  paired ratios, repetition by repetition.
- `per block`: one block of the dense copy and the same block of the pruned copy, each
  timed on the same hidden states: per-block cost with the other blocks gone.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.timing import deep_blocks  # noqa: E402
from lorp.models.loading import load_model  # noqa: E402
from lorp.models.surgery import drop_layers  # noqa: E402
from pipeline.evaluation.speed import speedup_bound, timed_speedups  # noqa: E402


def _ids(model: Any, seq_len: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, int(model.config.vocab_size), (1, seq_len), generator=g)


def _once(model: Any, ids: torch.Tensor) -> float:
    start = time.perf_counter()
    model(input_ids=ids, use_cache=False, logits_to_keep=1)
    return (time.perf_counter() - start) * 1000.0


def alternate(a: Any, b: Any, ids: torch.Tensor, rounds: int) -> dict[str, float]:
    """a / b: ratio of minima and median per-round ratio over `rounds` ABBA rounds."""
    ta, tb = [], []
    gc.collect()
    gc.disable()
    try:
        with torch.inference_mode():
            for _ in range(2):
                _once(a, ids), _once(b, ids)
            for i in range(rounds):
                if i % 2:
                    y, x = _once(b, ids), _once(a, ids)
                else:
                    x, y = _once(a, ids), _once(b, ids)
                ta.append(x)
                tb.append(y)
    finally:
        gc.enable()
    paired = [x / y for x, y in zip(ta, tb, strict=True)]
    return {
        "min_a_ms": min(ta),
        "min_b_ms": min(tb),
        "ratio_of_minima": min(ta) / min(tb),
        "median_paired": statistics.median(paired),
    }


def _bursts(stop: Any) -> None:
    import random

    rng = random.Random(0)
    while not stop.is_set():
        end = time.perf_counter() + rng.uniform(0.005, 0.04)
        while time.perf_counter() < end:
            pass
        time.sleep(rng.uniform(0.005, 0.04))


def under_load(dense: Any, pruned: Any, ids: torch.Tensor, reps: int) -> list[dict[str, float]]:
    """`alternate` over 10 rounds, `reps` times, beside a process busy in bursts."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    stop = ctx.Event()
    load = ctx.Process(target=_bursts, args=(stop,), daemon=True)
    load.start()
    try:
        return [alternate(dense, pruned, ids, 10) for _ in range(reps)]
    finally:
        stop.set()
        load.join()


def per_block(dense: Any, pruned: Any, kept: list[int], ids: torch.Tensor) -> dict[str, float]:
    """Mean over kept blocks of (block in dense copy) / (same block in pruned copy)."""
    from lorp.models.architectures import decoder_stack

    stack_d, stack_p = decoder_stack(dense), decoder_stack(pruned)
    with torch.inference_mode():
        out = dense.model(input_ids=ids, use_cache=False, output_hidden_states=True)
        h = out.hidden_states[0]
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        rot = dense.model.rotary_emb(h, pos)
    ratios, total_d, total_p = [], 0.0, 0.0
    gc.disable()
    try:
        with torch.inference_mode():
            for j, i in enumerate(kept):
                bd, bp = stack_d.layers[i], stack_p.layers[j]
                td = min(_block_ms(bd, h, rot) for _ in range(7))
                tp = min(_block_ms(bp, h, rot) for _ in range(7))
                ratios.append(td / tp)
                total_d += td
                total_p += tp
    finally:
        gc.enable()
    return {
        "block_ratio_median": statistics.median(ratios),
        "blocks_dense_ms": total_d,
        "blocks_pruned_ms": total_p,
    }


def _block_ms(block: Any, h: torch.Tensor, rot: Any) -> float:
    start = time.perf_counter()
    block(h, position_embeddings=rot, attention_mask=None)
    return (time.perf_counter() - start) * 1000.0


class Report:
    """The rows of every condition, each printed as it is measured beside N/(N-k)."""

    def __init__(self, n_blocks: int) -> None:
        self.n = n_blocks
        self.rows: list[dict[str, Any]] = []

    def say(self, name: str, k: int, fig: dict[str, Any]) -> None:
        bound = speedup_bound(self.n, k)
        self.rows.append({"condition": name, "removed": k, "bound": bound, **fig})
        print(
            f"{name:<22} k={k:<2} ratio of minima {fig['ratio_of_minima']:.3f}  median paired "
            f"{fig['median_paired']:.3f}  bound {bound:.3f}  (minima {fig['min_a_ms']:.1f} / "
            f"{fig['min_b_ms']:.1f} ms)",
            flush=True,
        )

    def per_block(self, k: int, fig: dict[str, float]) -> None:
        print(
            f"{'per block':<22} k={k:<2} same block, dense copy / pruned copy: median "
            f"{fig['block_ratio_median']:.3f}; kept blocks {fig['blocks_dense_ms']:.1f} vs "
            f"{fig['blocks_pruned_ms']:.1f} ms",
            flush=True,
        )
        self.rows.append({"condition": "per block", "removed": k, **fig})


def conditions(report: Report, loaded: Any, dense: Any, ids: torch.Tensor, a: Any) -> None:
    """Every condition but the group rounds: A/A, then per `--removed` count the copies,
    file against copy, under load and per block."""
    n = report.n
    report.say("A/A copies", 0, alternate(dense, copy.deepcopy(dense), ids, a.rounds))
    report.say("A/A file vs copy", 0, alternate(loaded, dense, ids, a.rounds))
    for k in a.removed:
        layers = deep_blocks(n, k)  # deep blocks, the boundary kept
        pruned = copy.deepcopy(dense)
        drop_layers(pruned, layers)
        report.say("copies", k, alternate(dense, pruned, ids, a.rounds))
        report.say("file vs copy", k, alternate(loaded, pruned, ids, a.rounds))
        for fig in under_load(dense, pruned, ids, a.load_reps):
            report.say("under load", k, fig)
        kept = [i for i in range(n) if i not in layers]
        report.per_block(k, per_block(dense, pruned, kept, ids))
        del pruned


def group_rounds(report: Report, dense: Any, a: Any) -> None:
    """The speed pass's group timing (`timed_speedups`) of every `--removed` variant and
    a twin of dense, with every run's time recorded for the minima."""
    variants = {}
    for k in a.removed:
        v = copy.deepcopy(dense)
        drop_layers(v, deep_blocks(report.n, k))
        variants[f"k{k}"] = (v, k)
    twin = copy.deepcopy(dense)
    variants["k0"] = (twin, 0)
    group, seen = recorded_group(dense, variants, a.seq_len, report.n, a.rounds)
    for key, (model, k) in variants.items():
        g = group[key]
        fig = {
            "ratio_of_minima": min(seen[id(dense)][1:]) / min(seen[id(model)][1:]),
            "median_paired": g["speedup_measured"],
            "interval": [g["speedup_low"], g["speedup_high"]],
            "min_a_ms": min(seen[id(dense)][1:]),
            "min_b_ms": min(seen[id(model)][1:]),
        }
        report.say("group rounds (medians)", k, fig)


def recorded_group(
    dense: Any, variants: dict[str, Any], seq_len: int, n: int, rounds: int
) -> tuple[dict[str, Any], dict[int, list[float]]]:
    """`timed_speedups` over `rounds` rounds, and every run's time per model (by id)."""
    import pipeline.evaluation.speed as speed

    seen: dict[int, list[float]] = {}
    timer = speed._time_ms

    def recorded(model: Any, ids: torch.Tensor) -> float:  # every run, for the minima
        t = timer(model, ids)
        seen.setdefault(id(model), []).append(t)
        return t

    speed._time_ms = recorded
    try:  # half_width 0: nothing resolves early, every variant is timed in every round
        group = timed_speedups(
            dense, variants, seq_len, n_blocks=n, min_runs=rounds, max_runs=rounds, half_width=0.0
        )
    finally:  # the speed pass's own timer back, for whatever runs next in this process
        speed._time_ms = timer
    return group, seen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--removed", type=int, nargs="+", default=[4, 8])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--load-reps", type=int, default=6, help="repetitions under load")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    lm = load_model(a.model, with_tokenizer=False)
    loaded = lm.model
    report = Report(int(loaded.config.num_hidden_layers))
    ids = _ids(loaded, a.seq_len)
    dense = copy.deepcopy(loaded)
    conditions(report, loaded, dense, ids, a)
    group_rounds(report, dense, a)
    if a.json:
        a.json.write_text(json.dumps(report.rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
