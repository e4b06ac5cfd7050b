"""The planner's predicted step time ÷ the step time measured on the emulated cluster, for three plans.

One emulated 2 × A100-80GB + 2 × V100-16GB cluster runs, one after another, the planner's best plan
(data parallelism over all four) and the two best pipelined plans of its ranking (the model fits
every device, so the pipelines are the planner's runners-up, each priced as it would run).
Measured: the slowest worker's mean step time over the second half of the run (the first
half warms up). Emulated figures, labelled with their mode:

- ``--mode throttled`` (default): the devices are CPU slices of 0.40 and 0.22 of a core (1.8 : 1;
  the catalog guesses 2.5 : 1) and the gradient all-reduce and the pipeline's stage-to-stage sends
  are padded to a named 1 Gbit/s link. The cluster is profiled first, and every prediction
  comes from that profile and the link alone: nothing is stretched, times are real.
- ``--mode padded``: every device pads its step to the catalog's modelled time, stretched so the
  predicted step is 2.5 s. This checks the plan-level composition only (the padding *is* the model).

Usage: python bench/plan_accuracy.py [--mode throttled|padded] [--steps 16]
(bench/planner.py runs the padded mode too, unless --no-measure)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

from hetero_ray.cluster.emulation import EmulatedCluster
from hetero_ray.config import RunConfig, parse_config
from hetero_ray.plan import search
from hetero_ray.train.prepare import Prepared, prepare, profiled_speeds, rank_types, topology_for

DEVICES = {"A100-80GB": 2, "V100-16GB": 2}
WORKLOAD = {"name": "gpt", "options": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32}}
GLOBAL_BATCH = 24
# Padded: every plan's predicted step is stretched to this long, so that Python, gloo and the
# pipeline schedule's own overheads (a few ms per micro-batch) stay small beside it.
STEP_S = 2.5
# Throttled: the truth, which only the cluster sees; a larger model and batch keep a step near a second
# on the slices, so the runtime's fixed costs per step and micro-batch stay small, without stretching anything.
CPU_SHARE = {"A100-80GB": 0.40, "V100-16GB": 0.22}
THROTTLED_WORKLOAD = {"name": "gpt", "options": {"n_layer": 4, "n_head": 4, "n_embd": 64, "block_size": 128}}
THROTTLED_BATCH = 192
# The two best pipelined plans are looked for among this many best plans.
RANKED = 50
LINK = {"bandwidth_gbps": 1.0, "latency_us": 50.0}


def config(steps: int, mode: str) -> RunConfig:
    throttled = mode == "throttled"
    return parse_config(
        {
            "devices": DEVICES,
            "emulation": {"mode": "throttled"} if throttled else {"dilation": 1.0},
            "workload": THROTTLED_WORKLOAD if throttled else WORKLOAD,
            "link": LINK if throttled else None,
            "train": {
                "global_batch": THROTTLED_BATCH if throttled else GLOBAL_BATCH,
                "steps": steps,
                "precision": "fp32",
                "report_every": steps // 2,
                "checkpoint_every": steps,
            },
            "run": {"name": f"plan-accuracy-{time.time_ns()}", "storage_path": "/tmp/hetero-ray-bench"},
        }
    )


def candidate_plans(cfg: RunConfig) -> list[tuple[str, RunConfig, Prepared]]:
    """(label, config, Prepared) of the three plans: ``cfg``'s best plan (data parallel) and its two best
    pipelined ones, each with a run name of its own (a shared one would resume the previous case)."""
    prepared = prepare(cfg)
    ranked = search.plan(
        rank_types(cfg),
        prepared.catalog,
        prepared.footprint,
        global_batch=cfg.train.global_batch,
        topology=topology_for(cfg, prepared.catalog, rank_types(cfg)),
        precision=cfg.train.precision,
        efficiency=prepared.efficiency,
        emulated=True,
        seconds_per_sample=profiled_speeds(cfg, prepared.catalog),
        top_k=RANKED,
    )
    pipelines = [p for p in ranked if p.is_pipelined][:2]
    if prepared.plan.is_pipelined or len(pipelines) < 2:
        raise SystemExit(f"expected a data-parallel best plan and two pipelined ones in the top {RANKED}")
    plans = [("data parallel", prepared.plan), ("pipeline (best)", pipelines[0]), ("pipeline (second)", pipelines[1])]
    return [
        (
            label,
            cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": f"{cfg.run.name}-{i}"})}),
            replace(prepared, plan=plan),
        )
        for i, (label, plan) in enumerate(plans)
    ]


def stretched(cases: list) -> list:
    """Padded mode: each case's dilation set so that its predicted step lasts ``STEP_S``."""
    out = []
    for label, cfg, prepared in cases:
        dilation = STEP_S / prepared.plan.predicted_step_s
        cfg = cfg.model_copy(update={"emulation": cfg.emulation.model_copy(update={"dilation": dilation})})
        out.append((label, cfg, replace(prepared, dilation=dilation)))
    return out


def describe(plan) -> str:
    shapes = {}
    for r in plan.roles:
        shapes.setdefault(r.pipeline, []).append(f"{r.gpu_type}{list(r.layers) if r.layers else ''}")
    return " | ".join(" → ".join(s) for s in shapes.values())


def device_record(d: dict) -> dict:
    """What one worker measured: its step, the compute inside it and its gradient sync, and how often the host's
    loopback delivered a message later than the named link would have (``comm_overruns``)."""
    keys = ("rank", "gpu_type", "local_batch", "micro_batch", "step_s", "comm_s", "comm_overruns")
    return {k: d[k] for k in keys} | {"busy_s": d["utilisation"] * d["step_s"]}


def role_record(r) -> dict:
    """What the planner predicted for one role."""
    return {
        "gpu_type": r.gpu_type,
        "pipeline": r.pipeline,
        "stage": r.stage,
        "layers": r.layers,
        "local_batch": r.local_batch,
        "micro_batch": r.micro_batch,
        "predicted_compute_s": r.predicted_compute_s,
    }


@contextmanager
def connected_cluster(devices: dict[str, int], cpu_share: dict[str, float] | None) -> Iterator[None]:
    """An emulated cluster of ``devices`` (throttled to ``cpu_share``, else padded) up and this process's Ray
    connected to it; Ray shut down and the cluster stopped after. One per process, entered before anything
    imports Ray: Ray reads the cluster's environment (its token, loopback) once, at import."""
    cluster = EmulatedCluster(devices, gpus_per_node=2, cpu_share=cpu_share)
    # Ray reads its authentication mode once, at import: the token must be set before `import ray`.
    os.environ.update(cluster.env)
    import ray

    with cluster:
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            yield
        finally:
            ray.shutdown()


@contextmanager
def profiled_cluster(steps: int) -> Iterator[Callable[[], RunConfig]]:
    """The throttled cluster up and Ray connected: a function that profiles every device (all at once, each
    beside the others, as in the runs) into a history of its own and returns the run config planned from it,
    for the benches that measure plans on this cluster. Each call is a fresh profile."""
    from rich.console import Console

    with connected_cluster(DEVICES, CPU_SHARE), tempfile.TemporaryDirectory() as tmp:
        from hetero_ray.perf.remote import profile_run  # imports Ray: after the cluster's environment is set

        profiles = itertools.count()
        yield lambda: profile_run(
            config(steps, "throttled"), f"{tmp}/profile-{next(profiles)}.parquet", Console(stderr=True)
        )


def measure(steps: int = 16, mode: str = "throttled") -> list[dict]:
    """Run the three plans on one emulated cluster; one record per plan with predicted, measured and their ratio."""
    from rich.console import Console

    throttled = mode == "throttled"
    records = []
    with connected_cluster(DEVICES, CPU_SHARE if throttled else None), tempfile.TemporaryDirectory() as tmp:
        # Both import Ray: after the cluster's environment is set.
        from hetero_ray.perf.remote import profile_run
        from hetero_ray.train.trainer import run_training

        cfg = config(steps, mode)
        if throttled:
            # One profile, of every device at once (each computing beside the others, as in the runs).
            cfg = profile_run(cfg, f"{tmp}/profile.parquet", Console(stderr=True))
        cases = candidate_plans(cfg)
        for label, cfg, prepared in cases if throttled else stretched(cases):
            metrics = run_training(cfg, prepared).metrics
            predicted = prepared.plan.predicted_step_s * (prepared.dilation or 1.0)
            records.append(
                {
                    "plan": label,
                    "shape": describe(prepared.plan),
                    "pipelined": prepared.plan.is_pipelined,
                    **({} if throttled else {"dilation": prepared.dilation}),
                    "predicted_step_s": predicted,
                    "measured_step_s": metrics["step_s"],
                    "predicted_over_measured": predicted / metrics["step_s"],
                    "predicted_compute_s": prepared.plan.predicted_compute_s,
                    "predicted_comm_s": prepared.plan.predicted_comm_s,
                    "devices": [device_record(d) for d in metrics["devices"]],
                    "roles": [role_record(r) for r in prepared.plan.roles],
                }
            )
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("padded", "throttled"), default="throttled")
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    head = {"emulated": True, "mode": args.mode, "cluster": DEVICES}
    if args.mode == "throttled":
        head |= {
            "workload": THROTTLED_WORKLOAD,
            "global_batch": THROTTLED_BATCH,
            "cpu_share": CPU_SHARE,
            "link": LINK,
            "predicted_from": "a profile of the throttled devices taken in this run, and the link",
        }
    else:
        head |= {
            "workload": WORKLOAD,
            "global_batch": GLOBAL_BATCH,
            "predicted_from": "catalog (the padding is the model)",
        }
    plans = measure(args.steps, args.mode)
    print(
        json.dumps(
            {
                **head,
                "plans": plans,
                "command": f"python bench/plan_accuracy.py --mode {args.mode} --steps {args.steps}",
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
