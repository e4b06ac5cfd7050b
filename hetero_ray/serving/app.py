"""Serve a checkpoint's model on idle GPU types, and give the devices back when training needs them.

``deploy`` starts a Serve application of ``NextByteServer`` replicas, each holding one device of the GPU types
asked for (placed by the ``hetero-ray/gpu-type`` label); ``scale`` changes its replica count in place (Serve's
external-scaler API: the replicas that stay keep running and serving); ``replicas`` counts the running ones;
``free_devices`` says what each GPU type has free; ``shutdown`` removes the application.

Imports Ray: Ray reads its authentication mode at import, so import this module only once the cluster's
environment (``RAY_ADDRESS``, ``RAY_AUTH_MODE``, the token) is in ``os.environ``.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from pathlib import Path

import ray
from ray import serve

from hetero_ray.cluster.catalog import load_catalog
from hetero_ray.cluster.emulation import EMULATED_LABEL, EMULATED_RESOURCE, GPU_TYPE_LABEL
from hetero_ray.serving.deployment import DEPLOYMENT, NextByteServer
from hetero_ray.serving.model import ServeError, load_predictor

DEFAULT_NAME = "hetero-ray"
DEFAULT_PORT = 8000
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
_POLL_S = 0.5


def _connect() -> None:
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=False)


def _client():
    """Ray's own client of the dashboard's Serve REST API (as `serve status` uses), with the cluster's token."""
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient
    from ray.dashboard.utils import get_address_for_submission_client

    return ServeSubmissionClient(get_address_for_submission_client(None))


def _replicas_by_state(name: str, client=None) -> dict[str, int]:
    details = (client or _client()).get_serve_details()
    app = details.get("applications", {}).get(name)
    if app is None:
        raise ServeError(
            f"no Serve application {name!r} on this cluster (it has: {', '.join(details.get('applications', {})) or 'none'})"
        )
    if app["status"] == "DEPLOY_FAILED":
        lines = [line for line in (app.get("message") or "").splitlines() if line.strip()]
        raise ServeError(f"{name}: deploying failed: {lines[-1] if lines else 'no message'}")
    counts: dict[str, int] = {}
    for replica in app["deployments"].get(DEPLOYMENT, {}).get("replicas", []):
        counts[replica["state"]] = counts.get(replica["state"], 0) + 1
    return counts


def replicas(name: str = DEFAULT_NAME) -> int:
    """How many replicas of application ``name`` are running (answering requests) now."""
    return _replicas_by_state(name).get("RUNNING", 0)


def _wait(name: str, target: int, wait_s: float, client=None) -> None:
    """Until exactly ``target`` replicas run and none is starting or stopping."""
    client = client or _client()
    deadline = time.monotonic() + wait_s
    while True:
        counts = _replicas_by_state(name, client)
        if counts.get("RUNNING", 0) == target and sum(counts.values()) == target:
            return
        if time.monotonic() > deadline:
            states = ", ".join(f"{n} {s.lower()}" for s, n in sorted(counts.items())) or "none"
            raise ServeError(
                f"{name}: {counts.get('RUNNING', 0)} of {target} replicas running after {wait_s:.0f} s ({states}); "
                "a replica waits until a device of its GPU types is free"
            )
        time.sleep(_POLL_S)


def _gpu_nodes() -> list[dict]:
    return [n for n in ray.nodes() if n["Alive"] and n.get("Labels", {}).get(GPU_TYPE_LABEL)]


def _placement(gpu_types: Sequence[str] | None, replicas: int) -> tuple[list[str], dict]:
    """The types to place on (default: every GPU type of the cluster) and the replicas' actor options."""
    nodes = _gpu_nodes()
    have = sorted({n["Labels"][GPU_TYPE_LABEL] for n in nodes})
    types = list(gpu_types) if gpu_types else have
    missing = [t for t in types if t not in have]
    if missing:
        raise ServeError(
            f"--types: this cluster has no node of GPU type {missing[0]!r} (its types: {', '.join(have) or 'none'})"
        )
    chosen = [n for n in nodes if n["Labels"][GPU_TYPE_LABEL] in types]
    emulated = {n["Labels"].get(EMULATED_LABEL) == "true" for n in chosen}
    if len(emulated) > 1:
        raise ServeError(f"--types: {', '.join(types)} mix emulated and real devices; serve on one kind")
    emulated_only = emulated.pop()
    resource = EMULATED_RESOURCE if emulated_only else "GPU"
    devices = int(sum(n["Resources"].get(resource, 0) for n in chosen))
    if replicas > devices:
        raise ServeError(f"--replicas: {replicas} replicas need {replicas} devices; {', '.join(types)} have {devices}")
    # Serve 2.60 passes `label_selector` in `ray_actor_options` through to the replica actors, as Ray core does
    # for any actor: a replica starts only on a node whose GPU-type label is one of `types`.
    selector = {GPU_TYPE_LABEL: types[0] if len(types) == 1 else f"in({','.join(types)})"}
    # One device per replica, so a replica really holds it: training asks for the same resource and waits for it.
    device = {"resources": {EMULATED_RESOURCE: 1}} if emulated_only else {"num_gpus": 1}
    return types, {"num_cpus": 1, **device, "label_selector": selector}


def deploy(
    checkpoint: str | os.PathLike[str],
    gpu_types: Sequence[str] | None = None,
    replicas: int = 1,
    *,
    name: str = DEFAULT_NAME,
    port: int = DEFAULT_PORT,
    host: str = "127.0.0.1",
    wait_s: float | None = 120.0,
) -> str:
    """Serve the model of ``checkpoint`` (a local directory every node can read) as application ``name`` with
    ``replicas`` replicas on devices of ``gpu_types`` (None: any GPU type of the cluster); return its URL.

    Bad input (a checkpoint that does not verify or names no workload, a model that is not a next-token model,
    an unknown GPU type or one the cluster lacks, more replicas than devices) raises ``ServeError`` (or the
    catalog's ``UnknownGpuType``) before anything is deployed. The HTTP proxy runs on the head node only, on
    ``host:port``; a Serve instance already running keeps its own port, which the URL then names.
    With ``wait_s`` the call returns once every replica is running, or raises ``ServeError`` after that long.
    """
    if not _NAME.fullmatch(name):
        raise ServeError(f"--name: {name!r}: use letters, digits, '-' and '_' (it is the URL's path)")
    if replicas < 1:
        raise ServeError(f"--replicas: must be >= 1 (got {replicas}); scale to 0 with scale() once deployed")
    catalog = load_catalog()
    for t in gpu_types or ():
        catalog.get(t)  # UnknownGpuType, with "did you mean", for a name no catalog holds
    path = Path(checkpoint).resolve()  # replicas run elsewhere, from another directory
    load_predictor(path)  # bad checkpoint or model: refused here, not in every replica
    _connect()
    types, actor_options = _placement(gpu_types, replicas)
    serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": port})
    app = NextByteServer.options(num_replicas=replicas, ray_actor_options=actor_options).bind(str(path))
    target = serve.RunTarget(target=app, name=name, route_prefix=f"/{name}", external_scaler_enabled=True)
    serve.run_many([target], wait_for_applications_running=False)
    client = _client()
    if wait_s is not None:
        _wait(name, replicas, wait_s, client)
    http = client.get_serve_details().get("http_options", {})
    shown = http.get("host", host)
    if shown in ("0.0.0.0", "::", ""):
        shown = ray.util.get_node_ip_address()
    return f"http://{shown}:{http.get('port', port)}/{name}"


def scale(name: str, replicas: int, *, wait_s: float | None = 60.0) -> int:
    """Set application ``name`` to ``replicas`` replicas in place (0 frees all its devices); return how many run.

    Replicas that stay are not restarted. With ``wait_s`` the call returns once exactly ``replicas`` run and the
    others are gone (their actors stopped: a job asking for their devices is placed as soon as Ray's resource view,
    which lags by a moment, has them back); scaling up waits for free devices of the deployment's GPU types and
    raises ``ServeError`` if they stay busy longer than ``wait_s``.
    """
    if replicas < 0:
        raise ServeError(f"replicas: must be >= 0 (got {replicas})")
    client = _client()
    path = f"/api/v1/applications/{name}/deployments/{DEPLOYMENT}/scale"
    response = client._do_request("POST", path, json_data={"target_num_replicas": replicas})
    if response.status_code != 200:
        try:
            error = response.json().get("error", response.text)
        except ValueError:
            error = response.text
        raise ServeError(f"scale {name} to {replicas}: {error} (HTTP {response.status_code})")
    if wait_s is not None:
        _wait(name, replicas, wait_s, client)
    return _replicas_by_state(name, client).get("RUNNING", 0)


def free_devices() -> dict[str, int]:
    """Devices free now per GPU type of the cluster (emulated devices or real GPUs)."""
    from ray.autoscaler.v2.sdk import get_cluster_status

    _connect()
    status = get_cluster_status(ray.get_runtime_context().gcs_address)
    free: dict[str, int] = {}
    for node in status.active_nodes + status.idle_nodes:
        gpu_type = (node.labels or {}).get(GPU_TYPE_LABEL)
        if gpu_type:
            available = node.available_resources()
            free[gpu_type] = free.get(gpu_type, 0) + int(available.get(EMULATED_RESOURCE, available.get("GPU", 0)))
    return free


def shutdown(name: str = DEFAULT_NAME) -> None:
    """Remove application ``name`` and its replicas (their devices are free when this returns)."""
    _connect()
    serve.delete(name)
