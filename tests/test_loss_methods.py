"""Loss-guided selection: `sleb`, `ppl` and `lorp-loss` against brute force over a hidden
"true damage" function and over a tiny real model, and the in-memory block drop that
`lorp.methods.removal_loss.LossEvaluator` scores candidates with."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable

import numpy as np
import pytest
import torch

from lorp import allocate, cluster_layers, select_layers
from lorp.methods import validate_options
from lorp.methods.removal_loss import LossEvaluator, calibration_loss
from lorp.models.architectures import decoder_blocks
from lorp.models.surgery import blocks_dropped, drop_layers
from tests.helpers.tiny_models import FAMILIES, tiny_model
from tests.helpers.windows import token_windows

Candidates = list[tuple[int, ...]]


def damage(n: int, seed: int = 0, pair: float = 0.3) -> Callable[[tuple[int, ...]], float]:
    """A hidden loss: each block costs its own weight, and dropping two neighbours costs
    `pair` more, so the greedy's second pick depends on its first."""
    w = np.random.default_rng(seed).uniform(0.1, 1.0, size=n)

    def true_loss(dropped: tuple[int, ...]) -> float:
        gone = set(dropped)
        return 2.0 + float(sum(w[b] for b in gone)) + pair * sum(b + 1 in gone for b in gone)

    return true_loss


class Recorder:
    """`Losses` over `true_loss`, remembering every batch it was handed."""

    def __init__(self, true_loss: Callable[[tuple[int, ...]], float]) -> None:
        self.true_loss = true_loss
        self.calls: list[Candidates] = []

    def __call__(self, candidates: Candidates) -> list[float]:
        assert all(c == tuple(sorted(set(c))) for c in candidates)
        self.calls.append(list(candidates))
        return [self.true_loss(c) for c in candidates]

    @property
    def n_evals(self) -> int:
        return sum(len(c) for c in self.calls)


def argmin(blocks: list[int], loss: Callable[[int], float]) -> int:
    return min(blocks, key=lambda b: (loss(b), b))


def locality_matrix(sizes: tuple[int, ...]) -> np.ndarray:
    """S with contiguous clusters of the given sizes: high within, low across."""
    n = sum(sizes)
    cluster = np.repeat(np.arange(len(sizes)), sizes)
    i, j = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    S = np.where(cluster[i] == cluster[j], 0.9 - 0.02 * np.abs(i - j), 0.1 + 0.001 * (i + j))
    np.fill_diagonal(S, 1.0)
    return S


S6 = locality_matrix((3, 3))


# -- SLEB, PPL and LoRP-loss on a hidden damage function ------------------------------------


def test_sleb_is_greedy_argmin_of_the_loss() -> None:
    true_loss = damage(6)
    rec = Recorder(true_loss)
    sel = select_layers(S6, 2, "sleb", losses=rec)
    pool = [1, 2, 3, 4]  # SLEB's released code never scores the first and last block
    first = argmin(pool, lambda b: true_loss((b,)))
    second = argmin([b for b in pool if b != first], lambda b: true_loss(tuple(sorted((first, b)))))
    assert sel.details["order"] == [first, second]
    assert sel.layers == tuple(sorted((first, second)))
    # One batch per step, every remaining candidate in it.
    assert [len(c) for c in rec.calls] == [4, 3]
    assert sel.details["n_evals"] == rec.n_evals == 7
    assert sel.details["picked_loss"][1] == pytest.approx(true_loss(sel.layers))
    assert sel.details["step_losses"][0] == {b: true_loss((b,)) for b in pool}
    assert json.loads(json.dumps(sel.to_dict()))["details"]["order"] == [first, second]


def test_sleb_keep_options_follow_the_barriers() -> None:
    rec = Recorder(lambda c: -float(sum(c)))  # prefers deep blocks
    sel = select_layers(np.eye(8), 3, "sleb", losses=rec, keep_last=3)
    assert sel.layers == (2, 3, 4) and sel.details["candidates"] == [1, 2, 3, 4]
    sel = select_layers(np.eye(8), 2, "sleb", losses=rec, keep_first=0, keep_last=0)
    assert sel.layers == (6, 7)


def test_ppl_picks_the_smallest_single_removal_losses() -> None:
    true_loss = damage(12, seed=3)
    rec = Recorder(true_loss)
    S = locality_matrix((4, 4, 4))
    sel = select_layers(S, 3, "ppl", losses=rec)
    pool = list(range(4, 10))  # the released "plus heuristic": keep 0-3, N-2, N-1
    expected = sorted(sorted(pool, key=lambda b: (true_loss((b,)), b))[:3])
    assert list(sel.layers) == expected
    assert rec.calls == [[(b,) for b in pool]]  # one call, every candidate
    assert sel.details["n_evals"] == 6
    plain = select_layers(S, 3, "ppl", losses=rec, keep_first=1, keep_last=1)
    pool = list(range(1, 11))
    assert list(plain.layers) == sorted(sorted(pool, key=lambda b: (true_loss((b,)), b))[:3])


def test_ppl_ties_go_to_the_lower_index() -> None:
    sel = select_layers(np.eye(8), 2, "ppl", losses=lambda c: [1.0] * len(c), keep_first=1)
    assert sel.layers == (1, 2)


def test_lorp_loss_counts_from_lorp_blocks_by_loss() -> None:
    sizes = (8, 8, 8)
    S = locality_matrix(sizes)
    n, budget = sum(sizes), 7
    true_loss = damage(n, seed=5)
    rec = Recorder(true_loss)
    sel = select_layers(S, budget, "lorp-loss", losses=rec, k=3)

    labels = cluster_layers(S, 3, seed=0)
    lorp_pick = allocate(S, labels, budget)
    counts = [sum(1 for b in lorp_pick if labels[b] == c) for c in range(3)]
    taken = [sum(1 for b in sel.layers if labels[b] == c) for c in range(3)]
    assert taken == counts == sel.details["counts"] == [4, 1, 2]
    assert sel.details["lorp_layers"] == lorp_pick
    assert 0 not in sel.layers and n - 1 not in sel.layers

    # Replay the rounds: each pick is its cluster's argmin given the earlier rounds.
    removed: tuple[int, ...] = ()
    for rnd in sel.details["rounds"]:
        for pick in rnd["picked"]:
            cands = [b for b in range(1, n - 1) if labels[b] == labels[pick] and b not in removed]
            given = {b: true_loss(tuple(sorted((*removed, b)))) for b in cands}
            assert pick == argmin(cands, given.__getitem__)
            assert rnd["losses"][pick] == given[pick]
        removed += tuple(rnd["picked"])
    assert list(removed) == sel.details["order"]
    assert json.loads(json.dumps(sel.to_dict()))["details"]["counts"] == [4, 1, 2]

    # Eligible sizes 7, 8, 7: (7 + 6 + 5 + 4) + 8 + (7 + 6) = 43 evaluations in 4 calls,
    # against SLEB's 22 + 21 + ... + 16 = 133 on the same problem.
    assert sel.details["n_evals"] == rec.n_evals == 43 and len(rec.calls) == 4
    sleb = Recorder(true_loss)
    select_layers(S, budget, "sleb", losses=sleb)
    assert sleb.n_evals == 133


def test_lorp_loss_reuses_a_profile_and_lorp_options() -> None:
    from lorp import profile

    S = locality_matrix((6, 6))
    rec = Recorder(damage(12))
    prof = profile(S)
    a = select_layers(S, 3, "lorp-loss", losses=rec, profile=prof)
    b = select_layers(S, 3, "lorp-loss", losses=rec)
    assert a.layers == b.layers and a.details["k"] == prof.k
    c = select_layers(S, 3, "lorp-loss", losses=rec, variant="released", k=2)
    assert sum(c.details["counts"]) == 3


# -- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["sleb", "ppl", "lorp-loss"])
def test_a_loss_method_without_losses_is_one_line(method: str) -> None:
    options = {"keep_first": 1, "keep_last": 1} if method == "ppl" else {}
    with pytest.raises(ValueError, match=f"^method '{method}' scores candidate models") as exc:
        select_layers(S6, 2, method, **options)
    assert "pass losses=" in str(exc.value) and "\n" not in str(exc.value)


BAD = [
    ("sleb", {"keep_first": -1}, "option 'keep_first': must be a non-negative integer, got -1"),
    ("sleb", {"keep_last": 1.5}, "option 'keep_last': must be an integer, got 1.5"),
    ("sleb", {"keep_first": True}, "option 'keep_first': must be an integer, got True"),
    ("ppl", {"keep_first": "4"}, "option 'keep_first': must be an integer, got '4'"),
    ("ppl", {"keep_last": -2}, "option 'keep_last': must be a non-negative integer, got -2"),
    ("ppl", {"depth": 3}, "has no option 'depth'"),
    ("lorp-loss", {"variant": "latest"}, "option 'variant': must be one of paper, released"),
    ("lorp-loss", {"k": 0}, "option 'k': must be a positive integer or null, got 0"),
    ("lorp-loss", {"seed": -1}, "option 'seed': must be an integer in [0, 2**32), got -1"),
    ("lorp-loss", {"ks": [2, 3]}, "ks needs exactly one entry more than thresholds"),
]


@pytest.mark.parametrize(("method", "options", "message"), BAD)
def test_bad_options_are_one_line(method: str, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"^method '{method}' ") as exc:
        validate_options(method, options)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_keep_options_must_leave_a_candidate() -> None:
    assert validate_options("ppl", {}) == {"keep_first": 4, "keep_last": 2}
    with pytest.raises(ValueError, match="6 protected blocks leave no candidate among 6$"):
        validate_options("ppl", {}, n_blocks=6)
    with pytest.raises(ValueError, match=r"budget 3 exceeds the 2 candidate blocks \(keep_first"):
        select_layers(np.eye(8), 3, "ppl", losses=lambda c: [0.0] * len(c))


def test_bad_losses_answers() -> None:
    with pytest.raises(ValueError, match="losses returned 1 values for 4 candidates"):
        select_layers(S6, 2, "sleb", losses=lambda c: [0.0])
    # A NaN loss (diverged model) is the worst candidate, never the pick.
    sel = select_layers(S6, 1, "sleb", losses=lambda c: [math.nan if c == (1,) else 1.0 for c in c])
    assert sel.layers == (2,)


# -- the real thing: blocks dropped in memory ------------------------------------------------


@pytest.fixture(scope="module")
def windows() -> torch.Tensor:
    # Longer than the tiny models' sliding window (16), so sliding layers matter.
    return token_windows(3, 40, vocab=512)


def snapshot(model: torch.nn.Module) -> tuple:
    return (
        decoder_blocks(model),
        list(decoder_blocks(model)),
        {k: v.clone() for k, v in model.state_dict().items()},
        model.config.to_dict(),
        dict(vars(model.config)),
        [getattr(m, "layer_idx", None) for m in model.modules()],
    )


def assert_unchanged(model: torch.nn.Module, before: tuple) -> None:
    blocks, members, state, config, attrs, idx = before
    assert decoder_blocks(model) is blocks and list(decoder_blocks(model)) == members
    now = model.state_dict()
    assert now.keys() == state.keys() and all(torch.equal(now[k], state[k]) for k in state)
    assert model.config.to_dict() == config
    assert vars(model.config).keys() == attrs.keys()
    assert [getattr(m, "layer_idx", None) for m in model.modules()] == idx


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen2"])
def test_blocks_dropped_is_drop_layers_then_undone(family: str, windows: torch.Tensor) -> None:
    model = tiny_model(family)
    dense = calibration_loss(model, windows, batch_size=2)
    before = snapshot(model)
    for dropped in [(1,), (2, 4), (0, 3, 5)]:
        pruned = copy.deepcopy(model)
        drop_layers(pruned, dropped)
        with blocks_dropped(model, dropped) as kept:
            assert len(decoder_blocks(model)) == model.config.num_hidden_layers == len(kept)
            if hasattr(pruned.config, "layer_types"):
                assert model.config.layer_types == pruned.config.layer_types
            inside = calibration_loss(model, windows, batch_size=2)
        assert inside == pytest.approx(calibration_loss(pruned, windows), abs=1e-6)
        assert_unchanged(model, before)
    with pytest.raises(RuntimeError, match="boom"), blocks_dropped(model, (2,)):
        raise RuntimeError("boom")
    assert_unchanged(model, before)
    assert calibration_loss(model, windows, batch_size=2) == dense  # bit-identical


def test_loss_evaluator_drives_sleb_ppl_and_lorp_loss(windows: torch.Tensor) -> None:
    model = tiny_model("llama")
    before = snapshot(model)
    evaluator = LossEvaluator(model, windows, batch_size=2)

    def brute(dropped: tuple[int, ...]) -> float:
        pruned = copy.deepcopy(model)
        if dropped:
            drop_layers(pruned, dropped)
        return calibration_loss(pruned, windows)

    assert evaluator([()]) == [pytest.approx(brute(()), abs=1e-9)]
    single = {b: brute((b,)) for b in range(1, 5)}
    first = argmin(list(single), single.__getitem__)
    second = argmin([b for b in single if b != first], lambda b: brute(tuple(sorted((first, b)))))

    n0 = evaluator.n_evals
    sel = select_layers(S6, 2, "sleb", losses=evaluator)
    assert sel.details["order"] == [first, second]
    assert sel.details["n_evals"] == evaluator.n_evals - n0 == 7
    for b, loss in sel.details["step_losses"][0].items():
        assert loss == pytest.approx(single[b], abs=1e-6)

    sel = select_layers(S6, 2, "ppl", losses=evaluator, keep_first=1, keep_last=1)
    assert list(sel.layers) == sorted(sorted(single, key=lambda b: (single[b], b))[:2])

    sel = select_layers(S6, 2, "lorp-loss", losses=evaluator, k=2)
    assert sel.details["counts"] == [1, 1]  # clusters {0, 1, 2} and {3, 4, 5}
    assert sel.layers == (argmin([1, 2], single.__getitem__), argmin([3, 4], single.__getitem__))
    assert sel.details["n_evals"] == 4
    assert_unchanged(model, before)
    assert not model.training


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_loss_evaluator_shares_prefixes_bit_identically(family: str, windows: torch.Tensor) -> None:
    """Candidates reuse the hidden state at their shared prefix of kept blocks: every loss
    equals the plain forward of the pruned model bit for bit, in fewer block passes."""
    model = tiny_model(family)
    before = snapshot(model)
    n = len(decoder_blocks(model))
    cands = [(b,) for b in range(n)] + [(1, b) for b in range(2, n)] + [(), (0, 2, 3, 4, 5)]
    cands += [(3, 1), (3,)]  # the same sets again, one unsorted: scored once, answered twice
    cands = cands[::-1]  # order does not matter; values come back in the asked order
    passes = [0]
    hooks = [b.register_forward_hook(lambda *_: passes.__setitem__(0, passes[0] + 1))
             for b in decoder_blocks(model)]  # fmt: skip
    try:
        shared = LossEvaluator(model, windows, batch_size=2)(cands)
    finally:
        for h in hooks:
            h.remove()
    plain = []
    for c in cands:
        with blocks_dropped(model, c):
            plain.append(calibration_loss(model, windows, batch_size=2))
    assert shared == plain  # bit-identical: each block sees exactly its usual input
    batches = math.ceil(len(windows) / 2)
    every = sum(n - len(c) for c in cands) * batches
    assert passes[0] < 0.7 * every, (passes[0], every)
    assert_unchanged(model, before)
    assert all(not b._forward_pre_hooks and not b._forward_hooks for b in decoder_blocks(model))


def test_loss_evaluator_refuses_bad_windows_in_one_line() -> None:
    model = tiny_model("llama")
    for bad in (torch.zeros((0, 8), dtype=torch.long), torch.zeros((2, 1), dtype=torch.long)):
        with pytest.raises(ValueError, match=r"windows must be \[n >= 1, T >= 2\]"):
            LossEvaluator(model, bad)
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        LossEvaluator(model, torch.zeros((2, 8), dtype=torch.long), batch_size=0)
