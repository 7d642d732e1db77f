"""The families table (docs/reference/families.md): what lorp does with every decoder family
transformers knows, read from the code as it is (`lorp.models.coverage`).

    python benchmarks/families.py [--check]

A decoder family is a `model_type` of transformers' causal-LM mapping whose config is
text-only or has a text sub-config. Each is read from a small config: the tiny one the
fleet tests build for the families they prune end to end (`tests/helpers/family_models`),
else transformers' default at 4 layers (its default where 4 does not build). Nothing is
downloaded and no weights are made (the model is built on the meta device). `--check`
writes nothing and exits 1 where the committed table differs (`tests/benchmarks/
test_families.py` runs it).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import logging
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.pages import markers, replace_section, table  # noqa: E402
from lorp.models.coverage import YES, Support, support  # noqa: E402

PAGE = ROOT / "docs" / "reference" / "families.md"
SECTION = "families"
TESTED = "tests/integration/test_families.py"
"""Multimodal wrappers a test prunes end to end."""


def causal_lm_types() -> dict[str, str]:
    """model_type -> the class transformers' causal-LM mapping names for it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()))


def multimodal_types() -> dict[str, str]:
    """model_type -> class of the image-text-to-text mapping's wrappers that the causal-LM
    mapping lacks (Mistral 3, Qwen2.5-VL, Qwen3-VL): their text towers are decoders too."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    causal = causal_lm_types()
    wrappers = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.items()
    return dict(sorted((k, v) for k, v in wrappers if k not in causal))


def family_config(model_type: str) -> tuple[Any, str]:
    """The config a family is read from, and which one it is (module docstring)."""
    from transformers import AutoConfig

    from tests.helpers.family_models import CONFIGS
    from tests.helpers.family_models import family_config as tiny

    if model_type in CONFIGS:
        return tiny(model_type), "tiny"
    for four in ({"num_hidden_layers": 4}, {"text_config": {"num_hidden_layers": 4}}):
        try:
            config = AutoConfig.for_model(model_type, **four)
        except (ValueError, TypeError, KeyError, AttributeError):
            continue
        if getattr(config.get_text_config(decoder=True), "num_hidden_layers", 4) == 4:
            return _one_layer_towers(config), "default, 4 layers"
    return _one_layer_towers(AutoConfig.for_model(model_type)), "default"


TOWER_DEPTHS = ("num_hidden_layers", "depth", "num_layers")


def _one_layer_towers(config: Any) -> Any:
    """`config` with its other towers (vision, audio) one layer deep: they are built on
    the meta device and never read, and at their default depth they take seconds."""
    from transformers import PretrainedConfig

    text = config.get_text_config(decoder=True)
    for value in vars(config).values():
        if isinstance(value, PretrainedConfig) and value is not text:
            for key in TOWER_DEPTHS:
                if isinstance(getattr(value, key, None), int):
                    setattr(value, key, 1)
    return config


def vllm_architectures() -> dict[str, str]:
    """Architecture class -> how the installed vLLM serves it (`native`, or
    `transformers backend`), read from its registry's source without importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return {}
    path = Path(next(iter(spec.submodule_search_locations))) / "model_executor/models/registry.py"
    served: dict[str, str] = {}
    for node in ast.parse(path.read_text()).body:
        if not isinstance(node, ast.Assign | ast.AnnAssign) or not isinstance(node.value, ast.Dict):
            continue
        target = node.targets[0] if isinstance(node, ast.Assign) else node.target
        name = getattr(target, "id", "")
        how = {"_TEXT_GENERATION_MODELS": "native", "_MULTIMODAL_MODELS": "native"}.get(name)
        how = how or ("transformers backend" if name == "_TRANSFORMERS_SUPPORTED_MODELS" else None)
        for key in node.value.keys:
            if how is not None and isinstance(key, ast.Constant):
                served.setdefault(str(key.value), how)
    return served


def rows(types: dict[str, str]) -> Iterator[tuple[str, Support | str, str, str]]:
    """(model_type, its support or why its config does not build, the config read, the
    class transformers loads it as) for each of `types` (model_type -> class)."""
    from transformers import logging as hf_logging

    # Quiet while reading (every default config warns), and as loud as before after: the
    # table's test reads it in a test process whose later tests log at INFO.
    disabled, verbosity = logging.root.manager.disable, hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    logging.disable(logging.WARNING)
    try:
        for model_type, cls in types.items():
            yield _row(model_type, cls)
    finally:
        logging.disable(disabled)
        hf_logging.set_verbosity(verbosity)


def _row(model_type: str, cls: str) -> tuple[str, Support | str, str, str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            config, read = family_config(model_type)
            _loads_as(config, cls)
        except Exception as exc:  # noqa: BLE001 - any failure of transformers' own default is the row
            return model_type, _first_line(exc), "default", cls
        try:
            return model_type, support(config), read, cls
        except Exception as exc:  # noqa: BLE001 - a config that does not build on meta is the row
            return model_type, f"its model does not build: {_first_line(exc)}", read, cls


def _loads_as(config: Any, cls: str) -> None:
    """Name `cls` in `config.architectures`, as a checkpoint of it does, where `cls` is
    built from `config`'s class (`llama4`'s causal LM is built from its text config)."""
    import transformers

    built = getattr(transformers, cls, None)
    if built is not None and isinstance(config, built.config_class):
        config.architectures = [cls]


def _first_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"[:160]


HEAD = (
    "model_type",
    "kinds of block",
    "block removal",
    "reload",
    "sub-layers",
    "linear repair",
    "vLLM",
    "tested end to end",
)


def render() -> str:
    """The page's tables, each with its counts above it."""
    from tests.helpers.family_models import DENSE, HYBRIDS, MIXTURES, MULTIMODAL

    served = vllm_architectures()
    tested = {*DENSE, *MIXTURES, *HYBRIDS, *MULTIMODAL}
    causal = _section(causal_lm_types(), served, tested)
    wrappers = _section(multimodal_types(), served, tested)
    return "\n".join(
        [
            f"### Causal language models\n\n{causal}",
            f"### Multimodal wrappers (image-text-to-text)\n\n{wrappers}",
            f"{len(tested)} families are pruned end to end by `{TESTED}`.",
        ]
    )


def _section(types: dict[str, str], served: dict[str, str], tested: set[str]) -> str:
    lines, pruned, repaired, split = [], 0, 0, 0
    for model_type, answer, read, cls in rows(types):
        vllm = served.get(cls, "no")
        check = "yes" if model_type in tested else ""
        if isinstance(answer, str):
            why = f"no: transformers' {read} config: {answer}"
            lines.append((model_type, "-", why, "-", "-", "-", vllm, check))
            continue
        ok = answer.refused is None
        pruned, repaired = pruned + ok, repaired + (ok and answer.repair == YES)
        split += ok and answer.sublayers == YES
        kinds = ", ".join(answer.kinds) or "-"
        cells = (answer.blocks, answer.reload, answer.sublayers, answer.repair)
        lines.append((model_type, kinds, *cells, vllm, check))
    summary = (
        f"{len(lines)} families; lorp removes blocks of {pruned}, repairs {repaired} of "
        f"those and splits {split} into sub-layers."
    )
    body = table(HEAD, (tuple(_cell(c) for c in r) for r in lines))
    return "\n".join([summary, "", *body, ""])


def _cell(value: str) -> str:
    return value.replace("|", "\\|")


NEW_PAGE = "# Families\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 where the page differs")
    args = parser.parse_args(argv)
    body = render()
    begin, end = markers(SECTION)
    if args.check:
        text = PAGE.read_text() if PAGE.exists() else ""
        current = text[text.find(begin) + len(begin) : text.find(end)].strip("\n")
        if begin not in text or current != body:
            print(f"{PAGE.relative_to(ROOT)} differs from what the code supports: run {__file__}")
            return 1
        return 0
    replace_section(PAGE, begin, end, body, "Families", NEW_PAGE)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
