"""What the sub-layer benchmarks (`benchmarks/sublayers.py`, `benchmarks/sublayer_pairs.py`)
measure on: a packaged model and `jobs/quality.yaml`'s calibration, held-out and
evaluation windows, built the same way for both."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from benchmarks.sublayers_report import DOMAINS

ROOT = Path(__file__).resolve().parents[1]


def batches_of(windows: Any, size: int = 8) -> list[Any]:
    import torch

    w = torch.as_tensor(windows)
    return [w[i : i + size] for i in range(0, len(w), size)]


def prepared(alias: str, args: Any) -> Any:
    """What every measurement of `alias` starts from: the model in `args.dtype` and its shape,
    `jobs/quality.yaml`'s calibration (`args.loss_samples` held-out windows per domain): the
    fit's batches, the held-out windows (all, and batched per domain), the BOS to skip, and
    `args.max_windows` evaluation windows per domain of `DOMAINS`."""
    from types import SimpleNamespace

    from lorp.data.windows import resolve_bos
    from lorp.models.loading import load_model
    from lorp.models.shape import ModelShape
    from pipeline.evaluation.metrics import corpus_windows
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
    return SimpleNamespace(
        model=model, tok=tok, shape=ModelShape.from_config(model.config.to_dict()),
        skip=1 if bos is not None else 0, fit=batches_of(cut(), cal.batch_size * 2),
        held_windows=held_out.windows,
        held={d: batches_of(w) for d, w in held_out.by_domain().items()},
        evals={d: corpus_windows(tok, c, ev) for d, c in DOMAINS.items()},
    )  # fmt: skip
