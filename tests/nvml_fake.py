"""A fake of the ``pynvml`` module for unit tests: a fixed machine, no driver, MIG included.

It uses pynvml's own error class, constants and structures, so the code under test sees
the same exceptions and values as with the real binding. What it models of MIG follows
NVIDIA's MIG user guide (https://docs.nvidia.com/datacenter/tesla/mig-user-guide/) and
NVML's API reference: MIG mode is (current, pending); MIG device indices run to
``nvmlDeviceGetMaxMigDeviceCount`` with gaps, a gap answering NVML_ERROR_NOT_FOUND;
``nvmlDeviceGetAttributes`` answers for MIG device handles only; a GPU holds at most 7
compute slices, 8 memory slices and each profile's documented number of instances.
Any NVML call that changes state (``nvmlDeviceSet*``, ``*Create*``, ``*Destroy*``,
``*Reset*``) is recorded in ``forbidden_calls`` and fails the test.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import pynvml

MiB = 2**20
GiB = 2**30


@dataclass(frozen=True)
class LgipProfile:
    """One row of ``nvidia-smi mig -lgip``."""

    name: str
    gpu_slices: int
    memory_slices: int
    sms: int
    memory_mib: int
    """NVML's ``memorySizeMB`` of an instance: the GiB ``-lgip`` prints (39.25 for 3g.40gb) × 1024."""
    max_instances: int


# By GPU name, profile ID → profile, as the MIG user guide lists them. Transcribed here apart from
# hetero_ray/cluster/mig.py, so that tests check the one against the other.
LGIP: dict[str, dict[int, LgipProfile]] = {
    "NVIDIA A100-SXM4-80GB": {
        19: LgipProfile("1g.10gb", 1, 1, 14, 9728, 7),
        15: LgipProfile("1g.20gb", 1, 2, 14, 19968, 4),
        14: LgipProfile("2g.20gb", 2, 2, 28, 19968, 3),
        9: LgipProfile("3g.40gb", 3, 4, 42, 40192, 2),
        5: LgipProfile("4g.40gb", 4, 4, 56, 40192, 1),
        0: LgipProfile("7g.80gb", 7, 8, 98, 81152, 1),
    },
    "NVIDIA H100 80GB HBM3": {
        19: LgipProfile("1g.10gb", 1, 1, 16, 9984, 7),
        15: LgipProfile("1g.20gb", 1, 2, 26, 20096, 4),
        14: LgipProfile("2g.20gb", 2, 2, 32, 20096, 3),
        9: LgipProfile("3g.40gb", 3, 4, 60, 40448, 2),
        5: LgipProfile("4g.40gb", 4, 4, 64, 40448, 1),
        0: LgipProfile("7g.80gb", 7, 8, 132, 81152, 1),
    },
}
MAX_MIG_DEVICES = 7

# NVML calls that change a GPU's state; discovery must never make one.
_MUTATOR = re.compile(r"^nvml\w*?(Set|Create|Destroy|Reset|Clear)(?![a-z])")


@dataclass(frozen=True)
class MigHandle:
    """A MIG device handle: its parent GPU's index and its MIG device index there."""

    parent: int
    index: int


def mig(gpu: dict, instances: dict[int, int | dict], *, current: int = 1, pending: int | None = None) -> dict:
    """``gpu`` in MIG mode with ``instances``: MIG device index → profile ID, or raw attributes
    (``slices``, ``ci_slices``, ``sms``, ``memory_mib``) for a profile the guide does not list.

    Checks the instances fit one GPU as the guide says (counts per profile, 7 compute and 8 memory slices).
    """
    profiles = LGIP[gpu["name"]]
    counts: dict[int, int] = {}
    for entry in instances.values():
        if isinstance(entry, int):
            counts[entry] = counts.get(entry, 0) + 1
            assert counts[entry] <= profiles[entry].max_instances, f"more {profiles[entry].name} than a GPU holds"
    assert sum(profiles[p].gpu_slices * n for p, n in counts.items()) <= 7, "more than 7 compute slices"
    assert sum(profiles[p].memory_slices * n for p, n in counts.items()) <= 8, "more than 8 memory slices"
    assert all(0 <= i < MAX_MIG_DEVICES for i in instances)
    return {
        **gpu,
        "mig": {"current": current, "pending": current if pending is None else pending, "instances": instances},
    }


class StubNvml:
    """STUB of the ``pynvml`` module for unit tests only: a fixed machine, no driver.

    ``devices`` are dicts: ``name``, ``memory`` (bytes), ``cc``; ``lost: True`` for a GPU that fell off
    the bus; ``mig`` (see ``mig``) for a GPU in MIG mode or with a MIG mode change pending.
    """

    NVMLError = pynvml.NVMLError

    def __init__(self, devices: list[dict], nvlinks: set[frozenset[int]] = frozenset(), init_error: int | None = None):
        self.devices, self.nvlinks, self.init_error = devices, nvlinks, init_error
        self.open = False
        self.forbidden_calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("NVML_"):
            return getattr(pynvml, name)
        if _MUTATOR.match(name):
            self.forbidden_calls.append(name)
            raise AssertionError(f"{name} changes the GPU's state; hetero-ray must only read NVML")
        raise AttributeError(f"the NVML fake does not model {name}")

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.open = True

    def nvmlShutdown(self) -> None:
        self.open = False

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def _device(self, handle: int | MigHandle) -> dict:
        assert self.open, "NVML used outside nvmlInit/nvmlShutdown"
        device = self.devices[handle.parent if isinstance(handle, MigHandle) else handle]
        if device.get("lost"):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return device

    def _instance(self, handle: MigHandle) -> tuple[str, int, int, int, int]:
        """(profile name, GPU-instance slices, compute-instance slices, SMs, memory MiB) of a MIG device."""
        entry = self._device(handle)["mig"]["instances"][handle.index]
        if isinstance(entry, int):
            p = LGIP[self._device(handle)["name"]][entry]
            return p.name, p.gpu_slices, p.gpu_slices, p.sms, p.memory_mib
        name = f"{entry['slices']}g.{-(-entry['memory_mib'] // 1024)}gb"
        return name, entry["slices"], entry.get("ci_slices", entry["slices"]), entry["sms"], entry["memory_mib"]

    def nvmlDeviceGetName(self, handle: int | MigHandle) -> str:
        name = self._device(handle)["name"]
        return f"{name} MIG {self._instance(handle)[0]}" if isinstance(handle, MigHandle) else name

    def nvmlDeviceGetMemoryInfo(self, handle: int | MigHandle) -> pynvml.c_nvmlMemory_t:
        if isinstance(handle, MigHandle):
            total = self._instance(handle)[4] * MiB
        else:
            total = self._device(handle)["memory"]
        return pynvml.c_nvmlMemory_t(total=total, free=0, used=0)

    def nvmlDeviceGetCudaComputeCapability(self, handle: int | MigHandle) -> tuple[int, int]:
        return self._device(handle)["cc"]

    def nvmlDeviceGetUUID(self, handle: int | MigHandle) -> str:
        if isinstance(handle, MigHandle):
            return f"MIG-stub-{handle.parent}-{handle.index}"
        return f"GPU-stub-{handle}"

    def nvmlDeviceGetP2PStatus(self, a: int, b: int, index: int) -> int:
        assert index == pynvml.NVML_P2P_CAPS_INDEX_NVLINK
        assert not isinstance(a, MigHandle) and not isinstance(b, MigHandle), "MIG devices have no P2P"
        if self.devices[a].get("name") == "NVIDIA A10G":
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        linked = frozenset((a, b)) in self.nvlinks
        return pynvml.NVML_P2P_STATUS_OK if linked else pynvml.NVML_P2P_STATUS_NOT_SUPPORTED

    # --- MIG: read-only calls --------------------------------------------------------------

    def _mig_capable(self, handle: int) -> dict:
        device = self._device(handle)
        if device["name"] not in LGIP and "mig" not in device:  # pre-Ampere, and boards without MIG (A10G)
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return device

    def nvmlDeviceGetMigMode(self, handle: int) -> list[int]:
        mode = self._mig_capable(handle).get("mig", {"current": 0, "pending": 0})
        return [mode["current"], mode["pending"]]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: int) -> int:
        self._mig_capable(handle)
        return MAX_MIG_DEVICES

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: int, index: int) -> MigHandle:
        mode = self._mig_capable(handle).get("mig", {"current": 0})
        if mode["current"] != pynvml.NVML_DEVICE_MIG_ENABLE or not 0 <= index < MAX_MIG_DEVICES:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if index not in mode["instances"]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return MigHandle(handle, index)

    def nvmlDeviceGetAttributes(self, handle: int | MigHandle) -> pynvml.c_nvmlDeviceAttributes:
        if not isinstance(handle, MigHandle):  # NVML: "currently only supports MIG device handles"
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        _, gi_slices, ci_slices, sms, memory_mib = self._instance(handle)
        return pynvml.c_nvmlDeviceAttributes(
            multiprocessorCount=sms * ci_slices // gi_slices,
            gpuInstanceSliceCount=gi_slices,
            computeInstanceSliceCount=ci_slices,
            memorySizeMB=memory_mib,
        )
