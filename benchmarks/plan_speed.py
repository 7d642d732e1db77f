"""How long `lorp plan JOB.yaml` takes, the first time and the second (issue 75: at most 10 s
and 5 s on 2 idle cores, with the models installed and converted).

    python benchmarks/plan_speed.py                       # jobs/quality.yaml, jobs/demo.yaml
    python benchmarks/plan_speed.py jobs/demo.yaml --repeat 5 --json plan.json

Each repetition plans every job in a lorp cache of its own that holds the conversions of
the real cache (its `models` folder and its GGUF files linked, and the GGUF digests' memos,
which the conversion writes, copied) and nothing the plan keeps: the first plan of a job there
is the first after installing and converting, the second plans it again. Each plan runs
`lorp plan` as a process of its own, with this checkout's code, and its output is compared
with every other plan's of the same job: a cached plan that said something else would be
wrong, not fast. Wall seconds are reported as the median and the range over the
repetitions, with the CPU seconds of the process (its user and system time), which are
less disturbed by whatever else shares the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
JOBS = ["jobs/quality.yaml", "jobs/demo.yaml"]


def converted_cache(real: Path, root: Path) -> Path:
    """A lorp cache at `root` that shares `real`'s conversions and none of its plan caches."""
    root.mkdir(parents=True)
    if (real / "models").is_dir():
        (root / "models").symlink_to((real / "models").resolve(), target_is_directory=True)
    (root / "gguf").mkdir()  # the files linked, not the folder: nothing written beside them
    for gguf in (real / "gguf").glob("*.gguf"):
        (root / "gguf" / gguf.name).symlink_to(gguf.resolve())
    (root / "fingerprints").mkdir()
    for memo in (real / "fingerprints").glob("file-*.json"):  # the GGUFs' digests
        shutil.copy(memo, root / "fingerprints" / memo.name)
    return root


def plan_once(job: str, cache: Path) -> tuple[float, float, str]:
    """Wall and CPU seconds of one `lorp plan job` with lorp's cache at `cache`, and what
    it printed; a plan that fails stops the benchmark."""
    env = os.environ | {"LORP_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-m", "lorp.cli", "plan", job],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if run.returncode != 0:
        raise SystemExit(f"lorp plan {job} exited {run.returncode}: {run.stderr.strip()}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, run.stdout


def summary(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 2),
        "min": round(min(values), 2),
        "max": round(max(values), 2),
    }


def measure(jobs: list[str], repeat: int, real: Path, work: Path) -> dict[str, Any]:
    """Per job: the first and the second plan's seconds over `repeat` fresh caches, and
    whether every plan of the job printed the same."""
    seconds: dict[str, dict[str, list[float]]] = {}
    outputs: dict[str, set[str]] = {job: set() for job in jobs}
    for r in range(repeat):
        for i, job in enumerate(jobs):  # a cache each: another job's models are not read
            cache = converted_cache(real, work / f"cache-{r}-{i}")
            for which in ("first", "second"):
                wall, cpu, out = plan_once(job, cache)
                runs = seconds.setdefault(job, {})
                runs.setdefault(f"{which}_wall_s", []).append(wall)
                runs.setdefault(f"{which}_cpu_s", []).append(cpu)
                outputs[job].add(out)
            shutil.rmtree(cache)
    return {
        job: {k: summary(v) for k, v in runs.items()} | {"identical": len(outputs[job]) == 1}
        for job, runs in seconds.items()
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jobs", nargs="*", default=JOBS)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the figures here too")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from lorp.cache import cache_root

    with tempfile.TemporaryDirectory(prefix="lorp-plan-speed-") as work:
        result = measure(args.jobs, args.repeat, cache_root(), Path(work))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
