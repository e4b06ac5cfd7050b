"""Recovery from a lost worker and from a lost node, on the emulated 2 × A100-80GB + 2 × V100-16GB cluster.

Prints one JSON object (emulated, and labelled so):
- worker_loss / node_loss: {recovery_s, steps_redone}: seconds from the failure (SIGKILL of a
  training worker; SIGKILL of the whole A100 node) to the end of the first step after the
  resume, and the steps run twice (done before the failure, after the checkpoint resumed from);
- node_loss.throughput_over_ideal: samples/s after the node loss ÷ the sum of each remaining
  device's standalone samples/s (its local batch over its modelled busy time), over the last window.

Usage: python bench/recovery.py [--steps 40] [--checkpoint-every 5]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time

from hetero_ray.cluster.emulation import EmulatedCluster
from hetero_ray.config import parse_config
from hetero_ray.monitor.metrics import balance_efficiency

DEVICES = {"A100-80GB": 2, "V100-16GB": 2}
START_TIMEOUT = {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "15"}


def config(name: str, steps: int, checkpoint_every: int, **train) -> dict:
    return {
        "devices": DEVICES,
        # About 0.3 s a step: failures land between checkpoints.
        "emulation": {"dilation": 150_000},
        "workload": {"name": "gpt", "options": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32}},
        "train": {
            "global_batch": 12,
            "steps": steps,
            "precision": "fp32",
            "report_every": 1,
            "checkpoint_every": checkpoint_every,
            "max_failures": 2,
            **train,
        },
        "run": {"name": f"recovery-{name}-{time.time_ns()}", "storage_path": "/tmp/hetero-ray-bench"},
    }


def run_with_failure(cluster: EmulatedCluster, cfg: dict, fail_after_step: int, fail) -> dict:
    """Train ``cfg``; once a report past ``fail_after_step`` arrives, call ``fail()``; time the recovery."""
    from ray.util.queue import Empty

    from hetero_ray.local_queue import local_queue
    from hetero_ray.train.prepare import prepare
    from hetero_ray.train.trainer import run_training

    run_cfg = parse_config(cfg)
    prepared = prepare(run_cfg)
    queue = local_queue()
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.update(result=run_training(run_cfg, prepared, progress=queue)))
    thread.start()
    reports, failed_at, done_before = [], None, None
    while thread.is_alive() or not queue.empty():
        try:
            m = queue.get(timeout=1)
        except Empty:
            continue
        reports.append(m)
        if failed_at is None and m["step"] >= fail_after_step:
            done_before = m["step"]
            failed_at = time.time()
            fail()
    thread.join()
    if "result" not in outcome:
        raise RuntimeError("the run did not finish; see the Ray logs")
    after = [m for m in reports if m["time"] > failed_at and m["resumed_from_step"] > 0]
    first = after[0]
    return {
        "recovery_s": first["time"] - failed_at,
        "steps_redone": done_before - first["resumed_from_step"] + 1,
        "resumed_from_step": first["resumed_from_step"],
        "failed_after_step": done_before,
        "last": after[-1],
    }


def kill_a_worker() -> None:
    from ray.util.state import list_actors

    actors = list_actors(filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")], detail=True)
    os.kill(int(actors[-1]["pid"]), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    args = parser.parse_args()
    # Fail two steps after a checkpoint: two or three steps are re-done.
    fail_after = 2 * args.checkpoint_every + 2
    cluster = EmulatedCluster(DEVICES, gpus_per_node=2)
    # Ray reads its authentication mode once, at import: the token must be set before `import ray`.
    os.environ.update(cluster.env)
    import ray

    # Ray prints the deaths this benchmark causes ("(raylet) A worker died …") on stdout;
    # they go to stderr so that stdout is the JSON alone.
    with cluster, contextlib.redirect_stdout(sys.stderr):
        # After a lost node, Ray Train asks for the old group size until this times out (Ray's
        # default 60 s), then re-plans on what is left; the figure is measured with 15 s.
        ray.init(address=cluster.address, log_to_driver=False, runtime_env={"env_vars": START_TIMEOUT})
        try:
            worker = run_with_failure(
                cluster, config("worker", args.steps, args.checkpoint_every), fail_after, kill_a_worker
            )
            node = run_with_failure(
                cluster,
                config("node", args.steps, args.checkpoint_every, min_workers=1),
                fail_after,
                lambda: cluster.kill_node("A100-80GB"),
            )
        finally:
            ray.shutdown()
    last = node.pop("last")
    worker.pop("last")
    print(
        json.dumps(
            {
                "emulated": True,
                "devices": DEVICES,
                "checkpoint_every": args.checkpoint_every,
                "ray_train_worker_group_start_timeout_s": float(
                    START_TIMEOUT["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"]
                ),
                "worker_loss": worker,
                "node_loss": {
                    **node,
                    "throughput_over_ideal": balance_efficiency(last),
                    "remaining_devices": sorted(d["gpu_type"] for d in last["devices"]),
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
