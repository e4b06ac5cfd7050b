"""The placement search: memory forces pipelines, slow links favour them, optimal on small instances, invariants."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from hetero_ray.cluster.catalog import load_catalog
from hetero_ray.perf.footprint import Footprint, LayerCost, measure_footprint
from hetero_ray.plan.data_parallel import plan_data_parallel
from hetero_ray.plan.exhaustive import exhaustive_best_step
from hetero_ray.plan.instances import footprint_of, random_instance, with_mixed_nodes, with_split
from hetero_ray.plan.plan import Infeasible, Plan
from hetero_ray.plan.plan_file import parse_plan
from hetero_ray.plan.report import describe
from hetero_ray.plan.search import plan
from hetero_ray.plan.stages import MeasuredSpeeds, group_table, stage_work, type_table
from hetero_ray.plan.topology import MixedNodeKind, Topology, uniform_topology
from hetero_ray.workloads import build_workload

GiB = 2**30
A100, V100 = "A100-80GB", "V100-16GB"
# Random instances planned again with their first two types also sharing nodes.
MIXED_SEEDS = range(16)


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


def layered(n: int, params: int, flops: float, act: float, out: float) -> Footprint:
    layer = LayerCost(
        params=params, flops_per_sample=flops, activation_bytes_per_sample=act, output_bytes_per_sample=out
    )
    return footprint_of((layer,) * n)


def check_invariants(p: Plan, rank_types: list[str], n_layers: int) -> None:
    """The contract of a Plan (see plan/plan.py), for every plan the search returns."""
    assert Plan.from_dict(p.to_dict()) == p
    for t in set(r.gpu_type for r in p.roles):
        assert sum(r.gpu_type == t for r in p.roles) <= rank_types.count(t)
    parse_plan(p.to_dict())  # the plan file's invariants, tensor-parallel groups included
    pipelines = sorted({r.pipeline for r in p.roles})
    assert pipelines == list(range(len(pipelines)))
    offset = 0
    for pipe in pipelines:
        stages = sorted((r for r in p.roles if r.pipeline == pipe and r.tp_rank == 0), key=lambda r: r.stage)
        assert [r.stage for r in stages] == list(range(len(stages)))
        assert len({(r.local_batch, r.micro_batch, r.sample_offset) for r in stages}) == 1
        head = stages[0]
        assert head.sample_offset == offset and head.local_batch >= 1
        offset += head.local_batch
        if len(stages) == 1:
            assert head.layers is None
        else:
            assert head.local_batch % head.micro_batch == 0
            assert [r.layers[0] for r in stages] == [0] + [r.layers[1] for r in stages[:-1]]
            assert stages[-1].layers[1] == n_layers and all(r.layers[0] < r.layers[1] for r in stages)
        for r in stages:
            assert r.predicted_memory_bytes <= r.memory_cap_bytes
    assert offset == p.global_batch
    assert p.schedule in ("1f1b", "gpipe") and p.explanation


def test_memory_cap_forces_a_pipeline(catalog):
    # 8 layers of 2^27 parameters: 16 GiB of weights, gradients and Adam state: no V100-16GB holds it.
    fp = layered(8, 2**27, 1e11, 0.05 * GiB, 1e6)
    ranks = [V100] * 4
    topo = uniform_topology(catalog, ranks, gpus_per_node=4, inter_node_gbps=100)
    assert isinstance(plan_data_parallel(ranks, catalog, fp, global_batch=16), Infeasible)
    plans = plan(ranks, catalog, fp, global_batch=16, topology=topo)
    assert isinstance(plans, list) and plans
    for p in plans:
        check_invariants(p, ranks, 8)
        assert p.is_pipelined and all(r.layers is not None for r in p.roles)
    assert re.search(r"stages? 0(-\d+)? on \d+ × V100-16GB \(fp16\) holds? ", plans[0].explanation)


def test_slow_link_favours_pipelines_over_data_parallelism(catalog):
    # Large weights, little activation: an all-reduce of 1.5 GiB of gradients over 1 Gbit/s dwarfs compute.
    fp = layered(8, 50_000_000, 2e10, 1e6, 1e5)
    ranks = [A100] * 8
    topo = uniform_topology(catalog, ranks, gpus_per_node=1, inter_node_gbps=1)
    best = plan(ranks, catalog, fp, global_batch=64, topology=topo)[0]
    dp = plan(ranks, catalog, fp, global_batch=64, topology=topo, max_stages=1)[0]
    check_invariants(best, ranks, 8)
    assert not dp.is_pipelined and best.is_pipelined
    assert best.predicted_step_s < 0.5 * dp.predicted_step_s
    # When the all-reduce is cheap (few weights, NVLink in one node), no bubble beats any pipeline.
    light = layered(8, 1_000_000, 2e10, 1e6, 1e5)
    fast = uniform_topology(catalog, ranks, gpus_per_node=8, inter_node_gbps=400)
    assert not plan(ranks, catalog, light, global_batch=64, topology=fast)[0].is_pipelined


def test_pure_data_parallel_matches_the_weighted_planner(catalog):
    fp = layered(4, 1000, 1e9, 1e3, 1e3)
    ranks = [A100, A100, V100, V100, V100, V100]
    topo = uniform_topology(catalog, ranks, gpus_per_node=8, inter_node_gbps=100)
    p = plan(ranks, catalog, fp, global_batch=72, topology=topo, max_stages=1)[0]
    check_invariants(p, ranks, 4)
    ref = plan_data_parallel(ranks, catalog, fp, global_batch=72)
    assert all(r.layers is None for r in p.roles)
    assert sorted(r.local_batch for r in p.roles) == sorted(r.local_batch for r in ref.roles)
    assert p.predicted_compute_s == pytest.approx(ref.predicted_compute_s)


@pytest.mark.parametrize(
    "seed, degrees, zero_stage, mixed_nodes",
    [(seed, (1,), 0, False) for seed in range(8)]
    + [(seed, (1, 2, 4), 0, False) for seed in range(16)]
    + [(seed, (1,), 1, False) for seed in range(16)]
    + [(seed, (1, 2), 0, True) for seed in MIXED_SEEDS],
)
def test_search_is_optimal_on_small_instances(catalog, seed, degrees, zero_stage, mixed_nodes):
    """Against the enumerator, which walks every split, checkpointing and micro-batch of every kind; with
    tensor parallelism, at each degree, the members' all-reduces priced by its own scalar sums; at ZeRO-1,
    each stage's Adam state split over its kind's replicas by its own scalar sums; where the instance's first
    two types also share nodes, groups across them, each member priced by its own sums."""
    inst = random_instance(seed, catalog)
    inst = with_mixed_nodes(inst) if mixed_nodes else inst
    kw = dict(
        global_batch=inst.global_batch,
        topology=inst.topology,
        max_stages=4,
        micro_batches=(1, 2),
        tensor_parallel=degrees,
        zero_stage=zero_stage,
    )
    ranks = list(inst.rank_types)
    result = plan(ranks, catalog, inst.footprint, **kw)
    optimum = exhaustive_best_step(ranks, catalog, inst.footprint, **kw)
    if isinstance(result, Infeasible):
        assert optimum == float("inf")
        return
    for p in result:
        check_invariants(p, ranks, len(inst.footprint.layers))
        assert p.zero_stage == zero_stage
    assert [p.predicted_step_s for p in result] == sorted(p.predicted_step_s for p in result)
    assert result[0].predicted_step_s <= 1.01 * optimum


def test_tensor_parallelism_lets_cards_too_small_for_a_layer_join(catalog):
    """Layers of 2^30 parameters (16 GiB of state each): no V100-16GB holds one, so without tensor
    parallelism the V100s are unused whatever the pipeline; split over 2 or 4 V100s of a node they train,
    and the step is shorter. The explanation says why the degree was chosen."""
    fp = with_blocks(layered(4, 2**30, 6 * 2**30 * 1024, 0.05 * GiB, 8 * 2**20))
    ranks = [A100] * 2 + [V100] * 8
    topo = uniform_topology(catalog, ranks, gpus_per_node=4, inter_node_gbps=100)
    without = plan(ranks, catalog, fp, global_batch=64, topology=topo)[0]
    assert {e.gpu_type: e.count for e in without.excluded} == {V100: 8}
    best = plan(ranks, catalog, fp, global_batch=64, topology=topo, tensor_parallel=(1, 2, 4))[0]
    check_invariants(best, ranks, 4)
    assert best.tensor_parallel > 1 and any(r.gpu_type == V100 for r in best.roles)
    assert best.predicted_step_s < without.predicted_step_s
    assert f"tensor-parallel degree {best.tensor_parallel}" in best.explanation
    assert f"{without.predicted_step_s * 1e3:.4g} ms at degree 1" in best.explanation
    members = [r for r in best.roles if r.gpu_type == V100]
    assert {r.tp_rank for r in members} == set(range(best.tensor_parallel))
    assert all(r.tp_weights == (1.0,) * best.tensor_parallel for r in members)


def per_type_topology(catalog, nodes: dict[str, int]) -> Topology:
    """Nodes of ``nodes[t]`` GPUs for each type t, NICs of 100 Gbit/s."""
    return Topology(
        nodes={
            t: uniform_topology(catalog, [t], gpus_per_node=n, inter_node_gbps=100).nodes[t] for t, n in nodes.items()
        }
    )


def big_blocks() -> Footprint:
    """4 GPT blocks of 2^30 parameters: 16 GiB of state each, more than a V100-16GB holds alone, half of it
    on each of two V100s split tensor-parallel; an A100-80GB holds one or more alone."""
    return with_blocks(layered(4, 2**30, 6 * 2**30 * 1024, 0.05 * GiB, 8 * 2**20))


def test_each_type_gets_its_own_tensor_parallel_degree(catalog):
    """2 A100-80GB, one per node, and 4 V100-16GB on one node: at degree 1 the V100s hold no block, at degree 2
    the A100s form no pair (one per node), so either uniform degree trains on one type only; A100 stages
    alone before V100 pairs train on all six and the step is shorter. The explanation names each type's
    degree and the uniform degrees it beat."""
    fp = big_blocks()
    ranks = [A100] * 2 + [V100] * 4
    topo = per_type_topology(catalog, {A100: 1, V100: 4})
    kw = dict(global_batch=64, topology=topo)
    uniform = [p[0] for d in (1, 2) if isinstance(p := plan(ranks, catalog, fp, tensor_parallel=(d,), **kw), list)]
    assert uniform and all(len({r.gpu_type for r in p.roles}) == 1 for p in uniform)
    best_uniform = min(p.predicted_step_s for p in uniform)
    best = plan(ranks, catalog, fp, tensor_parallel=(1, 2), **kw)[0]
    check_invariants(best, ranks, 4)
    assert {r.tp_degree for r in best.roles if r.gpu_type == A100} == {1}
    assert {r.tp_degree for r in best.roles if r.gpu_type == V100} == {2}
    assert best.tensor_parallel == 2 and len(best.roles) == 6
    assert best.predicted_step_s < 0.8 * best_uniform
    assert "A100-80GB stages alone, V100-16GB stages as tensor-parallel pairs" in best.explanation
    assert (
        f"tensor-parallel degree 2 on V100-16GB and 1 on A100-80GB ({best.predicted_step_s * 1e3:.4g} ms) against "
        f"{best_uniform * 1e3:.4g} ms at degree 1, none fits at degree 2"
    ) in best.explanation


@pytest.mark.parametrize("nodes", [{A100: 1, V100: 4}, {A100: 4, V100: 4}])
def test_pipelines_holding_a_layer_split_it_alike(catalog, nodes):
    """The runtime sums a layer's gradients per tensor-parallel part: among the returned plans, some with
    unequal degrees per type, every layer's holders share one degree."""
    fp = big_blocks()
    ranks = [A100] * 2 + [V100] * 8
    topo = per_type_topology(catalog, nodes)
    plans = plan(ranks, catalog, fp, global_batch=64, topology=topo, tensor_parallel=(1, 2, 4), top_k=20)
    unequal = [len({r.tp_degree for r in p.roles}) > 1 for p in plans]
    assert sum(unequal) >= 2 and not all(unequal)
    for p in plans:
        check_invariants(p, ranks, 4)
        for layer in range(4):
            holders = [r for r in p.roles if r.layers is None or r.layers[0] <= layer < r.layers[1]]
            assert len({r.tp_degree for r in holders}) == 1, (layer, describe(p))


def test_enumerator_walks_each_types_degree_as_the_search(catalog):
    """On the first test's devices, the enumerator's optimum over degrees (1, 2) per type is the search's best
    step, and shorter than its optimum at either degree for all types alike: it walks unequal degrees too."""
    fp = big_blocks()
    ranks = [A100] * 2 + [V100] * 4
    kw = dict(
        global_batch=16, topology=per_type_topology(catalog, {A100: 1, V100: 4}), max_stages=4, micro_batches=(1, 2)
    )
    optimum = exhaustive_best_step(ranks, catalog, fp, tensor_parallel=(1, 2), **kw)
    uniform = min(exhaustive_best_step(ranks, catalog, fp, tensor_parallel=(d,), **kw) for d in (1, 2))
    assert optimum < 0.8 * uniform
    best = plan(ranks, catalog, fp, tensor_parallel=(1, 2), **kw)[0]
    assert best.predicted_step_s == pytest.approx(optimum, rel=1e-9)


def test_a_layer_split_across_types_lets_a_card_too_small_for_it_join(catalog):
    """Two nodes, each an A100-80GB beside a V100-16GB. No V100 holds a block of 2^30 parameters, and no node
    holds two V100s, so without splitting across types the V100s sit out. Split by speed over each node's
    A100 and V100 (fp16, which both run: 312 and 125 TFLOP/s, 0.71 : 0.29), every device trains, each member
    within its own memory, the step is shorter, and the enumerator finds no better plan."""
    fp = big_blocks()
    ranks = [A100] * 2 + [V100] * 2
    plain = per_type_topology(catalog, {A100: 1, V100: 1})
    mixed = replace(plain, mixed=(MixedNodeKind(gpu_types=(A100, V100), nodes=2, nic_bandwidth_bytes_s=100e9 / 8),))
    kw = dict(global_batch=64, tensor_parallel=(1, 2))
    without = plan(ranks, catalog, fp, topology=plain, **kw)[0]
    assert {e.gpu_type: e.count for e in without.excluded} == {V100: 2}
    best = plan(ranks, catalog, fp, topology=mixed, **kw)[0]
    check_invariants(best, ranks, 4)
    assert best.splits_across_types and not best.excluded and len(best.roles) == 4
    assert best.predicted_step_s < 0.8 * without.predicted_step_s
    weights = catalog.get(A100).peak_flops("fp16"), catalog.get(V100).peak_flops("fp16")
    for r in best.roles:
        assert r.tp_weights == pytest.approx(tuple(w / sum(weights) for w in weights))
        assert r.gpu_type == (A100, V100)[r.tp_rank] and r.precision == "fp16"
        assert r.memory_cap_bytes == catalog.get(r.gpu_type).memory_bytes
    v100 = next(r for r in best.roles if r.gpu_type == V100)
    a100 = next(r for r in best.roles if r.gpu_type == A100 and r.stage == v100.stage)
    assert v100.predicted_memory_bytes < a100.predicted_memory_bytes / 2  # a member holds its part
    assert "A100-80GB+V100-16GB stages split across its types by speed (0.71 : 0.29)" in best.explanation
    assert f"against {without.predicted_step_s * 1e3:.4g} ms at degree 1" in best.explanation
    optimum = exhaustive_best_step(ranks, catalog, fp, topology=mixed, max_stages=8, micro_batches=(1, 2, 4, 8), **kw)
    assert best.predicted_step_s == pytest.approx(optimum, rel=1e-9)


def test_stages_of_one_type_get_a_degree_each(catalog):
    """Three A100-80GB on one node, a first block of 5.5 G parameters (88 GB of state, more than one A100 holds)
    and three of 1 G: at degree 1 nothing fits, at degree 2 for every stage one pair trains alone; a pair holding
    the big block, then a single A100 the rest, trains on all three and the step is shorter. The enumerator
    finds no better plan, and the explanation names the degrees."""
    huge, small = (
        with_split(
            LayerCost(
                params=n,
                flops_per_sample=6 * n * 512,
                activation_bytes_per_sample=0.1 * GiB,
                output_bytes_per_sample=8 * 2**20,
            )
        )
        for n in (5_500_000_000, 10**9)
    )
    fp = footprint_of((huge, small, small, small))
    ranks = [A100] * 3
    kw = dict(global_batch=32, topology=per_type_topology(catalog, {A100: 4}), max_stages=4, micro_batches=(1, 2))
    assert isinstance(plan(ranks, catalog, fp, tensor_parallel=(1,), **kw), Infeasible)
    pair = plan(ranks, catalog, fp, tensor_parallel=(2,), **kw)[0]
    assert len(pair.roles) == 2
    best = plan(ranks, catalog, fp, tensor_parallel=(1, 2), **kw)[0]
    check_invariants(best, ranks, 4)
    assert [(r.stage, r.layers, r.tp_degree) for r in best.roles] == [(0, (0, 1), 2), (0, (0, 1), 2), (1, (1, 4), 1)]
    assert best.predicted_step_s < 0.8 * pair.predicted_step_s
    assert "some A100-80GB stages as tensor-parallel pairs, the other A100-80GB stages alone" in best.explanation
    assert f"degree 2 on groups of 2 × A100-80GB and 1 on A100-80GB ({best.predicted_step_s * 1e3:.4g} ms)" in (
        best.explanation
    )
    optimum = exhaustive_best_step(ranks, catalog, fp, tensor_parallel=(1, 2), **kw)
    assert best.predicted_step_s == pytest.approx(optimum, rel=1e-9)


def test_a_group_across_types_is_its_slowest_member_and_each_member_its_part(catalog):
    """A member holds the split layers in proportion to its speed and the rest whole; the group's time is its
    slowest member's, which every member's part takes alike (the split is by speed)."""
    fp = with_blocks(layered(2, 10**8, 6e11, 1e8, 4e6))
    group = group_table(
        f"{A100}+{V100}",
        (A100, V100),
        catalog,
        fp.layers,
        precision="auto",
        efficiency=0.4,
        seconds_per_sample=None,
        tp_link=(16e9, 5e-6),
    )
    assert group.precision == "fp16" and [m.precision for m in group.members] == ["fp16", "fp16"]
    split = fp.layers[0]
    for member, w in zip(group.members, group.weights):
        assert member.params[1] == round(split.params - split.tp_params * (1 - w))
        assert member.flops[1] * member.seconds_per_flop == pytest.approx(
            group.flops[1] * group.seconds_per_flop, rel=0.02
        )  # the whole part (1 % of the layer here) runs at each member's speed
    assert group.seconds_per_flop == max(m.seconds_per_flop for m in group.members)
    assert group.cap_bytes == catalog.get(A100).memory_bytes + catalog.get(V100).memory_bytes


def test_some_random_instances_split_a_layer_across_types(catalog):
    """Guards the optimality test where nodes mix types: on its seeds the best plan of several splits a layer
    across types."""
    chosen = []
    for seed in MIXED_SEEDS:
        inst = with_mixed_nodes(random_instance(seed, catalog))
        result = plan(
            list(inst.rank_types),
            catalog,
            inst.footprint,
            global_batch=inst.global_batch,
            topology=inst.topology,
            max_stages=4,
            micro_batches=(1, 2),
            tensor_parallel=(1, 2),
        )
        chosen.append(isinstance(result, list) and result[0].splits_across_types)
    assert sum(chosen) >= 2, chosen


def test_tensor_parallel_member_holds_its_shard_and_pays_its_all_reduces(catalog):
    """A member's table: the split part of params, FLOPs and activations divided by the degree, and four
    all-reduces of the layer's output per micro-batch on the node's link."""
    fp = with_blocks(layered(2, 10**8, 6e11, 1e8, 4e6))
    link = (50e9, 5e-6)
    one = type_table(V100, catalog, fp.layers, precision="fp32", efficiency=0.4, seconds_per_sample=None)
    two = type_table(
        V100,
        catalog,
        fp.layers,
        precision="fp32",
        efficiency=0.4,
        seconds_per_sample=None,
        tp_degree=2,
        tp_link=link,
        dp_share=8,
    )
    split = fp.layers[0]
    assert two.params[1] == split.params - split.tp_params / 2
    assert two.flops[1] == pytest.approx(one.flops[1] / 2)
    assert two.act[1] == pytest.approx(split.activation_bytes_per_sample - split.tp_activation_bytes_per_sample / 2)
    # Ring of 2: each all-reduce sends the payload once and takes 2 latencies.
    assert two.tp_per_sample[1] == pytest.approx(4 * 4e6 / 50e9)
    assert two.tp_per_micro[1] == pytest.approx(4 * 2 * 5e-6)
    # A data-parallel member, priced per sample: its share of 8 samples is one micro-batch, whose latencies
    # the 8 share.
    assert two.tp_per_share[1] == pytest.approx(4 * 4e6 / 50e9 + 4 * 2 * 5e-6 / 8)


def with_blocks(fp: Footprint) -> Footprint:
    """``fp`` with every layer splittable as a GPT block is (``plan/instances.py::with_split``)."""
    return replace(fp, layers=tuple(with_split(c) for c in fp.layers))


def test_enumerator_finds_what_a_restricted_search_misses(catalog):
    # Guards the optimality test: with pipelines forbidden, the search falls behind the enumerator.
    fp = layered(6, 50_000_000, 2e10, 1e6, 1e5)
    ranks = [A100] * 4
    topo = uniform_topology(catalog, ranks, gpus_per_node=1, inter_node_gbps=1)
    dp_only = plan(ranks, catalog, fp, global_batch=16, topology=topo, max_stages=1)[0]
    optimum = exhaustive_best_step(ranks, catalog, fp, global_batch=16, topology=topo, max_stages=4)
    assert dp_only.predicted_step_s > 1.5 * optimum


def test_onebit_adam_costs_memory_and_saves_communication(catalog):
    fp = layered(4, 50_000_000, 2e10, 1e6, 1e5)
    ranks = [A100] * 4
    topo = uniform_topology(catalog, ranks, gpus_per_node=1, inter_node_gbps=10)
    adam = plan(ranks, catalog, fp, global_batch=16, topology=topo, max_stages=1)[0]
    onebit = plan(ranks, catalog, fp, global_batch=16, topology=topo, max_stages=1, optimizer="onebit_adam")[0]
    assert onebit.roles[0].predicted_memory_bytes > adam.roles[0].predicted_memory_bytes
    assert onebit.predicted_comm_s < 0.1 * onebit.predicted_comm_fp32_s
    assert onebit.predicted_comm_fp32_s == pytest.approx(adam.predicted_comm_s)


def test_model_that_fits_nowhere_names_the_smallest_shortfall(catalog):
    # One layer of 2^30 parameters: 16 GiB of state on a single device, whatever the split.
    fp = layered(2, 2**30, 1e12, 1e6, 1e6)
    ranks = [V100] * 4
    topo = uniform_topology(catalog, ranks, gpus_per_node=4, inter_node_gbps=100)
    result = plan(ranks, catalog, fp, global_batch=8, topology=topo)
    assert isinstance(result, Infeasible)
    assert result.reason.startswith("model needs 16 GiB per device at micro-batch 1")
    assert "its V100-16GB has 16 GiB" in result.reason and "\n" not in result.reason


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"global_batch": 0}, "global_batch: must be >= 1"),
        ({"global_batch": 8, "schedule": "zb"}, "schedule: unknown schedule 'zb'"),
        ({"global_batch": 8, "max_stages": 0}, "max_stages: must be >= 1"),
        ({"global_batch": 8, "zero_stage": 2}, r"zero_stage: .*stages 2 and 3 shard data parallelism only \(got 2\)"),
        ({"global_batch": 8, "zero_stage": 1, "optimizer": "onebit_adam"}, "zero_stage: .*1-bit optimizer onebit_adam"),
    ],
)
def test_bad_arguments_are_one_line_errors(catalog, kwargs, match):
    fp = layered(2, 1000, 1e9, 1e3, 1e3)
    topo = uniform_topology(catalog, [A100], gpus_per_node=1, inter_node_gbps=1)
    with pytest.raises(ValueError, match=match) as error:
        plan([A100], catalog, fp, topology=topo, **kwargs)
    assert "\n" not in str(error.value)


def test_checkpointed_data_parallel_devices_stay_within_memory():
    """Regression: a data-parallel device that fits only with checkpointing got a micro-batch sized as if its
    recomputed layer held one sample; 0.75 MiB devices and the tests' small GPT hit it."""
    tiny = load_catalog(Path(__file__).parent / "data" / "tiny-memory-gpus.yaml")
    opts = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32, "corpus_bytes": 200_000}
    fp = measure_footprint(lambda: build_workload("gpt", opts))
    ranks = [A100, A100, V100, V100]
    topo = uniform_topology(tiny, ranks, gpus_per_node=2, inter_node_gbps=100)
    plans = plan(ranks, tiny, fp, global_batch=12, topology=topo, precision="fp32", top_k=5)
    assert any(r.layers is None and r.activation_checkpointing for p in plans for r in p.roles)
    for p in plans:
        check_invariants(p, ranks, len(fp.layers))


def test_a_fixed_cost_per_micro_batch_makes_pipelines_use_larger_ones(catalog):
    """Measured speeds that include a fixed cost per forward and backward price every pipeline micro-batch
    with it: the planner then runs fewer, larger micro-batches than with a constant time per sample."""
    fp = layered(8, 2**27, 1e11, 0.05 * GiB, 1e6)  # fits no V100-16GB whole: a pipeline
    ranks = [V100] * 4
    topo = uniform_topology(catalog, ranks, gpus_per_node=4, inter_node_gbps=100)

    def constant(gpu_type: str, precision: str, micro_batch: int | None) -> float:
        return 0.01

    def with_fixed_cost(gpu_type: str, precision: str, micro_batch: int | None) -> float:
        return 0.01 + 0.05 / (micro_batch or 16)

    linear = plan(ranks, catalog, fp, global_batch=64, topology=topo, seconds_per_sample=constant)[0]
    fixed = plan(ranks, catalog, fp, global_batch=64, topology=topo, seconds_per_sample=with_fixed_cost)[0]
    for p in (linear, fixed):
        check_invariants(p, ranks, 8)
        assert p.is_pipelined
    assert fixed.roles[0].micro_batch > linear.roles[0].micro_batch
    # Each micro-batch costs its stage's share of the fixed cost too.
    assert fixed.predicted_step_s > linear.predicted_step_s


def test_each_stage_pays_a_measured_fixed_cost_in_full(catalog):
    """A profile's fixed cost of a step (``MeasuredSpeeds.fixed_seconds``) is host work that does not shrink
    with a stage's layers: every stage pays all of it per micro-batch, on top of its share of the step."""
    fp = layered(8, 2**20, 1e9, 1e6, 1e3)
    layers = fp.layers

    def per_sample(gpu_type: str, precision: str, micro_batch: int | None) -> float:
        return 0.01 + 0.05 / (micro_batch or 16)

    shared = type_table(V100, catalog, layers, precision="fp32", efficiency=0.4, seconds_per_sample=per_sample)
    full = type_table(
        V100,
        catalog,
        layers,
        precision="fp32",
        efficiency=0.4,
        seconds_per_sample=MeasuredSpeeds(per_sample=per_sample, fixed_seconds=lambda t, p: 0.05),
    )
    work = dict(micro=4, flight=1, optimizer="adamw", world=2)
    for i, j in ((0, 2), (0, 4), (3, 8), (0, 8)):
        extra = (
            stage_work(full, staged=True, **work).compute[i, j] - stage_work(shared, staged=True, **work).compute[i, j]
        )
        assert extra == pytest.approx((1 - (j - i) / 8) * 0.05)
    # A whole-model worker is priced per sample at its rate, as before.
    assert (stage_work(full, staged=False, **work).compute == stage_work(shared, staged=False, **work).compute).all()


def test_zero1_fits_a_pipeline_in_the_memory_its_replicas_share(catalog):
    """4 layers of 600 M parameters on 4 V100-16GB: two layers hold 19.2 GB of weights, gradients and Adam
    state, over the card's 17.2 GB, so at most 2 stages nothing fits; with 4 stages one layer per card does.
    At ZeRO-1 the 2 replicas of a 2-stage pipeline each keep half of every stage's Adam state: 14.4 GB."""
    P, act = 600_000_000, 1e6
    fp = layered(4, P, 1e11, act, 1e5)
    ranks = [V100] * 4
    topo = uniform_topology(catalog, ranks, gpus_per_node=4, inter_node_gbps=100)
    kw = dict(global_batch=16, topology=topo, precision="fp32")
    assert isinstance(plan(ranks, catalog, fp, max_stages=2, **kw), Infeasible)
    assert {r.stage for r in plan(ranks, catalog, fp, max_stages=4, **kw)[0].roles} == {0, 1, 2, 3}
    plans = plan(ranks, catalog, fp, max_stages=2, zero_stage=1, **kw)
    assert isinstance(plans, list) and plans
    best = plans[0]
    check_invariants(best, ranks, 4)
    assert best.zero_stage == 1 and best.num_pipelines == 2
    for r in best.roles:
        assert not r.activation_checkpointing
        # fp32 weights and gradients whole, Adam's two fp32 moments halved, then the saved activations.
        params = (r.layers[1] - r.layers[0]) * P
        flight = min(r.local_batch // r.micro_batch, 2 - r.stage)  # 1F1B on 2 stages
        expected = params * (4 + 4 + 8 / 2) + flight * r.micro_batch * (r.layers[1] - r.layers[0]) * act
        assert r.predicted_memory_bytes == pytest.approx(expected, rel=1e-12)
    assert "ZeRO-1: each stage's Adam state is sharded over the 2 replicas of its pipeline kind (1/2 each)" in (
        best.explanation
    )


@pytest.mark.parametrize("gpus_per_node", [8, 2])
def test_zero1_all_gather_is_half_an_all_reduce_over_a_kinds_replicas(catalog, gpus_per_node):
    """The updated parameters (fp32) are all-gathered among the replicas of each stage: half a hierarchical
    all-reduce of the stage's parameters, after the gradients' own (the same bytes at ``reduce_dtype`` fp32):
    1.5 times the all-reduce alone. More replicas or more parameters: a longer all-gather."""
    gather = {}
    for n, P in ((4, 10**7), (8, 10**7), (8, 4 * 10**7)):
        fp = layered(4, P, 1e9, 1e6, 1e5)
        ranks = [A100] * n
        topo = uniform_topology(catalog, ranks, gpus_per_node=gpus_per_node, inter_node_gbps=10)
        # Only 2-stage pipelines are in the space: pure data parallelism is not at ZeRO-1.
        p = plan(ranks, catalog, fp, global_batch=32, topology=topo, max_stages=2, zero_stage=1)[0]
        check_invariants(p, ranks, 4)
        r = n // 2
        assert p.num_pipelines == r
        payload = 4 * max(role.layers[1] - role.layers[0] for role in p.roles) * P
        local = min(r, gpus_per_node // 2)  # a node holds whole 2-stage runs of a pipeline's stages
        nodes = -(-r // local)
        (intra_bw, intra_lat), (inter_bw, inter_lat) = topo.intra(A100), topo.inter([A100])
        all_reduce = (2 * (local - 1) / local * payload / intra_bw + 2 * (local - 1) * intra_lat) + (
            2 * (nodes - 1) / nodes * payload / inter_bw + 2 * (nodes - 1) * inter_lat
        )
        assert p.predicted_comm_s == pytest.approx(1.5 * all_reduce, rel=1e-9)
        assert p.predicted_comm_fp32_s == p.predicted_comm_s
        assert f"the updated slices all-gathered after the step ({0.5 * all_reduce * 1e3:.3g} ms)" in p.explanation
        gather[n, P] = p.predicted_comm_s - all_reduce
    assert gather[4, 10**7] < gather[8, 10**7] < gather[8, 4 * 10**7]


def test_zero1_plans_no_pure_data_parallelism(catalog):
    """At ZeRO-1 pure data parallelism is the data-parallel planner's (it shards across types by memory): a
    light model on one fast node, whose top plans include all 8 devices data parallel, gets only plans with a
    pipeline of 2 or more stages, some with data-parallel devices beside it."""
    light = layered(8, 1_000_000, 2e10, 1e6, 1e5)
    ranks = [A100] * 4 + [V100] * 4
    fast = uniform_topology(catalog, ranks, gpus_per_node=8, inter_node_gbps=400)

    def one_stage_pipelines(p: Plan) -> int:
        return sum(all(r.layers is None for r in p.roles if r.pipeline == k) for k in range(p.num_pipelines))

    plain = plan(ranks, catalog, light, global_batch=64, topology=fast, top_k=10)
    assert any(one_stage_pipelines(p) == p.num_pipelines for p in plain)
    plans = plan(ranks, catalog, light, global_batch=64, topology=fast, zero_stage=1, top_k=10)
    assert len(plans) == 10
    for p in plans:
        check_invariants(p, ranks, 8)
        assert p.zero_stage == 1 and one_stage_pipelines(p) < p.num_pipelines
    assert any(one_stage_pipelines(p) for p in plans)
    only_data_parallel = plan(ranks, catalog, light, global_batch=64, topology=fast, zero_stage=1, max_stages=1)
    assert isinstance(only_data_parallel, Infeasible)
    assert only_data_parallel.reason.startswith("zero_stage 1 shards Adam's state within pipelines of 2 or more")
