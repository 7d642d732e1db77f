"""The held-out losses the sub-layer study's loss-guided methods select by: SLEB's and
FinerCut's over unit sets (`SelectionLosses`, on a copy in the selection dtype) and
`window`'s over repaired runs of units (`WindowLosses`), each candidate scored once."""

from __future__ import annotations

import copy
import functools
from typing import Any


class SelectionLosses:
    """The loss-guided methods' `losses=` over unit sets, on the held-out calibration
    windows: a `select_dtype` copy of the model (bfloat16 runs on this CPU's AMX at about
    five times float32's speed), made on first use, and every candidate's value remembered
    per measure (NLL; FinerCut's JS divergence), so SLEB at a larger budget replays the
    smaller one's steps for free. `by(measure)` is the callable a method takes."""

    def __init__(self, model: Any, windows: Any, dtype: str) -> None:
        self.model, self.windows, self.dtype = model, windows, dtype
        self.memos: dict[str, dict[tuple[int, ...], float]] = {}
        self.evaluators: dict[str, Any] = {}
        self.copy: Any = None
        self.repair_scores: Any = None
        """`window`'s `repair_scores=` (`WindowLosses`), set where the fit's windows are."""

    @property
    def evaluated(self) -> int:
        return sum(len(m) for m in self.memos.values())

    def by(self, measure: str) -> Any:
        scorer = functools.partial(self.score, measure=measure)
        scorer.measure = measure  # type: ignore[attr-defined]  # checked by the method
        return scorer

    def score(self, candidates: list[tuple[int, ...]], measure: str) -> list[float]:
        memo = self.memos.setdefault(measure, {})
        todo = [c for c in dict.fromkeys(candidates) if c not in memo]
        if todo:
            memo.update(zip(todo, self._evaluator(measure)(todo), strict=True))
        return [memo[c] for c in candidates]

    def _evaluator(self, measure: str) -> Any:
        if measure not in self.evaluators:
            import torch

            from lorp.models.loading import DTYPES
            from lorp.scoring.removal_loss import LossEvaluator

            if self.copy is None:
                self.copy = copy.deepcopy(self.model).to(DTYPES[self.dtype])
            w = torch.as_tensor(self.windows, dtype=torch.long)
            self.evaluators[measure] = LossEvaluator(
                self.copy, w, batch_size=4, units=True, measure=measure
            )
        return self.evaluators[measure]


class WindowLosses:
    """`window`'s `repair_scores=` at mixed granularity: every candidate run's unit sums
    from the fit's windows (validated on the held-out ones), then each repaired variant's
    loss on the held-out windows (`window_losses(units=True)`), on the float32 model; remembered
    per run."""

    def __init__(self, model: Any, fit: Any, held: Any, windows: Any, skip: int) -> None:
        self.model, self.fit, self.held, self.skip = model, fit, held, skip
        self.windows = windows
        self.memo: dict[tuple[int, int], float] = {}

    def __call__(self, runs: list[tuple[int, int]], score: str) -> list[float]:
        import torch

        from lorp.repair.sublayer_repair import unit_stats
        from lorp.scoring.window_scores import window_losses

        assert score == "loss"
        todo = [r for r in runs if r not in self.memo]
        if todo:
            sums = unit_stats(self.model, todo, self.fit, self.held, skip_prefix=self.skip)
            w = torch.as_tensor(self.windows, dtype=torch.long)
            self.memo |= window_losses(self.model, sums, w, batch_size=4, units=True)
        return [self.memo[r] for r in runs]
