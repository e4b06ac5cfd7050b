"""ZeRO-1 inside pipelines, on gloo ranks (spawned processes, no Ray): Adam's state of each stage sharded over
that stage's replicas (the pipelines cut alike), the same training as one process, each rank holding its
shard's moments alone, and a whole checkpoint that resumes on another plan or on one process.

The GPT's four layers (embedding, two blocks, head): two 2-stage pipelines cut alike beside a third cut
otherwise, as the placement search makes them (one kind replicated twice beside another kind), so a layer's
gradient is summed over all three pipelines while its Adam state is sharded over its kind's replicas.
"""

from __future__ import annotations

import pytest
from ranks import one_process, run_pipelined, run_ranks, worker_role

from hetero_ray.config import parse_config

OPTIONS = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "corpus_bytes": 50_000}
GLOBAL_BATCH, STEPS, SEED, LR = 12, 4, 5, 1e-3
# Small buckets: a stage's parameters spread over several chunks, so shards cut across chunks and tensors.
CONFIG = {
    "devices": {"A100-80GB": 1},
    "train": {"global_batch": GLOBAL_BATCH, "lr": LR, "seed": SEED, "bucket_mb": 0.01},
}


def stage(pipeline: int, stage: int, layers, local: int, micro: int, offset: int):
    return worker_role(local, offset, micro=micro, pipeline=pipeline, stage=stage, layers=layers)


# Ranks out of pipeline order, so a stage's replicas (in pipeline order) are not ascending ranks.
TWO_KINDS = [
    stage(1, 0, (0, 2), 4, 2, 4),
    stage(0, 0, (0, 2), 4, 2, 0),
    stage(2, 0, (0, 1), 4, 2, 8),
    stage(0, 1, (2, 4), 4, 2, 0),
    stage(1, 1, (2, 4), 4, 2, 4),
    stage(2, 1, (1, 4), 4, 2, 8),
]
# Resumed on three pipelines cut alike at another split of the batch: one kind, two shard groups of three.
THREE_ALIKE = [
    stage(p, s, (2 * s, 2 * s + 2), n, 1, o) for p, n, o in ((0, 6, 0), (1, 4, 6), (2, 2, 10)) for s in (0, 1)
]


def zero_rank_main(rank: int, world: int, roles, zero_stage: int, steps=range(STEPS), resume=None) -> dict:
    """``steps`` of ``roles``' pipelined plan at ``zero_stage`` (``run_pipelined``) from ``resume`` (a gathered
    whole (model, optimizer) state); the losses, the whole state gathered as a checkpoint is, this rank's Adam
    moments (elements of one moment), its stage's parameters and its shard group."""
    run = run_pipelined(rank, roles, parse_config(CONFIG), OPTIONS, "1f1b", steps, resume, zero_stage)
    return {
        "losses": run.losses,
        "whole": run.whole,
        "moments": sum(s["exp_avg"].numel() for s in run.sync.optimizer.state.values()),
        "stage_params": sum(p.numel() for p in run.stage.module.parameters()),
        "shard_ranks": run.shard_ranks,
    }


@pytest.fixture(scope="module")
def expected():
    """One process, full global batch every step."""
    return one_process(OPTIONS, GLOBAL_BATCH, STEPS, SEED, LR)


def assert_like_one_process(whole, expected, steps: int = STEPS) -> None:
    """The gathered model and AdamW state (both moments, by position) are the one-process run's (fp32)."""
    _, ref_model, ref_optimizer = expected
    model, optimizer = whole
    assert model.keys() == ref_model.keys()
    for k, t in model.items():
        assert float((t - ref_model[k]).abs().max()) <= 1e-5, k
    assert sorted(optimizer["state"]) == sorted(ref_optimizer["state"])
    for i, state in optimizer["state"].items():
        assert int(state["step"]) == steps
        for moment in ("exp_avg", "exp_avg_sq"):
            assert float((state[moment] - ref_optimizer["state"][i][moment]).abs().max()) <= 1e-6, (i, moment)


def test_zero_1_in_pipelines_trains_like_one_process_each_replica_holding_its_shard(expected, tmp_path) -> None:
    roles = TWO_KINDS
    results = run_ranks(zero_rank_main, len(roles), tmp_path, roles, 1)
    for r in results:
        assert r["losses"] == pytest.approx(expected[0], rel=1e-5)
    # Each stage's replicas, first pipeline first; the pipeline cut otherwise is a kind of its own.
    assert [r["shard_ranks"] for r in results] == [[1, 0], [1, 0], [2], [3, 4], [3, 4], [5]]
    for rank in (0, 1, 3, 4):  # two replicas of equal memory: half of the stage's moments each
        assert abs(results[rank]["moments"] - results[rank]["stage_params"] / 2) <= 1
    for rank in (2, 5):
        assert results[rank]["moments"] == results[rank]["stage_params"]
    assert_like_one_process(results[0]["whole"], expected)


@pytest.fixture(scope="module")
def halfway(tmp_path_factory):
    """The whole state gathered after the first half of the steps on the pipelined ZeRO-1 plan."""
    roles = TWO_KINDS
    return run_ranks(zero_rank_main, len(roles), tmp_path_factory.mktemp("half"), roles, 1, range(STEPS // 2))[0][
        "whole"
    ]


def test_zero_1_pipeline_checkpoint_resumes_on_three_pipelines_sharded_in_thirds(halfway, expected, tmp_path):
    """The last half on three pipelines cut alike at another split of the batch, each stage's state in thirds."""
    roles = THREE_ALIKE
    results = run_ranks(zero_rank_main, len(roles), tmp_path, roles, 1, range(STEPS // 2, STEPS), halfway)
    assert [r["shard_ranks"] for r in results] == [[0, 2, 4], [1, 3, 5]] * 3
    assert_like_one_process(results[0]["whole"], expected)


def test_zero_1_pipeline_checkpoint_resumes_in_one_process(halfway, expected) -> None:
    """The gathered state is plain AdamW's, by position: one process loads it and ends where it would have."""
    _, model, _ = one_process(OPTIONS, GLOBAL_BATCH, STEPS, SEED, LR, resume=(STEPS // 2, *halfway))
    for k, t in expected[1].items():
        assert float((model[k] - t).abs().max()) <= 1e-5, k
