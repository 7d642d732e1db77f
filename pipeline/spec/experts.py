"""`experts:`: routed experts removed from every mixture-of-experts layer, a grid dimension
beside the blocks (`lorp.experts`). Dense models of the job take no expert points."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.spec.checks import SpecError, check_budgets, positive, unique


@dataclass(frozen=True)
class ExpertsSpec:
    budgets: tuple[int | float, ...] = ()
    """Routed experts to remove from each MoE layer: counts (2) or fractions of the
    layer's experts (0.25: 32 of Qwen3-30B-A3B's 128). Every MoE layer loses as many, so
    the config stays one of its family; a budget that leaves fewer experts than a token
    is routed to (top-k) is refused for that model in one line. Empty (the default): no
    expert points."""
    methods: tuple[str, ...] = ("reap",)
    """Expert selectors (`lorp.experts.selection`): `reap`, the lowest router-weighted
    output norm over the tokens routed to the expert (REAP); `frequency`, the least
    routed; `random`, a seeded draw (the baseline)."""
    seed: int = 0
    """The `random` selector's seed."""
    combine: bool = True
    """Also take every unrepaired depth point of the job with every expert cut: a row
    that removes blocks and experts (the depth selection as made on the dense model). An
    expert cut's points are not repaired: the repair's sums are of the dense model's
    experts."""

    def __post_init__(self) -> None:
        from lorp.experts.selection import check_expert_method

        check_budgets("budgets", self.budgets, "an expert")
        unique("budgets", list(self.budgets))
        if self.budgets and not self.methods:
            raise SpecError("methods: at least one of reap, frequency, random is needed")
        for i, m in enumerate(self.methods):
            try:
                check_expert_method(m, f"methods[{i}]")
            except ValueError as exc:
                raise SpecError(str(exc)) from None
        unique("methods", list(self.methods))
        positive("seed", self.seed, minimum=0)

    @property
    def enabled(self) -> bool:
        return bool(self.budgets)
