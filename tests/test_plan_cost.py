"""Planner cost terms pinned on hand-worked values: compute, memory, all-reduce, stage messages, bubble, topology."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hetero_ray.cluster.catalog import load_catalog
from hetero_ray.config import ConfigError
from hetero_ray.plan.cost import (
    bubble_fraction,
    hierarchical_allreduce_seconds,
    p2p_seconds,
    pipeline_seconds,
    ring_allreduce_bytes,
    stage_compute_seconds,
)
from hetero_ray.plan.memory import activation_bytes, in_flight, stage_memory_bytes, static_bytes
from hetero_ray.plan.stages import min_max_split
from hetero_ray.plan.topology import load_cluster

ROOT = Path(__file__).resolve().parents[1]


def test_compute_is_flops_over_peak_times_efficiency_and_checkpointing_adds_a_forward():
    # 4e12 FLOPs at 40% of 1e13 FLOP/s: 1 s; recomputing the forward adds a third.
    assert stage_compute_seconds(4e12, 1e13, 0.4, checkpointing=False) == pytest.approx(1.0)
    assert stage_compute_seconds(4e12, 1e13, 0.4, checkpointing=True) == pytest.approx(4 / 3)


def test_static_memory_by_optimizer():
    # Adam: 4 (weight) + 4 (grad) + 8 (two moments) bytes per parameter.
    assert static_bytes(1000, "adam", 4) == 16_000
    # 1-bit Adam adds DeepSpeed's error buffers: 1000 pads to 1024 (multiple of 4 * lcm(4, 8) = 32);
    # worker error 4 * 1024 bytes, server error 4 * 1024 / 4.
    assert static_bytes(1000, "onebit_adam", 4) == 16_000 + 4096 + 1024


def test_activation_memory_of_a_stage_with_and_without_checkpointing():
    act, inputs = [100.0, 300.0], [10.0, 20.0]  # per sample, fp32
    # Without: every layer's activations for 3 micro-batches of 2, halved in bf16: 0.5 * 3 * 2 * 400.
    assert activation_bytes(act, inputs, micro_batch=2, in_flight=3, scale=0.5, checkpointing=False) == 1200
    # With: each layer's input per micro-batch in flight, plus the largest layer recomputed once:
    # 0.5 * (3 * 2 * 30 + 2 * 300).
    assert activation_bytes(act, inputs, micro_batch=2, in_flight=3, scale=0.5, checkpointing=True) == 390
    total = stage_memory_bytes(
        1000, act, inputs, optimizer="adam", world=2, micro_batch=2, in_flight=3, scale=0.5, checkpointing=True
    )
    assert total == 16_000 + 390


def test_micro_batches_in_flight_per_schedule():
    assert in_flight("gpipe", 8, 4, 0) == 8
    assert [in_flight("1f1b", 8, 4, s) for s in range(4)] == [4, 3, 2, 1]
    assert in_flight("1f1b", 2, 4, 0) == 2
    with pytest.raises(ValueError, match="schedule"):
        in_flight("zb", 8, 4, 0)


def test_bubble_of_uniform_and_uneven_stages():
    # S = 4, M = 12: (S-1)/(M+S-1) = 3/15 of the step is idle.
    assert bubble_fraction(4, 12) == pytest.approx(0.2)
    step = pipeline_seconds([1.0] * 4, 12)
    assert step == 15 and (step - 12) / step == pytest.approx(bubble_fraction(4, 12))
    # Uneven: the slowest stage paces M-1 micro-batches, one micro-batch crosses them all: 3 * 2 + 4.
    assert pipeline_seconds([1.0, 2.0, 1.0], 4) == 10


def test_stage_message_is_bytes_over_bandwidth_plus_latency():
    assert p2p_seconds(1000, 4, 1e6, 1e-3) == pytest.approx(4000 / 1e6 + 1e-3)


def test_hierarchical_allreduce():
    intra, inter = (100.0, 1e-3), (10.0, 1e-2)
    # 2 nodes of 4: intra reduce-scatter + all-gather move 2 * 3/4 of 800 bytes in 6 rounds,
    # the inter-node ring 2 * 1/2 of 800 bytes in 2 rounds.
    expected = (1200 / 100 + 6e-3) + (800 / 10 + 2e-2)
    assert hierarchical_allreduce_seconds(800, local=4, nodes=2, intra=intra, inter=inter) == pytest.approx(expected)
    # One node: a plain ring over its members; one member: nothing to do.
    assert hierarchical_allreduce_seconds(800, local=4, nodes=1, intra=intra, inter=inter) == pytest.approx(
        ring_allreduce_bytes(800, 4) / 100 + 6e-3
    )
    assert hierarchical_allreduce_seconds(800, local=1, nodes=1, intra=intra, inter=inter) == 0.0
    # Across nodes one by one it is the flat ring on the network.
    assert hierarchical_allreduce_seconds(800, local=1, nodes=4, intra=intra, inter=inter) == pytest.approx(
        ring_allreduce_bytes(800, 4) / 10 + 6e-2
    )


def test_min_max_split_balances_the_slowest_stage():
    # Layers of cost 1, 2, 3 on two equal stages: {1, 2} | {3} (max 3) beats {1} | {2, 3} (max 5).
    w = np.array([0.0, 1.0, 3.0, 6.0])
    cost = w[None, :] - w[:, None]
    cost = np.where(cost > 0, cost, np.inf)
    assert min_max_split([cost, cost]) == (0, 2, 3)
    # A stage that cannot hold layer 2 (memory) forces it elsewhere.
    blocked = cost.copy()
    blocked[:, 3] = np.inf
    assert min_max_split([cost, blocked]) is None
    assert min_max_split([blocked, cost]) == (0, 2, 3)


def test_topology_from_cluster_yaml():
    spec = load_cluster(ROOT / "cluster.yaml", load_catalog())
    a100 = spec.topology.node("A100-80GB")
    # p4de.24xlarge: 8 GPUs, 400 Gbit/s; NVLink 3 600 GB/s both ways = 300 GB/s each way.
    assert (a100.gpus_per_node, a100.nic_bandwidth_bytes_s, a100.intra_bandwidth_bytes_s) == (8, 50e9, 300e9)
    # Two node types hold V100s (8 and 1 GPUs, 25 and 10 Gbit/s): the smaller and slower is assumed.
    v100 = spec.topology.node("V100-16GB")
    assert (v100.gpus_per_node, v100.nic_bandwidth_bytes_s) == (1, 1.25e9)
    assert spec.topology.inter(["A100-80GB", "V100-16GB"])[0] == 1.25e9
    # max_workers × GPUs per node type.
    assert spec.devices["A100-80GB"] == 16 and spec.devices["V100-16GB"] == 2 * 8 + 4 * 1


def test_cluster_yaml_without_network_label_is_one_line_error(tmp_path: Path):
    bad = tmp_path / "c.yaml"
    bad.write_text(
        "cluster_name: c\nprovider: {type: aws, region: us-west-2}\n"
        "available_node_types:\n  g:\n    resources: {GPU: 4}\n    max_workers: 1\n    node_config: {}\n"
        "    labels: {hetero-ray/gpu-type: A100-80GB}\n"
    )
    with pytest.raises(ConfigError, match=r"available_node_types\.g\.labels: needs 'hetero-ray/network-gbps"):
        load_cluster(bad, load_catalog())
    with pytest.raises(ConfigError, match="cannot read"):
        load_cluster(tmp_path / "missing.yaml", load_catalog())
