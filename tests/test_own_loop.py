"""A user's own training loop through ``HeteroTrainer`` (``examples/own_loop.py``: a Hugging Face GPT-2, AdamW,
warm-up + cosine, clipping, evaluation, micro-batches) submitted with `ray job submit` to the session's emulated
cluster; and the pure parts of the API."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import time

import pytest
import ray
import ray.data
import torch
from cluster_jobs import REPO, job_status, ray_cli, submit_command, train_worker_pids, wait_for

from hetero_ray.config import ConfigError, parse_config
from hetero_ray.plan.data_parallel import Infeasible, plan_data_parallel
from hetero_ray.train import HeteroTrainer, get_context
from hetero_ray.train.buckets import Bucket, GradBuckets
from hetero_ray.train.data import GlobalBatches
from hetero_ray.train.own_loop import DatasetShare, ShareSampler
from hetero_ray.train.prepare import prepare


def test_own_loop_on_a_2_to_1_split_trains_like_one_process(cluster, tmp_path):
    """20 steps, A100s 4 samples each (two micro-batches of 2), V100s 2: the parameters end within 1e-5 of one
    process on the full batch, with clipping and the schedule on; a checkpoint and the held-out loss came back."""
    out = tmp_path / "own-loop.json"
    example = REPO / "examples" / "own_loop.py"
    job_id = submit_command(
        cluster, [sys.executable, str(example), "--check", "--storage", str(tmp_path / "runs"), "--output", str(out)]
    )
    assert wait_for(cluster, job_id, timeout=400) == "SUCCEEDED", ray_cli(cluster, "job", "logs", job_id)[-3000:]
    result = json.loads(out.read_text())
    assert result["split_max_abs"] <= 1e-5
    assert sorted(result["split"]) == [["A100-80GB", 4, 2]] * 2 + [["V100-16GB", 2, 2]] * 2
    assert result["metrics"]["step"] == 19 and result["metrics"]["eval_loss"] > 0
    assert (tmp_path / "runs" / "own-loop").is_dir()


def test_a_killed_worker_restarts_the_own_loop_from_its_checkpoint(cluster, tmp_path):
    """SIGKILL one worker of the own loop after its first checkpoint: Ray Train restarts the group, the workers
    are set up and planned again, the loop resumes from `ray.train.get_checkpoint()` (weights, AdamW, schedule,
    data position) and ends where one process ends."""
    out = tmp_path / "own-loop.json"
    example = REPO / "examples" / "own_loop.py"
    runs = tmp_path / "runs"
    job_id = submit_command(
        cluster,
        [sys.executable, str(example), "--check", "--storage", str(runs), "--name", "kill", "--output", str(out)],
    )
    deadline = time.monotonic() + 240
    # Ray Train registers a checkpoint in its snapshot after persisting it; a restart resumes from what is there.
    while not (runs / "kill" / "checkpoint_manager_snapshot.json").exists():
        assert time.monotonic() < deadline and job_status(cluster, job_id) in ("PENDING", "RUNNING")
        time.sleep(0.2)
    os.kill(train_worker_pids(cluster)[-1], signal.SIGKILL)
    assert wait_for(cluster, job_id, timeout=400) == "SUCCEEDED", ray_cli(cluster, "job", "logs", job_id)[-3000:]
    result = json.loads(out.read_text())
    assert result["metrics"]["resumed_from_step"] > 0 and result["metrics"]["step"] == 19
    assert result["split_max_abs"] <= 1e-5


def test_the_workers_loaders_together_yield_each_global_batch_once():
    """Shares 5 : 4 : 3 of 12 over two epochs: per step the workers' batches, in rank order, are the built-in
    loop's global batch."""
    batches = GlobalBatches(100, 12, seed=3)
    samplers = [ShareSampler(batches, offset, share) for offset, share in ((0, 5), (5, 4), (9, 3))]
    for epoch in range(2):
        for s in samplers:
            s.set_epoch(epoch)
        parts = list(zip(*samplers))
        assert len(parts) == 8
        for step, together in enumerate(parts):
            assert [len(p) for p in together] == [5, 4, 3]
            assert sum(together, []) == batches.indices(epoch * 8 + step).tolist()


def test_an_elastic_run_of_an_own_loop_is_refused_in_one_line():
    cfg = {"devices": {"A100-80GB": 2}, "train": {"min_workers": 1}}
    with pytest.raises(ConfigError, match=r"^train.min_workers: elastic runs need the built-in loop"):
        HeteroTrainer(lambda: None, config=cfg)


def test_get_context_outside_a_worker_says_where_to_call_it():
    with pytest.raises(RuntimeError, match="inside the train_loop_per_worker"):
        get_context()


def test_a_gradient_dropped_by_zero_grad_goes_back_into_its_bucket():
    """``optimizer.zero_grad()`` sets gradients to None; the next backward's gradient goes back into its view of
    the flat chunk, which then holds exactly it, × ``scale`` at launch (one rank: nothing to sum)."""
    model = torch.nn.Linear(3, 2)
    grads = GradBuckets([Bucket(None, 1, list(model.parameters()))], scale=0.5)
    x = torch.randn(4, 3)
    model(x).sum().backward()
    first = model.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    grads.arm()
    model(x).sum().backward()
    grads.finish()
    view = grads.chunks[0].views[model.weight]
    assert model.weight.grad.data_ptr() == view.data_ptr()
    assert torch.equal(model.weight.grad, 0.5 * first)


def test_the_workers_shares_of_a_ray_dataset_are_each_global_batch_in_order():
    """Shares 5 : 4 : 3 of 12 rows from a 40-row Ray Data dataset in 5 blocks: three global batches, each the
    workers' parts in rank order; the last partial batch is dropped."""
    # Ray's default temporary folder: a pytest one makes its socket paths too long.
    ray.init(address="local", num_cpus=1, object_store_memory=80 * 2**20, include_dashboard=False)
    try:
        ds = ray.data.from_items([{"x": i} for i in range(40)], override_num_blocks=5)
        parts = [list(DatasetShare(ds, offset, share, 12)) for offset, share in ((0, 5), (5, 4), (9, 3))]
    finally:
        ray.shutdown()
    assert [len(p) for p in parts] == [3, 3, 3]
    for step, together in enumerate(zip(*parts)):
        assert torch.cat([b["x"] for b in together]).tolist() == list(range(12 * step, 12 * step + 12))


def test_the_resnet_example_is_pipelined_because_its_devices_are_too_small():
    """examples/resnet.py's ResNet-18 (171 MiB of state) on 0.15 GiB A100s and 0.08 GiB V100s: no device holds it
    whole, so data parallelism is infeasible and the plan its HeteroTrainer makes is a pipeline."""
    spec = importlib.util.spec_from_file_location("resnet_example", REPO / "examples" / "resnet.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    cfg = parse_config({**example.CONFIG, "emulation": {"dilation": 1000.0}})
    prepared = prepare(cfg)
    types = [t for t, n in cfg.devices.items() for _ in range(n)]
    assert isinstance(
        plan_data_parallel(types, prepared.catalog, prepared.footprint, global_batch=16, precision="fp32"), Infeasible
    )
    assert prepared.plan.is_pipelined
    assert all(r.predicted_memory_bytes <= r.memory_cap_bytes for r in prepared.plan.roles)
