"""What the sub-layer scripts (`run.py`, `pairs.py`) measure on, built the same way for
both: a packaged model and `jobs/quality.yaml`'s calibration, held-out and evaluation
windows; and how both measure a variant (perplexity per domain, zero-shot, the repair)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from benchmarks.inputs import batches_of

ROOT = Path(__file__).resolve().parents[2]
DOMAINS = {"prose": "lee", "code": "code"}
"""Domain -> the corpus its perplexity is measured on (prose: the held-out news)."""


@dataclasses.dataclass
class Prepared:
    """A model and its windows: the fit's batches, the held-out windows (all, and batched
    per domain), the BOS prefix to skip, and the evaluation windows per domain."""

    model: Any
    tok: Any
    shape: Any
    skip: int
    fit: list[Any]
    held_windows: Any
    held: dict[str, list[Any]]
    evals: dict[str, Any]

    def ppl(self, model: Any) -> dict[str, float]:
        """`model`'s perplexity on each domain's evaluation windows."""
        from lorp.models.perplexity import perplexity

        return {d: perplexity(model, w, batch_size=4) for d, w in self.evals.items()}

    def zero_shot(self, model: Any, tasks: list[str], limit: int) -> dict[str, float]:
        """`model`'s zero-shot accuracy on `tasks`, the first `limit` items of each."""
        from pipeline.evaluation.zero_shot import hf_zero_shot

        return hf_zero_shot(model, self.tok, list(tasks), limit=limit)

    def repair(
        self, model: Any, units: list[int], sequential: bool = False, distill_epochs: int = 0
    ) -> list[Any]:
        """`units` removed from `model` in place and their repair folded: maps fitted on
        the fit's batches, validated on the held-out ones."""
        from lorp.repair.sublayer_repair import repair_sublayers

        return repair_sublayers(
            model,
            units,
            self.fit,
            held=self.held,
            skip_prefix=self.skip,
            sequential=sequential,
            distill_epochs=distill_epochs,
        )


def maps(fits: list[Any]) -> dict[str, int]:
    """How many of a variant's maps were kept fitted, left out, or distilled."""
    return {k: sum(f.kept == k for f in fits) for k in ("fit", "unrepaired", "distilled")}


def prepared(alias: str, args: Any) -> Prepared:
    """What every measurement of `alias` starts from: the model in `args.dtype` and its shape,
    `jobs/quality.yaml`'s calibration (`args.loss_samples` held-out windows per domain): the
    fit's batches, the held-out windows (all, and batched per domain), the BOS to skip, and
    `args.max_windows` evaluation windows per domain of `DOMAINS`."""
    from lorp.data.windows import resolve_bos
    from lorp.models.loading import load_model
    from lorp.models.shape import ModelShape
    from pipeline.evaluation.corpora import corpus_windows
    from pipeline.spec.parse import load_spec
    from pipeline.stages.calibration import _windows, heldout_windows

    spec = load_spec(ROOT / "jobs" / "quality.yaml")
    cal = dataclasses.replace(spec.calibration, loss_samples=args.loss_samples)
    ev = dataclasses.replace(spec.evaluation, max_windows=args.max_windows)
    loaded = load_model(alias, dtype=args.dtype)
    model, tok = loaded.model, loaded.tokenizer
    bos = resolve_bos(tok, cal.bos)
    cut, _ = _windows(tok, cal, cal.samples, cal.seed, bos)
    held_out = heldout_windows(tok, cal)
    return Prepared(
        model=model,
        tok=tok,
        shape=ModelShape.from_config(model.config.to_dict()),
        skip=1 if bos is not None else 0,
        fit=batches_of(cut(), cal.batch_size * 2),
        held_windows=held_out.windows,
        held={d: batches_of(w) for d, w in held_out.by_domain().items()},
        evals={d: corpus_windows(tok, c, ev) for d, c in DOMAINS.items()},
    )
