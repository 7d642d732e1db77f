"""The fleet and its methods: `models:` (a checkpoint and its per-model options) and
`methods:` (a registered selection method and its options).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lorp.methods import validate_options
from lorp.models.loading import DTYPES
from pipeline.spec.calibration import MixPart
from pipeline.spec.checks import SpecError, positive


@dataclass(frozen=True)
class ModelSpec:
    ref: str
    """HF directory, hub id (org/name), .gguf file, or packaged alias (smollm2-135m, ...)."""
    dtype: str = "float32"
    """Capture and evaluation dtype: float32 (CPU), bfloat16 (GPU), float16."""
    trust_remote_code: bool = False
    """Run the checkpoint's own Python code. Off unless this model entry turns it on."""
    allow_pickle: bool = False
    """Load pickled .bin weights. Off: only safetensors and GGUF load."""
    name: str | None = None
    """Display name in the catalog (default: the reference)."""
    calibration: str | tuple[MixPart, ...] | None = None
    """This model's calibration text where it differs from the job's `calibration.dataset`
    (a corpus or a mix, as that field takes; the rest of `calibration:` is the job's): a
    code model calibrated on a mix that includes `code` (docs: Domains)."""

    def __post_init__(self) -> None:
        if not self.ref.strip():
            raise SpecError("ref: must be a non-empty string")
        if self.dtype not in DTYPES:
            raise SpecError(f"dtype: must be one of {', '.join(DTYPES)}, got {self.dtype!r}")

    @property
    def label(self) -> str:
        return self.name or self.ref


@dataclass(frozen=True)
class MethodSpec:
    name: str
    """A registered method (`lorp.available_methods()`): lorp, shortgpt, streamline, ...,
    and the peer recipes replaceme, linear-patch, prune-comp, streamline-layer."""
    options: dict[str, Any] = field(default_factory=dict)
    """The method's options (e.g. lorp: variant, k, thresholds, ks, seed)."""
    label: str | None = None
    """Name in the catalog; needed when one method appears twice with other options."""
    repair_distill: int | None = None
    """Epochs of distillation of this method's repaired twins (the job's `repair_distill`
    when not given): distillation costs minutes per point, so a job can spend it on the
    methods whose repaired variants it ranks first."""
    repair_options: dict[str, Any] = field(default_factory=dict)
    """A peer recipe's options for its own repair (`lorp.peers.recipes.REPAIR_OPTIONS`:
    replaceme epochs and lr, linear-patch distill and lr, streamline-layer epochs and lr);
    only for the peer methods (docs: The peer recipes)."""

    def __post_init__(self) -> None:
        from lorp.methods import get_method
        from lorp.peers.recipes import check_repair_options

        if self.repair_distill is not None:
            positive("repair_distill", self.repair_distill, minimum=0)

        try:
            method = get_method(self.name)
        except ValueError as exc:
            raise SpecError(f"name: {exc}") from None
        if self.repair_options and method.peer is None:
            raise SpecError(
                f"repair_options: only a peer recipe takes them, and {self.name!r} is none"
            )
        try:
            check_repair_options(method.peer or "", self.repair_options) if method.peer else None
        except ValueError as exc:
            raise SpecError(f"repair_options: {exc}") from None
        try:  # names and values; values that depend on N are checked again at planning
            validate_options(self.name, self.options)
        except ValueError as exc:
            raise SpecError(f"options: {exc}") from None

    @property
    def key(self) -> str:
        return self.label or self.name

    @property
    def peer(self) -> str | None:
        """The peer recipe's own repair this method's points all take (None: lorp's)."""
        from lorp.methods import get_method

        return get_method(self.name).peer
