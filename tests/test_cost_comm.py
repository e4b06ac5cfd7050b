"""Communication cost terms pinned on hand-worked values."""

from __future__ import annotations

import pytest

from hetero_ray.config import LinkConfig
from hetero_ray.plan.cost import (
    allreduce_seconds,
    link_seconds,
    onebit_allreduce_bytes,
    padded_numel,
    ring_allreduce_bytes,
)


def test_ring_allreduce_sends_twice_w_minus_one_over_w_of_the_payload():
    # 4 ranks, 400 bytes: reduce-scatter 3 chunks of 100, all-gather 3 chunks of 100.
    assert ring_allreduce_bytes(400, 4) == 600
    assert ring_allreduce_bytes(400, 1) == 0


def test_padding_matches_deepspeeds_error_buffers():
    # multiple of W * lcm(W, 8): 16 for W=2, 32 for W=4, 72 for W=3.
    assert [padded_numel(37, 2), padded_numel(37, 4), padded_numel(37, 3), padded_numel(128, 4)] == [48, 64, 72, 128]


def test_onebit_bytes_are_two_phases_of_sign_chunks_and_scales():
    # 2^20 elements, W=4: chunk of 2^20/4 signs = 32768 bytes, plus a 4-byte scale, to 3 peers, twice.
    assert onebit_allreduce_bytes(2**20, 4) == 2 * 3 * (32768 + 4) == 196_632
    # 37 elements pad to 64: chunk 64/32 = 2 bytes + 4, to 3 peers, twice.
    assert onebit_allreduce_bytes(37, 4) == 36
    assert onebit_allreduce_bytes(2**20, 4) / ring_allreduce_bytes(4 * 2**20, 4) == pytest.approx(0.03125, rel=1e-3)


def test_link_and_allreduce_seconds():
    assert link_seconds(1e9, 10, 1e9, 1e-3) == pytest.approx(1.01)
    # 1e6 fp32 in two tensors on 4 ranks: one bucketed ring, 6e6 bytes at 1 GB/s plus 6 rounds of 10 us.
    assert allreduce_seconds([600_000, 400_000], 4, 1e9, 1e-5) == pytest.approx(6e-3 + 6e-5)
    # Compressed tensor by tensor: 2 * 3 * (n / 32 + 4) bytes and 12 rounds each.
    expected = 2 * 3 * (600_000 / 32 + 4 + 400_000 / 32 + 4) / 1e9 + 24e-5
    assert allreduce_seconds([600_000, 400_000], 4, 1e9, 1e-5, compressed=True) == pytest.approx(expected)
    assert allreduce_seconds([10**6], 1, 1e9, 1e-5) == 0.0


def test_link_config_units():
    link = LinkConfig(bandwidth_gbps=1, latency_us=50)
    assert link.bandwidth_bytes_s == 125_000_000
    assert link.latency_s == pytest.approx(5e-5)


def test_plan_prices_sync_on_the_link_and_says_when_compression_pays():
    """Two tensors of 500k and 500k fp32 on 4 workers over 1 Gbit/s (125 MB/s), 10 us per round."""
    from hetero_ray.cluster.catalog import load_catalog
    from hetero_ray.perf.footprint import Footprint
    from hetero_ray.plan.data_parallel import plan_data_parallel

    fp = Footprint(
        param_count=10**6,
        param_numels=(500_000, 500_000),
        dataset_samples=1000,
        flops_per_sample=1e9,
        activation_bytes_per_sample=1e3,
    )
    types = ["A100-80GB"] * 4
    kwargs = dict(global_batch=8, efficiency=0.5, link=(125e6, 1e-5))
    fp32 = plan_data_parallel(types, load_catalog(), fp, **kwargs)
    onebit = plan_data_parallel(types, load_catalog(), fp, compressed=True, **kwargs)
    # fp32 ring: 2 * 3/4 * 4e6 bytes = 6e6 bytes at 125 MB/s = 48 ms, plus 6 rounds.
    assert fp32.predicted_comm_s == pytest.approx(0.048 + 6e-5)
    # 1-bit: per tensor 2 * 3 * (500000 / 32 + 4) = 93774 bytes, 12 rounds.
    assert onebit.predicted_comm_s == pytest.approx(2 * 93774 / 125e6 + 24e-5)
    assert onebit.predicted_comm_fp32_s == fp32.predicted_comm_s
    assert onebit.predicted_step_s == pytest.approx(onebit.predicted_compute_s + onebit.predicted_comm_s)
    assert "compression pays" in onebit.explanation
