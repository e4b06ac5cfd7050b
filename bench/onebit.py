"""DeepSpeed 1-bit Adam against Adam on the emulated cluster, GPT workload, measured in one run.

Prints one JSON object (all figures emulated, labelled so):
- bytes_ratio: bytes a rank sends per step in the compressed phase (counted at the gloo
  backend) ÷ an fp32 ring all-reduce of the same gradients;
- loss_ratio: final loss with 1-bit Adam ÷ with Adam, same steps and data (fast link);
- speedup_comm_bound: samples/s with 1-bit Adam ÷ with Adam, compressed phase, over an
  emulated 1 Gbit/s link; speedup_fast_link: the same over 100 Gbit/s;
- grad_copy_s: what fusing costs on this CPU, measured in this process on the same GPT:
  copying the per-parameter gradients into the flat one that DeepSpeed steps (median of
  repeats), beside the compressed step time it is part of.

On gloo the model's tensors are fused into one parameter and compressed in one call with a
scale per tensor (``train/onebit/flat.py``), as the workers run it.

Both optimizers use the same betas; 1-bit Adam's warm-up is DeepSpeed's freeze_step.
fp32 everywhere so the emulated devices' modelled speed is their fp32 peak.
Usage: python bench/onebit.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from hetero_ray.cluster.emulation import EmulatedCluster
from hetero_ray.config import parse_config
from hetero_ray.plan.cost import ring_allreduce_bytes

DEVICES = {"A100-80GB": 2, "V100-16GB": 2}
LINKS_GBPS = {"slow": 1.0, "fast": 100.0}
GLOBAL_BATCH = 72
GPT = {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 64}


def config(optimizer: str, link_gbps: float, steps: int, freeze_step: int, dilation: float | str) -> dict:
    return {
        "devices": DEVICES,
        "emulation": {"dilation": dilation},
        "link": {"bandwidth_gbps": link_gbps, "latency_us": 10},
        "workload": {"name": "gpt", "options": GPT},
        "train": {
            "global_batch": GLOBAL_BATCH,
            "steps": steps,
            "lr": 1e-3,
            "precision": "fp32",
            # The last window (after the warm-up) is the one compared.
            "report_every": steps - freeze_step - 1,
            "checkpoint_every": steps,
        },
        "optimizer": {"name": optimizer, "betas": [0.9, 0.95], "freeze_step": freeze_step},
        "run": {"name": f"bench-onebit-{time.time_ns()}", "storage_path": "/tmp/hetero-ray-bench"},
    }


def grad_copy_seconds(model: torch.nn.Module, repeats: int = 50) -> float:
    """Median seconds to move ``model``'s gradients into the flat one (as ``DeepSpeedOnebit.step`` does)."""
    from hetero_ray.train.onebit import FlatParameters

    flat = FlatParameters(list(model.parameters()))
    times = []
    for _ in range(repeats):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        t0 = time.perf_counter()
        flat.collect_grads(4.0)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80, help="steps of the loss comparison (fast link)")
    parser.add_argument("--slow-steps", type=int, default=10, help="steps of each run on the slow link")
    args = parser.parse_args()
    cluster = EmulatedCluster(DEVICES)
    os.environ.update(cluster.env)  # before `import ray`: Ray reads its auth mode at import
    import ray

    from hetero_ray.train.prepare import prepare
    from hetero_ray.train.trainer import run_training

    freeze = max(1, args.steps // 4)
    first = prepare(parse_config(config("adam", LINKS_GBPS["fast"], args.steps, freeze, "auto")))
    dilation = first.dilation
    runs: dict[str, dict] = {}
    with cluster:
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            for opt in ("adam", "onebit_adam"):
                runs[f"{opt}/fast"] = run_training(
                    parse_config(config(opt, LINKS_GBPS["fast"], args.steps, freeze, dilation))
                ).metrics
                runs[f"{opt}/slow"] = run_training(
                    parse_config(config(opt, LINKS_GBPS["slow"], args.slow_steps, 2, dilation))
                ).metrics
        finally:
            ray.shutdown()

    from hetero_ray.workloads import build_workload

    torch.set_num_threads(1)  # as the workers run
    grad_copy_s = grad_copy_seconds(build_workload("gpt", GPT).model)
    world = sum(DEVICES.values())
    fp32_ring = ring_allreduce_bytes(4 * first.footprint.param_count, world)
    compressed = runs["onebit_adam/fast"]["devices"]
    assert all(d["compressed"] for d in compressed), "the measured window must be in the compressed phase"
    print(
        json.dumps(
            {
                "emulated": True,
                "cluster": DEVICES,
                "workload": f"gpt {GPT}, global batch {GLOBAL_BATCH}, fp32",
                "dilation": dilation,
                "links_gbps": LINKS_GBPS,
                "params": first.footprint.param_count,
                "fp32_ring_bytes_per_step": fp32_ring,
                "compressed_bytes_per_step": max(d["bytes_sent"] for d in compressed),
                "bytes_ratio": max(d["bytes_sent"] for d in compressed) / fp32_ring,
                "final_loss": {k: v["loss"] for k, v in runs.items()},
                "loss_ratio": runs["onebit_adam/fast"]["loss"] / runs["adam/fast"]["loss"],
                "samples_per_s": {k: v["samples_per_s"] for k, v in runs.items()},
                "speedup_comm_bound": runs["onebit_adam/slow"]["samples_per_s"] / runs["adam/slow"]["samples_per_s"],
                "speedup_fast_link": runs["onebit_adam/fast"]["samples_per_s"] / runs["adam/fast"]["samples_per_s"],
                "grad_copy_s": grad_copy_s,
                "grad_copy_over_step": grad_copy_s * runs["onebit_adam/slow"]["samples_per_s"] / GLOBAL_BATCH,
                "comm_overruns": {k: sum(d["comm_overruns"] for d in v["devices"]) for k, v in runs.items()},
                "overrun_steps": {k: sum(d["overrun_steps"] for d in v["devices"]) for k, v in runs.items()},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
