"""Discovery: which GPUs each Ray node has, read with NVML on the node itself.

One zero-CPU Ray task per alive node, pinned to it, reads NVML there and maps
device names to catalog names. Nodes without NVML (CI, laptops) report why
instead of failing. Emulated nodes (label ``hetero-ray/emulated=true``) report
their emulated type and count apart from any real GPU, never as one. A GPU in MIG
mode is reported as its MIG devices, each of a MIG type (``cluster/mig.py``);
discovery only reads MIG state and never changes it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from rich.console import Console
from rich.table import Table

from hetero_ray.cluster.catalog import GPUS_ENV_VAR, Catalog
from hetero_ray.cluster.emulation import EMULATED_LABEL, EMULATED_RESOURCE, GPU_TYPE_LABEL
from hetero_ray.cluster.mig import MIG_PARENTS, UnknownMigProfile, find_profile, mig_type_name, profile_name

# Enough for NVML on a loaded node; a node that cannot run a zero-CPU task in this
# long is reported as not answering rather than hanging the command.
PROBE_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuInfo:
    """One physical GPU, or one MIG device of a GPU in MIG mode, as NVML reports it."""

    index: int
    """NVML device index on its node; for a MIG device, its MIG device index on its parent GPU."""
    nvml_name: str
    """The NVML name of the GPU (of the parent GPU, for a MIG device)."""
    catalog_name: str | None
    """The catalog type (a MIG type such as ``A100-80GB-MIG-3g.40gb`` for a MIG device), or ``None`` when no
    type claims ``nvml_name``."""
    memory_total_bytes: int
    compute_capability: tuple[int, int]
    uuid: str
    nvlink_peers: tuple[str, ...]
    """UUIDs of the GPUs on the same node it reaches over NVLink (directly or through NVSwitch); none for MIG."""
    mig_profile: str | None = None
    """The MIG profile of a MIG device, e.g. ``3g.40gb``; ``None`` for a whole GPU."""
    mig_parent_index: int | None = None
    """NVML index of the GPU a MIG device is part of; ``None`` for a whole GPU."""
    note: str | None = None
    """One line worth knowing that is no problem, e.g. a MIG mode change pending until the GPU resets."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeReport:
    """What one Ray node has: real GPUs, emulated GPUs, or why it has none."""

    node_id: str
    node_ip: str
    labels: Mapping[str, str] = dataclasses.field(hash=False)
    gpus: tuple[GpuInfo, ...]
    error: str | None
    """One line, e.g. ``no NVIDIA GPU on node 1a2b3c4d (NVML: Driver Not Loaded)``."""
    emulated_gpu_type: str | None
    """The ``hetero-ray/gpu-type`` label of an emulated node; ``None`` on real nodes."""
    emulated_gpu_count: int

    @property
    def short_id(self) -> str:
        """The node id as shown in tables and messages."""
        return _short_id(self.node_id)


def _short_id(node_id: str) -> str:
    # 8 hex digits tell apart the nodes of any one cluster, as git's short hashes do.
    return node_id[:8]


def probe_local_gpus(catalog: Catalog, *, nvml: Any = None) -> tuple[tuple[GpuInfo, ...], str | None]:
    """The GPUs of this machine via NVML, and a one-line problem or ``None``.

    ``nvml`` is the NVML binding module (``pynvml`` from nvidia-ml-py by default);
    tests pass a stand-in. Never raises for a missing driver or GPU: it returns
    no GPUs and the reason. A device that cannot be read is left out and named
    in the problem; the others are still returned.
    """
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError as exc:
            return (), f"nvidia-ml-py not importable: {exc}"
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        return (), f"NVML: {exc}"
    try:
        return _read_devices(nvml, catalog)
    finally:
        nvml.nvmlShutdown()


def _read_devices(nvml: Any, catalog: Catalog) -> tuple[tuple[GpuInfo, ...], str | None]:
    try:
        count = nvml.nvmlDeviceGetCount()
    except nvml.NVMLError as exc:
        return (), f"NVML: {exc}"
    if count == 0:
        return (), "NVML: no devices"
    # (NVML handle of a whole GPU, or None for a MIG device, which has no NVLink peers; the device without its peers)
    read: list[tuple[Any, GpuInfo]] = []
    problems = []
    for index in range(count):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            name = nvml.nvmlDeviceGetName(handle)
            info = GpuInfo(
                index=index,
                nvml_name=name,
                catalog_name=catalog.normalise(name),
                memory_total_bytes=int(nvml.nvmlDeviceGetMemoryInfo(handle).total),
                compute_capability=tuple(nvml.nvmlDeviceGetCudaComputeCapability(handle)),
                uuid=nvml.nvmlDeviceGetUUID(handle),
                nvlink_peers=(),
            )
            current, pending = _mig_mode(nvml, handle)
            if current == nvml.NVML_DEVICE_MIG_ENABLE:
                note = None if pending == current else "MIG mode pending: off after the next GPU reset"
                devices, problem = _read_mig_devices(nvml, handle, info, note)
                read += [(None, device) for device in devices]
                problems += problem
            else:
                note = "MIG mode pending: on after the next GPU reset" if pending != current else None
                read.append((handle, dataclasses.replace(info, note=note)))
        except nvml.NVMLError as exc:
            problems.append(f"GPU {index} unreadable (NVML: {exc})")
    gpus = tuple(
        dataclasses.replace(
            info,
            nvlink_peers=tuple(
                peer.uuid for h, peer in read if h is not None and peer is not info and _nvlinked(nvml, handle, h)
            ),
        )
        if handle is not None
        else info
        for handle, info in read
    )
    return gpus, "; ".join(problems) or None


def _mig_mode(nvml: Any, handle: Any) -> tuple[int, int]:
    """(current, pending) MIG mode; disabled on a GPU or driver without MIG."""
    try:
        current, pending = nvml.nvmlDeviceGetMigMode(handle)
    except nvml.NVMLError as exc:
        if exc.value in (nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_FUNCTION_NOT_FOUND):
            return nvml.NVML_DEVICE_MIG_DISABLE, nvml.NVML_DEVICE_MIG_DISABLE
        raise
    return current, pending


def _read_mig_devices(nvml: Any, handle: Any, parent: GpuInfo, note: str | None) -> tuple[list[GpuInfo], list[str]]:
    """The MIG devices of a GPU in MIG mode, each typed by its profile, and one line per device left out.

    The profile is read from the device's attributes (GPU-instance slices and memory), which NVML gives
    any user, where reading GPU-instance profiles by ID needs root.
    """
    where = f"GPU {parent.index} ({parent.nvml_name})"
    if parent.catalog_name is not None and parent.catalog_name not in MIG_PARENTS:
        return [], [
            f"{where} is in MIG mode but hetero-ray has no MIG profile table for {parent.catalog_name} "
            f"(it has {', '.join(MIG_PARENTS)}); its MIG devices are left out"
        ]
    devices, problems = [], []
    for mig_index in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, mig_index)
        except nvml.NVMLError as exc:
            if exc.value == nvml.NVML_ERROR_NOT_FOUND:  # no MIG device at this index: indices have gaps
                continue
            problems.append(f"{where} MIG device {mig_index} unreadable (NVML: {exc})")
            continue
        try:
            attributes = nvml.nvmlDeviceGetAttributes(mig)
            memory = int(nvml.nvmlDeviceGetMemoryInfo(mig).total)
            uuid = nvml.nvmlDeviceGetUUID(mig)
        except nvml.NVMLError as exc:
            problems.append(f"{where} MIG device {mig_index} unreadable (NVML: {exc})")
            continue
        slices, memory_mib = attributes.gpuInstanceSliceCount, attributes.memorySizeMB
        if attributes.computeInstanceSliceCount != slices:
            problems.append(
                f"{where} MIG device {mig_index}: a compute instance of {attributes.computeInstanceSliceCount} of "
                f"the {slices} slices of a {profile_name(slices, memory_mib)} GPU instance shares its memory with "
                "other compute instances; hetero-ray plans whole GPU instances only, so it is left out"
            )
            continue
        catalog_name, profile = None, profile_name(slices, memory_mib)
        if parent.catalog_name is not None:
            try:
                profile = find_profile(parent.catalog_name, slices, memory_mib).name
            except UnknownMigProfile as exc:
                problems.append(f"{where} MIG device {mig_index}: {exc}; left out")
                continue
            catalog_name = mig_type_name(parent.catalog_name, profile)
        devices.append(
            GpuInfo(
                index=mig_index,
                nvml_name=parent.nvml_name,
                catalog_name=catalog_name,
                memory_total_bytes=memory,
                compute_capability=parent.compute_capability,
                uuid=uuid,
                nvlink_peers=(),  # MIG has no NVLink or P2P, not even between instances of one GPU
                mig_profile=profile,
                mig_parent_index=parent.index,
                note=note,
            )
        )
    if not devices and not problems:
        problems.append(
            f"{where} is in MIG mode with no MIG devices; create GPU and compute instances "
            "(nvidia-smi mig -cgi <profiles> -C) or turn MIG mode off: hetero-ray never changes MIG settings"
        )
    return devices, problems


def _nvlinked(nvml: Any, a: Any, b: Any) -> bool:
    # NVML's P2P status over NVLink covers direct links and NVSwitch alike, which
    # per-link remote PCI ids do not (through a switch they name the switch).
    try:
        return nvml.nvmlDeviceGetP2PStatus(a, b, nvml.NVML_P2P_CAPS_INDEX_NVLINK) == nvml.NVML_P2P_STATUS_OK
    except nvml.NVMLError:
        return False


def discover(catalog: Catalog, *, timeout_s: float = PROBE_TIMEOUT_S) -> list[NodeReport]:
    """Probe every alive node of the connected Ray cluster (``ray.init`` first), sorted by IP.

    Each probe is a zero-CPU task pinned to its node (hard affinity), so it runs
    even on a fully busy node and never on another one.
    """
    probe = ray.remote(num_cpus=0, max_retries=0)(probe_local_gpus)
    nodes = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: (n["NodeManagerAddress"], n["NodeID"]))
    refs = [
        probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(catalog)
        for n in nodes
    ]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    done = set(ready)
    reports = []
    for node, ref in zip(nodes, refs):
        if ref not in done:
            ray.cancel(ref, force=True)
            gpus, problem = (), f"probe did not finish within {timeout_s:g} s"
        else:
            try:
                gpus, problem = ray.get(ref)
            except ray.exceptions.RayError as exc:
                gpus, problem = (), f"probe failed: {str(exc).strip().splitlines()[0]}"
        reports.append(_node_report(node, gpus, problem, catalog))
    return reports


def _node_report(
    node: Mapping[str, Any], gpus: tuple[GpuInfo, ...], problem: str | None, catalog: Catalog
) -> NodeReport:
    labels = dict(node.get("Labels") or {})
    emulated = labels.get(EMULATED_LABEL) == "true"
    emulated_type = labels.get(GPU_TYPE_LABEL) if emulated else None
    short_id = _short_id(node["NodeID"])
    problems = []
    if problem:
        problems.append(f"no NVIDIA GPU on node {short_id} ({problem})" if not gpus else f"node {short_id}: {problem}")
    if emulated and emulated_type not in catalog:
        problems.append(f"emulated node {short_id}: label {GPU_TYPE_LABEL}={emulated_type!r} is not a catalog type")
    return NodeReport(
        node_id=node["NodeID"],
        node_ip=node["NodeManagerAddress"],
        labels=labels,
        gpus=gpus,
        error="; ".join(problems) or None,
        emulated_gpu_type=emulated_type,
        emulated_gpu_count=int(node["Resources"].get(EMULATED_RESOURCE, 0)) if emulated else 0,
    )


def unknown_gpu_message(reports: Iterable[NodeReport]) -> str | None:
    """One line naming the NVML device names no catalog type claims and how to declare them; ``None`` if none."""
    where: dict[str, list[str]] = {}
    for report in reports:
        for gpu in report.gpus:
            if gpu.catalog_name is None and report.short_id not in where.setdefault(gpu.nvml_name, []):
                where[gpu.nvml_name].append(report.short_id)
    if not where:
        return None
    names = "; ".join(f"{name!r} (node {', '.join(nodes)})" for name, nodes in sorted(where.items()))
    return (
        f"GPU model(s) not in the catalog: {names}; declare each in a gpus YAML (the schema of "
        f"hetero_ray/cluster/gpus.yaml, with the NVML name under nvml_names) and pass it with "
        f"--gpus FILE or {GPUS_ENV_VAR}=FILE"
    )


def gpu_type_label(gpus: Iterable[GpuInfo]) -> str | None:
    """The value of the ``hetero-ray/gpu-type`` label for a node with ``gpus``: their one catalog type.

    On a node of MIG devices it is their MIG type (``A100-80GB-MIG-3g.40gb``). ``None`` when the node has
    no GPU, one the catalog lacks, or several types (a Ray node carries one value; split such a node).
    """
    types = {gpu.catalog_name for gpu in gpus}
    return types.pop() if len(types) == 1 and None not in types else None


def label_problems(reports: Iterable[NodeReport]) -> list[str]:
    """One line per real node whose ``hetero-ray/gpu-type`` label is not what its GPUs are (a card put in MIG
    mode after its node was labelled, say): jobs placed by the label would plan for the wrong device."""
    problems = []
    for report in reports:
        given, found = report.labels.get(GPU_TYPE_LABEL), gpu_type_label(report.gpus)
        if report.emulated_gpu_type is None and given and found and given != found:
            problems.append(
                f"node {report.short_id}: label {GPU_TYPE_LABEL}={given} but its GPUs are {found}; "
                f"label it {found} (cluster.yaml's node type labels)"
            )
    return problems


def render_table(reports: Sequence[NodeReport], console: Console) -> None:
    """Print one row per GPU kind per node (real, emulated, or the node's error) as a rich table."""
    table = Table(title="hetero-ray discover")
    for column in ("node", "ip", "gpu type", "count", "memory", "CC", "NVLink peers", "status"):
        table.add_column(column, justify="right" if column in ("count", "memory") else "left")
    for report in reports:
        rows = _gpu_rows(report.gpus)
        if report.emulated_gpu_type is not None:
            emulated = f"{report.emulated_gpu_type} (emulated)"
            rows.append([emulated, str(report.emulated_gpu_count), "—", "—", "—", "emulated"])
        if report.error:
            rows.append(["—", "", "", "", "", f"[red]{report.error}[/red]"])
        for i, row in enumerate(rows):
            table.add_row(report.short_id if i == 0 else "", report.node_ip if i == 0 else "", *row)
        table.add_section()
    console.print(table)


def _gpu_rows(gpus: Sequence[GpuInfo]) -> list[list[str]]:
    """One row per (type, memory, CC, parent GPU of MIG devices, note) group of real GPUs."""
    groups: dict[tuple[str, int, tuple[int, int], bool, int | None, str | None], list[GpuInfo]] = {}
    for gpu in gpus:
        known = gpu.catalog_name is not None
        kind = gpu.catalog_name or (f"{gpu.nvml_name} MIG {gpu.mig_profile}" if gpu.mig_profile else gpu.nvml_name)
        key = (kind, gpu.memory_total_bytes, gpu.compute_capability, known, gpu.mig_parent_index, gpu.note)
        groups.setdefault(key, []).append(gpu)
    rows = []
    for (kind, memory, cc, known, parent, note), members in groups.items():
        fewest, most = min(len(g.nvlink_peers) for g in members), max(len(g.nvlink_peers) for g in members)
        nvlink = "none" if most == 0 else f"{fewest} each" if fewest == most else f"{fewest}–{most}"
        if parent is not None:
            kind, nvlink = f"{kind} (on GPU {parent})", "none (MIG)"
        status = ("ok" if known else "[yellow]not in catalog[/yellow]") + (f"; [yellow]{note}[/yellow]" if note else "")
        rows.append([kind, str(len(members)), f"{memory / 2**30:.1f} GiB", f"{cc[0]}.{cc[1]}", nvlink, status])
    return rows


def reports_to_json(reports: Iterable[NodeReport]) -> list[dict[str, Any]]:
    """Reports as JSON-ready dicts (the field names of ``NodeReport`` and ``GpuInfo``)."""
    return [dataclasses.asdict(report) for report in reports]


def reports_from_json(data: Iterable[Mapping[str, Any]]) -> list[NodeReport]:
    """Inverse of ``reports_to_json`` (after a trip through ``json.dumps``/``json.loads``)."""
    return [
        NodeReport(**{**report, "labels": dict(report["labels"]), "gpus": tuple(map(_gpu_from_json, report["gpus"]))})
        for report in data
    ]


def _gpu_from_json(gpu: Mapping[str, Any]) -> GpuInfo:
    # JSON has no tuples; the dataclasses hold tuples so that reports compare and hash.
    return GpuInfo(
        **{**gpu, "compute_capability": tuple(gpu["compute_capability"]), "nvlink_peers": tuple(gpu["nvlink_peers"])}
    )
