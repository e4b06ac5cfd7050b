"""Data-parallel planning: batch split, micro-batches by memory, exclusions, role binding, cost terms."""

from __future__ import annotations

import itertools
import json
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest

from hetero_ray.cluster.catalog import GPUS_ENV_VAR, Catalog, load_catalog
from hetero_ray.perf.footprint import Footprint, LayerCost
from hetero_ray.plan.cost import activation_scale, compute_seconds, max_micro_batch
from hetero_ray.plan.data_parallel import (
    fastest_zero_stage,
    memory_fits,
    plan_data_parallel,
    split_batch,
    zero_comm_seconds,
    zero_stage_plans,
)
from hetero_ray.plan.plan import Infeasible, Plan, WorkerRole
from hetero_ray.train.precision import choose_precision

GiB = 2**30
A100, V100 = "A100-80GB", "V100-16GB"
MIX = [A100, A100, V100, V100, V100, V100]

# Weights, gradients and Adam state take 16 bytes per parameter: 2**26 parameters are exactly 1 GiB.
ONE_GIB_OF_PARAMS = 2**26
# Memory never limits this one: micro-batches equal the shares.
SMALL = Footprint(param_count=1000, dataset_samples=10_000, flops_per_sample=1e9, activation_bytes_per_sample=1000.0)


def footprint(activation_gib_fp32: float) -> Footprint:
    """1 GiB of static state and ``activation_gib_fp32`` GiB of fp32 activations per sample."""
    return Footprint(
        param_count=ONE_GIB_OF_PARAMS,
        dataset_samples=10_000,
        flops_per_sample=1e9,
        activation_bytes_per_sample=activation_gib_fp32 * GiB,
    )


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(GPUS_ENV_VAR, raising=False)
        return load_catalog()


def plan_of(catalog: Catalog, rank_types, fp: Footprint, **kwargs) -> Plan:
    plan = plan_data_parallel(rank_types, catalog, fp, **kwargs)
    assert isinstance(plan, Plan), plan
    return plan


def slowest(shares, speeds) -> float:
    return max(b / s for b, s in zip(shares, speeds))


# --- split_batch ---------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [2, 3, 4])
@pytest.mark.parametrize("seed", range(8))
def test_split_batch_is_optimal_against_brute_force(workers: int, seed: int) -> None:
    rng = random.Random(seed)
    speeds = [rng.uniform(0.1, 10.0) for _ in range(workers)]
    for batch in range(workers, 13):
        shares = split_batch(batch, speeds)
        assert sum(shares) == batch and min(shares) >= 1
        best = min(
            slowest([*head, batch - sum(head)], speeds)
            for head in itertools.product(range(1, batch + 1), repeat=workers - 1)
            if batch - sum(head) >= 1
        )
        assert slowest(shares, speeds) == best, (batch, speeds, shares)


def test_split_batch_rejects_fewer_samples_than_workers() -> None:
    with pytest.raises(ValueError, match="smaller than the 3 workers"):
        split_batch(2, [1.0, 2.0, 3.0])


# --- how the global batch is shared -------------------------------------------------------


def test_proportional_split_follows_peak_flops(catalog: Catalog) -> None:
    # A100 bf16 312 vs V100 fp16 125 TFLOP/s: 20/312 ≈ 0.0641 and 8/125 = 0.064; one more sample
    # on either type (21/312 or 9/125) would be slower, and 2·20 + 4·8 = 72.
    plan = plan_of(catalog, MIX, SMALL, global_batch=72)
    assert [r.local_batch for r in plan.roles] == [20, 20, 8, 8, 8, 8]
    assert [r.sample_offset for r in plan.roles] == [0, 20, 40, 48, 56, 64]
    assert [r.precision for r in plan.roles] == ["bf16", "bf16", "fp16", "fp16", "fp16", "fp16"]
    assert [r.micro_batch for r in plan.roles] == [20, 20, 8, 8, 8, 8]
    # Slowest: an A100 with 20 samples of 1e9 FLOPs at 312e12 × 0.4 FLOP/s.
    assert plan.predicted_step_s == pytest.approx(20e9 / 124.8e12, rel=1e-12)
    assert plan.split == "proportional" and not plan.excluded


def test_equal_split(catalog: Catalog) -> None:
    plan = plan_of(catalog, MIX, SMALL, global_batch=72, split="equal")
    assert [r.local_batch for r in plan.roles] == [12] * 6


def test_explicit_weights_per_type(catalog: Catalog) -> None:
    plan = plan_of(catalog, [A100, A100, V100, V100], SMALL, global_batch=12, split={A100: 2, V100: 1})
    assert [r.local_batch for r in plan.roles] == [4, 4, 2, 2]
    assert plan.split == "weights"


def test_missing_weight_is_infeasible_naming_the_type(catalog: Catalog) -> None:
    result = plan_data_parallel([A100, V100], catalog, SMALL, global_batch=12, split={A100: 2})
    assert isinstance(result, Infeasible)
    assert V100 in result.reason


def test_batch_smaller_than_workers_is_infeasible(catalog: Catalog) -> None:
    result = plan_data_parallel([A100, V100], catalog, SMALL, global_batch=1)
    assert isinstance(result, Infeasible)
    assert "smaller than the 2 workers" in result.reason


# --- micro-batches by memory --------------------------------------------------------------


def test_micro_batch_is_limited_by_memory(catalog: Catalog) -> None:
    # 10 GiB/sample at fp32 is 5 GiB in bf16/fp16; 1 GiB is static.
    # A100: 79 GiB free → 15 fit; share 20 → 2 passes of 10.
    # V100: 15 GiB free → 3 fit; share 8 → 3 passes of 3, 3, 2.
    plan = plan_of(catalog, MIX, footprint(10), global_batch=72)
    a100, v100 = plan.roles[0], plan.roles[2]
    assert (a100.local_batch, a100.micro_batch, a100.accumulation_steps) == (20, 10, 2)
    assert (v100.local_batch, v100.micro_batch, v100.accumulation_steps) == (8, 3, 3)
    assert [size for _, size in v100.micro_batches()] == [3, 3, 2]
    assert a100.predicted_memory_bytes == 51 * GiB
    assert v100.predicted_memory_bytes == 16 * GiB == v100.memory_cap_bytes


def test_max_micro_caps_the_micro_batch(catalog: Catalog) -> None:
    plan = plan_of(catalog, [A100, V100], SMALL, global_batch=12, max_micro=2)
    assert [(r.local_batch, r.micro_batch) for r in plan.roles] == [(9, 2), (3, 2)]


@pytest.mark.parametrize("local_batch", range(1, 25))
def test_micro_batches_cover_the_share_exactly(local_batch: int) -> None:
    for micro in range(1, local_batch + 1):
        role = WorkerRole(
            gpu_type=A100,
            local_batch=local_batch,
            micro_batch=micro,
            sample_offset=7,
            precision="bf16",
            predicted_compute_s=1.0,
            predicted_memory_bytes=1.0,
            memory_cap_bytes=1,
        )
        parts = role.micro_batches()
        covered = [i for start, size in parts for i in range(start, start + size)]
        assert covered == list(range(7, 7 + local_batch))
        sizes = [size for _, size in parts]
        assert max(sizes) - min(sizes) <= 1 and max(sizes) <= micro


def test_micro_batches_of_a_planned_role(catalog: Catalog) -> None:
    role = plan_of(catalog, MIX, footprint(10), global_batch=72).roles[3]
    assert role.micro_batches() == [(48, 3), (51, 3), (54, 2)]


# --- exclusion and infeasibility ----------------------------------------------------------


def test_type_that_cannot_hold_one_sample_is_excluded(catalog: Catalog) -> None:
    # 40 GiB/sample at fp32 → 20 GiB half-width + 1 GiB static = 21 GiB: no V100-16GB fits one;
    # an A100-80GB fits 79 // 20 = 3 per pass, and the two carry 36 samples each.
    plan = plan_of(catalog, MIX, footprint(40), global_batch=72)
    assert [(r.gpu_type, r.local_batch, r.micro_batch) for r in plan.roles] == [(A100, 36, 3), (A100, 36, 3)]
    [excluded] = plan.excluded
    assert (excluded.gpu_type, excluded.count) == (V100, 4)
    assert "needs 21 GiB" in excluded.reason and "16 GiB" in excluded.reason
    assert V100 in plan.explanation and "excluded" in plan.explanation


def test_all_types_excluded_is_infeasible_naming_the_largest_device(catalog: Catalog) -> None:
    # 200 GiB/sample at fp32 → 100 GiB in bf16, + 1 GiB static = 101 GiB > 80 GiB.
    result = plan_data_parallel([V100, A100], catalog, footprint(200), global_batch=8)
    assert isinstance(result, Infeasible)
    assert "\n" not in result.reason
    assert "needs 101 GiB" in result.reason
    assert f"({A100}) has 80 GiB" in result.reason


# --- the Plan contract ---------------------------------------------------------------------


def test_roles_are_bound_by_type_not_position(catalog: Catalog) -> None:
    plan = plan_of(catalog, [A100, A100, V100, V100], SMALL, global_batch=12, split={A100: 2, V100: 1})
    a1, a2, v1, v2 = plan.roles
    bound = plan.roles_for([V100, A100, V100, A100])
    assert [id(r) for r in bound] == [id(v1), id(a1), id(v2), id(a2)]


def test_extra_rank_of_an_excluded_type_gets_no_role(catalog: Catalog) -> None:
    plan = plan_of(catalog, [A100, V100, A100], footprint(40), global_batch=8)
    a1, a2 = plan.roles
    bound = plan.roles_for([V100, A100, A100, V100])
    assert bound[0] is None and bound[3] is None
    assert bound[1] is a1 and bound[2] is a2


@pytest.mark.parametrize("split", ["proportional", {A100: 3, V100: 1}])
def test_plan_round_trips_through_json(catalog: Catalog, split) -> None:
    plan = plan_of(catalog, [A100, V100, V100, A100], footprint(12), global_batch=40, split=split, emulated=True)
    assert Plan.from_dict(json.loads(plan.to_json())) == plan


def test_excluded_plan_round_trips_through_json(catalog: Catalog) -> None:
    plan = plan_of(catalog, MIX, footprint(40), global_batch=72)
    assert Plan.from_dict(json.loads(plan.to_json())) == plan


# --- cost terms, on hand-worked values ----------------------------------------------------


def test_compute_seconds(catalog: Catalog) -> None:
    assert compute_seconds(catalog.get(A100), "bf16", 1e12, 0.5) == pytest.approx(1 / 156, rel=1e-12)
    assert compute_seconds(catalog.get(V100), "fp16", 1e12, 0.4) == pytest.approx(0.02, rel=1e-12)
    assert compute_seconds(catalog.get(V100), "fp32", 15.7e12, 1.0) == pytest.approx(1.0, rel=1e-12)


def test_compute_seconds_rejects_a_precision_the_card_lacks(catalog: Catalog) -> None:
    with pytest.raises(ValueError, match="no bf16 peak"):
        compute_seconds(catalog.get(V100), "bf16", 1e12, 0.5)


@pytest.mark.parametrize(("precision", "scale"), [("bf16", 0.5), ("fp16", 0.5), ("fp32", 1.0), ("tf32", 1.0)])
def test_activation_scale(precision: str, scale: float) -> None:
    assert activation_scale(precision) == scale


@pytest.mark.parametrize(
    ("gpu", "precision", "fp", "expected"),
    [
        (V100, "fp16", footprint(2), 15),  # 15 GiB free / 1 GiB per sample
        (V100, "fp32", footprint(2), 7),  # 15 GiB free / 2 GiB per sample
        (A100, "bf16", footprint(2), 79),  # 79 GiB free / 1 GiB per sample
        (V100, "fp16", footprint(30), 1),  # 15 GiB per sample fills the 15 GiB free exactly once
        (V100, "fp16", footprint(30.5), 0),  # 15.25 GiB per sample > 15 GiB free
        # No activations, but the static state alone is a byte over 16 GiB.
        (
            V100,
            "fp32",
            Footprint(
                param_count=2**30 + 1, dataset_samples=10_000, flops_per_sample=1.0, activation_bytes_per_sample=0.0
            ),
            0,
        ),
    ],
)
def test_max_micro_batch(catalog: Catalog, gpu: str, precision: str, fp: Footprint, expected: int) -> None:
    assert max_micro_batch(catalog.get(gpu), precision, fp) == expected


def test_zero_1_shards_adams_state_by_spare_memory_so_the_small_cards_train_too(catalog):
    """A model of 20 GiB unsharded (1.25 GiB of activations a sample in fp32) fits no V100-16GB whole: plain
    data parallelism leaves the four out. ZeRO-1 keeps 10 GiB of weights and gradients on every card and
    shares Adam's 10 GiB of state by what each has beyond them (70 : 6 GiB), so all six train, each within its
    memory, with the same fraction of its spare memory given to state."""
    fp = Footprint(
        param_count=20 * ONE_GIB_OF_PARAMS,
        dataset_samples=10_000,
        flops_per_sample=1e9,
        activation_bytes_per_sample=1.25 * GiB,
    )
    plain = plan_data_parallel(MIX, catalog, fp, global_batch=48)
    assert {r.gpu_type for r in plain.roles} == {A100} and plain.excluded[0].count == 4
    sharded = plan_data_parallel(MIX, catalog, fp, global_batch=48, zero_stage=1)
    assert sorted(r.gpu_type for r in sharded.roles) == sorted(MIX) and not sharded.excluded
    assert sharded.zero_stage == 1 and "ZeRO-1" in sharded.explanation
    spare = {A100: 80 - 10, V100: 16 - 10}
    fraction = 10 / (2 * spare[A100] + 4 * spare[V100])
    for r in sharded.roles:
        state = fraction * spare[r.gpu_type] * GiB
        activations = r.micro_batch * 1.25 * GiB * activation_scale(r.precision)
        assert r.predicted_memory_bytes == pytest.approx(10 * GiB + state + activations)
        assert r.predicted_memory_bytes <= r.memory_cap_bytes
        # The largest micro-batch that fits beside its share.
        assert r.micro_batch == min(
            r.local_batch, int(spare[r.gpu_type] * (1 - fraction) / (1.25 * activation_scale(r.precision)))
        )


def test_zero_1_prices_the_parameter_all_gather_and_says_when_the_state_fits_nowhere(catalog):
    """Owners send their updated parameters to all: half a ring all-reduce more on the link. A model whose
    weights and gradients alone exceed every card is infeasible, with the ZeRO-1 figures in the reason."""
    link = (10e9, 1e-5)
    plain = plan_data_parallel(MIX, catalog, SMALL, global_batch=48, link=link)
    sharded = plan_data_parallel(MIX, catalog, SMALL, global_batch=48, link=link, zero_stage=1)
    assert sharded.predicted_comm_s == pytest.approx(1.5 * plain.predicted_comm_s)
    huge = Footprint(
        param_count=180 * ONE_GIB_OF_PARAMS, dataset_samples=10, flops_per_sample=1e9, activation_bytes_per_sample=1.0
    )
    out = plan_data_parallel(MIX, catalog, huge, global_batch=6, zero_stage=1)
    assert isinstance(out, Infeasible) and "90 GiB per device and 90 GiB across them in shards (ZeRO-1)" in out.reason


# 64 GiB of state (16 weights, 16 gradients, 32 Adam) in 16 layers of 1 GiB of weights each; 0.5 GiB of fp32
# activations and 6 FLOPs a parameter for 1024 tokens a sample.
LAYERED = Footprint(
    param_count=64 * ONE_GIB_OF_PARAMS,
    dataset_samples=10_000,
    flops_per_sample=1e14,
    activation_bytes_per_sample=0.5 * GiB,
    layers=tuple(
        LayerCost(
            params=4 * ONE_GIB_OF_PARAMS,
            flops_per_sample=1e14 / 16,
            activation_bytes_per_sample=GiB / 32,
            output_bytes_per_sample=1e6,
        )
        for _ in range(16)
    ),
)


def test_zero_3_shards_everything_so_a_model_no_v100_holds_under_stages_0_to_2_trains_on_all_six(catalog):
    """Stages 0–2 keep at least the weights whole (16 GiB and more): no V100-16GB trains. Stage 3 holds two
    layers' weights and gradients whole (4 GiB) and splits all 64 GiB by what each card has beyond them
    (76 : 12 GiB), so all six train within their memory."""
    for stage in (0, 1, 2):
        plan = plan_of(catalog, MIX, LAYERED, global_batch=48, zero_stage=stage)
        assert {r.gpu_type for r in plan.roles} == {A100} and plan.excluded[0].count == 4
    plan = plan_of(catalog, MIX, LAYERED, global_batch=48, zero_stage=3)
    assert sorted(r.gpu_type for r in plan.roles) == sorted(MIX) and not plan.excluded
    assert "ZeRO-3: weights, gradients and Adam's state sharded" in plan.explanation
    spare = {A100: 80 - 4, V100: 16 - 4}
    fraction = 64 / (2 * spare[A100] + 4 * spare[V100])
    for r in plan.roles:
        activations = r.micro_batch * 0.5 * GiB * activation_scale(r.precision)
        assert r.predicted_memory_bytes == pytest.approx((4 + fraction * spare[r.gpu_type]) * GiB + activations)
        assert r.predicted_memory_bytes <= r.memory_cap_bytes


def test_each_zero_stage_prices_its_collectives_per_pass(catalog):
    """With one pass, against the plain all-reduce R: stage 1 adds the update's all-gather (R/2), stage 2
    reduces to owners (R/2) and gathers (R/2), stage 3 gathers for forward and backward (R) and reduces
    (R/2). With micro-batches, stages 2 and 3 pay theirs on every pass."""
    link = (10e9, 1e-5)
    plain = plan_of(catalog, MIX, SMALL, global_batch=48, link=link).predicted_comm_s
    comm = [plan_of(catalog, MIX, SMALL, global_batch=48, link=link, zero_stage=s).predicted_comm_s for s in (1, 2, 3)]
    assert comm == pytest.approx([1.5 * plain, plain, 1.5 * plain])
    three = plan_of(catalog, MIX, SMALL, global_batch=48, link=link, zero_stage=3, max_micro=2)
    passes = max(r.accumulation_steps for r in three.roles)
    assert passes > 1 and three.predicted_comm_s == pytest.approx(passes * 1.5 * plain)


def test_the_fastest_zero_stage_wins_and_the_explanation_weighs_the_others(catalog):
    """On the layered model with a link, stage 3 brings the four V100s in and its step is the fastest;
    without a link every stage computes alike and the tie goes to the stage that shards least."""
    link = (25e9, 1e-5)
    candidates = {
        s: plan_data_parallel(MIX, catalog, LAYERED, global_batch=48, link=link, zero_stage=s) for s in range(4)
    }
    best = fastest_zero_stage(candidates)
    assert best.zero_stage == 3 and best.predicted_step_s == min(p.predicted_step_s for p in candidates.values())
    assert "ZeRO stage 3" in best.explanation and "ms at ZeRO-0" in best.explanation
    untied = fastest_zero_stage(
        {s: plan_data_parallel(MIX, catalog, SMALL, global_batch=48, zero_stage=s) for s in range(4)}
    )
    assert untied.zero_stage == 0


def test_zero_3_gives_the_v100s_fewer_samples_when_a_second_pass_costs_more_than_it_saves(catalog):
    """8 GiB of fp16 activations a sample: a V100 holds one at a time. Split by speed, the V100s take two
    samples each, in two passes; on a 1 GB/s link each pass's gathers and reduces cost more than the A100
    computing two more samples, so the planner gives each V100 one sample and the step one pass."""
    fp = Footprint(
        **{**LAYERED.__dict__, "param_count": 8 * ONE_GIB_OF_PARAMS, "activation_bytes_per_sample": 16 * GiB}
    )
    fp = Footprint(**{**fp.__dict__, "layers": tuple(replace(c, params=ONE_GIB_OF_PARAMS) for c in LAYERED.layers[:8])})
    types = [A100, V100, V100]
    free = plan_of(catalog, types, fp, global_batch=10, zero_stage=3)
    assert [(r.local_batch, r.accumulation_steps) for r in free.roles] == [(6, 1), (2, 2), (2, 2)]
    slow = plan_of(catalog, types, fp, global_batch=10, zero_stage=3, link=(1e9, 1e-5))
    assert [(r.local_batch, r.accumulation_steps) for r in slow.roles] == [(8, 1), (1, 1), (1, 1)]


@pytest.mark.parametrize("seed", range(12))
def test_the_zero_plan_is_the_optimum_of_an_exhaustive_walk_over_stages_shares_and_passes(catalog, seed):
    """Small random instances: every stage, every integer split of the batch (each device at least one sample
    and at most its passes × its micro-batch cap) and every pass count; the planner's choice of stage, shares
    and passes is never slower than the best found (1e-9)."""
    rng = random.Random(seed)
    types = [rng.choice([A100, V100, "T4"]) for _ in range(3)]
    layers = rng.randint(2, 6)
    params = rng.randint(4, 24) * ONE_GIB_OF_PARAMS
    fp = Footprint(
        param_count=params,
        dataset_samples=10_000,
        flops_per_sample=1e14,
        activation_bytes_per_sample=rng.choice([2.0, 6.0, 10.0]) * GiB,
        layers=tuple(
            LayerCost(
                params=params // layers,
                flops_per_sample=1e14 / layers,
                activation_bytes_per_sample=GiB,
                output_bytes_per_sample=1e6,
            )
            for _ in range(layers)
        ),
    )
    link = (rng.choice([1e9, 10e9, 100e9]), 1e-5)
    batch = rng.randint(6, 14)
    best = fastest_zero_stage(
        {s: plan_data_parallel(types, catalog, fp, global_batch=batch, link=link, zero_stage=s) for s in range(4)}
    )
    specs = [catalog.get(t) for t in types]
    precisions = [choose_precision(s, "auto") for s in specs]
    numels = (params,)
    optimum = math.inf
    for stage in range(4):
        fits, _ = memory_fits(specs, precisions, fp, stage)
        usable = [i for i, f in enumerate(fits) if f >= 1]
        if not usable:
            continue
        t = [compute_seconds(specs[i], precisions[i], fp.flops_per_sample, 0.4) for i in usable]
        for shares in itertools.product(range(1, batch + 1), repeat=len(usable)):
            if sum(shares) != batch:
                continue
            passes = max(-(-b // fits[i]) for b, i in zip(shares, usable))
            step = max(b * x for b, x in zip(shares, t)) + zero_comm_seconds(numels, len(types), link, stage, passes)
            optimum = min(optimum, step)
    if optimum == math.inf:
        assert isinstance(best, Infeasible)
        return
    assert best.predicted_step_s <= optimum * (1 + 1e-9)


def test_each_zero_stage_weighs_the_kinds_of_plan_that_run_at_it():
    """Stage 0: the placement search's plans alone; 1: those (ZeRO-1 inside pipelines) beside data parallelism
    sharded by memory, fastest first; 2 and 3: the latter alone; none fitting: every kind's reason."""

    def step(seconds: float) -> Plan:
        return Plan(global_batch=1, split="proportional", emulated=False, roles=(), predicted_compute_s=seconds)

    asked: list[tuple[str, int]] = []

    def placed(stage: int) -> list[Plan]:
        asked.append(("placed", stage))
        return [step(3.0), step(1.0)]

    def sharded(stage: int) -> Plan:
        asked.append(("sharded", stage))
        return step(2.0)

    assert [p.predicted_step_s for p in zero_stage_plans(0, placed, sharded)] == [1.0, 3.0]
    assert [p.predicted_step_s for p in zero_stage_plans(1, placed, sharded)] == [1.0, 2.0, 3.0]
    assert [p.predicted_step_s for p in zero_stage_plans(3, placed, sharded)] == [2.0]
    assert asked == [("placed", 0), ("placed", 1), ("sharded", 1), ("sharded", 3)]
    none = zero_stage_plans(1, lambda _: Infeasible("no pipeline fits"), lambda _: Infeasible("no shard fits"))
    assert none == Infeasible("no pipeline fits; no shard fits")


def test_a_need_below_a_tenth_of_a_gib_is_given_in_three_figures() -> None:
    """At scaled-down memory (MiB, not GiB) an infeasible plan still says how much it needs."""
    tiny = load_catalog(Path(__file__).parent / "data" / "tiny-memory-gpus.yaml")  # 0.75 MiB a device
    fp = Footprint(param_count=2**16, dataset_samples=100, flops_per_sample=1e9, activation_bytes_per_sample=2**20)
    result = plan_data_parallel([V100], tiny, fp, global_batch=4)
    # 16 bytes of state per parameter: 1 MiB; one sample's 1 MiB of fp32 activations, halved in a V100's fp16.
    assert isinstance(result, Infeasible) and "needs 0.00146 GiB per device" in result.reason, result
