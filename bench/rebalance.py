"""Online rebalancing after a device throttles, on the emulated 2 × A100-80GB + 4 × V100-16GB cluster.

The first V100 drops to half speed at step ``--slow-at``; the workers re-split the batch from
their measured compute every ``--every`` steps. Prints one JSON object (emulated, labelled so):
- rebalance_recovered_over_ideal: samples/s ÷ the new ideal (the sum of each device's own
  samples/s, the throttled one at half) in the window after the third re-split (or after the
  last one, if fewer were needed);
- windows: every report window's step range, re-splits so far and samples/s ÷ ideal.

Usage: python bench/rebalance.py [--steps 30] [--every 3] [--slow-at 3]
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

from hetero_ray.cluster.emulation import EmulatedCluster
from hetero_ray.config import parse_config
from hetero_ray.monitor.metrics import balance_efficiency

DEVICES = {"A100-80GB": 2, "V100-16GB": 4}


def config(steps: int, every: int, slow_at: int) -> dict:
    return {
        "devices": DEVICES,
        "emulation": {
            "dilation": 100_000,
            "events": [{"step": slow_at, "gpu_type": "V100-16GB", "index": 0, "speed": 0.5}],
        },
        "workload": {"name": "gpt", "options": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32}},
        "train": {
            "global_batch": 72,
            "steps": steps,
            "precision": "fp32",
            "report_every": every,
            "checkpoint_every": steps,
            "rebalance_every": every,
        },
        "run": {"name": f"rebalance-{time.time_ns()}", "storage_path": "/tmp/hetero-ray-bench"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--slow-at", type=int, default=3)
    args = parser.parse_args()
    cluster = EmulatedCluster(DEVICES, gpus_per_node=2)
    # Ray reads its authentication mode once, at import: the token must be set before `import ray`.
    os.environ.update(cluster.env)
    import ray
    from ray.util.queue import Empty, Queue

    from hetero_ray.train.prepare import prepare
    from hetero_ray.train.trainer import run_training

    cfg = parse_config(config(args.steps, args.every, args.slow_at))
    prepared = prepare(cfg)
    reports: list[dict] = []
    with cluster:
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            queue = Queue(actor_options={"num_cpus": 0})
            thread = threading.Thread(target=run_training, args=(cfg, prepared), kwargs={"progress": queue})
            thread.start()
            while thread.is_alive() or not queue.empty():
                try:
                    reports.append(queue.get(timeout=1))
                except Empty:
                    continue
            thread.join()
        finally:
            ray.shutdown()
    windows = [
        {
            "steps": [r["step"] - args.every + 1, r["step"]],
            # Workers re-split after reporting: a report counts the re-splits its window ran after.
            "resplits_before": r["rebalances"],
            "over_ideal": balance_efficiency(r),
        }
        for r in reports
    ]
    slowed = [w for w in windows if w["steps"][0] >= args.slow_at]
    settled = [w for w in slowed if w["resplits_before"] <= 3]
    print(
        json.dumps(
            {
                "emulated": True,
                "devices": DEVICES,
                "slowed": {"gpu_type": "V100-16GB", "index": 0, "speed": 0.5, "at_step": args.slow_at},
                "rebalance_every": args.every,
                "rebalance_recovered_over_ideal": settled[-1]["over_ideal"],
                "resplits_used": settled[-1]["resplits_before"],
                "windows": windows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
