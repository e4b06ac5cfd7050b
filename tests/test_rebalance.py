"""Re-splitting a data-parallel batch from measurements: the pure parts (no Ray, no processes)."""

from __future__ import annotations

import pytest

from hetero_ray.plan.plan import WorkerRole
from hetero_ray.train.rebalance import Balance, halve, imbalance

# Per-sample modelled seconds of the two types: A100 about 2.4 × a V100 here.
A100_T, V100_T = 1.0, 2.4


def roles(shares: list[int], times: list[float]) -> list[WorkerRole]:
    offsets = [sum(shares[:i]) for i in range(len(shares))]
    return [
        WorkerRole(
            gpu_type="A100-80GB" if t == A100_T else "V100-16GB",
            local_batch=s,
            micro_batch=s,
            sample_offset=o,
            precision="fp32",
            predicted_compute_s=s * t,
            predicted_memory_bytes=1.0,
            memory_cap_bytes=2**30,
        )
        for s, t, o in zip(shares, times, offsets)
    ]


class FakeFootprint:
    def memory_bytes(self, micro: int, scale: float = 1.0) -> float:
        return float(micro)


TIMES = [A100_T, A100_T, V100_T, V100_T, V100_T, V100_T]
PLANNED = roles([20, 20, 8, 8, 8, 8], TIMES)


def test_splitting_the_planned_balance_keeps_the_planned_shares() -> None:
    balance = Balance.of(PLANNED, [64] * 6)
    assert [r.local_batch for r in balance.split(PLANNED, 72, FakeFootprint())] == [20, 20, 8, 8, 8, 8]


def test_an_out_of_memory_caps_the_micro_batch_and_shrinks_the_share() -> None:
    balance = Balance.of(PLANNED, [64] * 6).out_of_memory(3, fitted_micro=3, factor=0.5)
    new = balance.split(PLANNED, 72, FakeFootprint())
    assert new[3].local_batch < 8 and new[3].micro_batch <= 3
    assert sum(r.local_batch for r in new) == 72
    assert [r.sample_offset for r in new] == [sum(r.local_batch for r in new[:i]) for i in range(6)]


def test_excluded_rank_gets_no_role() -> None:
    new = (
        Balance.of(PLANNED, [64] * 6).out_of_memory(5, fitted_micro=64, factor=0.0).split(PLANNED, 72, FakeFootprint())
    )
    assert new[5] is None and sum(r.local_batch for r in new if r) == 72


def test_damping_moves_estimates_geometrically_toward_the_measurement() -> None:
    balance = Balance(speeds=(4.0, 1.0), micro_caps=(8, 8), factors=(1.0, 1.0))
    assert balance.measured([1 / 4, 1 / 1], 0.5).speeds == pytest.approx((4.0, 1.0))
    assert balance.measured([1 / 1, None], 0.5).speeds == pytest.approx((2.0, 1.0))
    assert balance.measured([1 / 1, 1 / 1], 1.0).speeds == pytest.approx((1.0, 1.0))


def throughput(shares: list[int], true_times: list[float]) -> float:
    return sum(shares) / max(s * t for s, t in zip(shares, true_times))


def test_a_device_slowed_to_half_is_rebalanced_within_three_windows() -> None:
    """The first V100 throttles to half speed: each window measures every worker's seconds per sample,
    the estimates move by the default damping, and by the third re-split throughput is ≥ 0.9 of ideal."""
    true_times = list(TIMES)
    true_times[2] *= 2
    ideal = sum(1 / t for t in true_times)
    current, balance = PLANNED, Balance.of(PLANNED, [64] * 6)
    history = [throughput([r.local_batch for r in current], true_times) / ideal]
    for _ in range(3):
        balance = balance.measured(true_times, damping=0.7)
        current = balance.split(current, 72, FakeFootprint())
        history.append(throughput([r.local_batch for r in current], true_times) / ideal)
    assert history[0] < 0.9 <= history[-1]
    assert history == sorted(history), f"rebalancing oscillated: {history}"


def test_imbalance_and_halving() -> None:
    assert imbalance([1.0, 1.0, 1.0]) == 0.0
    assert imbalance([2.0, 1.0, 1.0, 0.0]) == pytest.approx(0.5)
    assert [halve(n) for n in (8, 5, 2, 1)] == [4, 3, 1, 0]
