"""ZeRO stages 1 to 3 with uneven shards (``train/zero.py`` under ``train/sync.py::TorchAdam``) on gloo ranks
(spawned processes, no Ray), through the training loop's own step: shards sized apart from the batch split
train exactly as one process does, each rank holding optimizer state (stage 2: and gradients; stage 3: and
parameters) for its shard alone, ranks with fewer micro-batches run zero passes to keep the collectives
alike, a checkpoint taken on one ZeRO stage and device set resumes on another, and an fp16 rank's gradients
are unscaled as they leave during the backward."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from ranks import poisonable, run_ranks, worker_role
from torch import nn

from hetero_ray.config import ConfigError, parse_config
from hetero_ray.plan.cost import ring_allreduce_bytes
from hetero_ray.plan.plan import WorkerRole
from hetero_ray.train.data import GlobalBatches, collate
from hetero_ray.train.loop import equal_passes, local_backward
from hetero_ray.train.sync import TorchAdam
from hetero_ray.train.zero import Shards, layer_units
from hetero_ray.workloads import build_workload

OPTIONS = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "corpus_bytes": 50_000}
GLOBAL_BATCH, SEED, STEPS = 12, 11, 6


def config() -> object:
    # Small buckets: the model's parameters spread over several chunks, so shards cut across chunks and tensors.
    return parse_config(
        {
            "devices": {"A100-80GB": 1},
            "train": {"global_batch": GLOBAL_BATCH, "lr": 1e-3, "seed": SEED, "bucket_mb": 0.02},
        }
    )


def held(sync: TorchAdam) -> dict:
    """Elements this rank holds between steps: optimizer moments (per moment), summed gradients, parameters."""
    moments = sum(s.numel() for st in sync.optimizer.state.values() for k, s in st.items() if k.startswith("exp_avg"))
    chunks = sync.grads.chunks
    gradients = sum(g.numel() for g, _ in sync.grads.summed())
    # Under stage 2 and 3, gradient left on the rank besides its slices: chunks' storage, parameters' ``.grad``.
    loose = sum(c.flat.untyped_storage().nbytes() // 4 for c in chunks) + sum(p.grad is not None for p in sync.params)
    whole = sum(f.untyped_storage().nbytes() // 4 for f in sync.sharded.flats) if sync.sharded else 0
    slices = sum(p.numel() for p in sync.sharded.params) if sync.sharded else 0
    return {
        "moments": moments // 2,
        "gradients": gradients,
        "loose_gradients": loose if sync.zero_stage >= 2 else 0,
        "parameters": slices if sync.zero_stage == 3 else whole,
        "whole_parameters": whole,
    }


def whole(sync: TorchAdam, model: nn.Module) -> tuple[dict, dict | None]:
    """The whole model state, and on rank 0 the whole optimizer state (``None`` elsewhere), gathered as the loop
    checkpoints them; every rank must call it."""
    optimizer_state = sync.state_dict()
    return sync.model_state(model), optimizer_state


def train_ranks(
    rank: int,
    world: int,
    roles: list[WorkerRole],
    zero_stage: int,
    weights: list[float],
    steps: range,
    resume,
    checkpoint_after: int | None = None,
) -> dict:
    """``steps`` of the loop's data-parallel step with ZeRO ``zero_stage`` and shards by ``weights``, from
    ``resume`` (a file holding a whole (model, optimizer) state, as a checkpoint does) if given; on rank 0 the
    whole state at the end, and after step ``checkpoint_after`` if given; each rank's model and holdings."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    workload = build_workload("gpt", OPTIONS)
    cpu = torch.device("cpu")
    if resume is not None:
        # Each rank reads its own copy, as from a checkpoint: tensors handed to spawned processes are shared.
        model_state, optimizer_state = torch.load(resume)
        workload.model.load_state_dict(model_state)  # before the sharding, as the loop loads it
    layers = list(workload.layered.layers(workload.model))
    sync = TorchAdam(workload.model, config(), cpu, "fp32", shard_weights=weights, zero_stage=zero_stage, layers=layers)
    if resume is not None:
        sync.load_state_dict(optimizer_state)
    batches = GlobalBatches(len(workload.dataset), GLOBAL_BATCH, SEED)
    for step in steps:
        loss_sum, _ = local_backward(
            workload.model,
            workload,
            batches.indices(step),
            roles[rank],
            GLOBAL_BATCH,
            cpu,
            None,
            sync,
            "fp32",
            passes=equal_passes(roles, zero_stage),
        )
        synced = sync.step(loss_sum, False)
        if step == checkpoint_after:
            checkpoint = whole(sync, workload.model)
    holding = held(sync)
    end = whole(sync, workload.model)
    return {
        "whole": end if rank == 0 else None,
        "checkpoint": checkpoint if checkpoint_after is not None and rank == 0 else None,
        "model": end[0],
        "bytes_sent": synced.bytes_sent,
        **holding,
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


# 2 : 1 batch split; rank 0 in three micro-batches (3, 3, 2), rank 1 in one: two zero passes under stage 2 and 3.
TWO_TO_ONE = [worker_role(8, 0, micro=3), worker_role(4, 8)]


def test_shards_by_weight_tile_the_parameters():
    shards = Shards.by_weight(10, [1, 3, 1])
    assert shards.bounds == (0, 2, 8, 10)
    assert shards.pieces(0, 4) == [(0, 0, 2), (1, 2, 4)]
    assert shards.pieces(4, 6) == [(1, 0, 4), (2, 4, 6)]
    # Owners named by global rank: a pipeline stage's replicas, its first pipeline's rank first.
    named = Shards.by_weight(10, [1, 3, 1], ranks=[5, 1, 3])
    assert named.pieces(4, 6) == [(1, 0, 4), (3, 4, 6)]
    with pytest.raises(ValueError, match="one weight per rank"):
        Shards.by_weight(10, [1, 1], ranks=[0, 1, 2])


# A checkpoint taken at each stage resumes at another, on three ranks.
RESUME_AT = {1: 3, 2: 0, 3: 2}


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_uneven_shards_train_as_one_process_hold_only_their_shard_and_resume_elsewhere(tmp_path, zero_stage):
    """A 2 : 1 batch split in 3 and 1 micro-batches with shards 1 : 3 (the slower rank has the memory):
    parameters, moments and steps within 1e-5 of one process; each rank holds AdamW moments for its quarter or
    three quarters only, at stage 2 also the summed gradient (nothing else of it between steps), at stage 3
    also the parameters (none whole between steps). The checkpoint taken after three steps resumes for the
    other three on three ranks at another stage (shards 1 : 1 : 2, rank 2 in two micro-batches where the
    others take one) and ends where one process ends (1e-5)."""
    out = run_ranks(train_ranks, 2, tmp_path, TWO_TO_ONE, zero_stage, [1.0, 3.0], range(STEPS), None, 2)
    model_state, optimizer_state = out[0]["whole"]
    want_model, want_optimizer = one_process(STEPS)
    assert max_diff(model_state, want_model) <= 1e-5
    assert max_diff(out[0]["model"], out[1]["model"]) == 0.0
    total = sum(p.numel() for p in want_model.values())
    shard = [round(total / 4), total - round(total / 4)]
    assert [r["moments"] for r in out] == shard
    assert [r["gradients"] for r in out] == (shard if zero_stage >= 2 else [total] * 2)
    assert [r["loose_gradients"] for r in out] == [0, 0]
    assert [r["parameters"] for r in out] == (shard if zero_stage == 3 else [total] * 2)
    assert [r["whole_parameters"] for r in out] == ([0, 0] if zero_stage == 3 else [total] * 2)
    # A step's traffic as the planner prices it, in ring all-reduces of the model (rank 0 runs 3 passes): stage 1
    # one and an all-gather; stage 2 a reduce-scatter per pass and an all-gather; stage 3 per pass two gathers
    # and a reduce-scatter. Plus the step's vote.
    model_rings = {1: 1.5, 2: 3 * 0.5 + 0.5, 3: 3 * 1.5}[zero_stage]
    want_bytes = model_rings * ring_allreduce_bytes(4 * total, 2) + ring_allreduce_bytes(4 * 4, 2)
    assert [r["bytes_sent"] for r in out] == [pytest.approx(want_bytes)] * 2
    for i, want in want_optimizer["state"].items():
        got = optimizer_state["state"][i]
        assert float(got["step"]) == float(want["step"]) == STEPS
        assert (
            max_diff({k: got[k] for k in ("exp_avg", "exp_avg_sq")}, {k: want[k] for k in ("exp_avg", "exp_avg_sq")})
            <= 1e-5
        )
    torch.save(out[0]["checkpoint"], tmp_path / "half")
    three = [worker_role(6, 0), worker_role(4, 6), worker_role(2, 10, micro=1)]
    resumed = run_ranks(
        train_ranks, 3, tmp_path, three, RESUME_AT[zero_stage], [1.0, 1.0, 2.0], range(3, STEPS), tmp_path / "half"
    )
    assert max_diff(resumed[0]["whole"][0], want_model) <= 1e-5


def whole_layers_ranks(rank: int, world: int) -> dict:
    """Stage 3 on ``world`` ranks, one step: at the start of each layer's forward and backward, which layers
    have their parameters whole (gathered, or on their way)."""
    dist.init_process_group("gloo")
    torch.manual_seed(SEED)
    workload = build_workload("gpt", OPTIONS)
    layers = list(workload.layered.layers(workload.model))
    sync = TorchAdam(
        workload.model, config(), torch.device("cpu"), "fp32", shard_weights=[1.0] * world, zero_stage=3, layers=layers
    )

    def whole() -> list[int]:
        return [k for k, layer in enumerate(layers) if all(p.untyped_storage().nbytes() for p in layer.parameters())]

    seen: dict[str, list] = {"forward": [], "backward": []}
    for k, layer in enumerate(layers):
        # Registered after the engine's hooks, so these run after its gathers.
        layer.register_forward_pre_hook(lambda _m, _a, k=k: seen["forward"].append((k, whole())))

        def on_output(_m, _a, output, k=k):
            output.register_hook(lambda _g: seen["backward"].append((k, whole())))

        layer.register_forward_hook(on_output)
    batch = collate(workload.dataset, list(range(4)))
    sync.arm()
    sync.backward(workload.loss_fn(workload.model, batch))
    sync.step(0.0, False)
    after = whole()
    # A checkpoint's copy of the model: never more than one chunk whole on the device.
    held, gather = [], sync.sharded.gather
    resident = lambda: sum(f.untyped_storage().nbytes() > 0 for f in sync.sharded.flats)  # noqa: E731
    sync.sharded.gather = lambda chunks, **kw: (gather(chunks, **kw), held.append(resident()))
    state = sync.model_state(workload.model)
    after_copy = whole()
    sync.sharded.gather = gather
    gather(range(len(sync.sharded.flats)))
    same = all(torch.equal(state[k], v) for k, v in workload.model.state_dict().items())
    return {**seen, "after": after, "checkpoint_holds": max(held), "checkpoint_after": after_copy, "same": same}


def test_zero_3_sends_the_next_layers_gather_ahead_and_holds_two_layers_at_most(tmp_path):
    """FSDP's prefetch: as a layer starts its forward (its backward), the next layer's (the previous layer's)
    parameters are already on their way, so the gather travels while the layer computes; no more than those two
    layers are whole at once, as the planner budgets, and none after the step. A checkpoint's copy gathers one
    chunk at a time and equals the whole model."""
    for out in run_ranks(whole_layers_ranks, 2, tmp_path):
        n = len(out["forward"])
        assert out["forward"] == [(k, [k, k + 1] if k + 1 < n else [k]) for k in range(n)]
        # The backward of layer k starts once the gradient of its output arrives; layer k + 1's gradients may
        # still be on the wire then (its parameters freed chunk by chunk as they leave).
        for k, held in out["backward"]:
            assert {k, k - 1} & set(range(n)) <= set(held) <= {k + 1, k, k - 1}, (k, held)
        assert [k for k, _ in out["backward"]] == list(reversed(range(n)))
        assert out["after"] == []
        assert out["checkpoint_holds"] == 1 and out["checkpoint_after"] == [] and out["same"]


def test_zero_3_refuses_models_it_cannot_gather_layer_by_layer():
    """Stage 3 needs layers, each parameter in one of them; stage 2 takes what it gets."""
    torch.manual_seed(SEED)
    model = build_workload("gpt", OPTIONS).model
    with pytest.raises(ConfigError, match=r"zero_stage: 3 gathers .* this workload has no layers"):
        layer_units(model, None, 3)
    assert layer_units(model, None, 2) is None
    tied = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    tied[1].weight = tied[0].weight
    with pytest.raises(ConfigError, match=r"parameter 0\.weight sits in layers 0 and 1 \(tied weights\)"):
        layer_units(tied, list(tied), 3)
    with pytest.raises(ConfigError, match=r"parameter 1\.bias is in none of the workload's layers"):
        layer_units(tied, [tied[0]], 3)
    assert [len(u) for u in layer_units(tied, [tied[0]], 2)] == [2, 1]


def fp16_ranks(rank: int, world: int, roles: list[WorkerRole], steps: int, poison_step: int) -> dict:
    """``steps`` ZeRO-3 steps, each rank in its role's precision; at ``poison_step`` rank 1's loss is multiplied
    by inf, as an overflow would make it. Per step: whether the model changed, rank's scale; this rank's part of
    the first summed gradient's squared norm; the model at the end."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    workload = build_workload("gpt", OPTIONS)
    poisoned = poisonable(workload)
    mine, cpu = roles[rank], torch.device("cpu")
    layers = list(workload.layered.layers(workload.model))
    sync = TorchAdam(
        workload.model, config(), cpu, mine.precision, shard_weights=[1.0, 3.0], zero_stage=3, layers=layers
    )
    squares: list[float] = []
    sync.optimizer.register_step_pre_hook(
        lambda *_: squares.append(sum(float(p.grad.double().square().sum()) for p in sync.sharded.params))
    )
    batches = GlobalBatches(len(workload.dataset), GLOBAL_BATCH, SEED)
    out: dict = {"updated": [], "scale": []}
    model = whole(sync, workload.model)[0]
    for step in range(steps):
        poisoned[0] = step == poison_step and rank == 1
        loss_sum, _ = local_backward(
            workload.model,
            workload,
            batches.indices(step),
            mine,
            GLOBAL_BATCH,
            cpu,
            None,
            sync,
            mine.precision,
            passes=equal_passes(roles, 3),
        )
        sync.step(loss_sum, False)
        before, model = model, whole(sync, workload.model)[0]
        out["updated"].append(max_diff(before, model) > 0)
        out["scale"].append(sync.scaler.get_scale() if sync.scaler else None)
    return {**out, "first_squares": squares[0], "model": model}


def test_zero_3_unscales_an_fp16_ranks_gradients_as_they_leave_and_skips_non_finite_steps(tmp_path):
    """An fp32 rank and an fp16 rank under a loss scaler (in two micro-batches) at ZeRO-3: the first summed
    gradient is the fp32 one within half-precision roundings (its norm; an unscaled 2^16 would show), an inf in
    the fp16 rank's step 1 skips it on both ranks and halves that rank's scale, step 2 updates again, and both
    ranks end on the same model."""
    roles = [worker_role(8, 0), worker_role(4, 8, micro=2, precision="fp16")]
    out = run_ranks(fp16_ranks, 2, tmp_path, roles, 3, 1)
    assert [r["updated"] for r in out] == [[True, False, True]] * 2
    assert out[0]["scale"] == [None] * 3 and out[1]["scale"] == [2.0**16, 2.0**15, 2.0**15]
    assert max_diff(out[0]["model"], out[1]["model"]) == 0.0
    torch.manual_seed(SEED)
    workload = build_workload("gpt", OPTIONS)
    batch = collate(workload.dataset, GlobalBatches(len(workload.dataset), GLOBAL_BATCH, SEED).indices(0))
    workload.loss_fn(workload.model, batch).backward()
    want = math.sqrt(sum(float(p.grad.double().square().sum()) for p in workload.model.parameters()))
    assert math.sqrt(sum(r["first_squares"] for r in out)) == pytest.approx(want, rel=2**-6)
