"""A checkpoint's tensors placed by the names `from_pretrained` gives them: an expert bank
built from its experts' tensors equals the bank transformers loads, bit for bit, and every
tensor of the loaded model has exactly one entry."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from lorp.models.conversions import FusedEntry, assemble, model_entries
from lorp.models.disk_names import model_of
from lorp.models.safetensors_index import TensorEntry, tensor_index
from tests.helpers.family_models import family_model
from tests.helpers.model_checks import in_memory


def read(part: TensorEntry) -> torch.Tensor:
    with safe_open(str(part.file), framework="pt") as handle:
        return handle.get_tensor(part.key)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "jamba"])
def test_every_loaded_tensor_has_one_entry_and_a_bank_is_built_as_loaded(
    family: str, tmp_path: Path
) -> None:
    family_model(family).save_pretrained(tmp_path)
    loaded = in_memory(tmp_path)
    meta = model_of(loaded.config)
    entries = model_entries(meta, tensor_index(tmp_path))
    state = loaded.state_dict()
    assert set(entries) == set(state)
    for name, entry in entries.items():
        assert entry.shape == tuple(state[name].shape), name
        value = assemble(entry, read, meta)[name] if isinstance(entry, FusedEntry) else read(entry)
        assert torch.equal(value, state[name]), name
    fused = [e for e in entries.values() if isinstance(e, FusedEntry)]
    # gpt-oss's files keep its banks whole; the others keep one tensor per expert.
    assert len(fused) == (
        0 if family == "gpt_oss" else 2 * sum(1 for n in state if n.endswith(".experts.down_proj"))
    )


def test_mixtral_gate_and_up_are_gathered_expert_by_expert_gate_first(tmp_path: Path) -> None:
    """Mixtral's `w1` (gate) and `w3` (up) of experts 0..3 build `gate_up_proj` [E, 2I, d]:
    each projection's experts by number, gate's before up's, as transformers stacks and
    joins them."""
    model = family_model("mixtral")
    model.save_pretrained(tmp_path)
    entries = model_entries(model_of(model.config), tensor_index(tmp_path))
    bank = entries["model.layers.1.mlp.experts.gate_up_proj"]
    assert isinstance(bank, FusedEntry)
    prefix = "model.layers.1.block_sparse_moe.experts"
    by_pattern: dict[str, list[str]] = {}
    for pattern, part in bank.parts:
        by_pattern.setdefault(pattern, []).append(part.key)
    assert list(by_pattern.values()) == [
        [f"{prefix}.{j}.w{w}.weight" for j in range(4)] for w in (1, 3)
    ]
    assert bank.shape == (4, 2 * 128, 64)
    assert bank.nbytes_as(2) == 4 * 256 * 64 * 2
    router = entries["model.layers.1.mlp.gate.weight"]
    assert (
        isinstance(router, TensorEntry)
        and router.key == "model.layers.1.block_sparse_moe.gate.weight"
    )
    # Built from the parts in another order, the bank differs: the order is what is checked.
    swapped = FusedEntry(bank.key, bank.shape, bank.parts[::-1], bank.group, bank.converter)
    built = assemble(swapped, read, model_of(model.config))[bank.key]
    assert not torch.equal(built, model.model.layers[1].mlp.experts.gate_up_proj.detach())
