"""cluster.yaml: valid for Ray's own cluster launcher, one labelled node type per catalog GPU type."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from hetero_ray.cluster.catalog import load_catalog
from hetero_ray.cluster.emulation import GPU_TYPE_LABEL

CLUSTER_YAML = Path(__file__).resolve().parents[1] / "cluster.yaml"

# AWS instance type -> (catalog GPU type, GPUs per instance), from AWS's instance pages.
AWS_GPU_INSTANCES = {
    "p3.2xlarge": ("V100-16GB", 1),
    "p3.16xlarge": ("V100-16GB", 8),
    "p4de.24xlarge": ("A100-80GB", 8),
    "p5.48xlarge": ("H100-80GB", 8),
    "g6.12xlarge": ("L4", 4),
}


@pytest.fixture(scope="module")
def config() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def test_ray_validates_the_config(config: dict) -> None:
    # prepare_config merges the AWS defaults the way `ray up` does; validate_config
    # checks the result against Ray's JSON schema (no unknown keys anywhere).
    validate_config(prepare_config(copy.deepcopy(config)))


def test_ray_rejects_an_unknown_key(config: dict) -> None:
    # Guards the test above: validation is strict, so a passing config means something.
    broken = copy.deepcopy(config)
    broken["available_node_types"]["a100-80gb-x8"]["link_gbs"] = 600
    with pytest.raises(jsonschema.ValidationError, match="link_gbs"):
        validate_config(prepare_config(broken))


def test_head_is_cpu_only(config: dict) -> None:
    head = config["available_node_types"][config["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0 and GPU_TYPE_LABEL not in head.get("labels", {})


def test_every_worker_type_is_a_labelled_catalog_gpu_type(config: dict) -> None:
    catalog = load_catalog()
    workers = {n: t for n, t in config["available_node_types"].items() if n != config["head_node_type"]}
    labelled = set()
    for name, node_type in workers.items():
        gpu_type = node_type["labels"][GPU_TYPE_LABEL]
        assert gpu_type in catalog, (name, gpu_type)
        expected_type, expected_gpus = AWS_GPU_INSTANCES[node_type["node_config"]["InstanceType"]]
        assert gpu_type == expected_type, name
        assert node_type["resources"]["GPU"] == expected_gpus, name
        assert 0 <= node_type["min_workers"] <= node_type["max_workers"] <= config["max_workers"], name
        labelled.add(gpu_type)
    assert {"A100-80GB", "H100-80GB", "V100-16GB"} <= labelled
