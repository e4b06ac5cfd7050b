"""ZeRO stage 1 with uneven shards (``train/zero.py`` under ``train/sync.py::TorchAdam``) on gloo ranks
(spawned processes, no Ray), through the training loop's own step: shards sized apart from the batch split
train exactly as one process does, each rank holding AdamW state for its shard alone, and a checkpoint taken
on one ZeRO stage and device set resumes on another."""

from __future__ import annotations

import torch
import torch.distributed as dist
from ranks import run_ranks, worker_role

from hetero_ray.config import parse_config
from hetero_ray.plan.plan import WorkerRole
from hetero_ray.train.data import GlobalBatches, collate
from hetero_ray.train.loop import local_backward
from hetero_ray.train.sync import TorchAdam
from hetero_ray.train.zero import Shards
from hetero_ray.workloads import build_workload

OPTIONS = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "corpus_bytes": 50_000}
GLOBAL_BATCH, SEED, STEPS = 12, 11, 6


def config(zero_stage: int) -> object:
    # Small buckets: the model's parameters spread over several chunks, so shards cut across chunks and tensors.
    return parse_config(
        {
            "devices": {"A100-80GB": 1},
            "optimizer": {"zero_stage": zero_stage},
            "train": {"global_batch": GLOBAL_BATCH, "lr": 1e-3, "seed": SEED, "bucket_mb": 0.02},
        }
    )


def train_ranks(
    rank: int, world: int, roles: list[WorkerRole], zero_stage: int, weights: list[float], steps: range, resume
) -> dict:
    """``steps`` of the loop's data-parallel step with ZeRO ``zero_stage`` and shards by ``weights``, from
    ``resume`` (a file holding a whole (model, optimizer) state, as a checkpoint does) if given; the whole
    state at the end, on rank 0."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    workload = build_workload("gpt", OPTIONS)
    cpu = torch.device("cpu")
    sync = TorchAdam(workload.model, config(zero_stage), cpu, "fp32", shard_weights=weights)
    if resume is not None:
        # Each rank reads its own copy, as from a checkpoint: tensors handed to spawned processes are shared.
        model_state, optimizer_state = torch.load(resume)
        workload.model.load_state_dict(model_state)
        sync.load_state_dict(optimizer_state)
    batches = GlobalBatches(len(workload.dataset), GLOBAL_BATCH, SEED)
    for step in steps:
        loss_sum, _ = local_backward(
            workload.model, workload, batches.indices(step), roles[rank], GLOBAL_BATCH, cpu, None, sync, "fp32"
        )
        sync.step(loss_sum, False)
    optimizer_state = sync.state_dict()
    held = sum(s.numel() for st in sync.optimizer.state.values() for k, s in st.items() if k.startswith("exp_avg"))
    return {
        "whole": ({k: v.clone() for k, v in workload.model.state_dict().items()}, optimizer_state)
        if rank == 0
        else None,
        "state_elements": held // 2,
        "params": [p.detach().clone() for p in workload.model.parameters()],
    }


def one_process(steps: int) -> tuple[dict, dict]:
    """The whole batch in one process under full-batch AdamW: (model state, AdamW state dict)."""
    torch.manual_seed(SEED)
    workload = build_workload("gpt", OPTIONS)
    model = workload.model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    batches = GlobalBatches(len(workload.dataset), GLOBAL_BATCH, SEED)
    for step in range(steps):
        workload.loss_fn(model, collate(workload.dataset, batches.indices(step))).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict(), opt.state_dict()


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


TWO_TO_ONE = [worker_role(8, 0), worker_role(4, 8)]


def test_shards_by_weight_tile_the_parameters():
    shards = Shards.by_weight(10, [1, 3, 1])
    assert shards.bounds == (0, 2, 8, 10)
    assert shards.piece(1, 0, 4) == (2, 4) and shards.piece(1, 4, 6) == (0, 4) and shards.piece(0, 4, 6) is None


def test_uneven_shards_train_as_one_process_and_hold_only_their_state(tmp_path):
    """A 2 : 1 batch split with shards 1 : 3 (the slower rank has the memory): parameters, moments and steps
    within 1e-5 of one process; each rank holds AdamW moments for its quarter or three quarters only."""
    out = run_ranks(train_ranks, 2, tmp_path, TWO_TO_ONE, 1, [1.0, 3.0], range(STEPS), None)
    model_state, optimizer_state = out[0]["whole"]
    want_model, want_optimizer = one_process(STEPS)
    assert max_diff(model_state, want_model) <= 1e-5
    assert all(torch.equal(a, b) for a, b in zip(out[0]["params"], out[1]["params"]))
    total = sum(p.numel() for p in want_model.values())
    assert [r["state_elements"] for r in out] == [round(total / 4), total - round(total / 4)]
    for i, want in want_optimizer["state"].items():
        got = optimizer_state["state"][i]
        assert float(got["step"]) == float(want["step"]) == STEPS
        assert (
            max_diff({k: got[k] for k in ("exp_avg", "exp_avg_sq")}, {k: want[k] for k in ("exp_avg", "exp_avg_sq")})
            <= 1e-5
        )


def test_a_checkpoint_resumes_on_another_zero_stage_and_device_set(tmp_path):
    """Three steps on two ranks with ZeRO-1 (shards 3 : 1), resumed for three more on three ranks without ZeRO;
    three without ZeRO on two ranks, resumed with ZeRO-1 on three (shards 1 : 1 : 2): both end where six steps
    of one process end (1e-5)."""
    want_model, _ = one_process(STEPS)
    three = [worker_role(6, 0), worker_role(4, 6), worker_role(2, 10)]
    for first, second in (((1, [3.0, 1.0]), (0, [1.0] * 3)), ((0, [1.0, 1.0]), (1, [1.0, 1.0, 2.0]))):
        torch.save(
            run_ranks(train_ranks, 2, tmp_path, TWO_TO_ONE, *first, range(3), None)[0]["whole"], tmp_path / "half"
        )
        end = run_ranks(train_ranks, 3, tmp_path, three, *second, range(3, STEPS), tmp_path / "half")[0]["whole"]
        assert max_diff(end[0], want_model) <= 1e-5, (first, second)
