"""Mixed precision on gloo ranks (spawned processes, no Ray), through the training loop's own step
(``loop.local_backward`` + ``sync.TorchAdam``): ranks in bf16, fp16 with a loss scaler and fp32 train one
model; a non-finite gradient on one rank skips the step everywhere and lowers that rank's scale; a bf16 split
computes the gradient one bf16 process computes, within bf16's rounding."""

from __future__ import annotations

import torch
import torch.distributed as dist
from ranks import poisonable, run_ranks, worker_role

from hetero_ray.config import parse_config
from hetero_ray.plan.plan import WorkerRole
from hetero_ray.train.data import GlobalBatches, collate
from hetero_ray.train.loop import local_backward
from hetero_ray.train.precision import autocast, compute_precision
from hetero_ray.train.prepare import prepare
from hetero_ray.train.sync import TorchAdam
from hetero_ray.workloads import build_workload

OPTIONS = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "corpus_bytes": 50_000}
GLOBAL_BATCH, SEED = 12, 5
CONFIG = {"devices": {"A100-80GB": 1}, "train": {"global_batch": GLOBAL_BATCH, "lr": 1e-3, "seed": SEED}}


def train_ranks(rank: int, world: int, roles: list[WorkerRole], steps: int, poison_step: int | None) -> dict:
    """``steps`` steps of the loop's data-parallel step on this rank, in its role's precision; at
    ``poison_step`` rank 1's loss is multiplied by inf, as an overflow would make it."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    workload = build_workload("gpt", OPTIONS)
    poisoned = poisonable(workload)
    mine = roles[rank]
    cpu = torch.device("cpu")
    sync = TorchAdam(workload.model, parse_config(CONFIG), cpu, mine.precision)
    dtypes: set[torch.dtype] = set()
    workload.model.blocks[0].mlp[0].register_forward_hook(lambda m, i, out: dtypes.add(out.dtype))
    grads: list[list[torch.Tensor]] = []
    # The summed gradient the optimizer applies, read just before it does.
    sync.optimizer.register_step_pre_hook(lambda *_: grads.append([p.grad.clone() for p in sync.params]))
    batches = GlobalBatches(len(workload.dataset), GLOBAL_BATCH, SEED)
    out: dict = {"updated": [], "scale": [], "loss": []}
    for step in range(steps):
        poisoned[0] = step == poison_step and rank == 1
        before = [p.detach().clone() for p in workload.model.parameters()]
        loss_sum, _ = local_backward(
            workload.model, workload, batches.indices(step), mine, GLOBAL_BATCH, cpu, None, sync, mine.precision
        )
        synced = sync.step(loss_sum, False)
        out["loss"].append(synced.loss_total / GLOBAL_BATCH)
        out["updated"].append(any(not torch.equal(a, b) for a, b in zip(before, workload.model.parameters())))
        out["scale"].append(sync.scaler.get_scale() if sync.scaler else None)
    out["dtypes"] = sorted(str(d) for d in dtypes)
    out["params"] = [p.detach().clone() for p in workload.model.parameters()]
    out["first_grads"] = grads[0] if grads else None
    return out


def one_process(precision: str, steps: int) -> dict:
    """The whole batch in one process, in ``precision``, under full-batch AdamW."""
    torch.manual_seed(SEED)
    workload = build_workload("gpt", OPTIONS)
    model = workload.model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    batches = GlobalBatches(len(workload.dataset), GLOBAL_BATCH, SEED)
    first_grads = None
    for step in range(steps):
        with autocast(precision, torch.device("cpu")):
            loss = workload.loss_fn(model, collate(workload.dataset, batches.indices(step)))
        loss.backward()
        first_grads = first_grads or [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
    return {"params": [p.detach().clone() for p in model.parameters()], "first_grads": first_grads}


# bf16 keeps 8 significant bits: each matmul output is rounded to a relative u = 2^-9. A split rounds other
# partial sums (each rank's weight gradient over its own samples) before the fp32 all-reduce adds them, so an
# entry may differ by a few such roundings of the largest term it sums: allowed, 8u of its tensor's largest
# entry (measured: a 2 : 1 bf16 split 0.0047, one bf16 process against fp32 0.0053, the mixed ranks 0.0030).
TOLERANCE = 2**-6


def relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The largest difference of each tensor pair over the largest entry of ``want``'s tensor."""
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want))


MIXED = [
    worker_role(6, 0, precision="bf16"),
    worker_role(4, 6, micro=2, precision="fp16"),
    worker_role(2, 10, micro=2, precision="fp32"),
]


def test_bf16_fp16_and_fp32_ranks_train_one_model(tmp_path):
    """Each rank computes in its own precision (the first MLP's output dtype), the fp16 rank under a loss
    scaler, and all apply the same update: identical parameters; the summed gradient is fp32's within TOLERANCE."""
    out = run_ranks(train_ranks, 3, tmp_path, MIXED, 4, None)
    assert [r["dtypes"] for r in out] == [["torch.bfloat16"], ["torch.float16"], ["torch.float32"]]
    assert [r["scale"][0] for r in out] == [None, 2.0**16, None]
    assert all(all(r["updated"]) for r in out)
    for other in out[1:]:
        assert all(torch.equal(a, b) for a, b in zip(out[0]["params"], other["params"]))
    # The gradient the three apply: the fp32 one within a few half-precision roundings (see the bf16 test).
    fp32 = one_process("fp32", 1)["first_grads"]
    assert relative_error(out[0]["first_grads"], fp32) <= TOLERANCE


def test_a_non_finite_gradient_skips_the_step_everywhere_and_lowers_that_ranks_scale(tmp_path):
    """An inf in the fp16 rank's step 1: no rank updates, the fp16 rank's scale halves (GradScaler's backoff),
    and step 2 updates again on every rank."""
    out = run_ranks(train_ranks, 3, tmp_path, MIXED, 3, 1)
    assert [r["updated"] for r in out] == [[True, False, True]] * 3
    scale = out[1]["scale"]
    assert scale[1] == scale[0] / 2 and scale[2] == scale[1]
    for other in out[1:]:
        assert all(torch.equal(a, b) for a, b in zip(out[0]["params"], other["params"]))


def test_a_bf16_split_sums_the_gradient_one_bf16_process_computes(tmp_path):
    """Two bf16 ranks at 2 : 1 against one bf16 process on the whole batch: the first step's summed gradient,
    within TOLERANCE; one bf16 process is itself that far from fp32 (and an fp32 split is within 1e-5 of one
    fp32 process: test_buckets, test_training)."""
    split = run_ranks(
        train_ranks,
        2,
        tmp_path,
        [worker_role(8, 0, precision="bf16"), worker_role(4, 8, precision="bf16")],
        1,
        None,
    )
    bf16, fp32 = one_process("bf16", 1)["first_grads"], one_process("fp32", 1)["first_grads"]
    assert relative_error(split[0]["first_grads"], bf16) <= TOLERANCE
    assert relative_error(bf16, fp32) <= TOLERANCE


def test_emulated_devices_compute_in_fp32_unless_emulation_autocast():
    """A CPU stands in for a GPU in fp32 by default (its half precision is slower, not faster); a GPU and
    ``emulation.autocast`` keep the plan's precision."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert compute_precision("bf16", cpu, cpu_autocast=False) == "fp32"
    assert compute_precision("fp16", cpu, cpu_autocast=True) == "fp16"
    assert compute_precision("bf16", gpu, cpu_autocast=False) == "bf16"
    assert parse_config({"devices": {"A100-80GB": 1}, "emulation": {"autocast": True}}).emulation.autocast


def test_precision_per_gpu_type_reaches_the_plan():
    """``train.precision: {A100-80GB: fp32, V100-16GB: fp16}``: the planner gives each type the precision named
    (auto would give the A100 bf16), and prices it: the V100's share grows with fp16's FLOP/s."""
    base = {
        "devices": {"A100-80GB": 1, "V100-16GB": 1},
        "workload": {"options": {"n_layer": 1, "corpus_bytes": 50_000}},
        "train": {"global_batch": 16},
    }
    chosen = {}
    for name, precision in (("auto", "auto"), ("per-type", {"A100-80GB": "fp32", "V100-16GB": "fp16"})):
        plan = prepare(parse_config({**base, "train": {**base["train"], "precision": precision}})).plan
        chosen[name] = {r.gpu_type: (r.precision, r.local_batch) for r in plan.roles}
    assert chosen["auto"]["A100-80GB"][0] == "bf16" and chosen["auto"]["V100-16GB"][0] == "fp16"
    assert chosen["per-type"]["A100-80GB"][0] == "fp32" and chosen["per-type"]["V100-16GB"][0] == "fp16"
    assert chosen["per-type"]["V100-16GB"][1] > chosen["auto"]["V100-16GB"][1]
