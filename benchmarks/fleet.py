"""The overnight fleet, simulated: how busy the scheduler keeps a cluster's slots.

    python benchmarks/fleet.py --quick --json fleet.json [--page docs/results/benchmarks.md]
    python benchmarks/fleet.py --driver-points 1000 --json driver.json

1. The fleet. 12 tiny random-init checkpoints of 6 families, 6 to 12 blocks deep and 64 to
   192 wide (built here; stages differ in cost), x 2 budgets x 3 methods (LoRP, ShortGPT
   and SLEB, which is loss-guided and scores candidates on Ray actors), each with its
   dense point, perplexity and speed (`--quick`: no speed stage, one capture and one loss
   worker per model): `lorp run` twice on a local Ray that declares
   `--slots` logical CPUs (default 8), once as the fleet (every model in flight) and once
   with `max_models_in_flight: 1` (one model after another). Every figure comes from the
   job's own events (`pipeline.events.timeline.summarise`):
   - fleet_makespan_ratio   makespan / lower bound, where the lower bound is
                            max(busy slot-seconds / slots, the longest single-model chain)
   - fleet_utilization      busy slot-seconds / (slots x makespan)
   - serial_makespan_ratio  the same ratio with max_models_in_flight: 1
   What is simulated: 8 slots on a 2-core machine. Every unit of work runs slower than it
   would alone (the cores are shared), but it does so in both runs and inside every span,
   so the busy slot-seconds and the makespan are measured on the same clock: the ratios
   say how often a slot sat idle while there was work the schedule could have given it,
   which is what a real cluster's slots would do under the same schedule. Absolute times
   mean nothing here and are not targets.
2. The driver at fleet scale (`--driver-points N`, default 1,000 in a full run): N grid
   points over tiny models with evaluation off, planned, run on Ray, recorded in MLflow and
   catalogued. Reports the driver's own time per point (recording: MLflow run, catalog
   part, events), and the catalog's write per point at its first and last 100 rows.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # lorp, pipeline and the tests' tiny-model builders

from benchmarks.pages import markers, replace_section, rule  # noqa: E402

TARGETS = {"fleet_makespan_ratio": 1.15, "fleet_utilization": 0.75}
BEGIN, END = markers("fleet")
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "olmo2", "phi3")
DEPTHS = (6, 8, 10, 12)
WIDTHS = (64, 128, 192)


def build_models(root: Path, n: int, depth: int | None = None) -> list[tuple[str, Path]]:
    """`n` tiny checkpoints over the PTB vocabulary: families, depths (unless `depth`
    fixes it) and widths cycle."""
    from tests.helpers.tiny_models import save_tiny_ptb

    out = []
    for i in range(n):
        family, width = FAMILIES[i % 6], WIDTHS[i % 3]
        blocks = depth or DEPTHS[i % 4]
        name = f"{family}-{blocks}x{width}-{i:02d}"
        path = root / name
        if not (path / "config.json").is_file():
            save_tiny_ptb(family, path, seed=i, n_blocks=blocks, width=width)
        out.append((name, path))
    return out


def fleet_spec(
    root: Path,
    name: str,
    models: list[tuple[str, Path]],
    slots: int,
    quick: bool = False,
    **res: Any,
) -> dict[str, Any]:
    """The fleet's job. `quick`: one capture and one loss worker per model and no speed
    stage: on 2 cores a worker process's start (Python, torch, transformers) costs more
    than a tiny model's whole stage, and the quick run must end in minutes."""
    return {
        "name": name,
        "output_dir": str(root / name),
        "cache_dir": str(root / f"cache-{name}"),  # each run captures and selects anew
        "models": [{"ref": str(p), "name": n} for n, p in models],
        "budgets": [1, 2],
        "methods": [{"name": "lorp"}, {"name": "shortgpt"}, {"name": "sleb"}],
        "repair": ["none"],
        "checkpoints": "none",
        "calibration": {
            "dataset": "ptb",
            "samples": 8,
            "seq_len": 64,
            "shards": 2,
            "batch_size": 4,
        },
        "resources": {
            "capture": {"num_cpus": 1},
            "grid": {"num_cpus": 1},
            "speed": {"num_cpus": 1},
            "max_concurrent_points": slots,
            "capture_workers": 1 if quick else 2,
            "loss_workers": 1 if quick else 2,
            **res,
        },
        "ray": {"num_cpus": slots},
        "tracking": {"register": False},
        "evaluation": {
            "perplexity": ["ptb"],
            "seq_len": 64,
            "max_windows": 1 if quick else 2,
            "batch_size": 2,
            "zero_shot": [],
            "speed": not quick,
            "speed_repeats": 5,
        },
    }


def run_job(root: Path, spec: dict[str, Any]) -> tuple[float, list[dict[str, Any]]]:
    """`lorp run` in a process of its own (its own local Ray); wall seconds and events."""
    import yaml

    path = root / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    lorp = Path(sys.executable).parent / "lorp"
    start = time.perf_counter()
    out = subprocess.run([str(lorp), "run", str(path)], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(f"lorp run {path} failed:\n{out.stderr[-4000:]}")
    from pipeline.events.log import read_events

    return seconds, read_events(Path(spec["output_dir"]) / "events.jsonl")


def figures(events: list[dict[str, Any]]) -> dict[str, Any]:
    from pipeline.events.timeline import summarise

    u = summarise(events)
    assert u is not None, "no spans in the job's events"
    fleet = [e for e in events if e.get("event") == "fleet"][-1]
    return {
        "slots": u.slots,
        "makespan_s": round(u.makespan, 1),
        "busy_slot_s": round(u.busy, 1),
        "lower_bound_s": round(u.lower_bound, 1),
        "busy_over_slots_s": round(u.busy / u.slots, 1),
        "longest_chain_s": round(u.chain, 1),
        "longest_chain_model": u.chain_model,
        "makespan_ratio": round(u.makespan_ratio, 3),
        "utilization": round(u.utilisation, 3),
        "points": fleet["points"],
        "driver_ms_per_point": fleet["driver_ms_per_point"],
    }


def fleet_benchmark(root: Path, n_models: int, slots: int, quick: bool) -> dict[str, Any]:
    models = build_models(root / "models", n_models)
    out: dict[str, Any] = {"models": n_models, "slots": slots, "quick": quick}
    for label, extra in (("fleet", {}), ("serial", {"max_models_in_flight": 1})):
        spec = fleet_spec(root, label, models, slots, quick, **extra)
        wall, events = run_job(root, spec)
        out[label] = figures(events) | {"wall_s": round(wall, 1)}
        print(f"  {label}: {json.dumps(out[label])}", flush=True)
    out["fleet_makespan_ratio"] = out["fleet"]["makespan_ratio"]
    out["fleet_utilization"] = out["fleet"]["utilization"]
    out["serial_makespan_ratio"] = out["serial"]["makespan_ratio"]
    out["serial_over_fleet_makespan"] = round(
        out["serial"]["makespan_s"] / out["fleet"]["makespan_s"], 2
    )
    return out


def catalog_writes(rows: int) -> dict[str, float]:
    """ms per recorded row at the catalog's first and last 100 rows (one part per row)."""
    from pipeline.catalog.table import Catalog

    with tempfile.TemporaryDirectory() as tmp:
        cat = Catalog(Path(tmp) / Catalog.NAME)
        times = []
        for i in range(rows):
            row = {
                "grid_key": f"k{i:05d}",
                "job": "j",
                "model": f"m{i // 50}",
                "method_label": "lorp",
                "budget": i % 50,
                "created_at": "2026",
                "pruned_layers": [1, 2],
                "ppl_ptb": 10.0 + i,
            }
            start = time.perf_counter()
            cat.put(row)
            times.append(time.perf_counter() - start)
        start = time.perf_counter()
        cat.compact()
        compact = time.perf_counter() - start
    first, last = times[:100], times[-100:]
    return {
        "catalog_ms_per_row_first100": round(1000 * sum(first) / len(first), 3),
        "catalog_ms_per_row_last100": round(1000 * sum(last) / len(last), 3),
        "catalog_compact_ms": round(1000 * compact, 1),
    }


def driver_benchmark(root: Path, points: int) -> dict[str, Any]:
    methods = ["lorp", "shortgpt", "streamline", "angular", "lorp-stage2", "random"]
    budgets = list(range(1, 9))
    n_models = math.ceil(points / (len(methods) * len(budgets)))
    models = build_models(root / "driver-models", n_models, depth=12)
    spec = fleet_spec(root, "driver", models, 2)
    spec |= {
        "budgets": budgets,
        "methods": [{"name": m} for m in methods],
        "evaluation": {"enabled": False},
    }
    spec["resources"] |= {"max_concurrent_points": 4, "capture_workers": 1}
    spec["calibration"] |= {"shards": 1}
    wall, events = run_job(root, spec)
    fleet = [e for e in events if e.get("event") == "fleet"][-1]
    grids = [e for e in events if e.get("event") == "grid"]
    return {
        "points": fleet["points"],
        "models": len(spec["models"]),
        "planned": sum(e["points"] for e in grids),
        "wall_s": round(wall, 1),
        "driver_s": fleet["driver_s"],
        "driver_ms_per_point": fleet["driver_ms_per_point"],
        **catalog_writes(max(points, 1000)),
    }


def results_table(r: dict[str, Any]) -> str:
    f, s = r["fleet"], r["serial"]
    lines = [
        "| run | makespan | busy slot-s / slots | longest chain | lower bound "
        "| makespan / bound | utilization |",
        rule(7, tight=True),
    ]
    for name, x in (("fleet (all models in flight)", f), ("serial (max_models_in_flight: 1)", s)):
        lines.append(
            f"| {name} | {x['makespan_s']:.0f} s | {x['busy_over_slots_s']:.0f} s | "
            f"{x['longest_chain_s']:.0f} s | {x['lower_bound_s']:.0f} s | "
            f"**{x['makespan_ratio']:.2f}** | **{x['utilization']:.2f}** |"
        )
    return "\n".join(lines)


def page_block(r: dict[str, Any]) -> str:
    """The results page's block: how it was run, the table, each target met or missed."""
    f = r["fleet"]
    lines = [
        f"Measured {time.strftime('%Y-%m-%d')} (`--{'quick' if r['quick'] else 'models'}`, "
        f"{r['machine']['cpus']} cores, {r['slots']} slots, {r['models']} models, "
        f"{f['points']} points; {r['seconds'] / 60:.1f} min for both runs and the model build):",
        "",
        results_table(r),
        "",
    ]
    for key, target in TARGETS.items():
        lines.append(f"- `{key}` {r[key]:.3f} ({verdict(key, r[key], target)})")
    lines.append(
        f"- serial makespan {r['serial_over_fleet_makespan']:.2f}x the fleet's (the same CPU "
        "work on the same 2 cores); the driver's own time "
        f"{f['driver_ms_per_point']:.0f} ms per point"
    )
    return "\n".join(lines)


def verdict(key: str, value: float, target: float) -> str:
    """`target <= 1.15: met`: a ratio is met at or below its target, the rest at or above."""
    if "ratio" in key:
        return f"target <= {target}: {'met' if value <= target else 'MISSED'}"
    return f"target >= {target}: {'met' if value >= target else 'MISSED'}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="the fleet only (under 10 min on 2 cores)")
    ap.add_argument("--models", type=int, default=12)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--driver-points", type=int, default=None, help="run the driver benchmark")
    ap.add_argument("--skip-fleet", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--page", type=Path, help="write the fleet's figures into this results page")
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.models < 12 and not args.skip_fleet:
        ap.error(f"--models: a fleet is at least 12 models, got {args.models}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="lorp-fleet-"))
    root.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "workdir": str(root),
    }
    start = time.perf_counter()
    if not args.skip_fleet:
        print(
            f"fleet: {args.models} models x 2 budgets x 3 methods on {args.slots} slots", flush=True
        )
        result |= fleet_benchmark(root, args.models, args.slots, args.quick)
    points = (
        args.driver_points if args.driver_points is not None else (None if args.quick else 1000)
    )
    if points:
        print(f"driver: {points} grid points, evaluation off", flush=True)
        result["driver"] = driver_benchmark(root, points)
        print(f"  driver: {json.dumps(result['driver'])}", flush=True)
    result["seconds"] = round(time.perf_counter() - start, 1)
    if "fleet" in result:
        print_fleet(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if args.page and "fleet" in result:
        replace_section(args.page, BEGIN, END, page_block(result), "The fleet, measured")
    return 0


def print_fleet(result: dict[str, Any]) -> None:
    """The fleet's table and its targets, on the terminal."""
    print()
    print(results_table(result))
    print()
    for key, target in TARGETS.items():
        print(f"{key:24s} {result[key]:.3f}  ({verdict(key, result[key], target)})")
    print(
        f"{'serial_makespan_ratio':24s} {result['serial_makespan_ratio']:.3f}  "
        f"(serial makespan {result['serial_over_fleet_makespan']:.2f}x the fleet's)"
    )


if __name__ == "__main__":
    sys.exit(main())
