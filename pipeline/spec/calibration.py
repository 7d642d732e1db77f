"""`calibration:`: the text the statistics are captured on (a corpus or a weighted mix),
how many windows of how many tokens, and how they are sharded.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.spec.checks import SpecError, check_bos, is_number, positive, unique


@dataclass(frozen=True)
class MixPart:
    name: str
    """A corpus, as `calibration.dataset` names one."""
    weight: float = 1.0
    """Its share of the windows, relative to the other parts' weights."""

    def __post_init__(self) -> None:
        if not is_number(self.weight) or not self.weight > 0:
            raise SpecError(f"weight: must be a number > 0, got {self.weight!r}")


@dataclass(frozen=True)
class CalibrationSpec:
    dataset: str | tuple[MixPart, ...] = "ptb"
    """A local .txt/.json/.jsonl/.parquet file, a packaged alias (ptb, wiki, lee) or a hub
    dataset id; or a mix, a list of {name, weight}: each corpus gives its share of the
    windows (`lorp.data.windows.mixed_windows`), all read from `split`."""
    split: str = "train"
    """Dataset split."""
    samples: int = 128
    """Number of windows (the paper: 128)."""
    seq_len: int = 2048
    """Tokens per window (the paper: 2048)."""
    seed: int = 0
    """Seed of the window offsets."""
    shards: int = 1
    """Token shards = Ray capture tasks; each task reads only its shard."""
    batch_size: int = 1
    """Windows per forward pass inside a capture task."""
    text_field: str = "text"
    """Column holding the text, for hub datasets."""
    bos: str = "auto"
    """BOS before every window: auto (when the tokenizer adds one), always, never. The BOS
    position itself is left out of S."""
    loss_samples: int = 8
    """Held-out windows (same split and length, seed + 1, never in S) on which loss-guided
    methods (sleb, ppl, lorp-loss) score candidates."""

    @property
    def corpora(self) -> list[str]:
        """The corpora calibrated on."""
        return [self.dataset] if isinstance(self.dataset, str) else [p.name for p in self.dataset]

    @property
    def parts(self) -> list[tuple[str, float]]:
        """(corpus, weight) of every part; one corpus is a mix of one."""
        if isinstance(self.dataset, str):
            return [(self.dataset, 1.0)]
        return [(p.name, float(p.weight)) for p in self.dataset]

    def __post_init__(self) -> None:
        if not isinstance(self.dataset, str):
            if not self.dataset:
                raise SpecError("dataset: a mix needs at least one {name, weight}")
            unique("dataset", self.corpora, hint="name each corpus once")
            if len(self.dataset) > self.samples:
                raise SpecError(
                    f"dataset: {len(self.dataset)} corpora for {self.samples} samples "
                    "(each needs a window)"
                )
        check_bos(self.bos)
        positive("samples", self.samples)
        positive("loss_samples", self.loss_samples)
        positive("seq_len", self.seq_len, minimum=2)
        positive("shards", self.shards)
        positive("batch_size", self.batch_size)
        if self.shards > self.samples:
            raise SpecError(
                f"shards: {self.shards} shards for {self.samples} samples (at most one per sample)"
            )
