"""Registered model names, version URIs and tag values (`pipeline.tracking.registry`,
`registry_loading.parse_models_uri`)."""

from __future__ import annotations

import pytest

from pipeline.tracking.registry import registered_name, tag_value
from pipeline.tracking.registry_loading import parse_models_uri

pytestmark = [pytest.mark.integration]


def test_names_and_uris() -> None:
    assert registered_name("smollm2-135m") == "lorp-smollm2-135m"
    assert registered_name("/models/Qwen3 8B@v1:bf16") == "lorp-models-Qwen3-8B-v1-bf16"
    assert registered_name("org/name.v2") == "lorp-org-name-v2"
    assert parse_models_uri("models:/lorp-x@best-8") == ("lorp-x", None, "best-8")
    assert parse_models_uri("models:/lorp-x/3") == ("lorp-x", "3", None)
    with pytest.raises(ValueError, match="not a model version URI"):
        parse_models_uri("runs:/abc/model")
    assert tag_value([1, 2]) == "[1, 2]" and tag_value(True) == "true"
    assert tag_value(float("nan")) is None and tag_value(2.5) == "2.5"
