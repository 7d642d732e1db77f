"""The names labels take where they are stored (`pipeline.spec.names`); the refusals of
two labels stored under one name are in test_parse.py's table of bad specs."""

from __future__ import annotations

from pipeline.spec.names import registry_stem, safe_name


def test_a_directory_name_is_never_hidden_and_keeps_what_it_can() -> None:
    assert safe_name("smollm2-135m") == "smollm2-135m"
    assert safe_name("/models/Qwen3 8B@v1") == "_models_Qwen3_8B_v1"
    assert safe_name("lorp+linear-b2") == "lorp_linear-b2"
    assert safe_name(".exp") == "_exp" and safe_name("..") == "_."  # listings hide dot-names
    assert safe_name("v1.2") == "v1.2"


def test_a_registry_stem_is_valid_in_a_models_uri() -> None:
    assert registry_stem("/models/Qwen3 8B@v1:bf16") == "models-Qwen3-8B-v1-bf16"
    assert registry_stem("org/name.v2") == "org-name-v2" and registry_stem("///") == ""
