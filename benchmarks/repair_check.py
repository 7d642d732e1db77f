"""Linear repair on the packaged real models, outside the fleet: PTB test perplexity of
dense, pruned and repaired variants, one line per variant.

    python benchmarks/repair_check.py --models smollm2-135m --methods lorp shortgpt streamline

Protocol: calibration PTB train 64 x 256 (seed 0), evaluation PTB test 16 x 512, BOS as
the tokenizer wants it (kept out of the sums). For a post-MLP-norm family (Gemma 3) the
foldable orthogonal-diagonal map is reported beside the full map applied by hooks (not
foldable: the upper bound). With more than one run, the sequential fit (each run on the
inputs of the model repaired so far) is reported beside the one-pass fit. A run from
block 0 with tied embeddings is refused and reported as such. Uses `lorp/` only: no
Ray, MLflow or vLLM. `--models` takes a checkpoint directory too; the test suite runs
tiny random ones at `--calib 8x64 --test 2x128`.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.inputs import batches_of, evaluation_windows, ptb_calibration  # noqa: E402
from lorp.data.windows import prepend_bos, resolve_bos
from lorp.locality.capture import capture_stats
from lorp.methods import select_layers  # noqa: E402
from lorp.models.loading import load_model
from lorp.models.perplexity import perplexity
from lorp.models.surgery import drop_layers
from lorp.repair.capture import capture_repair_stats
from lorp.repair.fit import check_repairable, fit_runs
from lorp.repair.fold import applied_by_hooks, fold
from lorp.repair.maps import DEFAULT_RIDGE, RepairRefused
from lorp.repair.prune_and_repair import full_fits, prune_and_repair
from lorp.repair.stats import contiguous_runs


def windows_for(tokenizer, bos: int | None, calib: tuple[int, int], test: tuple[int, int]):  # type: ignore[no-untyped-def]
    cal = ptb_calibration(tokenizer, calib[0], calib[1])
    return prepend_bos(cal, bos), evaluation_windows(tokenizer, "ptb", test[0], test[1], bos)


@dataclass
class Setting:
    """One model and its windows: what every variant is fitted and judged on."""

    alias: str
    model: Any
    n_blocks: int
    skip: int
    cal: torch.Tensor
    ev: torch.Tensor
    batches: list[torch.Tensor]
    ridge: float

    def ppl(self, model: Any) -> float:
        return perplexity(model, self.ev, batch_size=4)


def setting(alias: str, calib: tuple[int, int], test: tuple[int, int], ridge: float) -> Setting:
    loaded = load_model(alias)
    model, tok = loaded.model, loaded.tokenizer
    bos = resolve_bos(tok)
    cal, ev = windows_for(tok, bos, calib, test)
    skip = 1 if bos is not None else 0
    return Setting(alias, model, loaded.n_blocks, skip, cal, ev, batches_of(cal, 8), ridge)


def variant(s: Setting, stats: Any, method: str, budget: int, dense: float) -> dict[str, Any]:
    """`method`'s selection at `budget` pruned, then repaired: its row."""
    layers = list(select_layers(stats, budget, method).layers)
    row = {"model": s.alias, "method": method, "blocks": budget, "layers": layers}
    row["dense"] = dense
    pruned = copy.deepcopy(s.model)
    kept = drop_layers(pruned, layers)
    row["pruned"] = s.ppl(pruned)
    try:
        runs = check_repairable(s.model, layers)
    except RepairRefused as exc:
        row["refused"] = str(exc)
        print(f"  {method} {budget} {layers}: pruned {row['pruned']:.1f}; {exc}")
        return row
    line = repaired(s, row, runs, pruned, kept)
    runs_txt = " ".join(f"{a}-{e}" for a, e in contiguous_runs(layers, s.n_blocks))
    print(
        f"  {method} {budget} [{runs_txt}]: pruned {row['pruned']:.1f} -> {line}; "
        f"fit {row['fit_s']} s",
        flush=True,
    )
    return row


def repaired(s: Setting, row: dict[str, Any], runs: Any, pruned: Any, kept: Any) -> str:
    """`row`'s variant repaired (one pass, folded), the full map by hooks beside a normed
    one, the sequential fit beside a one-pass fit of several runs; what to print."""
    model, layers = s.model, row["layers"]
    start = time.perf_counter()
    rstats = capture_repair_stats(model, s.batches, runs, skip_prefix=s.skip, progress=False)
    fits = fit_runs(model, rstats, ridge=s.ridge)
    row["fit_s"] = round(time.perf_counter() - start, 1)
    row["fits"] = [f.record() for f in fits]
    fixed = copy.deepcopy(model)
    fold(fixed, fits)
    drop_layers(fixed, layers)
    row["repaired"] = s.ppl(fixed)
    line = f"repaired {row['repaired']:.1f}"
    if any(f.form == "normed" for f in fits):
        with applied_by_hooks(pruned, full_fits(model, rstats, ridge=s.ridge), kept):
            row["full_hook"] = s.ppl(pruned)
        line += f" (full map by hook {row['full_hook']:.1f})"
    if len(runs) > 1:
        seq = copy.deepcopy(model)
        prune_and_repair(seq, s.cal, layers, ridge=s.ridge, skip_prefix=s.skip)
        row["sequential"] = s.ppl(seq)
        line += f", sequential {row['sequential']:.1f}"
    return line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="+", default=["smollm2-135m"])
    p.add_argument("--methods", nargs="+", default=["lorp", "shortgpt", "streamline"])
    p.add_argument("--budgets", nargs="+", type=int, default=[4, 8])
    p.add_argument("--ridge", type=float, default=DEFAULT_RIDGE)
    p.add_argument("--calib", default="64x256")
    p.add_argument("--test", default="16x512")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    calib = tuple(int(x) for x in args.calib.split("x"))
    test = tuple(int(x) for x in args.test.split("x"))
    rows = []
    for alias in args.models:
        s = setting(alias, calib, test, args.ridge)
        dense = s.ppl(s.model)
        print(f"{alias}: dense PTB perplexity {dense:.1f} (N = {s.n_blocks})", flush=True)
        stats = capture_stats(s.model, s.batches, skip_prefix=s.skip, progress=False)
        for method in args.methods:
            for budget in args.budgets:
                rows.append(variant(s, stats, method, budget, dense))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
