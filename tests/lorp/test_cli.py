"""`lorp select/capture/prune` as a user runs them: output and JSON agree with the API, the
checkpoint carries its provenance, bad input is one line on stderr and exit 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lorp import SimilarityStats, select_layers
from lorp.cli import main
from tests.helpers.cli_runner import lorp as run
from tests.helpers.states import make_states


@pytest.fixture(scope="module")
def stats_file(tmp_path_factory) -> Path:
    s = SimilarityStats(10)
    s.update(make_states(11, 64, 16, seed=4))
    return s.to_file(tmp_path_factory.mktemp("cli") / "stats.npz")


def test_select_json_matches_the_api(stats_file: Path) -> None:
    out = run("select", str(stats_file), "--budget", "3", "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    expected = select_layers(SimilarityStats.from_file(stats_file), 3, "lorp")
    assert d["pruned"] == list(expected.layers)
    assert d["details"]["k"] == expected.details["k"]
    assert len(d["details"]["labels"]) == 10 and len(d["kept"]) == 7


def test_select_text_output(stats_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["select", str(stats_file), "--budget", "0.3", "--variant", "released", "--k", "3"])
        == 0
    )
    text = capsys.readouterr().out
    assert "K = 3 (fixed)" in text and "budget 3" in text
    assert "pruned" in text and "stage1" in text


def test_select_npy_matrix(tmp_path: Path, stats_file: Path) -> None:
    np.save(tmp_path / "S.npy", SimilarityStats.from_file(stats_file).matrix())
    out = run(
        "select",
        str(tmp_path / "S.npy"),
        "--budget",
        "2",
        "--method",
        "random",
        "--seed",
        "3",
        "--json",
    )
    assert out.returncode == 0 and len(json.loads(out.stdout)["pruned"]) == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--budget", "0"], "1 <= blocks <= 8 for N=10, got 0"),
        (["--budget", "9"], "got 9"),
        (["--budget", "x"], "budget must be a block count or a fraction, got 'x'"),
        (["--budget", "2", "--method", "nope"], "unknown method 'nope'"),
        (
            ["--budget", "2", "--method", "shortgpt", "--k", "3"],
            "--k does not apply to method 'shortgpt'",
        ),
        (["--budget", "2", "--variant", "v2"], "invalid choice: 'v2'"),
    ],
)
def test_bad_input_is_one_line_exit_2(
    stats_file: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # In-process: the console script is `main`; test_bad_files_one_line runs the real one.
    code = main(["select", str(stats_file), *args])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.count("\n") == 1 and message in captured.err, captured.err
    assert captured.out == ""


def test_bad_files_one_line(tmp_path: Path) -> None:
    out = run("select", str(tmp_path / "missing.npz"), "--budget", "2")
    assert (
        out.returncode == 2 and "stats file not found" in out.stderr and out.stderr.count("\n") == 1
    )
    np.save(tmp_path / "rect.npy", np.ones((4, 5)))
    out = run("select", str(tmp_path / "rect.npy"), "--budget", "1")
    assert out.returncode == 2 and "square, got shape (4, 5)" in out.stderr
    np.save(tmp_path / "sq.npy", np.eye(6))
    out = run("select", str(tmp_path / "sq.npy"), "--budget", "2", "--method", "shortgpt")
    assert out.returncode == 2 and "needs the last block's output state" in out.stderr
    # --debug shows the traceback instead.
    out = run("--debug", "select", str(tmp_path / "rect.npy"), "--budget", "1")
    assert out.returncode != 0 and "Traceback" in out.stderr


def test_lorp_never_imports_the_fleet() -> None:
    code = (
        "import sys, lorp, lorp.cli; bad = {'ray', 'mlflow', 'vllm'} & set(sys.modules); "
        "print(sorted(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out


def test_select_window_and_candidate_options(stats_file: Path) -> None:
    stats = SimilarityStats.from_file(stats_file)
    for args, method, options in [
        (["--method", "streamline", "--last-block"], "streamline", {"last_block": True}),
        (["--method", "angular"], "angular", {}),
        (["--method", "shortgpt", "--candidates", "all"], "shortgpt", {"candidates": "all"}),
    ]:
        out = run("select", str(stats_file), "--budget", "3", "--json", *args)
        assert out.returncode == 0, out.stderr
        d = json.loads(out.stdout)
        assert d["pruned"] == list(select_layers(stats, 3, method, **options).layers)
        assert d["options"] == {**d["options"], **options}
    code = main(["select", str(stats_file), "--budget", "2", "--candidates", "all"])
    assert code == 2


def test_capture_with_bos_then_prune(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`capture --bos always` on a tiny PTB model (its tokenizer adds no BOS itself), then
    `prune --stats`: the checkpoint carries the one provenance layout."""
    from lorp.models.surgery import PROVENANCE_FILE
    from tests.helpers.tiny_models import save_tiny_ptb

    monkeypatch.setenv("LORP_CACHE", str(tmp_path / "cache"))
    model = save_tiny_ptb("llama", tmp_path / "llama")
    common = ["--data", "ptb", "--samples", "3", "--seq-len", "16"]
    assert main(["capture", str(model), *common, "--out", str(tmp_path / "auto.npz")]) == 0
    args = ["capture", str(model), *common, "--bos", "always", "--out", str(tmp_path / "s.npz")]
    assert main(args) == 0
    assert "BOS 1 first" in capsys.readouterr().out
    auto, bos = (SimilarityStats.from_file(tmp_path / f) for f in ("auto.npz", "s.npz"))
    assert auto.tokens == bos.tokens == 3 * 16  # the BOS position is not in S
    assert auto.sequences == bos.sequences == 3
    assert bos.calibration_fingerprint == auto.calibration_fingerprint + ":bos1"
    assert bos.extra["bos"] == "always" and auto.extra["bos_id"] is None

    out = tmp_path / "pruned"
    argv = ["prune", str(model), "--stats", str(tmp_path / "s.npz"), "--budget", "2"]
    assert main([*argv, "--method", "shortgpt", "--out", str(out)]) == 0
    record = json.loads((out / PROVENANCE_FILE).read_text())
    expected = select_layers(bos, 2, "shortgpt")
    assert record["pruned"] == list(expected.layers) and record["kept"] == list(expected.kept)
    assert record["method"] == "shortgpt" and record["options"] == {"candidates": "inner"}
    assert record["n_blocks"] == 6 and record["stats_hash"] and record["job"] is None
    manual = tmp_path / "manual"
    assert main(["prune", str(model), "--layers", "1,3-4", "--out", str(manual)]) == 0
    rec2 = json.loads((manual / PROVENANCE_FILE).read_text())
    assert rec2.keys() == record.keys() and rec2["kept"] == [0, 2, 5]
    assert rec2["method"] == "manual" and rec2["budget"] == 3


def _lorp_capture(model_dir: Path, data: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    from tests.helpers.cli_runner import lorp

    args = [
        "capture",
        str(model_dir),
        "--data",
        data,
        "--samples",
        "2",
        "--seq-len",
        "16",
        "--out",
        "s.npz",
    ]
    return lorp(*args, cwd=cwd)


def test_cli_bad_models_and_corpora(tmp_path: Path) -> None:
    """Through the CLI: one line, exit 2, no stats file written."""
    from tests.helpers.tiny_models import save_tiny_ptb

    bert = tmp_path / "bert"
    config = AutoConfig.for_model(
        "bert",
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=2,
        vocab_size=128,
        intermediate_size=128,
        is_decoder=True,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(bert)
    out = _lorp_capture(bert, "ptb", tmp_path)
    refused = "model_type 'bert' cannot be pruned by lorp: no list of decoder blocks"
    assert out.returncode == 2 and refused in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1

    llama = save_tiny_ptb("llama", tmp_path / "llama")
    (tmp_path / "empty.txt").write_text("\n  \n")
    out = _lorp_capture(llama, str(tmp_path / "empty.txt"), tmp_path)
    assert out.returncode == 2 and "is empty" in out.stderr and out.stderr.count("\n") == 1

    broken = AutoModelForCausalLM.from_pretrained(llama)
    with torch.no_grad():
        broken.model.layers[2].mlp.down_proj.weight.fill_(float("inf"))
    broken.save_pretrained(tmp_path / "broken")
    shutil.copy(llama / "tokenizer.json", tmp_path / "broken")
    shutil.copy(llama / "tokenizer_config.json", tmp_path / "broken")
    out = _lorp_capture(tmp_path / "broken", "ptb", tmp_path)
    assert out.returncode == 2 and "non-finite activations at layer 3" in out.stderr, out.stderr
    assert "float32 or bfloat16" in out.stderr and out.stderr.count("\n") == 1
    assert not (tmp_path / "s.npz").exists()


def test_sublayers_capture_select_and_prune_to_a_servable_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`capture --sublayers`, `select --granularity attention`, then `prune` writes the
    Nemotron-NAS checkpoint; whole blocks still select from the same statistics."""
    from lorp.methods.sublayer_selection import select_units
    from tests.helpers.tiny_models import save_tiny_ptb

    monkeypatch.setenv("LORP_CACHE", str(tmp_path / "cache"))
    model = save_tiny_ptb("llama", tmp_path / "llama")
    stats = tmp_path / "units.npz"
    common = ["--data", "ptb", "--samples", "3", "--seq-len", "16"]
    assert main(["capture", str(model), *common, "--sublayers", "--out", str(stats)]) == 0
    assert "12 sub-layers" in capsys.readouterr().out
    out = run(
        "select",
        str(stats),
        "--budget",
        "2",
        "--granularity",
        "attention",
        "--method",
        "shortgpt",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    picked = json.loads(out.stdout)
    expected = select_units(
        SimilarityStats.from_file(stats).similarity(), 2, "attention", "shortgpt"
    )
    assert picked["pruned"] == list(expected.layers) and all(u % 2 == 0 for u in expected.layers)
    blocks = run("select", str(stats), "--budget", "2", "--method", "shortgpt", "--json")
    assert len(json.loads(blocks.stdout)["details"]["blocks"]) == 2

    dest = tmp_path / "attention-2"
    argv = ["prune", str(model), "--stats", str(stats), "--budget", "2", "--method", "shortgpt"]
    assert main([*argv, "--granularity", "attention", "--out", str(dest)]) == 0
    config = json.loads((dest / "config.json").read_text())
    gone = [i for i, b in enumerate(config["block_configs"]) if b["attention"]["no_op"]]
    assert gone == [u // 2 for u in expected.layers]
    loaded = AutoModelForCausalLM.from_pretrained(dest, trust_remote_code=True)
    assert sum(hasattr(layer, "self_attn") for layer in loaded.model.layers) == 4
    record = json.loads((dest / "lorp_pruning.json").read_text())
    assert record["details"]["granularity"] == "attention" and record["trust_remote_code"]

    manual = tmp_path / "manual"
    assert main(["prune", str(model), "--units", "attn.2,mlp.4", "--out", str(manual)]) == 0
    assert json.loads((manual / "lorp_pruning.json").read_text())["pruned"] == [4, 9]


def test_sublayer_bad_input_is_one_line(tmp_path: Path, stats_file: Path) -> None:
    from tests.helpers.tiny_models import tiny_model

    out = run("select", str(stats_file), "--budget", "2", "--granularity", "attention")
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "--granularity attention needs sub-layer statistics: capture with --sublayers" in (
        out.stderr
    )
    gemma = tmp_path / "gemma"
    tiny_model("gemma3_text").save_pretrained(gemma)
    out = run("prune", str(gemma), "--units", "attn.2", "--out", str(tmp_path / "g"))
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "model_type 'gemma3_text': sub-layer variants are served by vLLM only" in out.stderr
    assert not (tmp_path / "g").exists()
    out = run("prune", str(gemma), "--units", "att.2", "--out", str(tmp_path / "g"))
    assert out.returncode == 2 and "sub-layer 'att.2'" in out.stderr
