"""The Plan: the one contract between planning and execution.

The runtime executes a Plan and never re-derives one; re-planning (after a
restart on other devices) calls the planner again. Roles are bound to ranks by
GPU type, not by position, because Ray Train re-orders ranks by node.

A plan is a set of pipelines replicated for data parallelism. Pure data
parallelism is the case of one-stage pipelines, one worker each. In a pipeline
every stage holds a contiguous range of the workload's layers (``Workload.layered``)
and all stages of one pipeline share its ``local_batch``, cut into equal
micro-batches; pipelines may differ in stage count, layer split and types
("virtual workers"), so gradients are averaged per layer over the pipelines.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True, kw_only=True)
class WorkerRole:
    """What one worker does in every step."""

    gpu_type: str
    local_batch: int
    micro_batch: int
    sample_offset: int
    precision: str
    predicted_compute_s: float
    predicted_memory_bytes: float
    memory_cap_bytes: int
    pipeline: int = 0
    stage: int = 0
    # [first, last) of the workload's layers; None: the whole model (pure data parallelism).
    layers: tuple[int, int] | None = None
    activation_checkpointing: bool = False
    # Tensor parallelism: the workers of one (pipeline, stage) split its GPT blocks' heads and MLP columns in
    # proportion to ``tp_weights`` (one per member, in ``tp_rank`` order); every member runs the stage's
    # samples. None: the stage is one worker.
    tp_weights: tuple[float, ...] | None = None
    tp_rank: int = 0

    @property
    def tp_degree(self) -> int:
        return len(self.tp_weights) if self.tp_weights else 1

    @property
    def tp_share(self) -> float:
        """The part of each split layer this member holds: its weight over the stage's (1 without a split)."""
        return self.tp_weights[self.tp_rank] / sum(self.tp_weights) if self.tp_weights else 1.0

    @property
    def accumulation_steps(self) -> int:
        return math.ceil(self.local_batch / self.micro_batch)

    def micro_batches(self) -> list[tuple[int, int]]:
        """(start, size) of each micro-batch, relative to the global batch."""
        n = self.accumulation_steps
        sizes = [self.local_batch // n + (i < self.local_batch % n) for i in range(n)]
        starts = [self.sample_offset + sum(sizes[:i]) for i in range(n)]
        return list(zip(starts, sizes))


@dataclass(frozen=True, kw_only=True)
class Exclusion:
    """Workers left without samples on purpose, and why."""

    gpu_type: str
    count: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class Plan:
    """One role per worker; the pipelines' local batches sum to the global batch.

    ``predicted_compute_s`` is the slowest pipeline's modelled time for its
    micro-batches including the bubble of ``schedule`` (for pure data
    parallelism: the slowest worker's compute).
    """

    global_batch: int
    split: str
    emulated: bool
    roles: tuple[WorkerRole, ...]
    predicted_compute_s: float
    excluded: tuple[Exclusion, ...] = ()
    predicted_comm_s: float = 0.0
    predicted_comm_fp32_s: float = 0.0
    schedule: str = "gpipe"
    # 1: Adam's state sharded over the data-parallel workers by the memory each has beyond weights and gradients.
    zero_stage: int = 0
    # The workload ({"name": …, "options": {…}}) the plan was made for; None in plans written before it was kept.
    workload: dict | None = None
    explanation: str = ""
    schema: int = field(default=2)

    @property
    def num_pipelines(self) -> int:
        return len({r.pipeline for r in self.roles})

    @property
    def is_pipelined(self) -> bool:
        """True when any worker holds only part of the model (a tensor-parallel worker holds part of a layer)."""
        return any(r.layers is not None or r.tp_weights for r in self.roles)

    @property
    def tensor_parallel(self) -> int:
        """The largest tensor-parallel degree of any stage (1: none)."""
        return max((r.tp_degree for r in self.roles), default=1)

    @property
    def splits_across_types(self) -> bool:
        """True when some stage is a tensor-parallel group of more than one GPU type."""
        types: dict[tuple[int, int], set[str]] = {}
        for r in self.roles:
            if r.tp_weights:
                types.setdefault((r.pipeline, r.stage), set()).add(r.gpu_type)
        return any(len(t) > 1 for t in types.values())

    @property
    def predicted_step_s(self) -> float:
        """Compute of the slowest worker, then gradient synchronisation (priced when a link is known)."""
        return self.predicted_compute_s + self.predicted_comm_s

    def roles_for(self, rank_types: Sequence[str]) -> list[WorkerRole | None]:
        """Bind roles to ranks: the k-th worker of a type gets the k-th role of that type.

        A rank whose type has no role left (excluded on purpose) gets ``None``.
        """
        pools: dict[str, list[WorkerRole]] = {}
        for role in self.roles:
            pools.setdefault(role.gpu_type, []).append(role)
        return [pools[t].pop(0) if pools.get(t) else None for t in rank_types]

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        return cls(
            **{k: v for k, v in data.items() if k not in ("roles", "excluded")},
            roles=tuple(
                WorkerRole(
                    **{
                        **r,
                        "layers": tuple(r["layers"]) if r.get("layers") is not None else None,
                        "tp_weights": tuple(r["tp_weights"]) if r.get("tp_weights") is not None else None,
                    }
                )
                for r in data["roles"]
            ),
            excluded=tuple(Exclusion(**e) for e in data.get("excluded", ())),
        )


class PlanError(RuntimeError):
    """No plan fits the devices: raised where a caller needs a plan and the planner said ``Infeasible``."""


@dataclass(frozen=True)
class Infeasible:
    """No plan exists; ``reason`` is one line saying why and what to try."""

    reason: str
