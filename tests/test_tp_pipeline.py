"""Tensor-parallel stages inside pipelines, on gloo ranks (spawned processes, no Ray): the same training as one
process, and the whole state gathered back in the unsplit layout.

The GPT's four layers (embedding, two blocks, head) run with each stage a tensor-parallel group splitting its
blocks' heads and MLP columns unevenly; every plan must end where full-batch AdamW in one process ends.
"""

from __future__ import annotations

import time

import pytest
import torch
from ranks import one_process, run_pipelined, run_ranks, worker_role

from hetero_ray.config import parse_config
from hetero_ray.train.pipeline import (
    Boundary,
    actions,
    boundary,
    gradient_buckets,
    layer_holders,
    part_holders,
    sub_pipelines,
    tensor_members,
)
from hetero_ray.workloads import build_workload
from hetero_ray.workloads.tensor_parallel import TensorParallelBlock

OPTIONS = {"n_layer": 2, "n_head": 8, "n_embd": 32, "block_size": 16, "corpus_bytes": 50_000}
GLOBAL_BATCH, STEPS, SEED, LR = 12, 4, 3, 1e-3
CONFIG = {"devices": {"A100-80GB": 1}, "train": {"global_batch": GLOBAL_BATCH, "lr": LR, "seed": SEED}}


def member(pipeline: int, stage: int, layers, local: int, micro: int, offset: int, weights=None, k: int = 0, **kw):
    return worker_role(
        local,
        offset,
        micro=micro,
        pipeline=pipeline,
        stage=stage,
        layers=layers,
        tp_weights=weights,
        tp_rank=k,
        **kw,
    )


# Stage 0 (embedding, block 0) split 5 : 3, stage 1 (block 1, head) split 1 : 1; ranks out of member order,
# so a group's ranks (ascending) are not its members' order.
TWO_BY_TWO = [
    member(0, 1, (2, 4), 12, 3, 0, (1.0, 1.0), 1),
    member(0, 0, (0, 2), 12, 3, 0, (5.0, 3.0), 1),
    member(0, 0, (0, 2), 12, 3, 0, (5.0, 3.0), 0),
    member(0, 1, (2, 4), 12, 3, 0, (1.0, 1.0), 0),
]
TWO_THEN_ONE = [
    member(0, 1, (2, 4), 12, 3, 0),
    member(0, 0, (0, 2), 12, 3, 0, (5.0, 3.0), 1),
    member(0, 0, (0, 2), 12, 3, 0, (5.0, 3.0), 0),
]
PLANS = {
    "two stages of two": ("gpipe", TWO_BY_TWO),
    "two stages of two, 1f1b checkpointed": (
        "1f1b",
        [
            member(0, 1, (2, 4), 12, 3, 0, (1.0, 1.0), 1),
            member(0, 0, (0, 2), 12, 3, 0, (5.0, 3.0), 1, activation_checkpointing=True),
            member(0, 0, (0, 2), 12, 3, 0, (5.0, 3.0), 0, activation_checkpointing=True),
            member(0, 1, (2, 4), 12, 3, 0, (1.0, 1.0), 0),
        ],
    ),
    # Stages of different degrees (our own schedule): two members split 5 : 3, then one whole stage; two
    # pipelines of that layout, 6 samples each, their parts of each layer summed.
    "a stage of two, then one, twice": (
        "gpipe",
        [member(p, r.stage, r.layers, 6, 3, 6 * p, r.tp_weights, r.tp_rank) for p in (1, 0) for r in TWO_THEN_ONE],
    ),
    # One, three split 4 : 3 : 1, one; 1F1B.
    "one, three, one, 1f1b": (
        "1f1b",
        [
            member(0, s, layers, 12, 3, 0, weights, k)
            for s, layers, weights in ((2, (3, 4), None), (0, (0, 1), None), (1, (1, 3), (4.0, 3.0, 1.0)))
            for k in range(len(weights or (1,)))
        ],
    ),
    # Two whole-model (one-stage) replicas, each a tensor-parallel group of two split 5 : 3.
    "two replicas of two": (
        "gpipe",
        [
            member(0, 0, None, 8, 4, 0, (5.0, 3.0), 1),
            member(1, 0, None, 4, 2, 8, (5.0, 3.0), 0),
            member(0, 0, None, 8, 4, 0, (5.0, 3.0), 0),
            member(1, 0, None, 4, 2, 8, (5.0, 3.0), 1),
        ],
    ),
}
# Each rank's heads in its stage's blocks: 5 and 3 of 8 at 5 : 3, 4 each at 1 : 1.
HEADS = {
    "two stages of two": [[4], [3], [5], [4]],
    "two stages of two, 1f1b checkpointed": [[4], [3], [5], [4]],
    "two replicas of two": [[3, 3], [5, 5], [5, 5], [3, 3]],
    "a stage of two, then one, twice": [[], [3], [5]] * 2,
    "one, three, one, 1f1b": [[], [], [4, 4], [3, 3], [1, 1]],
}
# The two-by-two pipeline beside a whole-model replica without tensor parallelism: refused.
MIXED = [
    *[member(0, r.stage, r.layers, 8, 2, 0, r.tp_weights, r.tp_rank) for r in TWO_BY_TWO],
    member(1, 0, None, 4, 2, 8),
]


def tp_rank_main(rank: int, world: int, roles, schedule: str, steps=range(STEPS), resume=None, clip=None) -> dict:
    """``steps`` of ``roles``' plan (``run_pipelined``); ``resume``: a gathered whole (model, optimizer) state to
    start from; ``clip``: ``train.grad_clip``."""
    cfg = parse_config({**CONFIG, "train": {**CONFIG["train"], "grad_clip": clip}})
    run = run_pipelined(rank, roles, cfg, OPTIONS, schedule, steps, resume)
    return {
        "losses": run.losses,
        "whole": run.whole,
        "heads": [layer.n_head for layer in run.stage.module if isinstance(layer, TensorParallelBlock)],
    }


@pytest.fixture(scope="module")
def expected():
    """One process, full global batch every step."""
    return one_process(OPTIONS, GLOBAL_BATCH, STEPS, SEED, LR)


@pytest.mark.parametrize("name", PLANS)
def test_tensor_parallel_plan_trains_like_one_process(name: str, expected, tmp_path) -> None:
    """Every rank's losses, the gathered whole model and its AdamW state (both moments, by position in the
    unsplit model's parameters) are the one-process run's (fp32, 1e-5); each member held its share of heads."""
    schedule, roles = PLANS[name]
    results = run_ranks(tp_rank_main, len(roles), tmp_path, roles, schedule)
    assert [r["heads"] for r in results] == HEADS[name]
    ref_losses, ref_model, ref_optimizer = expected
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5)
    model, optimizer = results[0]["whole"]
    assert model.keys() == ref_model.keys()
    for k, t in model.items():
        assert t.shape == ref_model[k].shape, k
        assert float((t - ref_model[k]).abs().max()) <= 1e-5, k
    assert sorted(optimizer["state"]) == sorted(ref_optimizer["state"])
    assert optimizer["param_groups"][0]["params"] == ref_optimizer["param_groups"][0]["params"]
    for i, state in optimizer["state"].items():
        assert int(state["step"]) == STEPS
        for moment in ("exp_avg", "exp_avg_sq"):
            assert float((state[moment] - ref_optimizer["state"][i][moment]).abs().max()) <= 1e-6, (i, moment)


def test_clipping_counts_each_tensor_once_across_the_members(tmp_path) -> None:
    """A clip that acts (the gradient's norm is above it on every step): each member adds its shards' squares
    and 1/degree of its whole tensors', so the norm, and the run, are one process's with clip_grad_norm_."""
    clip = 0.05
    schedule, roles = PLANS["two stages of two"]
    results = run_ranks(tp_rank_main, len(roles), tmp_path, roles, schedule, range(STEPS), None, clip)
    _, ref_model, _ = one_process(OPTIONS, GLOBAL_BATCH, STEPS, SEED, LR, clip)
    model, _ = results[0]["whole"]
    for k, t in ref_model.items():
        assert float((model[k] - t).abs().max()) <= 1e-5, k


@pytest.mark.parametrize("first, then", [("two stages of two", "two replicas of two"), ("two replicas of two", None)])
def test_a_run_resumes_on_another_split_or_none(first: str, then: str | None, expected, tmp_path) -> None:
    """Two steps on one plan, their gathered whole state, then the last two on another: a tensor-parallel
    plan split otherwise (the shards and their Adam moments cut from the whole state), or the data-parallel
    format of one process; the end is the one-process run's (1e-5)."""
    schedule, roles = PLANS[first]
    half = STEPS // 2
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    whole = run_ranks(tp_rank_main, len(roles), tmp_path / "a", roles, schedule, range(half))[0]["whole"]
    if then is None:  # one process, as the data-parallel format loads anywhere
        _, model, _ = one_process(OPTIONS, GLOBAL_BATCH, STEPS, SEED, LR, resume=(half, *whole))
    else:
        schedule, roles = PLANS[then]
        results = run_ranks(tp_rank_main, len(roles), tmp_path / "b", roles, schedule, range(half, STEPS), whole)
        model = results[0]["whole"][0]
    for k, t in expected[1].items():
        assert float((model[k] - t).abs().max()) <= 1e-5, k


def test_members_and_sub_pipelines_follow_tp_rank_and_stage() -> None:
    assert tensor_members(TWO_BY_TWO) == {(0, 0): [2, 1], (0, 1): [3, 0]}
    assert sub_pipelines(TWO_BY_TWO) == {(0, 0): [2, 3], (0, 1): [1, 0]}
    _, replicas = PLANS["two replicas of two"]
    assert tensor_members(replicas) == {(0, 0): [2, 0], (1, 0): [1, 3]}
    assert sub_pipelines(replicas) == {(0, 0): [2], (0, 1): [0], (1, 0): [1], (1, 1): [3]}


def test_a_part_is_summed_over_the_members_holding_it() -> None:
    """Member k of each pipeline's stage holds the same part of a layer: one set per tp_rank."""
    assert layer_holders(TWO_BY_TWO, 4) == [(1, 2), (1, 2), (0, 3), (0, 3)]
    assert part_holders(TWO_BY_TWO, 4) == [[(2,), (1,)], [(2,), (1,)], [(3,), (0,)], [(3,), (0,)]]
    _, replicas = PLANS["two replicas of two"]
    assert part_holders(replicas, 4) == [[(1, 2), (0, 3)]] * 4


def one_line_error(fn, *args) -> str:
    with pytest.raises(ValueError) as err:
        fn(*args)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_pipelines_splitting_a_layer_differently_are_refused_in_one_line() -> None:
    """A layer's parts must have the same shapes in every pipeline holding it: a whole-model replica beside a
    tensor-parallel pipeline, or two replicas split differently, are refused before any group exists."""
    assert "layer 0" in one_line_error(part_holders, MIXED, 4)
    workload = build_workload("gpt", OPTIONS)
    one_line_error(gradient_buckets, list(workload.layered.layers(workload.model)), MIXED, 0)
    _, replicas = PLANS["two replicas of two"]
    uneven = [r if r.pipeline == 0 else member(1, 0, None, 4, 2, 8, (1.0, 1.0), r.tp_rank) for r in replicas]
    assert "tp_weights" in one_line_error(part_holders, uneven, 4)


def test_stages_of_different_degrees_exchange_across_each_boundary_by_member_modulo_degree() -> None:
    """No sub-pipelines where degrees differ; member j of a later stage takes the activation from member j mod d
    of the earlier, member k of the earlier the gradient from member k mod d' of the later; a pipeline whose
    stages share a degree keeps torch's schedules (no boundary)."""
    assert sub_pipelines(TWO_THEN_ONE) == {}
    assert boundary(TWO_THEN_ONE, 2) == Boundary(0, 2, None, (0,), 0, ())
    assert boundary(TWO_THEN_ONE, 1) == Boundary(0, 2, None, (), 0, ())
    assert boundary(TWO_THEN_ONE, 0) == Boundary(1, 2, 2, (), None, (2, 1))
    _, twice = PLANS["a stage of two, then one, twice"]
    # Pipeline 0's ranks 3, 4, 5 are pipeline 1's 0, 1, 2 shifted: each pipeline its own boundaries.
    assert boundary(twice, 3) == Boundary(1, 2, 5, (), None, (5, 4))
    _, roles = PLANS["one, three, one, 1f1b"]
    # Stage 2 on rank 0, stage 0 on 1, stage 1's members 0, 1, 2 on 2, 3, 4.
    assert boundary(roles, 1) == Boundary(0, 3, None, (2, 3, 4), 2, ())
    assert boundary(roles, 3) == Boundary(1, 3, 1, (), 0, ())
    assert boundary(roles, 2) == Boundary(1, 3, 1, (0,), 0, (1,))
    assert boundary(roles, 0) == Boundary(2, 3, 2, (), None, (2, 3, 4))
    assert boundary(TWO_BY_TWO, 0) is None


def test_own_schedule_runs_gpipe_and_1f1b_orders() -> None:
    assert actions("gpipe", 0, 2, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert actions("1f1b", 0, 3, 4) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)]
    assert actions("1f1b", 2, 3, 4) == [a for m in range(4) for a in (("F", m), ("B", m))]
    assert actions("1f1b", 0, 4, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


def test_inconsistent_tensor_parallel_stages_are_refused_in_one_line() -> None:
    rank_twice = [TWO_BY_TWO[1], member(0, 0, (0, 2), 12, 3, 0, (5.0, 3.0), 1)]
    assert "tp_rank" in one_line_error(tensor_members, rank_twice)
    weights_differ = [TWO_BY_TWO[1], member(0, 0, (0, 2), 12, 3, 0, (1.0, 1.0), 0)]
    assert "disagree" in one_line_error(tensor_members, weights_differ)


def test_an_emulated_member_holds_its_all_reduces_to_the_link_on_top_of_its_padded_compute() -> None:
    """Each all-reduce of a tensor-parallel member lasts the ring's bytes ÷ bandwidth + 2(d − 1) latencies
    (× dilation), the planner's price; on a padded device that time comes on top of the modelled compute of
    the micro-batch it falls in."""
    from hetero_ray.cluster.catalog import load_catalog
    from hetero_ray.cluster.emulated_device import EmulatedDevice, PaddedModule
    from hetero_ray.plan.cost import link_seconds, ring_allreduce_bytes

    emu = EmulatedDevice(
        spec=load_catalog().get("V100-16GB"), precision="fp32", flops_per_sample=3e9, efficiency=0.5, dilation=200.0
    )
    bandwidth, latency = 2e8, 1e-4
    hold = emu.all_reduce_hook((bandwidth, latency), 2)
    reduced = torch.zeros(16, 256)  # 16 KiB: a ring of 2 sends it once
    seconds = 200.0 * link_seconds(ring_allreduce_bytes(16 * 256 * 4, 2), 2, bandwidth, latency)
    assert 0.05 < seconds < 0.5

    class Reducing(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hold(reduced, time.perf_counter())
            return x * 2

    padded = PaddedModule(torch.nn.Sequential(Reducing()), emu, 2)
    modelled = emu.modelled_seconds(2) / 3
    t0 = time.perf_counter()
    padded(torch.ones(2, 4, requires_grad=True))
    took = time.perf_counter() - t0
    assert emu.all_reduce_s == pytest.approx(seconds)
    assert took >= modelled + seconds
    assert padded.busy_s == pytest.approx(modelled + seconds)
