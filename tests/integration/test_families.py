"""Every decoder family a fleet holds, pruned end to end through lorp's Python API on a tiny
random model built from its transformers config class: loaded from its checkpoint,
captured, selected, pruned and repaired, saved, reloaded. The reloaded model's logits are
the in-memory variant's; on its calibration windows the repaired variant is closer to the
dense model than the unrepaired one."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from lorp import select_layers
from lorp.locality.capture import capture_stats
from lorp.models.architectures import model_class
from lorp.models.layer_config import CutRefused
from lorp.models.loading import load_model
from lorp.models.surgery import drop_layers, save_pruned
from lorp.repair.prune_and_repair import prune_and_repair
from tests.helpers.family_models import (
    DENSE,
    HYBRIDS,
    MIXTURES,
    MULTIMODAL,
    family_model,
    multimodal_model,
)

pytestmark = pytest.mark.integration

CUTS = {"jamba": [1, 2]}
"""A family whose config states its layers as a repeating pattern takes only cuts that
keep its phase (Jamba: attention every 2nd layer, experts every 2nd): two blocks."""


def windows(n: int = 8, T: int = 24, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 120, (n, T), generator=g)


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.double()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("family", [*DENSE, *MIXTURES, *HYBRIDS])
def test_a_family_is_pruned_repaired_saved_and_reloaded(family: str, tmp_path: Path) -> None:
    family_model(family).save_pretrained(tmp_path / "dense")
    lm = load_model(str(tmp_path / "dense"), with_tokenizer=False)
    x = windows()
    stats = capture_stats(lm.model, x.split(4), progress=False)
    assert stats.n_blocks == 4 and stats.tokens == x.numel()
    budget = len(CUTS.get(family, [2]))
    selection = select_layers(stats, budget, method="shortgpt")
    assert len(selection.layers) == budget and 0 < min(selection.layers) < 3
    layers = CUTS.get(family, list(selection.layers))
    dense = copy.deepcopy(lm.model)
    unrepaired = copy.deepcopy(lm.model)
    drop_layers(unrepaired, layers)
    fits = prune_and_repair(lm.model, x, layers, sequential=False)
    assert fits and all(f.residual < f.unrepaired for f in fits)
    reference = logits(dense, x)
    repaired = logits(lm.model, x)
    assert relative(repaired, reference) < relative(logits(unrepaired, x), reference)
    save_pruned(lm.model, None, tmp_path / "pruned", {"method": "shortgpt"})
    cls = model_class(lm.model.config)
    reloaded = cls.from_pretrained(str(tmp_path / "pruned")).eval()
    assert relative(logits(reloaded, x), repaired) < 1e-5


def test_a_cut_a_family_cannot_state_is_refused_in_one_line_before_anything_changes() -> None:
    """Jamba keeps its attention and its experts every 2nd layer in a pattern its config
    derives: removing one block would reload its neighbours as other blocks."""
    model = family_model("jamba")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CutRefused) as refused:
        prune_and_repair(model, windows(), [1], sequential=False)
    assert str(refused.value).count("\n") == 0
    assert "Jamba: kept block 2 would reload as another block at 1" in str(refused.value)
    assert len(model.model.layers) == 4
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("model_type", list(MULTIMODAL))
def test_a_multimodal_model_loses_text_blocks_and_keeps_its_vision_tower(
    model_type: str, tmp_path: Path
) -> None:
    """The text tower is pruned and repaired; the checkpoint reloads as the same class
    (`Gemma3ForConditionalGeneration`, ...), everything but its text tower byte-identical."""
    model = multimodal_model(model_type)
    cls = type(model)
    model.save_pretrained(tmp_path / "dense")
    lm = load_model(str(tmp_path / "dense"), with_tokenizer=False)
    assert type(lm.model) is cls and lm.n_blocks == 4
    tower = "language_model.model." if model_type == "llama4" else "language_model."
    others = {k: v.clone() for k, v in lm.model.state_dict().items() if tower not in k}
    x = windows()
    stats = capture_stats(lm.model, x.split(4), progress=False)
    layers = list(select_layers(stats, 1, method="shortgpt").layers)
    fits = prune_and_repair(lm.model, x, layers, sequential=False)
    assert fits and all(f.residual < f.unrepaired for f in fits)
    save_pruned(lm.model, None, tmp_path / "pruned", {"method": "shortgpt"})
    reloaded = cls.from_pretrained(str(tmp_path / "pruned")).eval()
    assert reloaded.config.get_text_config(decoder=True).num_hidden_layers == 3
    state = reloaded.state_dict()
    assert others.keys() == {k for k in state if tower not in k}
    assert all(torch.equal(state[k], v) for k, v in others.items())
    assert relative(logits(reloaded, x), logits(lm.model, x)) < 1e-5
