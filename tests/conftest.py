"""Shared test fixtures: paths, and the one emulated cluster the job tests share."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hetero_ray.cluster.emulation import EmulatedCluster

REPO = Path(__file__).resolve().parents[1]
# Third-party data the tests check against, carried in the tree (sources in data/reference/README.md).
REFERENCE_DATA = REPO / "data" / "reference"
# Ray Train's controller polls its workers every 2 s (its default), and sees a group start, finish or fail only
# then: the tests' 20-step job took 42-44 s with it and 39-41 s at 0.5 s. Set before any cluster starts, so
# that every raylet, driver and controller the tests start inherits it.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")


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
