"""The planner's predicted step time ÷ the step time measured on the emulated cluster, for three plans.

One emulated 2 × A100-80GB + 2 × V100-16GB cluster runs, one after another:
- the planner's best plan with the packaged catalog (data parallelism over all four);
- with ``tests/data/tiny-memory-gpus.yaml`` (0.75 MiB per device: the model fits on none
  whole) the planner's best and second-best plans, both pipelines.
Predicted: ``Plan.predicted_step_s`` × the run's dilation (the emulated devices run
modelled GPU time stretched by it). Measured: the slowest worker's mean step time over
the second half of the run (the first half warms up). Emulated figures, labelled so.

Usage: python bench/plan_accuracy.py [--steps 16]   (bench/planner.py runs it too, unless --no-measure)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from pathlib import Path

from hetero_ray.cluster.emulation import EmulatedCluster
from hetero_ray.config import RunConfig, parse_config
from hetero_ray.plan import search
from hetero_ray.train.prepare import prepare, rank_types, topology_for

REPO = Path(__file__).resolve().parents[1]
TINY_MEMORY = REPO / "tests" / "data" / "tiny-memory-gpus.yaml"
DEVICES = {"A100-80GB": 2, "V100-16GB": 2}
WORKLOAD = {"name": "gpt", "options": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32}}
GLOBAL_BATCH = 24
# Every plan's predicted step is stretched to this long, so that Python, gloo and the
# pipeline schedule's own overheads (a few ms per micro-batch) stay small beside it.
STEP_S = 2.5


def config(steps: int, gpus_file: Path | None, dilation: float = 1.0) -> RunConfig:
    return parse_config(
        {
            "devices": DEVICES,
            "emulation": {"dilation": dilation},
            "workload": WORKLOAD,
            "gpus_file": str(gpus_file) if gpus_file else None,
            "train": {
                "global_batch": GLOBAL_BATCH,
                "steps": steps,
                "precision": "fp32",
                "report_every": steps // 2,
                "checkpoint_every": steps,
            },
            "run": {"name": f"plan-accuracy-{time.time_ns()}", "storage_path": "/tmp/hetero-ray-bench"},
        }
    )


def plans_to_measure(steps: int) -> list[tuple[str, RunConfig, object]]:
    """(label, config, Prepared) of the three plans, each with its own dilation."""
    out = []
    dp_cfg = config(steps, None)
    dp = prepare(dp_cfg)
    out.append(("data parallel", dp_cfg, dp))
    tiny_cfg = config(steps, TINY_MEMORY)
    tiny = prepare(tiny_cfg)
    ranked = search.plan(
        rank_types(tiny_cfg),
        tiny.catalog,
        tiny.footprint,
        global_batch=GLOBAL_BATCH,
        topology=topology_for(tiny_cfg, tiny.catalog, rank_types(tiny_cfg)),
        precision="fp32",
        efficiency=tiny.efficiency,
        emulated=True,
        top_k=2,
    )
    for label, plan in zip(("pipeline (best)", "pipeline (second)"), ranked):
        out.append((label, tiny_cfg, replace(tiny, plan=plan)))
    measured = []
    for i, (label, cfg, prepared) in enumerate(out):
        dilation = STEP_S / prepared.plan.predicted_step_s
        # A run name of its own: the same name would resume the previous case's checkpoint.
        cfg = cfg.model_copy(
            update={
                "emulation": cfg.emulation.model_copy(update={"dilation": dilation}),
                "run": cfg.run.model_copy(update={"name": f"{cfg.run.name}-{i}"}),
            }
        )
        measured.append((label, cfg, replace(prepared, dilation=dilation)))
    return measured


def describe(plan) -> str:
    shapes = {}
    for r in plan.roles:
        shapes.setdefault(r.pipeline, []).append(f"{r.gpu_type}{list(r.layers) if r.layers else ''}")
    return " | ".join(" → ".join(s) for s in shapes.values())


def measure(steps: int = 16) -> list[dict]:
    """Run the three plans on one emulated cluster; one record per plan with predicted, measured and their ratio."""
    cases = plans_to_measure(steps)
    cluster = EmulatedCluster(DEVICES, gpus_per_node=2)
    # Ray reads its authentication mode once, at import: the token must be set before `import ray`.
    os.environ.update(cluster.env)
    import ray

    from hetero_ray.train.trainer import run_training

    records = []
    with cluster:
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            for label, cfg, prepared in cases:
                metrics = run_training(cfg, prepared).metrics
                predicted = prepared.plan.predicted_step_s * prepared.dilation
                records.append(
                    {
                        "plan": label,
                        "shape": describe(prepared.plan),
                        "pipelined": prepared.plan.is_pipelined,
                        "dilation": prepared.dilation,
                        "predicted_step_s": predicted,
                        "measured_step_s": metrics["step_s"],
                        "predicted_over_measured": predicted / metrics["step_s"],
                        "emulated": True,
                    }
                )
        finally:
            ray.shutdown()
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    print(json.dumps(measure(args.steps), indent=2))


if __name__ == "__main__":
    main()
