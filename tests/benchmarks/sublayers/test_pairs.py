"""benchmarks/sublayers/pairs.py: one block's decode cost spent on an MLP and an attention of
two other blocks; candidates scored by the held-out loss, on a tiny model."""

from __future__ import annotations

import sys

import pytest
import torch

from lorp.models.shape import ModelShape
from lorp.models.sublayers import block_units
from lorp.scoring.removal_loss import LossEvaluator
from tests.helpers.paths import REPO
from tests.helpers.tiny_models import tiny_model
from tests.helpers.windows import token_windows

sys.path.insert(0, str(REPO))

from benchmarks.sublayers.costs import unit_cost  # noqa: E402
from benchmarks.sublayers.losses import SelectionLosses  # noqa: E402
from benchmarks.sublayers.pairs import candidates, main, named, summary  # noqa: E402


def test_pairs_are_an_mlp_and_an_attention_of_two_blocks_costing_one_block() -> None:
    model = tiny_model("llama")  # 6 blocks: blocks 1-4 eligible, units 2..9
    shape = ModelShape.from_config(model.config.to_dict())
    held = token_windows(4)
    losses = SelectionLosses(model, held, "float32")
    found = candidates(model, shape, losses.by("nll"), 2, "float32")
    plain = LossEvaluator(model, torch.as_tensor(held), units=True)
    blocks = [tuple(block_units([b])) for b in (1, 2, 3, 4)]
    assert sorted(found["blocks"]) == blocks
    want = plain(found["blocks"])
    assert [found["loss"][b] for b in found["blocks"]] == pytest.approx(want, rel=1e-5)
    assert want == sorted(want)  # best first
    singles = {u: found["loss"][(u,)] for u in range(2, 10)}
    mlps = sorted((u for u in singles if u % 2), key=singles.get)[:2]
    attns = sorted((u for u in singles if u % 2 == 0), key=singles.get)[:4]
    cost = unit_cost(model, shape, "float32")
    # no sliding window: an MLP and an attention of two blocks cost exactly one block
    assert {cost(p) for p in found["pairs"]} == {cost(blocks[0])} == {found["cap"]}
    assert sorted(found["pairs"]) == sorted(
        tuple(sorted((m, a))) for m in mlps for a in attns if m // 2 != a // 2
    )
    pairs = found["pairs"]
    assert [found["loss"][p] for p in pairs] == pytest.approx(plain(pairs), rel=1e-5)
    values = [found["loss"][p] for p in pairs]
    assert values == sorted(values)


def test_the_summary_names_each_side_s_best_and_a_missing_pair() -> None:
    dense = {
        "ppl": {"prose": 10.0, "code": 4.0},
        "decode_bytes_4k": 100.0,
        "zero_shot": {"acc_arc_easy": 50.0, "acc_copa": 60.0, "acc_avg": 55.0},
    }
    block = {
        "sublayers": ["attn.11", "mlp.11"],
        "ppl": {"prose": 10.3, "code": 4.2},
        "decode_bytes_4k": 97.0,
        "zero_shot": {"acc_arc_easy": 45.0, "acc_copa": 60.0},
    }
    pair = {
        "sublayers": ["mlp.10", "attn.11"],
        "ppl": {"prose": 10.2, "code": 4.4},
        "decode_bytes_4k": 97.0,
    }
    result = {
        "model": "m",
        "dense": dense,
        "blocks": [block],
        "pairs": [pair],
        "best": {"blocks": block["sublayers"], "pairs": pair["sublayers"]},
    }
    lines = summary(result).splitlines()
    assert lines == [
        "m best of blocks: attn.11, mlp.11: 1.050x (decode at 4k 0.970, 95.0% zero-shot)",
        "m best of pairs: mlp.10, attn.11: 1.100x (decode at 4k 0.970)",
    ]
    del result["best"]["pairs"]
    assert summary(result).splitlines()[1] == "m: no pair costs at most the best block"


def test_a_count_below_one_is_refused_in_one_line(capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit):
        main(["--model", "m", "--top", "0"])
    assert "--top: must be at least 1, got 0" in capsys.readouterr().err


def test_named_sets_go_to_their_side_and_bad_ones_are_refused(capsys) -> None:  # type: ignore[no-untyped-def]
    found = named(["attn.11,mlp.11", "mlp.10,attn.11", "mlp.3,attn.4,attn.3,mlp.4"])
    assert found["blocks"] == [(22, 23), (6, 7, 8, 9)] and found["pairs"] == [(21, 22)]
    for only, says in (
        (["attn.11,mlp.11"], "needs whole blocks and a pair"),
        (["attn.11,mlp.11", "mlp.x"], "--only: sub-layer 'mlp.x'"),
    ):
        with pytest.raises(SystemExit):
            main(["--model", "m", "--only", *only])
        assert says in capsys.readouterr().err
