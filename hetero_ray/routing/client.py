"""Submitting a job of a class, and the cluster's state by GPU type: what ``hetero-ray submit`` and
``hetero-ray status`` call (the process is connected to the cluster with ``ray.init``).

A submitted job's entrypoint is wrapped (``python -m hetero_ray.routing.run``): in the job's driver it asks the
ledger for devices, runs the user's command with them in ``HETERO_RAY_DEVICES`` (``hetero-ray train`` plans
for exactly those), and gives them back when the command ends.
"""

from __future__ import annotations

import os
import shlex
import sys
import uuid
from collections.abc import Sequence

from hetero_ray.cluster.catalog import Catalog
from hetero_ray.cluster.emulation import EMULATED_RESOURCE, GPU_TYPE_LABEL
from hetero_ray.routing.ledger import get_ledger
from hetero_ray.routing.policy import Policy, PolicyError, check_class, default_policy


def cluster_devices() -> dict[str, int]:
    """Devices per GPU type of the connected cluster's live nodes (by their ``hetero-ray/gpu-type`` label), in
    the order ``ray.nodes()`` lists them (by node id: the order first fit takes types in, which no one chose)."""
    import ray

    devices: dict[str, int] = {}
    for node in ray.nodes():
        gpu_type = (node.get("Labels") or {}).get(GPU_TYPE_LABEL)
        if node["Alive"] and gpu_type:
            resources = node["Resources"]
            devices[gpu_type] = devices.get(gpu_type, 0) + int(
                resources.get(EMULATED_RESOURCE, resources.get("GPU", 0))
            )
    return {t: n for t, n in devices.items() if n}


def open_ledger(name: str, catalog: Catalog, policy: Policy | None):
    """The cluster's ledger ``name``, created with ``policy`` (``None``: the default for the cluster's types) when
    it is the first; ``PolicyError`` when it runs another policy than the one asked."""
    import ray

    devices = cluster_devices()
    if not devices:
        raise PolicyError(f"the cluster has no node labelled {GPU_TYPE_LABEL}: no GPU type to route jobs to")
    policy = policy or default_policy(list(devices), catalog)
    ledger = get_ledger(name, devices, policy)
    running = ray.get(ledger.policy_name.remote())
    if running != policy.name:
        raise PolicyError(
            f"--policy: the cluster's job ledger {name!r} runs policy {running!r}, not {policy.name!r}; submit with "
            "the same policy, or use another --ledger"
        )
    return ledger


def submit(
    command: Sequence[str],
    *,
    job_class: str,
    gpus: int,
    only: Sequence[str] | None,
    ledger,
    ledger_name: str,
    address: str | None = None,
) -> str:
    """Submit ``command`` as a Ray job of ``job_class`` wanting ``gpus`` devices (of the ``only`` types, if
    given); the submission id. Refuses, in one line, a job that could never be placed."""
    import ray
    from ray.job_submission import JobSubmissionClient

    check_class(job_class)
    if gpus < 1:
        raise PolicyError(f"--gpus: {gpus}; a job needs at least 1 device")
    if not command:
        raise PolicyError("submit: no command after --; e.g. hetero-ray submit --class train -- python jobs/train.py …")
    problem = ray.get(ledger.problem.remote(job_class, gpus, list(only) if only else None))
    if problem:
        raise PolicyError(problem)
    job_id = f"{job_class}-{uuid.uuid4().hex[:8]}"
    wrapper = [sys.executable, "-m", "hetero_ray.routing.run", "--class", job_class, "--gpus", str(gpus)]
    wrapper += ["--ledger", ledger_name, "--job", job_id, *(["--only", ",".join(only)] if only else []), "--"]
    client = JobSubmissionClient(address or os.environ.get("RAY_API_SERVER_ADDRESS"))
    return client.submit_job(entrypoint=shlex.join([*wrapper, *command]), submission_id=job_id)


def ledger_status(name: str) -> dict:
    """The ledger's ``status()``."""
    import ray

    return ray.get(get_ledger(name).status.remote())
