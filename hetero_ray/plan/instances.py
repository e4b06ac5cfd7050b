"""Seeded random small planning problems, small enough for the exhaustive enumerator (tests and bench)."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from hetero_ray.cluster.catalog import Catalog
from hetero_ray.perf.footprint import Footprint, LayerCost
from hetero_ray.plan.topology import MixedNodeKind, Topology, uniform_topology

# Types of different speed, memory and precision, so that every kind of plan can win somewhere.
SMALL_TYPES = ("A100-80GB", "V100-16GB", "T4", "A10")


@dataclass(frozen=True, kw_only=True)
class Instance:
    """One random problem: devices, a layered footprint, topology, batch."""

    seed: int
    rank_types: tuple[str, ...]
    footprint: Footprint
    topology: Topology
    global_batch: int
    inter_node_gbps: float
    gpus_per_node: int

    def describe(self) -> dict:
        counts = {t: self.rank_types.count(t) for t in dict.fromkeys(self.rank_types)}
        return {
            "seed": self.seed,
            "devices": counts,
            "layers": len(self.footprint.layers),
            "params": self.footprint.param_count,
            "global_batch": self.global_batch,
            "gpus_per_node": self.gpus_per_node,
            "inter_node_gbps": self.inter_node_gbps,
        }


def with_split(layer: LayerCost) -> LayerCost:
    """The layer as a GPT block a tensor-parallel split divides: its FLOPs, nearly all its parameters (the
    layer norms and row-parallel biases stay whole) and about 3/4 of its saved activations (a measured
    block's ratio; the residual stream and layer-norm outputs stay whole). No random draw, so a seed's
    instance is the one it was before tensor parallelism."""
    return replace(
        layer,
        tp_params=round(layer.params * 0.99),
        tp_flops_per_sample=layer.flops_per_sample,
        tp_activation_bytes_per_sample=0.75 * layer.activation_bytes_per_sample,
    )


def footprint_of(layers: tuple[LayerCost, ...]) -> Footprint:
    """A footprint made of ``layers`` (one parameter tensor each, a million samples)."""
    return Footprint(
        param_count=sum(c.params for c in layers),
        dataset_samples=10**6,
        flops_per_sample=sum(c.flops_per_sample for c in layers),
        activation_bytes_per_sample=sum(c.activation_bytes_per_sample for c in layers),
        param_numels=tuple(c.params for c in layers),
        layers=layers,
    )


def random_instance(seed: int, catalog: Catalog) -> Instance:
    """2-3 types, 1-4 devices each, 4-7 layers of 0.1-0.7 G parameters (so memory binds on small cards)."""
    rng = random.Random(seed)
    types = rng.sample(SMALL_TYPES, rng.choice((2, 3)))
    rank_types = tuple(t for t in types for _ in range(rng.randint(1, 4)))
    layers = tuple(
        with_split(
            LayerCost(
                params=(p := rng.randint(100, 700) * 10**6),
                flops_per_sample=6 * p * rng.choice((256, 512, 1024)),
                activation_bytes_per_sample=rng.uniform(0.05, 1.5) * 2**30,
                output_bytes_per_sample=rng.uniform(1, 50) * 2**20,
            )
        )
        for _ in range(rng.randint(4, 7))
    )
    footprint = footprint_of(layers)
    gpn, gbps = rng.choice((1, 2, 4)), rng.choice((1.0, 10.0, 100.0))
    return Instance(
        seed=seed,
        rank_types=rank_types,
        footprint=footprint,
        topology=uniform_topology(catalog, types, gpus_per_node=gpn, inter_node_gbps=gbps),
        global_batch=rng.choice((8, 12, 16, 24)),
        inter_node_gbps=gbps,
        gpus_per_node=gpn,
    )


def with_mixed_nodes(inst: Instance) -> Instance:
    """``inst`` whose first two types also share nodes, one device of each per node, as many nodes as the scarcer
    type has devices, over PCIe: where the planner may split a layer across the two types."""
    first, second = list(dict.fromkeys(inst.rank_types))[:2]
    mixed = MixedNodeKind(
        gpu_types=(first, second),
        nodes=min(inst.rank_types.count(first), inst.rank_types.count(second)),
        nic_bandwidth_bytes_s=inst.inter_node_gbps * 1e9 / 8,
    )
    return replace(inst, topology=replace(inst.topology, mixed=(mixed,)))
