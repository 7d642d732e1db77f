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
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lorp.data.corpora import load_corpus, tokenize_documents
from lorp.data.windows import calibration_windows, eval_windows, prepend_bos, resolve_bos
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
    train = tokenize_documents(tokenizer, load_corpus("ptb", "train"))
    cal = calibration_windows(train, calib[0], calib[1], seed=0, name="ptb train")
    test_docs = tokenize_documents(tokenizer, load_corpus("ptb", "test"))
    ev = eval_windows(torch.cat([torch.as_tensor(d) for d in test_docs]), test[1], test[0])
    return prepend_bos(cal, bos), prepend_bos(ev, bos)


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
        loaded = load_model(alias)
        model, tok = loaded.model, loaded.tokenizer
        bos = resolve_bos(tok)
        skip = 1 if bos is not None else 0
        cal, ev = windows_for(tok, bos, calib, test)
        batches = [cal[i : i + 8] for i in range(0, len(cal), 8)]
        dense = perplexity(model, ev, batch_size=4)
        print(f"{alias}: dense PTB perplexity {dense:.1f} (N = {loaded.n_blocks})", flush=True)
        stats = capture_stats(model, batches, skip_prefix=skip, progress=False)
        for method in args.methods:
            for budget in args.budgets:
                layers = list(select_layers(stats, budget, method).layers)
                row = {"model": alias, "method": method, "blocks": budget, "layers": layers}
                rows.append(row)
                row["dense"] = dense
                pruned = copy.deepcopy(model)
                kept = drop_layers(pruned, layers)
                row["pruned"] = perplexity(pruned, ev, batch_size=4)
                try:
                    runs = check_repairable(model, layers)
                except RepairRefused as exc:
                    row["refused"] = str(exc)
                    print(f"  {method} {budget} {layers}: pruned {row['pruned']:.1f}; {exc}")
                    continue
                start = time.perf_counter()
                rstats = capture_repair_stats(
                    model, batches, runs, skip_prefix=skip, progress=False
                )
                fits = fit_runs(model, rstats, ridge=args.ridge)
                row["fit_s"] = round(time.perf_counter() - start, 1)
                row["fits"] = [f.record() for f in fits]
                repaired = copy.deepcopy(model)
                fold(repaired, fits)
                drop_layers(repaired, layers)
                row["repaired"] = perplexity(repaired, ev, batch_size=4)
                line = f"repaired {row['repaired']:.1f}"
                if any(f.form == "normed" for f in fits):
                    with applied_by_hooks(pruned, full_fits(model, rstats, ridge=args.ridge), kept):
                        row["full_hook"] = perplexity(pruned, ev, batch_size=4)
                    line += f" (full map by hook {row['full_hook']:.1f})"
                if len(runs) > 1:
                    seq = copy.deepcopy(model)
                    prune_and_repair(seq, cal, layers, ridge=args.ridge, skip_prefix=skip)
                    row["sequential"] = perplexity(seq, ev, batch_size=4)
                    line += f", sequential {row['sequential']:.1f}"
                    del seq
                runs_txt = " ".join(f"{s}-{e}" for s, e in contiguous_runs(layers, loaded.n_blocks))
                print(
                    f"  {method} {budget} [{runs_txt}]: pruned {row['pruned']:.1f} -> {line}; "
                    f"fit {row['fit_s']} s",
                    flush=True,
                )
                del pruned, repaired
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
