"""A model streamed a module at a time from its files computes what the in-memory model does,
one matrix resident at a time, and refuses a checkpoint it cannot place."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from lorp.locality.capture import capture_stats
from lorp.models.architectures import decoder_blocks
from lorp.models.perplexity import perplexity
from lorp.models.streaming import build_streamed, streamer_of
from lorp.models.surgery import drop_layers
from lorp.repair.capture import capture_repair_stats
from pipeline.evaluation.speed import count_params
from tests.helpers.model_checks import in_memory
from tests.helpers.tiny_models import FAMILIES, N_BLOCKS, VOCAB
from tests.helpers.windows import token_windows


def stat_arrays(stats: object) -> dict[str, torch.Tensor]:
    return {k: getattr(stats, k) for k in ("_sum", "_last_sum", "_last_angle")}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_streamed_equals_in_memory(family: str, checkpoints: dict[str, Path]) -> None:
    path = checkpoints[family]
    dense, streamed = in_memory(path), build_streamed(path)
    x = token_windows(4)
    # S and the last-token statistics, two batches, BOS position skipped as the jobs do.
    a = capture_stats(dense, [x[:2], x[2:]], progress=False, skip_prefix=1)
    # A capture worker's model: the decoder stack only, the LM head never read.
    stack_only = build_streamed(path, head=False)
    assert stack_only.lm_head.weight.device.type == "meta"
    b = capture_stats(stack_only, [x[:2], x[2:]], progress=False, skip_prefix=1)
    for key, value in stat_arrays(a).items():
        assert torch.allclose(value, stat_arrays(b)[key], rtol=0, atol=1e-6), key
    assert float(a._sum.abs().sum()) > 0
    # The repair's sums (a run inside the stack and one ending at the last block).
    runs = [(2, 3), (N_BLOCKS - 1, N_BLOCKS - 1)]
    ra = capture_repair_stats(dense, [x], runs, progress=False)._arrays("")
    rb = capture_repair_stats(streamed, [x], runs, progress=False)._arrays("")
    for key, value in ra.items():
        if value.dtype.kind == "f":
            assert abs(value - rb[key]).max() <= 1e-6 * max(1.0, abs(value).max()), key
    # Parameters counted alike (the streamed matrices are on the meta device).
    assert count_params(streamed) == count_params(dense)
    # Perplexity dense and pruned: the hooks travel with the blocks through surgery.
    assert perplexity(streamed, x, batch_size=2) == pytest.approx(perplexity(dense, x), rel=1e-6)
    drop_layers(dense, [1, 4])
    drop_layers(streamed, [1, 4])
    assert perplexity(streamed, x) == pytest.approx(perplexity(dense, x), rel=1e-6)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_streamed_zero_shot_loglikelihoods_equal_in_memory(
    family: str, checkpoints: dict[str, Path]
) -> None:
    """The transformers backend's zero-shot scoring (lm-eval's HFLM, continuation head) on
    a streamed model gives the in-memory log-likelihoods; Gemma 3 ties its head."""
    from pipeline.evaluation.zero_shot import hf_lm
    from tests.helpers.tiny_models import word_tokenizer

    tokenizer = word_tokenizer(["a"], add_bos=False)
    g = torch.Generator().manual_seed(1)
    requests = []
    for i, (n, k) in enumerate([(5, 1), (9, 2), (17, 3), (3, 4), (30, 1)]):
        tokens = torch.randint(3, VOCAB, (n + k,), generator=g).tolist()
        requests.append(((f"context {i}", f"continuation {i}"), tokens[:n], tokens[n:]))
    got = {}
    for name, model in (
        ("memory", in_memory(checkpoints[family])),
        ("streamed", build_streamed(checkpoints[family])),
    ):
        got[name] = hf_lm(model, tokenizer, 2)._loglikelihood_tokens(requests, disable_tqdm=True)
    assert [f for _, f in got["streamed"]] == [f for _, f in got["memory"]]
    for (a, _), (b, _) in zip(got["streamed"], got["memory"], strict=True):
        assert a == pytest.approx(b, rel=1e-5) and a < 0


def test_streaming_holds_one_matrix(checkpoints: dict[str, Path]) -> None:
    """At most one module's matrices (a projection, the embeddings, the head) are on a
    real device at any time, and a forward of a batch reads each of them once."""
    streamed = build_streamed(checkpoints["llama"])
    streamer = streamer_of(streamed)
    assert streamer is not None
    # Every block's 7 projections, the embeddings and the head.
    assert len(streamer.units) == 7 * N_BLOCKS + 2
    held: list[int] = []

    def count(module: torch.nn.Module, args: tuple) -> None:
        held.append(sum(1 for p in streamed.parameters() if p.dim() >= 2 and not p.is_meta))

    for u in streamer.units.values():
        u.module.register_forward_pre_hook(count)
    perplexity(streamed, token_windows(4), batch_size=4)
    assert held == [1] * len(streamer.units)
    assert streamer.reads == len(streamer.units)
    assert all(p.is_meta for p in streamed.parameters() if p.dim() >= 2)


def test_a_skipped_block_changes_the_figures(checkpoints: dict[str, Path]) -> None:
    """The equality above can fail: a streamer that serves block 2's MLP weights for
    block 3's gives another perplexity."""
    path = checkpoints["llama"]
    streamed = build_streamed(path)
    streamer = streamer_of(streamed)
    assert streamer is not None
    blocks = decoder_blocks(streamed)
    for name in ("gate_proj", "up_proj", "down_proj"):
        source = streamer.units[id(getattr(blocks[2].mlp, name))]
        streamer.units[id(getattr(blocks[3].mlp, name))].tensors = list(source.tensors)
    x = token_windows(4)
    assert perplexity(streamed, x) != pytest.approx(perplexity(in_memory(path), x), rel=1e-3)


def test_a_checkpoint_missing_a_vector_is_refused_naming_it(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "qwen2"
    shutil.copytree(checkpoints["qwen2"], copy)
    tensors = load_file(str(copy / "model.safetensors"))
    del tensors["model.layers.1.self_attn.q_proj.bias"]
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"no tensor for 'model.layers.1.self_attn.q_proj.bias'"):
        build_streamed(copy)


def test_legacy_rotary_frequencies_are_ignored_as_from_pretrained_does(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Old Llama checkpoints carry `rotary_emb.inv_freq`, which today's modules compute:
    the streamer skips it (with any tensor the model has no place for it still refuses)."""
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "llama"
    shutil.copytree(checkpoints["llama"], copy)
    tensors = load_file(str(copy / "model.safetensors"))
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    x = token_windows(4)
    assert perplexity(build_streamed(copy), x) == pytest.approx(perplexity(in_memory(copy), x))
    tensors["model.layers.0.self_attn.nonsense.weight"] = torch.ones(8, 8)
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.nonsense.weight' has no place"):
        build_streamed(copy)


MIXTURES = ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "jamba", "bamba"]
"""Banks from per-expert files (Qwen3-MoE's names, Mixtral's renamed `block_sparse_moe`
and `w1`/`w2`/`w3`), from files that keep them whole (gpt-oss), a dense first block then
experts with a shared expert (DeepSeek-V3), and Mamba mixers between them (Jamba) or
beside attention without experts (Bamba): their mixers hand `conv1d.weight` to a kernel
without calling `conv1d`."""


@pytest.fixture(scope="module")
def mixtures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.helpers.family_models import family_model

    root = tmp_path_factory.mktemp("mixtures")
    for family in MIXTURES:
        family_model(family).save_pretrained(root / family)
    return {f: root / f for f in MIXTURES}


@pytest.mark.parametrize("family", MIXTURES)
def test_a_streamed_mixture_equals_in_memory(family: str, mixtures: dict[str, Path]) -> None:
    """S, the repair's sums and perplexity, dense and pruned, as the model held whole."""
    path = mixtures[family]
    dense, streamed = in_memory(path), build_streamed(path)
    x = token_windows(4, vocab=128)
    a = capture_stats(dense, [x[:2], x[2:]], progress=False, skip_prefix=1)
    b = capture_stats(
        build_streamed(path, head=False), [x[:2], x[2:]], progress=False, skip_prefix=1
    )
    for key, value in stat_arrays(a).items():
        assert torch.allclose(value, stat_arrays(b)[key], rtol=0, atol=1e-6), key
    runs = [(2, 2), (3, 3)]  # folds into block 1's experts and block 2's last stage
    ra = capture_repair_stats(dense, [x], runs, progress=False)._arrays("")
    rb = capture_repair_stats(streamed, [x], runs, progress=False)._arrays("")
    for key, value in ra.items():
        if value.dtype.kind == "f":
            assert abs(value - rb[key]).max() <= 1e-6 * max(1.0, abs(value).max()), key
    assert count_params(streamed) == count_params(dense)
    assert perplexity(streamed, x, batch_size=2) == pytest.approx(perplexity(dense, x), rel=1e-6)
    cut = [3] if family == "jamba" else [2]  # Jamba's config describes no other one-block cut
    drop_layers(dense, cut)
    drop_layers(streamed, cut)
    assert perplexity(streamed, x) == pytest.approx(perplexity(dense, x), rel=1e-6)


def test_a_mixture_holds_one_module_and_reads_each_expert_once(
    mixtures: dict[str, Path],
) -> None:
    """A DeepSeek-V3 forward reads every expert's tensor from its file once, each layer's
    banks as its experts module runs (built there, one bank after the other) and
    released after: at most one module's matrices (a layer's two banks) are resident."""
    streamed = build_streamed(mixtures["deepseek_v3"])
    streamer = streamer_of(streamed)
    assert streamer is not None
    files: list[str] = []
    read_file = streamer._read_file
    streamer._read_file = lambda e, c: files.append(e.key) or read_file(e, c)  # type: ignore[method-assign]
    held: list[int] = []

    def resident(m: torch.nn.Module) -> bool:
        return any(p is not None and p.dim() >= 2 and not p.is_meta for p in m._parameters.values())

    def count(module: torch.nn.Module, args: tuple) -> None:
        held.append(sum(1 for m in streamed.modules() if resident(m)))

    for u in streamer.units.values():
        u.module.register_forward_pre_hook(count)
    perplexity(streamed, token_windows(4, vocab=128), batch_size=4)
    assert held == [1] * len(streamer.units)
    assert streamer.reads == len(streamer.units)
    experts = [k for k in files if ".mlp.experts." in k]
    assert len(experts) == len(set(experts)) == 3 * 4 * 3  # 3 MoE blocks, 4 experts, 3 each
    banks = [n for n, p in streamed.named_parameters() if n.endswith("mlp.experts.down_proj")]
    assert len(banks) == 3 and all(p.is_meta for p in streamed.parameters() if p.dim() >= 2)
