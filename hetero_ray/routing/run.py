"""A routed job's driver: ``python -m hetero_ray.routing.run --class C --gpus N [--only T,…] -- COMMAND…``.

Waits for the ledger to grant the job its devices (shrinking the Serve applications that held some), runs
``COMMAND`` with them in ``HETERO_RAY_DEVICES``
(``{"A100-80GB": 2}``), its class in ``HETERO_RAY_JOB_CLASS`` and its id in ``HETERO_RAY_JOB_ID``, and gives the devices back when the
command ends, fails, or the job is stopped (``ray job stop`` sends SIGTERM), growing the Serve applications
into what is free again.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys

import ray

from hetero_ray.routing.ledger import get_ledger
from hetero_ray.routing.policy import CLASS_ENV, DEVICES_ENV, JOB_ENV


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hetero_ray.routing.run", description=__doc__.splitlines()[0])
    parser.add_argument("--class", dest="job_class", required=True)
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--only", help="comma-separated GPU types the job may use")
    parser.add_argument("--ledger", default="default")
    parser.add_argument("--job", required=True, help="the job's submission id: what the ledger knows it by")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    job = args.job
    ray.init(address="auto", log_to_driver=False)
    ledger = get_ledger(args.ledger)
    child: list[subprocess.Popen] = []

    def stop(signum, frame):
        for process in child:
            process.terminate()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        only = args.only.split(",") if args.only else None
        grant = ray.get(ledger.acquire.remote(job, args.job_class, args.gpus, only))
        devices = grant["devices"]
        print(f"hetero-ray: job {job} ({args.job_class}) got {devices}", flush=True)
        rescale(grant["reclaim"], "devices for this job")
        env = {**os.environ, DEVICES_ENV: json.dumps(devices), CLASS_ENV: args.job_class, JOB_ENV: job}
        child.append(subprocess.Popen(command, env=env))
        return child[0].wait()
    finally:
        rescale(ray.get(ledger.release.remote(job)), "devices free again")
        ray.shutdown()


def rescale(counts: dict[str, int], why: str) -> None:
    """Set each Serve application of ``counts`` to its replica count (the ledger's decision), saying why."""
    if not counts:
        return
    from hetero_ray.serving.app import scale

    for app, replicas in counts.items():
        print(f"hetero-ray: Serve application {app} to {replicas} replicas ({why})", flush=True)
        scale(app, replicas)


if __name__ == "__main__":
    sys.exit(main())
