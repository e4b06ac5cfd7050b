"""Where the planner's bandwidths come from: GPUs per node, links within and between nodes.

Nodes hold one GPU type each (a Ray node type per GPU type, as in ``cluster.yaml``); a
``Topology`` built in Python may also name nodes that mix types (``MixedNodeKind``),
where the planner may split a layer across types.
Within a node GPUs talk over the type's NVLink or PCIe (the catalog's
``interconnect_gbs``, halved: datasheets add both directions); between nodes over
the nodes' NICs, the slower of two ends. ``cluster.yaml`` names each node type's NIC
in Gbit/s with the node label ``hetero-ray/network-gbps`` (a label, because Ray's
launcher schema rejects unknown keys anywhere else).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hetero_ray.cluster.catalog import Catalog, UnknownGpuType
from hetero_ray.config import ConfigError
from hetero_ray.strict_yaml import YamlError, load_yaml

GPU_TYPE_LABEL = "hetero-ray/gpu-type"
NETWORK_LABEL = "hetero-ray/network-gbps"
# Per-message latencies: NCCL's small-message all-reduce latency is a few µs over
# NVLink/PCIe and ~10 µs or more over InfiniBand/Ethernet.
INTRA_LATENCY_S = 5e-6
INTER_LATENCY_S = 20e-6
# Cards of two types in one node meet over PCIe (NVLink bridges join cards of one type): PCIe 3.0 x16, one
# direction, the slot a V100 or T4 era card has.
PCIE_BYTES_S = 16e9
# Joins a group's types into its name (``MixedNodeKind.name``). A GPU type's name is a Ray node label's value,
# whose syntax (Kubernetes') has no "+", so no type's own name holds it.
GROUP_SEPARATOR = "+"


@dataclass(frozen=True, kw_only=True)
class NodeKind:
    """The nodes that hold one GPU type."""

    gpu_type: str
    gpus_per_node: int
    intra_bandwidth_bytes_s: float
    """GPU-to-GPU within the node, one direction."""
    nic_bandwidth_bytes_s: float
    """The node's network, one direction."""
    intra_latency_s: float = INTRA_LATENCY_S


@dataclass(frozen=True, kw_only=True)
class MixedNodeKind:
    """Nodes that each hold one GPU of each of several types (a workstation with an A100 and a V100): where a
    tensor-parallel group may span types. Their cards talk over PCIe: NVLink joins cards of one type only."""

    gpu_types: tuple[str, ...]
    nodes: int
    nic_bandwidth_bytes_s: float
    intra_bandwidth_bytes_s: float = PCIE_BYTES_S
    intra_latency_s: float = INTRA_LATENCY_S

    @property
    def name(self) -> str:
        """The group's name in plans and explanations: its types joined by ``+``."""
        return group_name(self.gpu_types)

    def node(self) -> NodeKind:
        """The node as the planner sees a group of it: one member of each type."""
        return NodeKind(
            gpu_type=self.name,
            gpus_per_node=len(self.gpu_types),
            intra_bandwidth_bytes_s=self.intra_bandwidth_bytes_s,
            nic_bandwidth_bytes_s=self.nic_bandwidth_bytes_s,
            intra_latency_s=self.intra_latency_s,
        )


@dataclass(frozen=True, kw_only=True, eq=False)
class Topology:
    """Node kinds by GPU type, the nodes that mix types, and the latency between nodes.

    The devices of ``mixed`` nodes are also counted among their types' devices; ``nodes`` prices them when the
    planner uses them one by one, the mixed node kind when it groups them across types."""

    nodes: Mapping[str, NodeKind]
    inter_latency_s: float = INTER_LATENCY_S
    mixed: tuple[MixedNodeKind, ...] = ()

    def node(self, gpu_type: str) -> NodeKind:
        try:
            return self.nodes[gpu_type]
        except KeyError:
            raise ConfigError(
                f"topology: no node kind for GPU type {gpu_type!r}; have {', '.join(sorted(self.nodes))}"
            ) from None

    def intra(self, gpu_type: str) -> tuple[float, float]:
        """(bandwidth bytes/s, latency s) between two GPUs of ``gpu_type`` in one node."""
        n = self.node(gpu_type)
        return n.intra_bandwidth_bytes_s, n.intra_latency_s

    def inter(self, gpu_types: Iterable[str]) -> tuple[float, float]:
        """(bandwidth, latency) of a ring through nodes of ``gpu_types``: its slowest NIC."""
        return min(self.node(t).nic_bandwidth_bytes_s for t in gpu_types), self.inter_latency_s


def uniform_topology(
    catalog: Catalog, gpu_types: Iterable[str], *, gpus_per_node: int, inter_node_gbps: float
) -> Topology:
    """Nodes of ``gpus_per_node`` GPUs, links from the catalog, one NIC speed for all (``simulate``)."""
    if gpus_per_node < 1 or inter_node_gbps <= 0:
        raise ConfigError(
            f"topology: gpus per node must be >= 1 and inter-node Gbit/s > 0 (got {gpus_per_node}, {inter_node_gbps})"
        )
    return Topology(
        nodes={
            t: NodeKind(
                gpu_type=t,
                gpus_per_node=gpus_per_node,
                intra_bandwidth_bytes_s=catalog.get(t).interconnect_gbs * 1e9 / 2,
                nic_bandwidth_bytes_s=inter_node_gbps * 1e9 / 8,
            )
            for t in set(gpu_types)
        }
    )


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """What a cluster-launcher file says: GPUs per type (at each node type's max_workers) and the topology."""

    devices: dict[str, int]
    topology: Topology


def _launcher_problem(data: object) -> str | None:
    """What Ray's cluster launcher would refuse in ``data`` by its own schema (``ray up`` checks the same file),
    as ``field: problem``; ``None`` when the schema accepts it. Only the schema: the launcher's other checks
    need a cloud provider's defaults."""
    import jsonschema  # only `plan` reads cluster files

    # The schema file that ships in Ray's package; found without importing Ray.
    ray_dir = Path(importlib.util.find_spec("ray").submodule_search_locations[0])
    schema = json.loads((ray_dir / "autoscaler" / "ray-schema.json").read_text(encoding="utf-8"))
    error = jsonschema.exceptions.best_match(jsonschema.Draft7Validator(schema).iter_errors(data))
    if error is None:
        return None
    return f"{'.'.join(map(str, error.absolute_path)) or '(top level)'}: {error.message}"


def load_cluster(path: str | Path, catalog: Catalog) -> ClusterSpec:
    """Read a Ray cluster-launcher YAML: node types labelled ``hetero-ray/gpu-type`` with GPUs and a NIC label.

    Where several node types hold one GPU type, the type gets the smallest
    node and the slowest NIC among them (a plan priced on those holds on any).
    """
    try:
        data = load_yaml(Path(path).read_text(encoding="utf-8"), str(path))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read cluster file ({exc.strerror or exc})") from None
    except YamlError as exc:
        raise ConfigError(str(exc)) from None
    if not isinstance(data, dict) or not isinstance(data.get("available_node_types"), dict):
        raise ConfigError(f"{path}: no 'available_node_types' mapping; expected a Ray cluster-launcher file")
    problem = _launcher_problem(data)
    if problem:
        # A file `ray up` refuses cannot be the cluster a plan is for (labels must be strings, counts integers, …).
        raise ConfigError(f"{path}: {problem} (Ray's cluster-launcher schema)")
    devices: dict[str, int] = {}
    kinds: dict[str, NodeKind] = {}
    for name, node in data["available_node_types"].items():
        where = f"{path}: available_node_types.{name}"
        labels = node.get("labels", {})
        gpu_type = labels.get(GPU_TYPE_LABEL)
        if gpu_type is None:
            continue
        try:
            spec = catalog.get(gpu_type)
        except UnknownGpuType as exc:
            raise ConfigError(f"{where}.labels.{GPU_TYPE_LABEL}: {exc}") from None
        gpus = node["resources"].get("GPU", 0)
        if gpus < 1:
            raise ConfigError(f"{where}.resources.GPU: a node labelled {gpu_type} needs GPU >= 1 (got {gpus})")
        try:
            nic_gbps = float(labels[NETWORK_LABEL])
        except (KeyError, ValueError):
            raise ConfigError(
                f"{where}.labels: needs '{NETWORK_LABEL}: \"<NIC Gbit/s>\"' (got {labels.get(NETWORK_LABEL)!r})"
            ) from None
        devices[gpu_type] = devices.get(gpu_type, 0) + gpus * node.get("max_workers", 0)
        kind = NodeKind(
            gpu_type=gpu_type,
            gpus_per_node=gpus,
            intra_bandwidth_bytes_s=spec.interconnect_gbs * 1e9 / 2,
            nic_bandwidth_bytes_s=nic_gbps * 1e9 / 8,
        )
        prev = kinds.get(gpu_type)
        if prev is not None:
            kind = NodeKind(
                gpu_type=gpu_type,
                gpus_per_node=min(prev.gpus_per_node, gpus),
                intra_bandwidth_bytes_s=kind.intra_bandwidth_bytes_s,
                nic_bandwidth_bytes_s=min(prev.nic_bandwidth_bytes_s, kind.nic_bandwidth_bytes_s),
            )
        kinds[gpu_type] = kind
    devices = {t: n for t, n in devices.items() if n > 0}
    if not devices:
        raise ConfigError(f"{path}: no node type labelled '{GPU_TYPE_LABEL}' with max_workers > 0")
    return ClusterSpec(devices=devices, topology=Topology(nodes=kinds))


def is_group(gpu_type: str) -> bool:
    """Whether a planner's type name is a tensor-parallel group planned as a type of its own: of several types
    (``MixedNodeKind.name``), or of devices of one type beside that type's single devices."""
    return GROUP_SEPARATOR in gpu_type


def group_name(gpu_types: Sequence[str]) -> str:
    """The name of a group of one device of each of ``gpu_types`` (a type may repeat)."""
    return GROUP_SEPARATOR.join(gpu_types)


def group_members(name: str) -> tuple[str, ...]:
    """The GPU type of each member of the group ``name`` (``group_name``'s inverse)."""
    return tuple(name.split(GROUP_SEPARATOR))
