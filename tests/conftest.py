"""Shared test fixtures: paths, and the one emulated cluster the job tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetero_ray.cluster.emulation import EmulatedCluster

REPO = Path(__file__).resolve().parents[1]
# Third-party data the tests check against, carried in the tree (sources in data/reference/README.md).
REFERENCE_DATA = REPO / "data" / "reference"


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def reference_data() -> Path:
    return REFERENCE_DATA


@pytest.fixture(scope="session")
def cluster():
    """2 × A100-80GB on one emulated node, 2 × V100-16GB on another, for every module that submits jobs.

    A test that takes a node away puts one back before it ends.
    """
    with EmulatedCluster({"A100-80GB": 2, "V100-16GB": 2}, gpus_per_node=2) as c:
        yield c
