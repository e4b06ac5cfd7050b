"""MIG instances as GPU types of their own, derived from their parent's catalog entry.

A GPU in MIG mode (A100, H100) is cut into GPU instances, each with its own SMs,
memory slices and L2, isolated from its siblings. hetero-ray treats each instance
profile as a catalog type, ``<parent>-MIG-<profile>`` (``A100-80GB-MIG-3g.40gb``),
whose figures are the parent's scaled by the instance's share. Profiles come from
NVIDIA's MIG user guide; hetero-ray only reads MIG state and never changes it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from hetero_ray.cluster.catalog import MIG_MARK, Catalog, GpuSpec

MIG_GUIDE = "https://docs.nvidia.com/datacenter/tesla/mig-user-guide/"
# A100 and H100 have 8 memory slices (and 7 compute slices); a profile holds a whole number of each.
MEMORY_SLICES = 8


class UnknownMigProfile(ValueError):
    """A MIG instance or profile name the table does not hold; the message is one line."""


@dataclass(frozen=True, kw_only=True)
class MigProfile:
    """One GPU-instance profile of a parent GPU, as ``nvidia-smi mig -lgip`` lists it."""

    name: str
    """``<compute slices>g.<memory GB>gb``, e.g. ``3g.40gb``: how NVIDIA, nvidia-smi and Kubernetes name it."""
    profile_id: int
    """The ID ``nvidia-smi mig -lgip`` prints and ``nvmlGpuInstanceProfileInfo_t.id`` holds (``-cgi 9``)."""
    nvml_profile: int
    """The ``NVML_GPU_INSTANCE_PROFILE_*`` index passed to ``nvmlDeviceGetGpuInstanceProfileInfo``."""
    gpu_slices: int
    """Compute slices of 7 (NVML's ``gpuInstanceSliceCount``)."""
    memory_slices: int
    """Memory slices of ``MEMORY_SLICES``."""
    sms: int
    """Streaming multiprocessors of the instance."""
    max_instances: int
    """How many of this profile one GPU holds at most."""


@dataclass(frozen=True, kw_only=True)
class MigParent:
    """The MIG facts of one parent catalog type."""

    sms: int
    """SMs the whole GPU has enabled outside MIG mode (what its catalog FLOP/s are for)."""
    host_link: str
    host_link_gbs: float
    """The GPU's PCIe link to the host, both directions added: MIG instances talk through it only."""
    profiles: tuple[MigProfile, ...]

    def profile(self, name: str) -> MigProfile | None:
        """The profile called ``name``, or ``None``."""
        return next((p for p in self.profiles if p.name == name), None)


def _profile(
    name: str, profile_id: int, nvml_profile: int, memory_slices: int, sms: int, max_instances: int
) -> MigProfile:
    return MigProfile(
        name=name,
        profile_id=profile_id,
        nvml_profile=nvml_profile,
        gpu_slices=int(name.split("g.", 1)[0]),
        memory_slices=memory_slices,
        sms=sms,
        max_instances=max_instances,
    )


# Rows: _profile(name, -lgip ID, NVML index, memory slices, SMs, max instances), from the guide's
# "Supported MIG Profiles" tables and its `nvidia-smi mig -lgip` listings. NVML indices are the
# NVML_GPU_INSTANCE_PROFILE_* constants (nvml.h): 1_SLICE 0, 2_SLICE 1, 3_SLICE 2, 4_SLICE 3, 7_SLICE 4,
# 1_SLICE_REV2 9 (one compute slice, two memory slices). The "+me" profiles (1g.10gb+me, ID 20) have
# the same SMs and memory as their plain one plus media engines, which training does not use: NVML
# reports them alike and they are the same type here.
# The profiles of A100 (2020) and H100 (2022) as the guide lists them; the derived figures are the parent's own.
_SOURCE = (
    f"NVIDIA Multi-Instance GPU User Guide (A100 profiles 2020, H100 2022), Supported MIG Profiles and "
    f"nvidia-smi mig -lgip; {MIG_GUIDE}"
)

_A100_LINK = "PCIe Gen4 x16, 64 GB/s (no NVLink or P2P between MIG instances)"


def _a100_profiles(gb_per_memory_slice: int) -> tuple[MigProfile, ...]:
    """The A100's six profiles: the 40 GB and 80 GB cards differ only in the memory of a slice (5 or 10 GB)."""
    # (compute slices, profile id, NVML profile index, memory slices, SMs, most instances)
    rows = (
        (1, 19, 0, 1, 14, 7),
        (1, 15, 9, 2, 14, 4),
        (2, 14, 1, 2, 28, 3),
        (3, 9, 2, 4, 42, 2),
        (4, 5, 3, 4, 56, 1),
        (7, 0, 4, 8, 98, 1),
    )
    return tuple(
        _profile(f"{g}g.{gb_per_memory_slice * m}gb", pid, nvml, m, sms, most) for g, pid, nvml, m, sms, most in rows
    )


MIG_PARENTS: Mapping[str, MigParent] = {
    # The A100 has 108 SMs enabled; in MIG mode a compute slice is 14 SMs and the seven give 98, so even
    # 7g.40gb/7g.80gb run at 98/108 of the whole GPU.
    "A100-40GB": MigParent(sms=108, host_link=_A100_LINK, host_link_gbs=64, profiles=_a100_profiles(5)),
    "A100-80GB": MigParent(sms=108, host_link=_A100_LINK, host_link_gbs=64, profiles=_a100_profiles(10)),
    # H100 SXM5: 132 SMs, and 7g.80gb holds all of them.
    "H100-80GB": MigParent(
        sms=132,
        host_link="PCIe Gen5 x16, 128 GB/s (no NVLink or P2P between MIG instances)",
        host_link_gbs=128,
        profiles=(
            _profile("1g.10gb", 19, 0, 1, 16, 7),
            _profile("1g.20gb", 15, 9, 2, 26, 4),
            _profile("2g.20gb", 14, 1, 2, 32, 3),
            _profile("3g.40gb", 9, 2, 4, 60, 2),
            _profile("4g.40gb", 5, 3, 4, 64, 1),
            _profile("7g.80gb", 0, 4, 8, 132, 1),
        ),
    ),
}


def mig_type_name(parent: str, profile: str) -> str:
    """The catalog name of a MIG type: ``mig_type_name("A100-80GB", "3g.40gb") == "A100-80GB-MIG-3g.40gb"``."""
    return f"{parent}{MIG_MARK}{profile}"


def profile_name(gpu_slices: int, memory_mib: int) -> str:
    """The profile name of an instance from NVML's ``gpuInstanceSliceCount`` and ``memorySizeMB`` (MiB).

    NVML reports a little less memory than the name says (39.25 GiB for a 3g.40gb of an A100-80GB),
    so the GiB are rounded up, as the Kubernetes device plugin and DCGM name MIG devices.
    """
    return f"{gpu_slices}g.{math.ceil(memory_mib / 1024)}gb"


def _parent(parent_name: str) -> MigParent:
    try:
        return MIG_PARENTS[parent_name]
    except KeyError:
        raise UnknownMigProfile(
            f"no MIG profile table for GPU type {parent_name!r}; hetero-ray has one for {', '.join(MIG_PARENTS)}"
        ) from None


def find_profile(parent_name: str, gpu_slices: int, memory_mib: int) -> MigProfile:
    """The profile of a MIG instance of a ``parent_name`` GPU; ``UnknownMigProfile`` if none has that size."""
    parent = _parent(parent_name)
    name = profile_name(gpu_slices, memory_mib)
    found = parent.profile(name)
    if found is None:
        raise UnknownMigProfile(
            f"a {gpu_slices}-slice MIG instance of {memory_mib / 1024:g} GiB ({memory_mib} MiB, {name}) "
            f"matches no {parent_name} MIG profile ({', '.join(p.name for p in parent.profiles)}; {MIG_GUIDE})"
        )
    return found


def mig_spec(parent_spec: GpuSpec, profile: str) -> GpuSpec:
    """The catalog type of one MIG profile of ``parent_spec``, its figures the parent's scaled by its share.

    Peak FLOP/s scale with SMs (the SMs are the instance's, clocks and per-SM rates are the parent's);
    memory and memory bandwidth with memory slices (each slice has its own memory controllers).
    Interconnect: the host's PCIe link. MIG has no NVLink or GPU-to-GPU P2P between instances, even on
    one GPU, so instances exchange gradients through host memory; the whole link's figure is given
    (siblings share it), an upper bound like every other figure in the catalog.
    """
    parent = _parent(parent_spec.name)
    found = parent.profile(profile)
    if found is None:
        raise UnknownMigProfile(
            f"{parent_spec.name} has no MIG profile {profile!r}; it has {', '.join(p.name for p in parent.profiles)}"
        )
    compute = found.sms / parent.sms
    memory = found.memory_slices / MEMORY_SLICES
    return GpuSpec(
        name=mig_type_name(parent_spec.name, found.name),
        architecture=parent_spec.architecture,
        compute_capability=parent_spec.compute_capability,
        memory_gib=parent_spec.memory_gib * memory,
        memory_bandwidth_gbs=parent_spec.memory_bandwidth_gbs * memory,
        peak_tflops={p: tflops * compute for p, tflops in parent_spec.peak_tflops.items()},
        interconnect=parent.host_link,
        interconnect_gbs=parent.host_link_gbs,
        # NVML names physical GPUs; MIG devices are recognised by their parent and profile instead.
        nvml_names=(),
        source=(
            f"derived from {parent_spec.name}: {found.sms}/{parent.sms} SMs, "
            f"{found.memory_slices}/{MEMORY_SLICES} memory slices; {_SOURCE}"
        ),
    )


def mig_types(parent_spec: GpuSpec) -> tuple[GpuSpec, ...]:
    """Every MIG type of ``parent_spec``; none if it has no MIG profile table."""
    parent = MIG_PARENTS.get(parent_spec.name)
    return tuple(mig_spec(parent_spec, p.name) for p in parent.profiles) if parent else ()


def with_mig_types(catalog: Catalog) -> Catalog:
    """``catalog`` plus the MIG types of every parent it holds, so that planners look them up by name.

    A type the catalog already holds under a MIG type's name (a user's own figures) is kept.
    """
    derived = [spec for name in catalog for spec in mig_types(catalog.get(name)) if spec.name not in catalog]
    return catalog.with_types(derived)
