"""What device a Ray Train worker drives: its GPU type, its torch device, and whether it is emulated."""

from __future__ import annotations

import ray
import torch

from hetero_ray.cluster.catalog import Catalog
from hetero_ray.cluster.cpu_slices import join_device_slice
from hetero_ray.cluster.discovery import probe_local_gpus
from hetero_ray.cluster.emulation import EMULATED_LABEL, GPU_TYPE_LABEL
from hetero_ray.config import RunConfig


class DeviceError(RuntimeError):
    """A worker cannot tell which GPU type it runs on."""


def worker_gpu_type(catalog: Catalog) -> tuple[str, bool]:
    """(catalog name, emulated?) of this worker's device.

    The node label wins (emulated nodes and labelled real nodes); otherwise NVML
    names the GPU Ray assigned to this worker.
    """
    labels = ray.get_runtime_context().get_node_labels()
    if GPU_TYPE_LABEL in labels:
        return catalog.get(labels[GPU_TYPE_LABEL]).name, labels.get(EMULATED_LABEL) == "true"
    gpus, error = probe_local_gpus(catalog)
    ids = ray.get_gpu_ids()
    if error or not gpus or not ids:
        raise DeviceError(
            f"worker on node {ray.get_runtime_context().get_node_id()[:8]} has no label {GPU_TYPE_LABEL} "
            f"and no GPU found by NVML ({error or 'no GPU assigned'})"
        )
    gpu = next((g for g in gpus if str(g.index) == str(ids[0])), gpus[0])
    if gpu.catalog_name is None:
        raise DeviceError(f"unknown GPU '{gpu.nvml_name}'; declare it in a gpus file (gpus_file in the config)")
    return gpu.catalog_name, False


def torch_device(emulated: bool) -> torch.device:
    """CUDA for a real GPU worker (Ray sets CUDA_VISIBLE_DEVICES to its GPU), CPU for an emulated one."""
    return torch.device("cuda", 0) if not emulated and torch.cuda.is_available() else torch.device("cpu")


def enter_device(cfg: RunConfig, emulated: bool) -> tuple | None:
    """On a throttled emulated node, move this worker into a free device slice and return the claim (keep it);
    ``None`` elsewhere. A throttled run on an unthrottled node, or the reverse, is an error: its times would
    mean something else than the run says."""
    throttled = emulated and cfg.emulation is not None and cfg.emulation.throttled
    claim = join_device_slice() if emulated else None
    if throttled != (claim is not None):
        node = ray.get_runtime_context().get_node_id()[:8]
        raise DeviceError(
            f"emulation.mode is {cfg.emulation.mode if cfg.emulation else 'absent'} but node {node} "
            f"{'has' if claim else 'has no'} throttled device slices; start the cluster "
            f"{'without' if claim else 'with'} cpu_share, or set emulation.mode to match"
        )
    return claim
