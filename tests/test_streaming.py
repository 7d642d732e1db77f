"""Checkpoints larger than memory (`lorp.models.memory`, `lorp.models.streaming`,
`lorp.models.file_surgery`): on every tiny family, a model streamed a module at a time from its
files gives the in-memory model's S, last-token statistics, repair sums and perplexity, and the
pruned (and repaired) checkpoint written from the files is the in-memory surgery's, tensor for
tensor and config key for key. The sizes read from the headers are the loaded model's bytes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from lorp.locality.capture import capture_stats
from lorp.models.architectures import decoder_blocks
from lorp.models.file_surgery import renamed, write_pruned_files
from lorp.models.memory import GIB, stage_activations, weight_size
from lorp.models.perplexity import perplexity
from lorp.models.safetensors_index import read_header, split_block_key, tensor_index
from lorp.models.shape import ModelShape
from lorp.models.streaming import build_streamed, streamer_of
from lorp.models.surgery import drop_layers, save_pruned
from lorp.repair.capture import capture_repair_stats
from lorp.repair.fit import fit_runs
from lorp.repair.fold import file_folds, fold
from lorp.repair.maps import RepairRefused
from lorp.repair.stats import contiguous_runs
from pipeline.cluster.decisions import TooLargeError, decide
from pipeline.evaluation.speed import count_params
from tests.helpers.tiny_models import FAMILIES, N_BLOCKS, VOCAB, save_tiny
from tests.helpers.windows import token_windows


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: save_tiny(f, root / f) for f in FAMILIES}


def in_memory(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


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
    for name, model in (("memory", in_memory(checkpoints[family])),
                        ("streamed", build_streamed(checkpoints[family]))):  # fmt: skip
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


def test_sizes_from_headers_are_the_loaded_bytes(checkpoints: dict[str, Path]) -> None:
    for family, path in checkpoints.items():
        model = in_memory(path)
        for dtype in (torch.float32, torch.bfloat16):
            size = weight_size(tensor_index(path), dtype)
            itemsize = 2 if dtype == torch.bfloat16 else 4
            blocks = [
                sum(p.numel() for p in b.parameters()) * itemsize for b in decoder_blocks(model)
            ]
            assert list(size.blocks) == blocks, family
            distinct = {p.data_ptr(): p.numel() for p in model.parameters()}
            assert size.total == sum(distinct.values()) * itemsize, family
            assert (size.head == 0) == (family == "gemma3_text"), family


def test_decide_memory_streamed_refused(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["llama"]
    size = weight_size(tensor_index(path), torch.float32)
    shape = ModelShape.from_config(json.loads((path / "config.json").read_text()))
    kw = {"batch": 2, "seq_len": 32, "itemsize": 4, "label": "tiny"}
    roomy = decide("capture", size, shape, worker_bytes=GIB, **kw)
    assert roomy.mode == "memory" and roomy.need_bytes == roomy.memory_bytes
    # Enough for the resident parts, two blocks and the activations, not the whole model.
    streamed_need = roomy.memory_bytes - size.total + size.resident + 2 * size.largest_unit
    tight = int(streamed_need / 0.8) + 1
    d = decide("capture", size, shape, worker_bytes=tight, **kw)
    assert (d.mode, d.need_bytes, d.batch) == ("streamed", streamed_need, 2)
    # With room for three more windows per forward (activations are linear in the
    # batch), a streamed stage takes them: each forward reads every block once.
    per_window = stage_activations("capture", shape, 1, 32, 4)
    roomier = int((streamed_need + 3 * per_window) / 0.8) + 1
    assert (streamed_need + 3 * per_window) < roomy.memory_bytes  # still streamed
    wide = decide("capture", size, shape, worker_bytes=roomier, max_batch=64, **kw)
    assert (wide.mode, wide.batch) == ("streamed", 5)
    assert decide("capture", size, shape, worker_bytes=roomier, max_batch=4, **kw).batch == 4
    # Held whole with one copy where two do not fit (a CPU point then loads its own).
    one = decide("evaluate", size, shape, worker_bytes=GIB, copies=2, **kw)
    assert (one.mode, one.copies) == ("memory", 2)
    acts = one.memory_bytes - 2 * size.total
    only_one = int((size.total + acts) / 0.8) + 1
    d = decide("evaluate", size, shape, worker_bytes=only_one, copies=2, **kw)
    assert (d.mode, d.copies, d.memory_bytes) == ("memory", 1, size.total + acts)
    with pytest.raises(TooLargeError, match=r"model 'tiny' cannot run its capture even streamed"):
        decide("capture", size, shape, worker_bytes=tight - 8, **kw)


def test_header_reader_refuses_a_non_safetensors_file(tmp_path: Path) -> None:
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00nope!")
    with pytest.raises(ValueError, match="no readable safetensors header"):
        read_header(bad)


def tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out |= {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    return out


def config_of(path: Path) -> dict:
    config = json.loads((path / "config.json").read_text())
    config.pop("transformers_version", None)
    return config


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_file_surgery_equals_in_memory(
    family: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Pruned and repaired from the files = pruned and repaired in memory, for a run
    from block 0 (where the embeddings are not tied) and a run inside the stack."""
    path = checkpoints[family]
    tied = family == "gemma3_text"
    layers = [2, 3] if tied else [0, 1, 3, 4]
    dense = in_memory(path)
    stats = capture_repair_stats(
        dense, [token_windows(8)], contiguous_runs(layers, N_BLOCKS), progress=False
    )
    fits = fit_runs(dense, stats)
    provenance = {"pruned": layers}
    written = write_pruned_files(
        path, tmp_path / "files", layers, provenance, changes=file_folds(fits)
    )
    fold(dense, fits)
    drop_layers(dense, layers)
    saved = save_pruned(dense, None, tmp_path / "memory", provenance)
    a, b = tensors(saved), tensors(written)
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert config_of(saved) == config_of(written)
    assert config_of(written)["num_hidden_layers"] == N_BLOCKS - len(layers)
    # The fold did change block s-1's down_proj (block 2 is the pruned model's block 0
    # when blocks 0, 1, 3, 4 go; block 1 stays block 1 when 2, 3 go).
    before, after = (1, 1) if tied else (2, 0)
    down = "model.layers.{}.mlp.down_proj.weight"
    assert not torch.equal(tensors(path)[down.format(before)], b[down.format(after)])
    reloaded = AutoModelForCausalLM.from_pretrained(str(written), dtype=torch.float32)
    assert len(decoder_blocks(reloaded)) == N_BLOCKS - len(layers)


def test_file_surgery_refuses_a_fold_into_tied_embeddings(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    path = checkpoints["gemma3_text"]
    dense = in_memory(path)
    stats = capture_repair_stats(dense, [token_windows(8)], [(0, 1)], progress=False)
    fits = fit_runs(dense, stats)
    with pytest.raises(RepairRefused, match="tied embeddings"):
        write_pruned_files(path, tmp_path / "x", [0, 1], {}, changes=file_folds(fits))
    assert not (tmp_path / "x").exists()


def test_file_surgery_shards_and_dtype(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """A checkpoint in several shards keeps its shards (and an index naming them); with
    a dtype, every floating tensor is written in it."""
    path = checkpoints["qwen2"]
    model = in_memory(path)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="200KB")
    assert len(list(sharded.glob("*.safetensors"))) > 1
    out = write_pruned_files(sharded, tmp_path / "out", [2], {}, dtype=torch.bfloat16)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    got = tensors(out)
    assert set(index["weight_map"]) == set(got)
    assert {t.dtype for t in got.values()} == {torch.bfloat16}
    want = tensors(path)
    assert torch.equal(
        got["model.layers.2.mlp.up_proj.weight"],
        want["model.layers.3.mlp.up_proj.weight"].bfloat16(),
    )
    assert config_of(out)["dtype"] == "bfloat16"


def test_a_fold_on_a_streamed_model_equals_the_in_memory_fold(
    checkpoints: dict[str, Path],
) -> None:
    """The fold changes the resident vectors in place and matrices by overrides:
    the repaired, pruned streamed model computes what the in-memory one does."""
    path = checkpoints["olmo2"]  # a normed fit: down_proj and the post-MLP norm change
    dense, streamed = in_memory(path), build_streamed(path)
    layers = [0, 3, 4]
    stats = capture_repair_stats(
        dense, [token_windows(8)], contiguous_runs(layers, N_BLOCKS), progress=False
    )
    fits = fit_runs(dense, stats)
    for model in (dense, streamed):
        fold(model, fits)
        drop_layers(model, layers)
    x = token_windows(4)
    assert perplexity(streamed, x) == pytest.approx(perplexity(dense, x), rel=1e-6)
    # Run 0-0 folds into the embeddings, run 3-4 into block 2's down_proj.
    overrides = streamer_of(streamed).overrides
    assert set(overrides) == {"model.embed_tokens.weight", "model.layers.2.mlp.down_proj.weight"}


@pytest.mark.parametrize("family", ["llama", "olmo2"])
def test_a_streamed_fold_evaluates_what_its_bf16_checkpoint_holds(
    family: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """A bf16 checkpoint's variant is written in bf16, the fold rounded there: the
    streamed model runs that rounded fold, so its perplexity is the written variant's
    (OLMo 2: its post-MLP norm's folded scale too)."""
    bf16 = tmp_path / "bf16"
    in_memory(checkpoints[family]).to(torch.bfloat16).save_pretrained(bf16)
    layers = [3, 4]
    stats = capture_repair_stats(
        in_memory(bf16), [token_windows(8)], contiguous_runs(layers, N_BLOCKS), progress=False
    )
    fits = fit_runs(in_memory(bf16), stats)
    streamed = build_streamed(bf16)
    fold(streamed, fits)
    drop_layers(streamed, layers)
    written = write_pruned_files(bf16, tmp_path / "variant", layers, {}, changes=file_folds(fits))
    x = token_windows(4)
    assert perplexity(streamed, x) == pytest.approx(perplexity(in_memory(written), x), rel=1e-6)
    # Held whole in fp32, the fold is not rounded: the figures differ, so the test can fail.
    dense = in_memory(bf16)
    fold(dense, fits)
    drop_layers(dense, layers)
    assert perplexity(dense, x) != pytest.approx(perplexity(streamed, x), rel=1e-6)
    # A matrix is folded once: a second fold of the same run would start from the file.
    again = build_streamed(bf16)
    fold(again, fits)
    with pytest.raises(ValueError, match="is already folded: a matrix is folded once"):
        fold(again, fits)


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


def test_only_the_checkpoints_own_files_are_read(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """A repository may ship another format's weights beside the shards (Mistral's
    `consolidated.safetensors`): sizing, streaming and file surgery read only the files
    the checkpoint names."""
    from safetensors.torch import save_file

    copy = tmp_path / "llama"
    shutil.copytree(checkpoints["llama"], copy)
    save_file(
        {"layers.0.attention.wq.weight": torch.ones(4, 4)}, str(copy / "consolidated.safetensors")
    )
    assert "layers.0.attention.wq.weight" not in tensor_index(copy)
    x = token_windows(4)
    assert perplexity(build_streamed(copy), x) == pytest.approx(perplexity(in_memory(copy), x))
    out = write_pruned_files(copy, tmp_path / "out", [1], {})
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]


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


def test_block_keys_split_at_the_blocks_index() -> None:
    assert split_block_key("model.layers.3.sub.layers.1.weight") == (
        "model.layers.",
        3,
        "sub.layers.1.weight",
    )
    assert split_block_key("model.embed_tokens.weight") is None
    assert renamed("model.layers.3.sub.layers.3.w", {3: 0}) == "model.layers.0.sub.layers.3.w"
