"""A ResNet-18 (transformers' implementation of torchvision's architecture, built from a config) on devices too
small for it: the planner cuts it at its stages into a pipeline, and ``HeteroTrainer``'s built-in loop trains it.

    ray job submit --working-dir . -- python examples/resnet.py [--steps N] [--json]
    python examples/resnet.py --start-cluster            # no cluster: starts an emulated one

The devices' memory comes from ``examples/small-memory-gpus.yaml`` (emulated memory caps: an emulated device
raises out-of-memory past it). GroupNorm replaces BatchNorm: pipeline stages run micro-batches, over which
batch statistics would not be the batch's (hetero-ray refuses to pipeline a BatchNorm model).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import ray

from hetero_ray.cluster.emulation import EmulatedCluster
from hetero_ray.train import HeteroTrainer

HERE = Path(__file__).resolve().parent
CONFIG = {
    "devices": {"A100-80GB": 2, "V100-16GB": 2},
    "gpus_file": str(HERE / "small-memory-gpus.yaml"),
    "emulation": {"dilation": "auto"},
    "workload": {
        "name": "resnet",
        "options": {"arch": "resnet18", "norm": "group", "image_size": 32, "samples": 2048},
    },
    "train": {"global_batch": 16, "steps": 10, "lr": 1e-3, "precision": "fp32", "report_every": 5},
    "run": {"name": "resnet", "storage_path": "~/hetero-ray-runs"},
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=CONFIG["train"]["steps"])
    parser.add_argument("--storage", default=CONFIG["run"]["storage_path"], help="run.storage_path (a URI too)")
    parser.add_argument("--json", action="store_true", help="print the plan and the final metrics as JSON")
    parser.add_argument("--output", type=Path, help="also write that JSON to this file")
    parser.add_argument("--start-cluster", action="store_true", help="run on an emulated cluster started for it")
    args = parser.parse_args(argv)
    if args.start_cluster:
        # Again in a process with the cluster's environment: Ray reads its address and auth mode at import.
        rest = [a for a in sys.argv[1:] if a != "--start-cluster"]
        with EmulatedCluster(CONFIG["devices"]) as cluster:
            return subprocess.run([sys.executable, __file__, *rest], env=cluster.env).returncode
    ray.init(address="auto")
    config = {
        **CONFIG,
        "train": {**CONFIG["train"], "steps": args.steps},
        "run": {**CONFIG["run"], "storage_path": args.storage},
    }
    trainer = HeteroTrainer(config=config)  # no loop of ours: the built-in one
    plan = trainer.prepared.plan
    result = trainer.fit()
    stages = [
        {"gpu_type": r.gpu_type, "pipeline": r.pipeline, "stage": r.stage, "layers": r.layers} for r in plan.roles
    ]
    out = {
        "emulated": "padded",
        "pipelined": plan.is_pipelined,
        "stages": stages,
        "explanation": plan.explanation,
        "loss": result.metrics["loss"],
        "losses": result.metrics["losses"],
        "checkpoint_path": result.checkpoint.path,
    }
    if args.output:
        args.output.write_text(json.dumps(out, indent=2))
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(plan.explanation)
        print(f"loss {out['loss']:.4f} after {args.steps} steps; stages: {stages}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
