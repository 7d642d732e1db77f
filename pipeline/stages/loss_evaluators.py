"""Loss-guided selection on the fleet: the `Losses` callable that `sleb`, `ppl`,
`lorp-loss` and `finercut` consume, served by Ray actors, and a cache of their selections.

Each `LossWorker` actor loads the dense model once and scores candidate block sets on the
held-out calibration windows (`lorp.scoring.removal_loss.LossEvaluator`: blocks dropped in memory,
no checkpoint written). `RayLosses` splits each batch of candidates over the actors, so the
candidates of one greedy step run in parallel, and records every batch with the time span
each actor spent on its share (`events.jsonl`, event `losses`). The held-out windows are
cut from the calibration split with `seed + 1` and never enter S; the test split is never
used for selection.

Sub-layer points of a loss-guided method (`sleb` at attention, MLP or mixed
granularity, `lorp.methods.sublayer_selection`) ask the same actors about candidate sets
of sub-layer units (`LossEvaluator(units=True)` on the one loaded model), remembered in a
memo of their own. FinerCut (`finercut`, registered with ``measure="js"``) asks the same
actors for the JS divergence of each candidate's outputs from the dense model's instead
of its loss (`LossEvaluator(measure="js")`), remembered apart from the losses.

A loss-guided selection costs minutes, so it is cached by content key (S, the held-out
windows, method, options, budget): a rerun or a resumed job selects instantly. Below that,
every candidate's loss is remembered per model and held-out set (`LossMemo`, persisted in
storage after each batch): selections of one model ask for many of the same candidate sets
(SLEB at 8 blocks repeats SLEB at 4 step for step; `ppl` scores SLEB's first step), and a
job killed mid-selection resumes without re-scoring what it had. A remembered loss is the
number the same worker code computed for the same weights, windows, dtype and device.
Methods still count the evaluations they asked for (`n_evals`, their cost on their own);
`select_s` is the wall time this run spent, which the memo can shorten.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import ray

from lorp import Selection
from lorp.methods.registry import MEASURES, jsonable
from pipeline.cluster.model_source import load_checked
from pipeline.events import timeline
from pipeline.messages import LossTask
from pipeline.spec.evaluation import EvaluationSpec
from pipeline.spec.resources import Resources
from pipeline.stages.settings import StageSettings
from pipeline.storage.store import Storage


def loss_task(
    evaluation: EvaluationSpec, grid: Resources, plan: Any, windows: np.ndarray
) -> LossTask:
    """What every loss worker of `plan`'s model receives: the grid's resources, batches of
    the evaluation's size (larger where the model is streamed)."""
    batch = plan.batch("evaluate", evaluation.batch_size)
    return LossTask(plan.source(), windows, batch, grid)


@ray.remote
class LossWorker:
    """One loaded dense model; scores shares of candidate batches."""

    def __init__(self, task: LossTask, submitted: float | None = None) -> None:
        start = timeline.actor_start(submitted)
        import torch

        from lorp.scoring.removal_loss import LossEvaluator

        torch.set_num_threads(max(1, int(task.resources.num_cpus)))
        device = "cuda" if task.resources.num_gpus > 0 else "cpu"
        self.label = task.model.label
        lm = load_checked(task.model, device)
        windows = torch.from_numpy(task.windows.astype(np.int64))
        self.evaluators = {
            (units, measure): LossEvaluator(
                lm.model, windows, batch_size=task.batch_size, units=units, measure=measure
            )
            for units in (False, True)
            for measure in MEASURES
        }  # one model: blocks or sub-layer units removed in memory
        timeline.report("load", start, time.time(), model=self.label, of="losses")

    def ready(self) -> bool:
        """Answers once the model is loaded: the worker can take candidates."""
        return True

    def score(
        self,
        candidates: list[tuple[int, ...]],
        selection: str = "",
        step: int = 0,
        units: bool = False,
        measure: str = "nll",
    ) -> tuple[list[float], dict[str, Any]]:
        """The loss (`measure` "js": the output's divergence from dense) of each candidate
        set of blocks (`units`: of sub-layer units)."""
        start = time.time()
        losses = self.evaluators[units, measure](candidates)
        end = time.time()
        labels = {"model": self.label, "selection": selection, "step": step, "n": len(candidates)}
        timeline.report("losses", start, end, **labels)
        span = {"pid": os.getpid(), "start": start, "end": end, "n": len(candidates)}
        return losses, span


class LossMemo:
    """Candidate block set -> loss, for one model and held-out set, kept in storage."""

    def __init__(self, store: Storage, key: str, fresh: bool = False) -> None:
        """`fresh` (a forced run) starts empty and overwrites what was kept."""
        self.store, self.name = store, f"{key}.json"
        data = None if fresh else store.read_bytes(self.name)
        pairs = json.loads(data) if data is not None else []
        self.losses: dict[tuple[int, ...], float] = {tuple(c): float(v) for c, v in pairs}

    def missing(self, candidates: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        return [c for c in dict.fromkeys(candidates) if c not in self.losses]

    def add(self, candidates: list[tuple[int, ...]], losses: list[float]) -> None:
        self.losses.update(zip(candidates, losses, strict=True))
        pairs = sorted([list(c), v] for c, v in self.losses.items())
        self.store.write_bytes(self.name, json.dumps(pairs).encode())


class RayLosses:
    """`losses(candidates) -> list[float]` over `n` actors; scores only the candidates
    the memo does not hold, and counts what it scored (`n_evals`). `scorer()` is the same
    over candidate sets of sub-layer units, or by another measure, on the same actors."""

    def __init__(
        self,
        task: LossTask,
        n: int,
        record: Callable[..., None],
        memo: LossMemo,
        note: Callable[[str], None] | None = None,
    ) -> None:
        """`record(candidates=, evaluated=, spans=)` records each batch."""
        res = task.resources
        self.actors = [
            LossWorker.options(
                num_cpus=res.num_cpus, num_gpus=res.num_gpus, max_restarts=2, max_task_retries=2
            ).remote(task, time.time())
            for _ in range(max(1, n))
        ]
        self.starting = {actor.ready.remote(): actor for actor in self.actors}
        self.created = time.monotonic()
        self.started: list[Any] = []
        self.record, self.memo, self.n_evals = record, memo, 0
        self.note = note  # one progress line per scored batch: a SLEB step can take an hour
        self.name, self.steps = "losses", 0  # the selection being made; its requests so far

    measure = "nll"  # what calling this object scores: block sets' losses

    def __call__(self, candidates: list[tuple[int, ...]]) -> list[float]:
        return self.score(candidates, self.memo, units=False)

    def scorer(self, memo: LossMemo, units: bool, measure: str) -> Scorer:
        """`losses` over block (`units`: sub-layer unit) sets, by `measure`, remembered in
        `memo`."""
        return Scorer(self, memo, units, measure)

    def score(
        self, candidates: list[tuple[int, ...]], memo: LossMemo, units: bool, measure: str = "nll"
    ) -> list[float]:
        from pipeline.events.progress import duration

        todo = memo.missing(candidates)
        spans: list[dict[str, Any]] = []
        self.steps += 1
        start = time.perf_counter()
        if todo:
            actors = self._started()
            shares = [todo[i :: len(actors)] for i in range(len(actors))]
            refs = [
                a.score.remote(s, self.name, self.steps, units, measure)
                for a, s in zip(actors, shares, strict=True)
                if s
            ]
            results = ray.get(refs)
            out: list[float] = [0.0] * len(todo)
            for i, (losses, _) in enumerate(results):
                out[i :: len(actors)] = losses
            memo.add(todo, out)
            spans = [s for _, s in results]
        self.n_evals += len(todo)
        self.record(candidates=len(candidates), evaluated=len(todo), spans=spans)
        if todo and self.note is not None:
            served = len(set(candidates)) - len(todo)
            remembered = f", {served} from memo" if served else ""
            self.note(
                f"  {self.name} step {self.steps}: {len(todo)} candidates scored in "
                f"{duration(time.perf_counter() - start)} on {len(spans)} actor"
                f"{'s' if len(spans) > 1 else ''}{remembered}"
            )
        return [memo.losses[c] for c in candidates]

    def _started(self) -> list[Any]:
        """The actors that have loaded their model (waiting for the first when none has):
        a share never waits on an actor still queued for a slot, which other models'
        work may hold for as long as this selection runs."""
        if self.starting:
            grace = 0.0
            if not self.started:  # the first to load; the others get as long again (<= 30 s)
                ray.wait(list(self.starting), num_returns=1)
                grace = min(30.0, max(5.0, time.monotonic() - self.created))
            n = len(self.starting)
            ready, _ = ray.wait(list(self.starting), num_returns=n, timeout=grace)
            for ref in ready:
                actor = self.starting.pop(ref)
                ray.get(ref)  # an actor that cannot load the model fails the selection here
                self.started.append(actor)
        return self.started

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor)


class Scorer:
    """`losses` over block or unit sets by one measure, on `RayLosses`' actors; its
    `measure` lets the method check that it is scored by what it ranks by."""

    def __init__(self, losses: RayLosses, memo: LossMemo, units: bool, measure: str) -> None:
        self.losses, self.memo, self.units, self.measure = losses, memo, units, measure

    def __call__(self, candidates: list[tuple[int, ...]]) -> list[float]:
        return self.losses.score(candidates, self.memo, self.units, self.measure)


class SelectionCache:
    """Selections of loss-guided methods as JSON files, by content key."""

    def __init__(self, store: Storage) -> None:
        self.store = store

    def get(self, key: str) -> tuple[Selection, float] | None:
        data = self.store.read_bytes(f"{key}.json")
        if data is None:
            return None
        d = json.loads(data)
        sel = Selection(
            layers=tuple(d["pruned"]),
            method=d["method"],
            budget=d["budget"],
            n_blocks=d["n_blocks"],
            options=d["options"],
            details=d["details"],
        )
        return sel, float(d.get("select_s", 0.0))

    def put(self, key: str, selection: Selection, seconds: float) -> None:
        record = selection.to_dict() | {"select_s": seconds}
        self.store.write_bytes(f"{key}.json", json.dumps(jsonable(record), sort_keys=True).encode())


class LossSelector:
    """Selections of loss-guided methods for one model: cached, else computed on
    `RayLosses` actors that start on first use and stop with `close()`."""

    def __init__(
        self,
        stage: StageSettings,
        plan: Any,
        stats: Any,
        stats_key: str,
        profile: Any,
        record: Callable[..., None],
        note: Callable[[str], None],
        unit_stats: Any = None,
    ) -> None:
        """`record(candidates=, evaluated=, spans=)` records each scored batch; `note`
        says a log line; `unit_stats`: the sub-layer S, where the job has sub-layer points.
        `stage.force` re-selects and re-scores what the caches hold."""
        self.stage, self.force, self.plan, self.stats = stage, stage.force, plan, stats
        self.profile, self.stats_key = profile, stats_key
        self.record, self.note = record, note
        self.cache = SelectionCache(stage.cache.sub("selections"))
        self.unit_stats = unit_stats
        self.heldout: tuple[np.ndarray, str] | None = None
        self.losses: RayLosses | None = None
        self.memo_key = ""
        self.memos: dict[tuple[bool, str], LossMemo] = {}

    def __call__(self, method: Any, budget: int) -> tuple[Selection, float]:
        from lorp.methods import get_method, select_layers

        measure = get_method(method.name).measure

        def run(losses: RayLosses) -> Selection:
            memo = losses.memo if measure == "nll" else self._memo(False, measure)
            scored = losses.scorer(memo, False, measure)
            return select_layers(
                self.stats,
                budget,
                method.name,
                profile=self.profile,
                losses=scored,
                **method.options,
            )

        return self._cached(method, budget, "block", run)

    def units(self, method: Any, budget: int, granularity: str) -> tuple[Selection, float]:
        """The sub-layer units a loss-guided method removes at `granularity`, scored on
        the same actors (`lorp.methods.sublayer_selection.select_units`)."""
        from lorp.methods.sublayer_selection import loss_measure, select_units

        if self.unit_stats is None:
            raise ValueError(f"granularity {granularity!r}: the sub-layer S was not captured")
        similarity = self.unit_stats.similarity()

        def run(losses: RayLosses) -> Selection:
            measure = loss_measure(method.name)
            by_unit = losses.scorer(self._memo(True, measure), True, measure)
            return select_units(
                similarity, budget, granularity, method.name, losses=by_unit, **method.options
            )

        return self._cached(method, budget, granularity, run)

    def _cached(
        self, method: Any, budget: int, granularity: str, run: Callable[[RayLosses], Selection]
    ) -> tuple[Selection, float]:
        """The selection `run` makes with the actors' losses, or the cache's."""
        from lorp.methods import validate_options
        from pipeline.events.progress import duration
        from pipeline.plan.grid import content_key

        windows, fp = self._heldout()
        options = validate_options(method.name, method.options)
        unit = [] if granularity == "block" else [granularity]
        key = content_key(self.stats_key, fp, method.name, options, budget, *unit)
        hit = None if self.force else self.cache.get(key)
        if hit is not None:
            return hit
        name = f"{self.plan.label} {'-'.join([method.key, *unit])}-b{budget}"
        start = time.perf_counter()  # actor start-up and the memo's read count too
        losses = self._losses(windows, fp)
        losses.name, losses.steps = name, 0
        sel = run(losses)
        seconds = time.perf_counter() - start
        self.cache.put(key, sel, seconds)
        n = sel.details.get("n_evals", 0)
        self.note(f"selected {name}: {n} evaluations in {duration(seconds)}")
        return sel, seconds

    def _heldout(self) -> tuple[np.ndarray, str]:
        if self.heldout is None:
            from pipeline.stages.calibration import heldout_windows
            from pipeline.stages.statistics import plan_tokenizer

            cal, domains = self.plan.calibration, dict(self.stage.domains)
            held = heldout_windows(plan_tokenizer(self.plan), cal, domains)
            self.heldout = held.windows, held.fingerprint
        return self.heldout

    def _losses(self, windows: np.ndarray, heldout_fp: str) -> RayLosses:
        if self.losses is None:
            from pipeline.plan.grid import content_key

            stage = self.stage
            task = loss_task(stage.evaluation, stage.resources.grid, self.plan, windows)
            res = task.resources
            device = "cuda" if res.num_gpus > 0 else "cpu"
            key = content_key(
                self.plan.fingerprint, heldout_fp, self.plan.spec.dtype, task.batch_size, device
            )
            self.memo_key = key
            memo = LossMemo(stage.cache.sub("losses"), key, fresh=self.force)
            n = stage.resources.loss_workers or stage.resources.max_concurrent_points
            self.losses = RayLosses(task, n, self.record, memo, self.note)
        return self.losses

    def _memo(self, units: bool, measure: str) -> LossMemo:
        """The values of sub-layer candidates, or of another measure, kept apart from the
        block candidates' losses (whose memo keeps the key it always had)."""
        if (units, measure) not in self.memos:
            from pipeline.plan.grid import content_key

            store = self.stage.cache.sub("losses")
            parts = [*(["units"] if units else []), *([measure] if measure != "nll" else [])]
            key = content_key(self.memo_key, *parts)
            self.memos[units, measure] = LossMemo(store, key, fresh=self.force)
        return self.memos[units, measure]

    def close(self) -> None:
        if self.losses is not None:
            self.losses.close()
            self.losses = None


@ray.remote
def _repaired_losses(
    task: LossTask, stats: Any, runs: list[tuple[int, int]], ridge: float | None, units: bool
) -> list[float]:
    """`lorp.scoring.window_scores.window_losses` (`units`: of sub-layer units) on one
    worker: the dense model loaded once, each run removed and its map applied in turn,
    scored on the held-out windows."""
    import torch

    from lorp.scoring.window_scores import window_losses

    torch.set_num_threads(max(1, int(task.resources.num_cpus)))
    device = "cuda" if task.resources.num_gpus > 0 else "cpu"
    lm = load_checked(task.model, device)
    windows = torch.from_numpy(task.windows.astype(np.int64))
    got = window_losses(
        lm.model, stats, windows, ridge=ridge, batch_size=task.batch_size, runs=runs, units=units
    )
    return [got[r] for r in runs]


def repaired_window_losses(
    stage: StageSettings,
    plan: Any,
    stats: Any,
    stats_key: str,
    runs: list[tuple[int, int]],
    units: bool = False,
) -> tuple[dict[tuple[int, int], float], int]:
    """Run -> the held-out calibration loss of `plan`'s model with that run removed and
    its fitted map applied (the `window` method's `score: loss`; `units`: runs of
    sub-layer units), and how many were scored now: one task on the grid's resources
    scores the runs its memo does not hold (kept in storage by the repair sums' key, the
    held-out windows and the ridge)."""
    from pipeline.plan.grid import content_key
    from pipeline.stages.calibration import heldout_windows
    from pipeline.stages.statistics import plan_tokenizer

    held = heldout_windows(plan_tokenizer(plan), plan.calibration, dict(stage.domains))
    windows, fp = held.windows, held.fingerprint
    task = loss_task(stage.evaluation, stage.resources.grid, plan, windows)
    res = task.resources
    device = "cuda" if res.num_gpus > 0 else "cpu"
    key = content_key(
        plan.fingerprint,
        fp,
        "repaired",
        stats_key,
        stage.repair.ridge,
        stage.repair.rounds,
        plan.spec.dtype,
        task.batch_size,
        device,
        *(["units"] if units else []),
    )
    memo = LossMemo(stage.cache.sub("losses"), key, fresh=stage.force)
    todo = memo.missing([(int(s), int(e)) for s, e in runs])
    if todo:  # only the runs to score travel: at large d each run's sums are d x d
        call = _repaired_losses.options(num_cpus=res.num_cpus, num_gpus=res.num_gpus, max_retries=2)
        scored = call.remote(task, stats.subset(todo), todo, stage.repair.ridge_value, units)
        memo.add(todo, ray.get(scored))
    return {(int(s), int(e)): memo.losses[(s, e)] for s, e in runs}, len(todo)
