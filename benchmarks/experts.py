"""Experts as a pruning axis, measured: REAP, frequency and random expert selection on
mixture-of-experts models made from the packaged dense ones (`benchmarks/moefication.py`).

    python benchmarks/experts.py [--quick] [--models smollm2-135m qwen2.5-coder-0.5b]
        [--runs runs/experts] [--page docs/results/experts.md] [--json FILE] [--cache DIR]

Per model: the dense model MoEfied into 8 experts, top-2 (Qwen2-MoE; the checkpoint cached
under `--cache`, keyed by the dense model's fingerprint, the MoEfication's settings and
`benchmarks/moefication.py`'s text, so a rerun loads it), its perplexity against dense on
each domain (prose: PTB test, code: the code corpus's test files), then the expert
statistics (`capture_stats(experts=True)`) on each calibration (`CALIBRATIONS`: mix, PTB
and code train half each; prose, PTB train only; windows at seed + 1, so not the router's)
and, for each `EXPERT_METHODS` selector at each budget (`BUDGETS`: a quarter and half the
experts), the pruned variant (`lorp.experts.surgery.drop_experts`) measured on the same
test windows. Calibration reads train splits only and evaluation test splits only: they
are disjoint by construction. `random` does not read the statistics: its variant is
measured once and shown under both calibrations. One variant is also written on files
(`write_pruned_files(experts=...)`), reloaded, compared with the one in memory and asked
for a few greedy tokens: the page's sanity line. A model's results go to
`--runs/<model>.json` as soon as it finishes; a rerun renders what is there. `--quick`:
SmolLM2 only, 4 windows wherever there are windows (the check that it runs).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import moefication as mf  # noqa: E402
from benchmarks.inputs import batches_of  # noqa: E402
from benchmarks.pages import markers, replace_section, table  # noqa: E402
from lorp.experts.selection import EXPERT_METHODS, resolve_expert_budget, select_experts  # noqa: E402

BEGIN, END = markers("experts")
MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b")
CALIBRATIONS = {"mix": (("ptb", 1.0), ("code", 1.0)), "prose": (("ptb", 1.0),)}
"""Calibration -> (corpus, weight) parts, train splits."""
DOMAINS = mf.EVALUATION
"""Domain -> the corpus whose test split it is measured on."""
BUDGETS = (0.25, 0.5)
"""Fractions of each layer's routed experts removed."""
PROMPTS = ("The company said that", "def fibonacci(n):")
NEW_TOKENS = 12
SANITY = ("mix", 0.25, "reap")
"""The variant (calibration, budget, method) written on files and generated from."""


@dataclass(frozen=True)
class Settings:
    models: tuple[str, ...] = MODELS
    experts: int = 8
    top_k: int = 2
    seq_len: int = 256
    moefy_windows: int = 16
    """Per corpus, the router's fit (`moefication.calibration_set`)."""
    calibration_windows: int = 16
    """In all, the expert statistics of each calibration."""
    eval_windows: int = 8
    """Per domain."""
    seed: int = 0


QUICK = {"models": MODELS[:1], "moefy_windows": 4, "calibration_windows": 4, "eval_windows": 4}


# ---- the MoEfied checkpoint -------------------------------------------------------------


def checkpoint_key(fingerprint: str, s: Settings) -> str:
    """What the MoEfied checkpoint depends on, hashed: the dense weights, the settings the
    MoEfication reads and the script that makes it."""
    source = (ROOT / "benchmarks" / "moefication.py").read_bytes()
    made = [fingerprint, s.experts, s.top_k, s.seed, s.moefy_windows, s.seq_len]
    made.append(hashlib.sha256(source).hexdigest())
    return hashlib.sha256(json.dumps(made).encode()).hexdigest()[:16]


def moefied(lm: Any, s: Settings, cache: Path) -> tuple[Path, bool]:
    """The MoEfied checkpoint of `lm` (a `LoadedModel`) under `cache`, made where it is not
    there yet (written aside and renamed, so a stopped run leaves none half-written), and
    whether it was made now."""
    out = cache / checkpoint_key(lm.fingerprint, s)
    if (out / "moefication.json").is_file():
        return out, False
    windows = mf.calibration_set(lm.tokenizer, s.moefy_windows, s.seq_len)
    moe, _ = mf.moefy(lm.model, windows, s.experts, s.top_k, s.seed)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    made = {"model": lm.ref, "experts": s.experts, "top_k": s.top_k, "seed": s.seed}
    made["router_windows"] = f"{s.moefy_windows} x {s.seq_len} of each of ptb, code train"
    mf.save_checkpoint(moe, lm.tokenizer, partial, made)
    partial.rename(out)
    return out, True


def load_moe(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


# ---- measuring --------------------------------------------------------------------------


def evaluate(model: Any, evals: dict[str, torch.Tensor]) -> dict[str, float]:
    from lorp.models.perplexity import perplexity

    return {d: perplexity(model, w, batch_size=4) for d, w in evals.items()}


def parameters(model: Any, top_k: int) -> dict[str, int]:
    """Total parameters (tied ones once, embeddings included) and those one token uses:
    all but the routed experts it is not routed to."""
    from lorp.experts.layers import moe_layers

    total = sum(p.numel() for p in model.parameters())
    idle = 0
    for layer in moe_layers(model):
        bank = sum(p.numel() for p in layer.experts.parameters())
        idle += bank // layer.n_experts * (layer.n_experts - top_k)
    return {"total": total, "active": total - idle}


def calibration(tokenizer: Any, name: str, s: Settings) -> torch.Tensor:
    """`s.calibration_windows` windows of calibration `name`, at seed + 1 (the router was
    fitted on seed 0's), BOS first where the tokenizer adds one."""
    from lorp.data.corpora import load_corpus, tokenize_documents
    from lorp.data.windows import mixed_windows, prepend_bos, resolve_bos

    parts = [
        (tokenize_documents(tokenizer, load_corpus(c, "train")), w, f"{c} train")
        for c, w in CALIBRATIONS[name]
    ]
    windows = mixed_windows(parts, s.calibration_windows, s.seq_len, s.seed + 1)
    return prepend_bos(windows, resolve_bos(tokenizer))


def expert_stats(model: Any, windows: torch.Tensor, skip: int) -> Any:
    """The routed experts' sums (`ExpertStats`) over `windows`, a BOS prefix left out."""
    from lorp.locality.capture import capture_stats

    stats = capture_stats(
        model, batches_of(windows, 4), experts=True, skip_prefix=skip, progress=False
    )
    return stats.experts


def pruned(moe: Any, removed: dict[int, tuple[int, ...]]) -> Any:
    """A copy of `moe` without the `removed` experts."""
    from lorp.experts.surgery import drop_experts

    model = copy.deepcopy(moe)
    drop_experts(model, removed)
    return model


@dataclass
class Bench:
    """One MoEfied model and what every variant of it is measured on."""

    moe: Any
    evals: dict[str, torch.Tensor]
    base: dict[str, float]
    top_k: int
    measured: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    def measure(self, removed: dict[int, tuple[int, ...]]) -> dict[str, Any]:
        """Perplexity per domain, ratios to the MoEfied model and parameters of the variant
        without `removed`; measured once per distinct cut."""
        key = json.dumps(sorted(removed.items()))
        if key not in self.measured:
            start = time.perf_counter()
            model = pruned(self.moe, removed)
            ppl = evaluate(model, self.evals)
            ratio = {d: ppl[d] / self.base[d] for d in ppl}
            self.measured[key] = {
                "ppl": ppl,
                "ratio": ratio,
                "worst": max(ratio.values()),
                "params": parameters(model, self.top_k),
                "seconds": round(time.perf_counter() - start, 1),
            }
        return self.measured[key]


def rerouted(stats: Any, removed: dict[int, tuple[int, ...]]) -> float:
    """The share of the calibration's routing slots that went to a removed expert."""
    shares = [
        stats.routed[row, list(removed[block])].sum() / stats.routed[row].sum()
        for row, block in enumerate(stats.layers)
    ]
    return round(float(sum(shares) / len(shares)), 4)


def variant_rows(bench: Bench, tokenizer: Any, skip: int, s: Settings) -> list[dict[str, Any]]:
    """Every calibration x budget x method: the row of its variant."""
    rows = []
    for cal in CALIBRATIONS:
        stats = expert_stats(bench.moe, calibration(tokenizer, cal, s), skip)
        for budget in BUDGETS:
            count = resolve_expert_budget(budget, s.experts, s.top_k)
            for method in EXPERT_METHODS:
                sel = select_experts(stats, count, method, seed=s.seed)
                removed = dict(sel.removed)
                row = {"calibration": cal, "budget": budget, "method": method, "kept": sel.kept}
                row |= {"removed": sel.as_dict(), "rerouted": rerouted(stats, removed)}
                rows.append(row | bench.measure(removed))
                print(f"  {cal} {method} {budget}: {rows[-1]['ppl']}", flush=True)
    return rows


# ---- the check of outputs ---------------------------------------------------------------


def generations(model: Any, tokenizer: Any) -> list[str]:
    """`NEW_TOKENS` greedy tokens after each of `PROMPTS`."""
    out = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            made = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        out.append(tokenizer.decode(made[0, ids.shape[1] :], skip_special_tokens=True))
    return out


def sanity(bench: Bench, path: Path, rows: list[dict[str, Any]], tokenizer: Any) -> dict:
    """The `SANITY` variant written on files from the MoEfied checkpoint, reloaded: its
    config, its largest logit gap to the variant made in memory, and its greedy tokens."""
    from lorp.models.file_surgery import write_pruned_files

    row = next(r for r in rows if (r["calibration"], r["budget"], r["method"]) == SANITY)
    removed = {int(b): tuple(e) for b, e in row["removed"].items()}
    window = next(iter(bench.evals.values()))[:1]
    with tempfile.TemporaryDirectory() as tmp:
        out = write_pruned_files(path, Path(tmp) / "variant", [], {}, experts=removed)
        files = load_moe(out)
        with torch.inference_mode():
            a = files(input_ids=window).logits
            b = pruned(bench.moe, removed)(input_ids=window).logits
        text = generations(files, tokenizer)
    return {
        "variant": dict(zip(("calibration", "budget", "method"), SANITY, strict=True)),
        "num_experts": files.config.num_experts,
        "logit_gap": float((a - b).abs().max()),
        "finite": bool(torch.isfinite(a).all()),
        "generated": text,
    }


# ---- one model --------------------------------------------------------------------------


def measure_model(alias: str, s: Settings, cache: Path) -> dict[str, Any]:
    """Dense, MoEfied and every variant of `alias` (module docstring)."""
    from lorp.data.windows import resolve_bos
    from lorp.models.loading import load_model

    start = time.perf_counter()
    lm = load_model(alias)
    path, made = moefied(lm, s, cache)
    evals = mf.evaluation_set(lm.tokenizer, s.eval_windows, s.seq_len)
    result: dict[str, Any] = {"model": Path(alias).name, "moefied_now": made}
    result["dense"] = {"ppl": evaluate(lm.model, evals), "params": parameters(lm.model, 0)}
    result["dense"]["generated"] = generations(lm.model, lm.tokenizer)
    tokenizer, skip = lm.tokenizer, int(resolve_bos(lm.tokenizer) is not None)
    del lm
    moe = load_moe(path)
    base = evaluate(moe, evals)
    result["moe"] = {"ppl": base, "params": parameters(moe, s.top_k)}
    result["moe"]["generated"] = generations(moe, tokenizer)
    print(f"{alias}: dense {result['dense']['ppl']}, MoEfied {base}", flush=True)
    bench = Bench(moe, evals, base, s.top_k)
    result["rows"] = variant_rows(bench, tokenizer, skip, s)
    result["sanity"] = sanity(bench, path, result["rows"], tokenizer)
    result["settings"] = dataclasses.asdict(s) | {"models": None}
    result["seconds"] = round(time.perf_counter() - start)
    return result


# ---- the page ---------------------------------------------------------------------------


def millions(n: int) -> str:
    return f"{n / 1e6:.1f}M"


def fmt(x: float) -> str:
    return f"{x:,.0f}" if x >= 1000 else f"{x:.2f}"


HEAD = ("model", "calibration", "method", "experts kept", "ppl prose", "ppl code")
HEAD += ("worst ratio to MoEfied", "slots rerouted", "active params", "total params")


def model_rows(r: dict[str, Any]) -> list[list[Any]]:
    """The table's rows of one model: dense, MoEfied, then every variant."""
    e = r["settings"]["experts"]
    out = []
    for name, key, kept in (("dense", "dense", "-"), ("MoEfied", "moe", f"{e} of {e}")):
        p = r[key]
        worst = "-" if key == "dense" else "1.00x"
        ppl = [fmt(p["ppl"][d]) for d in DOMAINS]
        params = [millions(p["params"]["active"]), millions(p["params"]["total"])]
        out.append([r["model"], "-", name, kept, *ppl, worst, "-", *params])
    for v in sorted(
        r["rows"], key=lambda v: (v["budget"], list(CALIBRATIONS).index(v["calibration"]))
    ):
        ppl = [fmt(v["ppl"][d]) for d in DOMAINS]
        params = [millions(v["params"]["active"]), millions(v["params"]["total"])]
        cells = [v["calibration"], v["method"], f"{v['kept']} of {e}", *ppl]
        out.append([r["model"], *cells, f"{v['worst']:.2f}x", f"{v['rerouted']:.0%}", *params])
    return out


def moefied_table(results: list[dict[str, Any]]) -> list[str]:
    """Dense against its MoEfication, per model and domain."""
    head = ["model", *(f"dense {d}" for d in DOMAINS), *(f"MoEfied {d}" for d in DOMAINS)]
    rows = []
    for r in results:
        dense, moe = r["dense"]["ppl"], r["moe"]["ppl"]
        worst = max(moe[d] / dense[d] for d in DOMAINS)
        rows.append(
            [r["model"], *(fmt(dense[d]) for d in DOMAINS), *(fmt(moe[d]) for d in DOMAINS)]
            + [f"{worst:,.0f}x"]
        )
    return table([*head, "worst ratio to dense"], rows)


def findings(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per model, budget and calibration, each method's worst-domain ratio and the best;
    per model, budget and calibrated method, code's ratio under each calibration."""
    cells, code = [], []
    for r in results:
        for budget in BUDGETS:
            mine = [v for v in r["rows"] if v["budget"] == budget]
            for cal in CALIBRATIONS:
                worst = {v["method"]: v["worst"] for v in mine if v["calibration"] == cal}
                best = min(worst, key=lambda m: worst[m])
                cells.append({"model": r["model"], "budget": budget, "calibration": cal})
                cells[-1] |= {"worst": worst, "best": best}
            for method in ("reap", "frequency"):
                by_cal = {
                    v["calibration"]: v["ratio"]["code"] for v in mine if v["method"] == method
                }
                code.append({"model": r["model"], "budget": budget, "method": method} | by_cal)
    wins = {m: sum(c["best"] == m for c in cells) for m in EXPERT_METHODS}
    return {"cells": cells, "wins": wins, "code_by_calibration": code}


def finding_lines(f: dict[str, Any], experts: int) -> list[str]:
    lines = []
    for c in f["cells"]:
        worst = ", ".join(f"{m} {w:.2f}x" for m, w in c["worst"].items())
        lines.append(
            f"- {c['model']}, {round(c['budget'] * experts)} of {experts} removed, calibrated "
            f"on {c['calibration']}: worst-domain ratio {worst}; lowest: {c['best']}"
        )
    wins = ", ".join(f"{m} {n}" for m, n in f["wins"].items())
    lines.append(f"- lowest worst-domain ratio, cells won of {len(f['cells'])}: {wins}")
    for c in f["code_by_calibration"]:
        lines.append(
            f"- {c['model']}, {c['method']}, {round(c['budget'] * experts)} removed: code "
            f"{c['mix']:.2f}x calibrated on the mix, {c['prose']:.2f}x on prose only"
        )
    return lines


def sanity_lines(results: list[dict[str, Any]]) -> list[str]:
    lines = []
    for r in results:
        s = r["sanity"]
        v = s["variant"]
        lines.append(
            f"- {r['model']}, {v['method']} at {v['budget']:.0%} calibrated on "
            f"{v['calibration']}, written on files and reloaded: {s['num_experts']} experts "
            f"per layer, logits finite: {s['finite']}, largest logit gap to the variant made "
            f"in memory {s['logit_gap']:.1e}."
        )
        for i, prompt in enumerate(PROMPTS):
            made = [r["dense"]["generated"][i], r["moe"]["generated"][i], s["generated"][i]]
            shown = " / ".join(json.dumps(t) for t in made)
            lines.append(f"  - `{prompt}` -> dense / MoEfied / pruned: {shown}")
    return lines


def page(results: list[dict[str, Any]], command: str) -> str:
    s = results[0]["settings"]
    seconds = sum(r["seconds"] for r in results)
    rows = [row for r in results for row in model_rows(r)]
    out = [
        f"Reproduce: `{command}`. {s['experts']} experts, top-{s['top_k']} (Qwen2-MoE); "
        f"the router fitted on {s['moefy_windows']} x {s['seq_len']} tokens of each of PTB "
        f"and code train; expert statistics on {s['calibration_windows']} x {s['seq_len']} "
        f"train tokens per calibration (mix: PTB and code half each; prose: PTB); perplexity "
        f"on {s['eval_windows']} x {s['seq_len']} test tokens per domain (prose: PTB test, "
        "code: the code corpus's test files). Ratios are to the MoEfied model. Slots "
        "rerouted: the share of the calibration's routing slots (tokens x top-k) that went "
        "to an expert the variant removes, averaged over layers. `random` reads no "
        "statistics: its rows are one variant, shown under both calibrations.",
        "",
        *moefied_table(results),
        "",
        *table(HEAD, rows),
        "",
        "Outputs checked:",
        "",
        *sanity_lines(results),
        "",
        "Findings, computed from the table:",
        "",
        *finding_lines(findings(results), s["experts"]),
        "",
        f"Wall time: {seconds} s for the models above ("
        + ", ".join(f"{r['model']} {r['seconds']} s" for r in results)
        + "), MoEfication included where it was made in that run; a shared 2-core CPU, so "
        "indicative only.",
    ]
    return "\n".join(out)


# ---- the command ------------------------------------------------------------------------


def results_of(s: Settings, runs: Path, cache: Path) -> list[dict[str, Any]]:
    """Each model's results: from `runs/<model>.json` where it holds these settings', else
    measured now and written there."""
    runs.mkdir(parents=True, exist_ok=True)
    settings = dataclasses.asdict(s) | {"models": None}
    out = []
    for alias in s.models:
        path = runs / f"{Path(alias).name}.json"
        if not path.is_file() or json.loads(path.read_text())["settings"] != settings:
            path.write_text(json.dumps(measure_model(alias, s, cache), indent=1) + "\n")
        out.append(json.loads(path.read_text()))
    return out


def write_page(path: Path, text: str) -> None:
    new_page = f"# Experts, measured\n\n{BEGIN}\n{END}\n"
    replace_section(path, BEGIN, END, text, "Expert pruning on MoEfied models", new_page)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    from lorp.cache import cache_root

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="SmolLM2 only, 4 windows each")
    p.add_argument("--models", nargs="*")
    p.add_argument("--runs", type=Path, help="default runs/experts (--quick: runs/experts-quick)")
    p.add_argument("--page", type=Path, default=ROOT / "docs" / "results" / "experts.md")
    p.add_argument("--json", type=Path)
    p.add_argument("--cache", type=Path, help="MoEfied checkpoints (default $LORP_CACHE/moefied)")
    args = p.parse_args(argv)
    s = Settings(**QUICK) if args.quick else Settings()
    if args.models:
        s = dataclasses.replace(s, models=tuple(args.models))
    runs = args.runs or ROOT / "runs" / ("experts-quick" if args.quick else "experts")
    results = results_of(s, runs, args.cache or cache_root() / "moefied")
    command = "python benchmarks/experts.py" + (" --quick" if args.quick else "")
    if args.models:
        command += " --models " + " ".join(args.models)
    text = page(results, command)
    print(text)
    if args.page:
        write_page(args.page, text)
    if args.json:
        summary = {"models": results, "findings": findings(results)}
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
