"""A seeded stream of train, fine-tune and inference jobs, routed by class vs Ray's first fit, on one throttled cluster.

One emulated cluster of 2 × A100-80GB + 4 × V100-16GB (throttled: each device a CPU slice, A100 0.34 and
V100 0.19 of a core), started once. The same fixed stream (``random.Random(--seed)``) is submitted to fresh
job ledgers, one run after the other: ``routed`` (hetero-ray's default policy: training on the A100s,
fine-tuning on the V100s falling back to any, inference on whatever is idle, the V100s first; queued training
first) and ``default`` (``--first-fit``: no preference, the types in a fixed order, arrival order, as Ray
places jobs without hetero-ray; run with the A100s first and with the V100s first). Every job is real and short: training and fine-tuning run ``jobs/train.py`` on a tiny GPT for a
fixed number of steps on the devices granted; inference runs ``bench/job_mix_infer.py`` (timed next-byte
requests on its device). Prints JSON (all figures emulated, mode throttled), also written to
docs/measurements/job-mix-throttled.json:

- ``utilization_routed`` / ``_default``: held device-seconds (ledger log) ÷ (6 × first submit to last finish);
- ``mean_completion_s_routed`` / ``_default``: mean of finish − submit over the jobs;
- ``inference_p50_ms``: median latency of inference requests made while a training job held devices;
- ``target_met``: routed utilisation ≥ default + 0.15 and routed mean completion ≤ default's.

Usage: python bench/job_mix.py [--seed 0] [--jobs N] [--scale 1.0] [--repeats 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

from hetero_ray.cluster.emulation import start_retrying
from hetero_ray.output import report_json

REPO = Path(__file__).resolve().parent.parent
DEVICES = {"A100-80GB": 2, "V100-16GB": 4}
CPU_SHARE = {"A100-80GB": 0.34, "V100-16GB": 0.19}
WORKLOAD = {"name": "gpt", "options": {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 64}}
# The stream's make-up, chosen before any run: 3 training jobs, 4 fine-tuning jobs, 2 inference jobs, in an order
# and at gaps drawn from the seed. Sizes: steps (training, fine-tuning) or requests (inference), drawn per job.
MIX = ["train"] * 3 + ["finetune"] * 4 + ["inference"] * 2
SIZE = {"train": (160, 240), "finetune": (80, 140), "inference": (800, 1200)}
GAP_S = (4.0, 14.0)
GLOBAL_BATCH = 48
TARGET_GAIN = 0.15
MEASUREMENTS = REPO / "docs" / "measurements"


def job_stream(seed: int, jobs: int, scale: float) -> list[dict]:
    """The fixed stream: class, arrival (s after the first), size; the first ``jobs`` of it."""
    rng = random.Random(seed)
    classes = list(MIX)
    rng.shuffle(classes)
    stream, at = [], 0.0
    for i, job_class in enumerate(classes):
        low, high = SIZE[job_class]
        stream.append(
            {"index": i, "class": job_class, "arrival_s": round(at, 1), "size": round(rng.randint(low, high) * scale)}
        )
        at += rng.uniform(*GAP_S) * scale
    return stream[:jobs]


def command(job: dict, run: str, tmp: Path) -> tuple[list[str], dict]:
    """The job's command and its ``submit`` options: training only on the A100s (``--only``: a model whose memory
    only they hold, under both policies), fine-tuning on any 2 devices, inference on any 1."""
    name = f"{run}-{job['index']}-{job['class']}"
    out = tmp / f"{name}.json"
    if job["class"] == "inference":
        return [
            sys.executable,
            str(REPO / "bench" / "job_mix_infer.py"),
            "--requests",
            str(job["size"]),
            "--output",
            str(out),
        ], {
            "gpus": 1,
            "only": None,
        }
    config = {
        "devices": DEVICES,  # replaced by the devices granted (HETERO_RAY_DEVICES)
        "emulation": {"mode": "throttled"},
        "workload": WORKLOAD,
        "train": {
            "global_batch": GLOBAL_BATCH,
            "steps": job["size"],
            "lr": 3e-3 if job["class"] == "train" else 1e-3,
            "seed": job["index"],
            "precision": "fp32",
            "split": "proportional",
            "checkpoint_every": job["size"],
            "report_every": job["size"],
        },
        "run": {"name": name, "storage_path": str(tmp / "runs")},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    train = [sys.executable, str(REPO / "jobs" / "train.py"), "--config", str(path), "--output", str(out)]
    return train, {"gpus": 2, "only": ["A100-80GB"] if job["class"] == "train" else None}


def run_stream(label: str, order: list[str], stream: list[dict], tmp: Path, stamp: str) -> dict:
    """Submit ``stream`` at its arrival times to a fresh ledger (the types in ``order``: what first fit and the
    fallbacks go by), wait for every job, read the ledger's log."""
    import ray
    from ray.job_submission import JobSubmissionClient

    from hetero_ray.cluster.catalog import load_catalog
    from hetero_ray.routing.client import submit
    from hetero_ray.routing.ledger import get_ledger
    from hetero_ray.routing.policy import FIRST_FIT, default_policy

    name = f"{label}-{stamp}"
    policy = default_policy(order, load_catalog()) if label == "routed" else FIRST_FIT
    ledger = get_ledger(name, {t: DEVICES[t] for t in order}, policy)
    client = JobSubmissionClient(os.environ["RAY_API_SERVER_ADDRESS"])
    rows, began = [], time.time()
    for job in stream:
        time.sleep(max(0.0, began + job["arrival_s"] - time.time()))
        cmd, options = command(job, name, tmp)
        submitted = time.time()
        job_id = submit(cmd, job_class=job["class"], ledger=ledger, ledger_name=name, **options)
        rows.append({**job, "job_id": job_id, "submit": submitted, "output": cmd[-1]})
    for row in rows:
        while (status := client.get_job_status(row["job_id"]).value) not in ("SUCCEEDED", "FAILED", "STOPPED"):
            time.sleep(1.0)
        row["status"] = status
        if status != "SUCCEEDED":
            row["log_tail"] = client.get_job_logs(row["job_id"])[-1500:]
    log = ray.get(ledger.status.remote())["log"]
    for row in rows:
        events = {e["event"]: e for e in log if e["job"] == row["job_id"]}
        row["devices"] = events.get("acquire", {}).get("devices")
        row["start"] = events.get("acquire", {}).get("time")
        row["finish"] = events.get("release", {}).get("time") or time.time()
    return summarise(label, rows, began)


def summarise(label: str, rows: list[dict], began: float) -> dict:
    """Utilisation, completion, per-job rows and inference latencies of one run (times relative to its start)."""
    end = max(r["finish"] for r in rows)
    makespan = end - began
    held = {t: 0.0 for t in DEVICES}
    for r in rows:
        for t, n in (r["devices"] or {}).items():
            held[t] += n * (r["finish"] - r["start"])
    training = [(r["start"], r["finish"]) for r in rows if r["class"] == "train" and r["start"]]
    during, alone = [], []
    for r in rows:
        if r["class"] == "inference" and r["status"] == "SUCCEEDED":
            served = json.loads(Path(r["output"]).read_text())["requests"]
            r["p50_ms"] = statistics.median(ms for _, ms in served)
            for at, ms in served:
                (during if any(a <= at <= b for a, b in training) else alone).append(ms)
    return {
        "policy": label,
        "utilization": sum(held.values()) / (sum(DEVICES.values()) * makespan),
        "utilization_by_type": {t: held[t] / (DEVICES[t] * makespan) for t in DEVICES},
        "mean_completion_s": statistics.mean(r["finish"] - r["submit"] for r in rows),
        "makespan_s": makespan,
        "inference_p50_ms_while_training": statistics.median(during) if during else None,
        "inference_requests_while_training": len(during),
        "inference_p50_ms_otherwise": statistics.median(alone) if alone else None,
        "failed_jobs": sum(r["status"] != "SUCCEEDED" for r in rows),
        "jobs": [
            {
                "index": r["index"],
                "class": r["class"],
                "size": r["size"],
                "status": r["status"],
                "devices": r["devices"],
                "submit_s": round(r["submit"] - began, 2),
                "start_s": round(r["start"] - began, 2) if r["start"] else None,
                "finish_s": round(r["finish"] - began, 2),
                "wait_s": round(r["start"] - r["submit"], 2) if r["start"] else None,
                "completion_s": round(r["finish"] - r["submit"], 2),
                **({"p50_ms": round(r["p50_ms"], 2)} if "p50_ms" in r else {}),
                **({"log_tail": r["log_tail"]} if "log_tail" in r else {}),
            }
            for r in rows
        ],
    }


def settle(limit_s: float = 30.0) -> float:
    """Wait (at most ``limit_s``) until the machine is mostly idle again: the last run's processes gone."""
    began = time.monotonic()

    def busy() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split()[1:8]]
        return sum(fields) - fields[3], sum(fields)

    while time.monotonic() - began < limit_s:
        (b0, t0), _ = busy(), time.sleep(1.0)
        b1, t1 = busy()
        if (b1 - b0) / max(t1 - t0, 1) < 0.25:
            break
    return time.monotonic() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=len(MIX), help="the first N jobs of the stream (smoke runs)")
    parser.add_argument("--scale", type=float, default=1.0, help="× every job's size and gap (smoke runs)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the three runs, each reversing the last")
    parser.add_argument("--json", default=str(MEASUREMENTS / "job-mix-throttled.json"))
    args = parser.parse_args()
    for flag, value in (("--jobs", args.jobs), ("--repeats", args.repeats), ("--scale", args.scale)):
        if not value > 0:
            parser.error(f"{flag}: {value} runs nothing; give a number above 0")
    started = time.monotonic()
    stream = job_stream(args.seed, args.jobs, args.scale)
    tmp = Path(tempfile.mkdtemp(prefix="hetero-ray-job-mix-"))
    cluster = start_retrying(DEVICES, cpu_share=CPU_SHARE, on_retry=lambda line: print(line, file=sys.stderr))
    os.environ.update(cluster.env)  # before `import ray`: Ray reads its auth mode at import
    import ray

    from hetero_ray.routing.client import cluster_devices

    joined, reverse = list(DEVICES), list(reversed(DEVICES))
    # First fit in each order of the types (Ray fixes none), routed in the order the nodes joined, between them.
    sequence = [("default", joined), ("routed", joined), ("default", reverse)]
    runs: dict[str, list[dict]] = {"routed": [], "default": []}
    # Ray's driver prints the raylets' warnings to sys.stdout; stdout is for the JSON alone.
    with contextlib.redirect_stdout(sys.stderr), contextlib.ExitStack() as stack:
        stack.callback(cluster.stop)
        ray.init(address=cluster.address, log_to_driver=False, logging_level="WARNING")
        ray_order = list(cluster_devices())
        cluster_s = time.monotonic() - started
        try:
            warm = run_stream(
                "warmup", joined, [{"index": 0, "class": "finetune", "arrival_s": 0, "size": 20}], tmp, "0"
            )
            for r in range(args.repeats):
                for label, order in sequence if r % 2 == 0 else sequence[::-1]:
                    settled = settle()
                    run = run_stream(label, order, stream, tmp, f"{time.strftime('%H%M%S')}-{r}")
                    runs[label].append({"order": order, "repeat": r, "settle_s": settled, **run})
                    brief = {k: v for k, v in runs[label][-1].items() if k != "jobs"}
                    print(f"{label}: {json.dumps(brief)}", file=sys.stderr)
        finally:
            ray.shutdown()

    def mean(label: str, key: str) -> float | None:
        values = [run[key] for run in runs[label] if run[key] is not None]
        return statistics.mean(values) if values else None

    gain = mean("routed", "utilization") - mean("default", "utilization")
    completion = {label: mean(label, "mean_completion_s") for label in runs}
    failed = sum(run["failed_jobs"] for label in runs for run in runs[label])
    result = {
        "emulated": True,
        "mode": "throttled",
        "cpu_share": CPU_SHARE,
        "cluster": DEVICES,
        "utilization_routed": mean("routed", "utilization"),
        "utilization_default": mean("default", "utilization"),
        "utilization_gain": gain,
        "mean_completion_s_routed": completion["routed"],
        "mean_completion_s_default": completion["default"],
        "inference_p50_ms": mean("routed", "inference_p50_ms_while_training"),
        "inference_p50_ms_default": mean("default", "inference_p50_ms_while_training"),
        "target": f"utilization_routed >= utilization_default + {TARGET_GAIN}, mean completion no worse",
        "target_met": bool(gain >= TARGET_GAIN and completion["routed"] <= completion["default"] and not failed),
        "default_by_order": {
            " > ".join(run["order"]): {k: run[k] for k in ("utilization", "mean_completion_s", "makespan_s")}
            for run in runs["default"]
        },
        "failed_jobs": failed,
        "seed": args.seed,
        "stream": stream,
        "scale": args.scale,
        "repeats": args.repeats,
        "stream_design": (
            f"fixed before any run: {MIX.count('train')} training, {MIX.count('finetune')} fine-tuning, "
            f"{MIX.count('inference')} inference jobs shuffled by the seed, gaps uniform in {GAP_S} s; sizes uniform "
            f"in {SIZE} (steps, or requests for inference)"
        ),
        "jobs": {
            "train": f"jobs/train.py, gpt 2 layers x 64, block 64, global batch {GLOBAL_BATCH}; --class train --gpus 2 "
            "--only A100-80GB under both policies (--only stands for a model whose memory only the A100s hold)",
            "finetune": "the same training job, fewer steps and a lower lr (no checkpoint loaded); --class finetune "
            "--gpus 2",
            "inference": "bench/job_mix_infer.py: one actor in the granted device's slice, next-byte forwards of 8 x 64 "
            "bytes one after another; --class inference --gpus 1",
        },
        "definitions": {
            "utilization": "device-seconds held by jobs (ledger acquire to release) / (6 x first submit to last "
            "release)",
            "completion": "ledger release - submit, per job",
            "utilization_default": "the mean of first fit with the A100s first and with the V100s first",
            "inference_p50_ms": "median latency of the routed run's inference requests begun while a training job "
            "held devices (inference_p50_ms_default: the first-fit runs' mean)",
        },
        "ray_nodes_type_order": ray_order,
        "warmup_run": {k: warm[k] for k in ("makespan_s", "failed_jobs")},
        "runs": runs,
        "notes": [
            "emulated: devices are CPU slices of one 2-core machine; job start-up (processes, torch, Ray Train) runs "
            "outside the slices and counts as held time",
            "the ledgers are made with get_ledger and the types in a fixed order, not with open_ledger: "
            "open_ledger takes the order of ray.nodes(), which follows node ids, not the order the nodes joined, "
            "so first fit would put fine-tuning on the A100s or on the V100s by chance of the cluster's start; "
            "first fit runs in both orders (utilization_default is their mean), routed in the join order (A100s "
            "first)",
            "runs share one cluster, one after the other (first fit A100s first, routed, first fit V100s first), "
            "after a warm-up job; each waits for the machine to go idle first",
            "the stream and job sizes were fixed before any run and not changed; running first fit in both type "
            "orders was added after a smoke run (3 jobs) showed open_ledger's order putting the V100s first",
            "the default policy's inference rule changed after two full runs (gain 0.101 and 0.096, target not met), "
            "in which routed inference took idle A100s and kept training jobs waiting: inference now prefers the "
            "slowest idle types (falling back to any); every recorded run since has it",
        ],
        "cluster_start_s": cluster_s,
        "load_average_1m_at_end": os.getloadavg()[0],
        "seconds": time.monotonic() - started,
    }
    report_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
