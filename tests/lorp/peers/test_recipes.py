"""`repair_peer`: each peer repair run by name, the blocks it drops and the tensors it
changed named, and a bad option refused in one line naming it."""

from __future__ import annotations

import copy

import pytest

from lorp.peers.recipes import PeerRepair, check_repair_options, repair_peer
from tests.helpers.tiny_models import tiny_model
from tests.helpers.windows import token_windows


@pytest.mark.parametrize(
    ("peer", "dropped", "changed"),
    [
        (
            PeerRepair("cosine-map", {"epochs": 1}),
            (2, 3),
            {"model.layers.1.mlp.down_proj.weight"},
        ),
        (
            PeerRepair("hadamard-patch"),
            (2, 3),
            {"model.layers.1.mlp.down_proj.weight", "model.layers.1.self_attn.o_proj.weight"},
        ),
        (
            PeerRepair(
                "magnitude-comp", steps=({"block": 2, "alpha": 1.5}, {"block": 3, "alpha": 1.2})
            ),
            (2, 3),
            {"model.embed_tokens.weight"}
            | {
                f"model.layers.{j}.{p}.weight"
                for j in (0, 1, 2)
                for p in ("self_attn.o_proj", "mlp.down_proj")
            },
        ),
        (
            PeerRepair("replacement-ffn", {"epochs": 1, "lr": 1e-3}),
            (2,),
            {"model.layers.3.self_attn.o_proj.weight"}
            | {f"model.layers.3.mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
        ),
    ],
)
def test_each_peer_names_what_it_drops_and_changes(
    peer: PeerRepair, dropped: tuple, changed: set
) -> None:
    model, w = copy.deepcopy(tiny_model("llama")), token_windows(4, 24)
    result = repair_peer(model, [2, 3], w, {"": w[:2]}, peer)
    assert result.dropped == dropped and set(result.changed) == changed
    assert result.record["repair"] == peer.name


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("cosine-map", {"rounds": 2}, "option 'rounds': cosine-map takes epochs, lr"),
        ("replacement-ffn", {"lr": 3}, "option 'lr': out of range for replacement-ffn, got 3"),
        ("linear", {}, "repair .linear.: not a peer repair"),
    ],
)
def test_bad_options_are_refused_in_one_line(name: str, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_repair_options(name, options)
