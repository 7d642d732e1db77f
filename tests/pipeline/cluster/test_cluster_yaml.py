"""`cluster.yaml`, the Ray cluster launcher's config the pipeline runs on: valid against
Ray's own schema."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml

from tests.helpers.paths import REPO

pytestmark = [pytest.mark.integration]

ROOT = REPO


def test_cluster_yaml_validates_against_rays_schema() -> None:
    schema_path = Path(ray.__file__).parent / "autoscaler" / "ray-schema.json"
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    jsonschema.validate(config, json.loads(schema_path.read_text()))
    assert config["head_node_type"] in config["available_node_types"]
    assert config["available_node_types"]["gpu_worker"]["resources"]["GPU"] == 1
    assert any("[gpu]" in c for c in config["setup_commands"])
