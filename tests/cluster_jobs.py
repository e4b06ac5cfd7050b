"""Shared by the tests that submit jobs to an emulated cluster: the standard small job, `ray job` helpers,
and the one-process reference every run on the full global batch must reproduce."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import torch
import yaml

from hetero_ray.cluster.emulation import EmulatedCluster
from hetero_ray.train.data import GlobalBatches, collate
from hetero_ray.workloads import build_workload

REPO = Path(__file__).resolve().parents[1]

STEPS = 20
WORKLOAD = {
    "name": "gpt",
    "options": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32, "corpus_bytes": 200_000},
}


HELD_OUT = 48  # samples the evaluating runs hold out


def run_config(storage: Path, name: str, *, evaluate: bool = False) -> dict:
    """2 fast + 2 slow workers with a 2:1 split, fp32, fixed seed; ``evaluate``: the loss on the dataset's last
    HELD_OUT samples every 10 steps."""
    config = {
        "devices": {"A100-80GB": 2, "V100-16GB": 2},
        # Slow enough (about 0.3 s a step) that a run can be stopped between checkpoints.
        "emulation": {"dilation": 150_000},
        "workload": WORKLOAD,
        "train": {
            "global_batch": 12,
            "steps": STEPS,
            "lr": 1e-3,
            "seed": 7,
            "precision": "fp32",
            "split": {"A100-80GB": 2, "V100-16GB": 1},
            "checkpoint_every": 5,
            "report_every": 5,
            # Gradient norms run 0.79-1.42 over the 20 steps: a clip at 1 acts on some steps and not others.
            "grad_clip": 1.0,
            "lr_schedule": {"name": "cosine", "warmup_steps": 3, "min_lr": 1e-4},
        },
        "run": {"name": name, "storage_path": str(storage)},
    }
    if evaluate:
        config["train"] |= {"eval_every": 10, "eval_samples": HELD_OUT}
    return config


def ray_cli(cluster: EmulatedCluster, *args: str, timeout: float = 60) -> str:
    out = subprocess.run(["ray", *args], env=cluster.env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def submit_command(cluster: EmulatedCluster, command: list[str], env: dict[str, str] | None = None) -> str:
    """`ray job submit --no-wait` of ``command`` (``env``: more environment for the job and its workers); returns
    the submission id."""
    job_id = f"test-{uuid.uuid4().hex[:8]}"
    ray_cli(
        cluster,
        "job",
        "submit",
        "--no-wait",
        "--submission-id",
        job_id,
        # After a lost node, Ray Train first asks for the old group size until this times out
        # (default 60 s) and only then re-plans on what is left; tests need not wait that long.
        "--runtime-env-json",
        json.dumps({"env_vars": {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "15", **(env or {})}}),
        "--",
        *command,
    )
    return job_id


def submit(
    cluster: EmulatedCluster, tmp: Path, cfg: dict, env: dict[str, str] | None = None, plan: Path | None = None
) -> tuple[str, Path]:
    """`ray job submit --no-wait` of jobs/train.py with ``cfg`` (and ``plan``: ``--plan``); returns (submission
    id, result path)."""
    cfg_path, out_path = tmp / f"{cfg['run']['name']}.yaml", tmp / f"{cfg['run']['name']}-{uuid.uuid4().hex[:6]}.json"
    cfg_path.write_text(yaml.safe_dump(cfg))
    command = [sys.executable, str(REPO / "jobs" / "train.py"), "--config", str(cfg_path), "--output", str(out_path)]
    command += ["--plan", str(plan)] if plan else []
    return submit_command(cluster, command, env), out_path


def job_status(cluster: EmulatedCluster, job_id: str) -> str:
    """The job's status, from the job server's REST API (what `ray job status` asks): a `ray` process per poll
    costs about 2 s of CPU, which the polled job's workers would otherwise have had on this two-core machine."""
    return cluster.api(f"/api/jobs/{job_id}")["status"]


def wait_for(cluster: EmulatedCluster, job_id: str, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = job_status(cluster, job_id)
        if status in ("SUCCEEDED", "FAILED", "STOPPED"):
            return status
        time.sleep(0.5)
    raise TimeoutError(f"job {job_id} still not finished after {timeout} s")


def train_worker_pids(cluster: EmulatedCluster) -> list[int]:
    """The pids of the live Ray Train workers of the cluster."""
    out = ray_cli(
        cluster,
        "list",
        "actors",
        "--filter",
        "class_name=RayTrainWorker",
        "--filter",
        "state=ALIVE",
        "--detail",
        "--format",
        "json",
    )
    return [int(a["pid"]) for a in json.loads(out)]


def final_params(result: dict) -> dict[str, torch.Tensor]:
    return torch.load(Path(result["checkpoint_path"]) / "model.pt")


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def single_process_reference(
    steps: int = STEPS, workload: dict = WORKLOAD, held_out: int = 0
) -> dict[str, torch.Tensor]:
    """One process, full global batch every step: what every split, plan and recovery must reproduce. The
    clip and the schedule are torch's own: ``clip_grad_norm_``, and ``LinearLR`` then ``CosineAnnealingLR``
    for a run of ``steps`` steps; the dataset's last ``held_out`` samples are never drawn."""
    cfg = run_config(Path("/unused"), "reference")["train"]
    torch.manual_seed(cfg["seed"])
    workload = build_workload(workload["name"], workload["options"])
    opt = torch.optim.AdamW(workload.model.parameters(), lr=cfg["lr"], weight_decay=0.0)
    warmup, min_lr = cfg["lr_schedule"]["warmup_steps"], cfg["lr_schedule"]["min_lr"]
    schedule = torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / warmup, total_iters=warmup - 1),
            torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps - 1 - warmup, eta_min=min_lr),
        ],
        milestones=[warmup],
    )
    batches = GlobalBatches(len(workload.dataset) - held_out, cfg["global_batch"], cfg["seed"])
    for step in range(steps):
        workload.loss_fn(workload.model, collate(workload.dataset, batches.indices(step))).backward()
        torch.nn.utils.clip_grad_norm_(workload.model.parameters(), cfg["grad_clip"])
        opt.step()
        opt.zero_grad()
        schedule.step()
    return workload.model.state_dict()


def held_out_loss(state: dict[str, torch.Tensor], held_out: int = HELD_OUT) -> float:
    """The mean loss of the model in ``state`` over the dataset's last ``held_out`` samples, in one batch."""
    workload = build_workload(WORKLOAD["name"], WORKLOAD["options"])
    workload.model.load_state_dict(state)
    workload.model.eval()
    n = len(workload.dataset)
    with torch.no_grad():
        return float(workload.loss_fn(workload.model, collate(workload.dataset, torch.arange(n - held_out, n))))
