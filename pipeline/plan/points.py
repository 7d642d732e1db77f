"""A model's grid points, made from its selections: the dense point, then one point per
selection and repair, keyed by what its figures depend on, with where its checkpoint
goes. The driver (`pipeline.driver.model_stages`) makes each selection and hands it here;
the plan never calls back into the driver.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from lorp import Selection, get_method
from lorp.experts.selection import ExpertSelection
from lorp.repair.stats import contiguous_runs
from pipeline.plan.grid import EXPERTS, GridPoint, ModelPlan, content_key, grid_key, stored_at
from pipeline.spec.models import MethodSpec
from pipeline.spec.repair import RepairSettings


def repair_refusal(plan: ModelPlan, layers: tuple[int, ...]) -> str | None:
    """Why `layers` of `plan`'s model cannot be repaired (one line), or None. Every
    supported family has an exact fold (`lorp.repair`); what remains is a run from block
    0 when the embeddings are tied to the LM head (`lorp.repair.fit.check_repairable`)."""
    if layers and min(layers) == 0 and plan.tied_embeddings:
        e = contiguous_runs(layers, plan.n_blocks)[0][1]
        return (
            f"run 0-{e} starts at block 0 and {plan.label} ties its embeddings to the LM "
            "head: no weight takes the map without changing the logits"
        )
    return None


def on_loss_actors(method: str, granularity: str) -> bool:
    """Whether selecting with `method` at `granularity` scores candidates on the loss
    actors (`pipeline.stages.loss_evaluators.LossSelector`)."""
    from lorp.methods.sublayer_selection import LOSS_METHODS

    if granularity == "block":
        return get_method(method).needs_evaluator
    return method in LOSS_METHODS


def selection_order(
    granularity: Sequence[str], methods: Sequence[MethodSpec]
) -> list[tuple[str, MethodSpec]]:
    """(granularity, method) in the order their selections are made. Selections on the
    loss actors last: they hold the grid's slots until the last of them is made, so a
    repair-aware one (its sums from capture workers) must come first."""
    grid = [(g, m) for g in granularity for m in methods]
    return sorted(grid, key=lambda gm: on_loss_actors(gm[1].name, gm[0]))


@dataclass(frozen=True)
class ModelGrid:
    """One model's grid: its dense point, and the points each selection makes."""

    plan: ModelPlan
    model_key: str
    """The model key (weights, calibration, dtype): every point's key starts from it."""
    evaluation: dict[str, Any] | None
    """The evaluation settings that change a figure (`evaluation_key`); None: the job
    does not evaluate (then it has no dense point)."""
    repair: RepairSettings
    saves_checkpoints: bool
    """Whether the job stores its variants (`checkpoints` is not none)."""

    def dense(self) -> GridPoint | None:
        """The dense point, when the job evaluates."""
        if self.evaluation is None:
            return None
        key = grid_key(self.model_key, "dense", {}, 0, self.evaluation)
        return GridPoint(key, self.plan, None, None)

    def points(
        self, method: MethodSpec, selection: Selection, seconds: float, granularity: str
    ) -> tuple[list[GridPoint], list[tuple[GridPoint, str]]]:
        """The points of one selection, one per repair, and the repaired ones whose runs
        cannot fold, each with the reason (left out of the grid)."""
        made, refused = [], []
        if method.peer is not None:  # a peer recipe: its selection with its own repair only
            return [self._peer_point(method, selection, seconds)], []
        for repair in self.repair.repairs:
            point = self._point(method, selection, seconds, granularity, repair)
            why = repair_refusal(self.plan, point.layers) if repair != "none" else None
            if why is None:
                made.append(point)
            else:
                refused.append((point, why))
        return made, refused

    def _point(
        self, m: MethodSpec, sel: Selection, seconds: float, g: str, repair: str
    ) -> GridPoint:
        r = self.repair
        key = grid_key(
            self.model_key,
            m.name,
            sel.to_dict()["options"],
            sel.budget,
            self.evaluation,
            repair,
            r.rounds,
            r.ridge,
            r.followers if g == "block" else 0,  # unit runs take no followers
            (r.distill_epochs(m), float(r.distill_lr)),
            r.gate,
            g,
        )
        point = GridPoint(key, self.plan, m, sel, seconds, repair, g)
        return replace(point, checkpoint=stored_at(point, self.saves_checkpoints))

    def _peer_point(self, m: MethodSpec, sel: Selection, seconds: float) -> GridPoint:
        """A peer recipe's point (`lorp.peers`): keyed by its selection and its repair's
        options; the selection's details (Prune&Comp's alphas) are part of what it folds."""
        assert m.peer is not None
        options = sel.to_dict()["options"]
        repair = {"peer": m.peer, "options": dict(m.repair_options)}
        key = content_key(self.model_key, m.name, options, sel.budget, self.evaluation, repair)
        point = GridPoint(key, self.plan, m, sel, seconds, m.peer, "block")
        return replace(point, checkpoint=stored_at(point, self.saves_checkpoints))

    def expert_points(
        self, cut: ExpertSelection, seed: int, depth: Sequence[GridPoint]
    ) -> list[GridPoint]:
        """The points of one expert cut: the cut alone, and with each unrepaired depth
        point of `depth` (a job's `experts.combine`: its selection made on the dense
        model). An expert cut is not repaired: the repair's sums are of every expert."""
        what = {"method": cut.method, "removed": cut.per_layer}
        what |= {"seed": seed} if cut.method == "random" else {}
        key = grid_key(self.model_key, EXPERTS, {}, 0, self.evaluation, experts=what)
        alone = GridPoint(key, self.plan, None, None, granularity=EXPERTS, experts=cut)
        made = [alone]
        for p in depth:
            depth_only = p.method is not None and p.selection is not None and not p.experts
            if not depth_only or p.repair != "none" or p.granularity != "block":
                continue  # the dense point, a repaired twin, a sub-layer or expert cut
            assert p.method is not None
            key = grid_key(
                self.model_key,
                p.method.name,
                p.options,
                p.budget,
                self.evaluation,
                experts=what,
            )
            made.append(replace(p, key=key, experts=cut))
        return [replace(p, checkpoint=stored_at(p, self.saves_checkpoints)) for p in made]
