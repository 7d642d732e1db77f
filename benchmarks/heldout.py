"""Held-out quality of pruned and repaired variants, outside the fleet: how the ratio to
dense on text nothing was fitted on moves with the repair's ridge, the calibration size
and the calibration mix.

    python benchmarks/heldout.py --models smollm2-135m --calib ptb --tokens 8192 32768
    python benchmarks/heldout.py --calib ptb:1,wiki:1 --ridge auto 0.001 --json out.json
    python benchmarks/heldout.py --methods window --window-score loss   # ranked by loss
    python benchmarks/heldout.py --methods window --followers 0 1 2     # follower maps
    python benchmarks/heldout.py --methods --cuts 8-15 6-9+12-15        # blocks as given
    python benchmarks/heldout.py --methods window --followers 1 --distill 0 2  # distilled

Per model and calibration setting: S and the repair sums from `--tokens` calibration
tokens (windows of 256, BOS per the tokenizer), the held-out calibration windows (8 x 256
of the same mix, seed + 1: what `repair_ridge: auto` validates on), then for each method
at each budget the pruned variant and its repaired twin under each `--ridge` (auto: the
product's validated fit, the ridge chosen on the held-out windows; a number: that ridge;
either way a map no better than none on the held-out windows is not kept), with each
`--followers` count of follower maps (`lorp.repair.followers.fit_followers`, validated)
and each `--distill` count of epochs of distillation (`lorp.repair.distill`, validated).
Perplexity on PTB test and on the Lee news corpus (held out: never calibrated on here
unless named in --calib), `--eval-windows` windows of 512 each (12: 6k tokens;
`jobs/quality.yaml` takes 32), as ratios to dense. Uses `lorp/` only: no Ray, MLflow or
vLLM. `--models` takes a checkpoint directory too: the test suite runs a tiny random one.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.inputs import batches_of, evaluation_windows  # noqa: E402
from lorp.data.corpora import load_corpus, tokenize_documents
from lorp.data.windows import mixed_windows, prepend_bos, resolve_bos
from lorp.locality.capture import capture_stats
from lorp.methods import select_layers  # noqa: E402
from lorp.models.loading import load_model
from lorp.models.perplexity import perplexity
from lorp.models.surgery import drop_layers
from lorp.repair.capture import capture_repair_stats
from lorp.repair.distill import DEFAULT_LR, distill_fits
from lorp.repair.fit import check_repairable, fit_runs
from lorp.repair.fold import fold
from lorp.repair.followers import fit_followers
from lorp.repair.maps import RepairRefused
from lorp.repair.stats import contiguous_runs
from lorp.scoring.window_scores import window_losses, window_scores

SEQ = 256
HELD = 8
EVAL = ("ptb", "lee")


def parse_mix(text: str) -> list[tuple[str, float]]:
    """`ptb` or `ptb:1,wiki:1` -> [(corpus, weight)]."""
    out = []
    for part in text.split(","):
        name, _, weight = part.partition(":")
        out.append((name, float(weight or 1)))
    return out


def calibration(tok: Any, bos: int | None, mix: list[tuple[str, float]], n: int, seed: int):  # type: ignore[no-untyped-def]
    parts = [(tokenize_documents(tok, load_corpus(c, "train")), w, f"{c} train") for c, w in mix]
    windows = mixed_windows(parts, n, SEQ, seed)
    return prepend_bos(windows, bos) if bos is not None else windows


def ppl_all(model: Any, tests: dict[str, torch.Tensor]) -> dict[str, float]:
    return {c: perplexity(model, w, batch_size=4) for c, w in tests.items()}


def one_setting(loaded: Any, args: argparse.Namespace, mix_text: str, tokens: int) -> list[dict]:
    model, tok = loaded.model, loaded.tokenizer
    bos = resolve_bos(tok)
    skip = int(bos is not None)
    mix = parse_mix(mix_text)
    cal = calibration(tok, bos, mix, tokens // SEQ, 0)
    held = calibration(tok, bos, mix, HELD, 1)
    tests = {c: evaluation_windows(tok, c, args.eval_windows, 512, bos) for c in EVAL}
    dense = ppl_all(model, tests)
    ctx = _Setting(model, skip, cal, held, tests, dense, loaded.n_blocks)
    rows = []
    for method, budget, layers in selections(ctx, args):
        base = {
            "model": args.current,
            "calib": mix_text,
            "tokens": tokens,
            "method": method,
            "budget": budget,
            "layers": layers,
        }
        rows += variant_rows(ctx, args, base)
    return rows


@dataclass
class _Setting:
    """One model under one calibration setting: what every variant is fitted and judged on."""

    model: Any
    skip: int
    cal: torch.Tensor
    held: torch.Tensor
    tests: dict[str, torch.Tensor]
    dense: dict[str, float]
    n_blocks: int

    def repair_stats(self, runs, held: bool = True):  # type: ignore[no-untyped-def]
        """The repair sums of `runs` on the calibration windows, with the held-out
        windows' under `.held` (what `fit_runs` validates on, and `window_losses` judges)."""
        kw = {"skip_prefix": self.skip, "progress": False}
        rs = capture_repair_stats(self.model, batches_of(self.cal), runs, **kw)
        if held:
            rs.held = capture_repair_stats(self.model, batches_of(self.held), runs, **kw)
        return rs


def parse_cuts(text: str) -> list[int]:
    """`6-9+12-15` -> [6, 7, 8, 9, 12, 13, 14, 15]: blocks given, not selected."""
    out = []
    for part in text.split("+"):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def selections(ctx: _Setting, args: argparse.Namespace) -> Iterator[tuple[str, int, list[int]]]:
    """(method, budget, blocks removed): each `--methods` at each `--budgets` as the method
    selects on this setting's S, then each `--cuts` as given (method `cuts`)."""
    stats = capture_stats(ctx.model, batches_of(ctx.cal), skip_prefix=ctx.skip, progress=False)
    for method in args.methods:
        for budget in args.budgets:
            kwargs = {}
            if method == "window":
                kwargs = {"repair_scores": _window_scorer(ctx), "score": args.window_score}
            yield method, budget, list(select_layers(stats, budget, method, **kwargs).layers)
    for text in args.cuts:
        layers = parse_cuts(text)
        yield "cuts", len(layers), layers


def _window_scorer(ctx: _Setting):  # type: ignore[no-untyped-def]
    """The `window` method's `repair_scores`: each candidate run's residual or held-out loss."""

    def scores(runs, score):  # type: ignore[no-untyped-def]
        if score == "residual":
            ws = window_scores(ctx.repair_stats(runs, held=False))
        else:
            ws = window_losses(ctx.model, ctx.repair_stats(runs), ctx.held)
        return [ws[r] for r in runs]

    return scores


def variant_rows(ctx: _Setting, args: argparse.Namespace, base: dict) -> list[dict]:
    """The pruned variant of `base["layers"]`, then its repaired twin under each `--ridge`
    and `--followers` count."""
    model, layers = ctx.model, base["layers"]
    pruned = copy.deepcopy(model)
    drop_layers(pruned, layers)
    rows = [base | {"repair": "none"} | _ratios(ppl_all(pruned, ctx.tests), ctx.dense)]
    _say(rows[-1], ctx.n_blocks)
    del pruned
    try:
        runs = check_repairable(model, layers)
    except RepairRefused as exc:
        print(f"  {base['method']} {base['budget']}: {exc}")
        return rows
    rs = ctx.repair_stats(runs)
    for ridge in args.ridge:
        for followers in args.followers:
            value = None if ridge == "auto" else float(ridge)
            start = time.perf_counter()
            fits = fit_runs(model, rs, ridge=value)
            fits += fit_followers(
                model, fits, layers, ctx.cal, ctx.held, followers, ridge=value, skip_prefix=ctx.skip
            )
            fit_s = time.perf_counter() - start
            for epochs in args.distill:
                start = time.perf_counter()
                tuned = distill_fits(
                    model,
                    fits,
                    layers,
                    ctx.cal,
                    ctx.held,
                    epochs=epochs,
                    lr=args.distill_lr,
                    say=lambda line: print(f"    {line}", flush=True),
                )
                repaired = copy.deepcopy(model)
                fold(repaired, tuned)
                drop_layers(repaired, layers)
                repair = f"linear@{ridge}" + (f"+{followers}f" if followers else "")
                repair += f"+kd{epochs}" if epochs else ""
                row = base | {"repair": repair} | _ratios(ppl_all(repaired, ctx.tests), ctx.dense)
                row["fits"] = [f.record() for f in tuned]
                row["fit_s"] = round(fit_s + time.perf_counter() - start, 1)
                rows.append(row)
                _say(row, ctx.n_blocks)
                del repaired
    return rows


def _say(r: dict, n_blocks: int) -> None:
    """One line per variant, as it is measured."""
    runs_txt = " ".join(f"{s}-{e}" for s, e in contiguous_runs(r["layers"], n_blocks))
    kept = ""
    if r.get("fits"):
        kept = " kept " + ",".join(
            f"{f.get('kept', 'fit')}@{f.get('ridge', '')}" for f in r["fits"]
        )
    print(
        f"  {r['calib']:>14} {r['tokens']:>6} {r['method']:>9}@{r['budget']} "
        f"{r['repair']:>14}: ptb x{r['ratio_ptb']:.2f}  lee x{r['ratio_lee']:.2f}  "
        f"[{runs_txt}]{kept}",
        flush=True,
    )


def _ratios(ppl: dict[str, float], dense: dict[str, float]) -> dict[str, float]:
    return {f"ratio_{c}": ppl[c] / dense[c] for c in ppl} | {f"ppl_{c}": ppl[c] for c in ppl}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="+", default=["smollm2-135m"])
    p.add_argument("--methods", nargs="*", default=["shortgpt", "lorp", "window"])
    p.add_argument(
        "--cuts",
        nargs="*",
        default=[],
        help="blocks to remove as given, not selected: 6-9+12-15 (each cut its own map)",
    )
    p.add_argument("--budgets", nargs="+", type=int, default=[8])
    p.add_argument("--calib", nargs="+", default=["ptb"], help="corpus or mix: ptb:1,wiki:1")
    p.add_argument("--tokens", nargs="+", type=int, default=[8192])
    p.add_argument("--ridge", nargs="+", default=["auto", "0.001"])
    p.add_argument(
        "--followers", nargs="+", type=int, default=[0], help="follower maps per cut (each)"
    )
    p.add_argument(
        "--distill",
        nargs="+",
        type=int,
        default=[0],
        help="epochs of distillation of the maps (lorp.repair.distill), each; 0: least squares",
    )
    p.add_argument("--distill-lr", type=float, default=DEFAULT_LR)
    p.add_argument(
        "--window-score",
        choices=("residual", "loss"),
        default="residual",
        help="how the window method ranks its candidates (its `score` option)",
    )
    p.add_argument(
        "--eval-windows",
        type=int,
        default=12,
        help="512-token windows per corpus",
    )
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    rows: list[dict] = []
    for alias in args.models:
        loaded = load_model(alias)
        args.current = alias
        print(f"{alias}: N = {loaded.n_blocks}", flush=True)
        for mix in args.calib:
            for tokens in args.tokens:
                rows += one_setting(loaded, args, mix, tokens)
                if args.json:
                    args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
