"""`hetero-ray env`: what this machine offers hetero-ray, for bug reports (as `accelerate env` does).

Versions of the packages a run depends on, the GPUs NVML sees, whether throttled
emulated devices can be made here (a writable cgroup cpu controller), and which Ray
cluster a command would reach with which authentication mode. Nothing here starts
or joins a cluster.
"""

from __future__ import annotations

import os
import platform
from importlib import metadata
from typing import Any

from rich.console import Console
from rich.table import Table

from hetero_ray.cluster.catalog import Catalog
from hetero_ray.cluster.cpu_slices import CgroupError, find_cpu_root
from hetero_ray.cluster.discovery import probe_local_gpus

# The distributions whose versions decide what a run does (DeepSpeed: 1-bit Adam needs 0.19.6).
PACKAGES = ("hetero-ray", "ray", "torch", "deepspeed", "nvidia-ml-py", "pydantic")


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def environment(catalog: Catalog) -> dict[str, Any]:
    """This machine's report as a JSON-ready mapping: versions, GPUs, cgroup support, Ray address and auth mode."""
    gpus, gpu_problem = probe_local_gpus(catalog)
    try:
        cgroup: dict[str, Any] = {"throttled_devices": True, "cpu_root": str(find_cpu_root())}
    except CgroupError as exc:
        cgroup = {"throttled_devices": False, "reason": str(exc)}
    return {
        "versions": {"python": platform.python_version(), **{p: _version(p) for p in PACKAGES}},
        "platform": platform.platform(),
        "gpus": [{"index": g.index, "nvml_name": g.nvml_name, "catalog_name": g.catalog_name} for g in gpus],
        "gpu_problem": gpu_problem,
        "cgroup": cgroup,
        # What `hetero-ray train/discover/profile` pass to ray.init (RAY_ADDRESS, else "auto"), and the mode
        # every process must share: Ray 2.60 turns token authentication on for new clusters. None: not set.
        "ray": {"address": os.environ.get("RAY_ADDRESS"), "auth_mode": os.environ.get("RAY_AUTH_MODE")},
    }


def render_environment(report: dict[str, Any], console: Console) -> None:
    """The report as a two-column table."""
    table = Table(show_header=False)
    for name, version in report["versions"].items():
        table.add_row(name, version)
    table.add_row("platform", report["platform"])
    gpus = ", ".join(f"{g['index']}: {g['nvml_name']} ({g['catalog_name'] or 'not in the catalog'})"
                     for g in report["gpus"])  # fmt: skip
    problem = f" ({report['gpu_problem']})" if report["gpu_problem"] else ""
    table.add_row("GPUs (NVML)", (gpus or "none") + problem)
    cgroup = report["cgroup"]
    table.add_row(
        "throttled devices",
        f"yes (cgroup cpu controller at {cgroup['cpu_root']})" if cgroup["throttled_devices"] else cgroup["reason"],
    )
    table.add_row("Ray address", report["ray"]["address"] or "auto (RAY_ADDRESS not set: a cluster on this machine)")
    table.add_row("Ray auth mode", report["ray"]["auth_mode"] or "RAY_AUTH_MODE not set (Ray's default)")
    console.print(table)
