"""Re-deriving data-parallel shares during a run from what the workers measured.

Every ``rebalance_every`` steps the workers share their compute seconds per sample;
each rank's speed estimate moves toward its measurement (geometric damping, so a noisy
window cannot swing the split back and forth), and when the slowest worker's compute
exceeds the mean by more than ``threshold`` the global batch is split again by the
estimates, water-filling as the planner does. An out-of-memory caps the device's
micro-batch at once and scales its share by the health policy's factor.

Pure functions of the gathered figures: every rank computes the same new split.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from hetero_ray.monitor.health import HealthDecision, HealthPolicy
from hetero_ray.plan.data_parallel import data_parallel_roles, split_batch
from hetero_ray.plan.plan import WorkerRole


@dataclass(frozen=True)
class Balance:
    """What the shares are derived from, per rank."""

    speeds: tuple[float, ...]
    """Samples per second of compute (estimates)."""
    micro_caps: tuple[int, ...]
    """Largest micro-batch known to fit."""
    factors: tuple[float, ...]
    """Health share factors: 1 keep, (0, 1) shrink, 0 exclude."""

    @classmethod
    def of(cls, roles: Sequence[WorkerRole | None], micro_caps: Sequence[int]) -> Balance:
        """The balance a plan's roles imply: each worker finishing its share in the planned step, so
        that re-splitting keeps the planned (or user's) shares until measurements say otherwise."""
        step = max(r.predicted_compute_s for r in roles if r is not None)
        return cls(
            speeds=tuple(r.local_batch / step if r else 0.0 for r in roles),
            micro_caps=tuple(micro_caps),
            factors=tuple(1.0 if r else 0.0 for r in roles),
        )

    def measured(self, seconds_per_sample: Sequence[float | None], damping: float) -> Balance:
        """Move each estimate toward ``1 / seconds_per_sample`` (ranks that measured nothing keep theirs)."""
        speeds = tuple(
            s ** (1 - damping) * (1 / t) ** damping if t and s > 0 else s
            for s, t in zip(self.speeds, seconds_per_sample)
        )
        return replace(self, speeds=speeds)

    def out_of_memory(self, rank: int, fitted_micro: int, factor: float) -> Balance:
        """Rank ``rank`` ran out of memory: only ``fitted_micro`` samples fit at once, and its share scales by ``factor``."""
        caps, factors = list(self.micro_caps), list(self.factors)
        caps[rank] = min(caps[rank], fitted_micro)
        factors[rank] = factors[rank] * factor
        return replace(self, micro_caps=tuple(caps), factors=tuple(factors))

    def split(self, roles: Sequence[WorkerRole | None], global_batch: int, footprint) -> list[WorkerRole | None]:
        """New roles: the global batch split by speed × factor, micro-batches within the caps."""
        active = [i for i, (r, f) in enumerate(zip(roles, self.factors)) if r is not None and f > 0]
        weights = [self.speeds[i] * self.factors[i] for i in active]
        shares = split_batch(global_batch, weights)
        new = data_parallel_roles(
            [(roles[i].gpu_type, roles[i].precision, roles[i].memory_cap_bytes) for i in active],
            shares,
            [1 / self.speeds[i] for i in active],
            [self.micro_caps[i] for i in active],
            footprint,
        )
        out: list[WorkerRole | None] = [None] * len(roles)
        for i, role in zip(active, new):
            out[i] = role
        return out


def imbalance(seconds: Sequence[float]) -> float:
    """How much longer the slowest worker's compute takes than the mean (0: perfectly balanced)."""
    busy = [s for s in seconds if s > 0]
    return max(busy) / (sum(busy) / len(busy)) - 1 if busy else 0.0


def halve(size: int) -> int:
    """The micro-batch to retry with after an out-of-memory at ``size`` (0: nothing smaller to try)."""
    return math.ceil(size / 2) if size > 1 else 0


@dataclass(frozen=True)
class Change:
    """A re-split every rank agreed on: the new roles and why, as (cause, one line) pairs.

    Causes: ``imbalance``, ``out_of_memory``, ``health``. ``mine`` is this rank's own new
    health decision, if it made one.
    """

    roles: list[WorkerRole | None]
    reasons: list[tuple[str, str]]
    mine: HealthDecision | None


class Rebalancer:
    """One worker's side of rebalancing in a data-parallel run.

    ``step_done`` runs on every rank after every step: one 1-element all-reduce says
    whether any rank ran out of memory or crossed a health threshold; then (or every
    ``every`` steps) the ranks gather what they measured and all derive the same split.
    """

    def __init__(
        self,
        roles: Sequence[WorkerRole | None],
        micro_caps: Sequence[int],
        *,
        global_batch: int,
        footprint,
        policy: HealthPolicy,
        every: int | None,
        threshold: float,
        damping: float,
    ):
        self.roles = list(roles)
        self.balance = Balance.of(roles, micro_caps)
        self.global_batch, self.footprint, self.policy = global_batch, footprint, policy
        self.every, self.threshold, self.damping = every, threshold, damping
        self.busy_s, self.samples, self.ooms = 0.0, 0, 0
        self.applied: str = "keep"

    def step_done(self, step: int, rank: int, busy_s: float, fitted_micro: int | None, reading) -> Change | None:
        """Account this rank's step; return the change all ranks agreed on, if any."""
        role = self.roles[rank]
        self.busy_s += busy_s if role else 0.0
        self.samples += role.local_batch if role else 0
        self.ooms += fitted_micro is not None
        decision = self.policy.decide([reading], self.ooms) if reading is not None else None
        news = decision is not None and decision.action != self.applied
        flag = torch.tensor([float(fitted_micro is not None or news)])
        dist.all_reduce(flag)
        reasons: list[tuple[str, str]] = []
        mine_decision = decision if news else None
        if flag.item() > 0:
            mine = (fitted_micro, decision.share_factor if news else 1.0, decision.reason if news else None)
            if news:
                self.applied = decision.action
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
            for r, (fitted, factor, reason) in enumerate(everyone):
                if fitted is not None or factor != 1.0:
                    self.balance = self.balance.out_of_memory(r, fitted or self.balance.micro_caps[r], factor)
                    if reason:
                        reasons.append(("health", reason))
                    else:
                        reasons.append(("out_of_memory", f"rank {r} ran out of memory: micro-batch at most {fitted}"))
        if self.every and (step + 1) % self.every == 0:
            window = torch.tensor([self.busy_s, float(self.samples)])
            gathered = [torch.zeros(2) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, window)
            self.busy_s, self.samples = 0.0, 0
            per_sample = [float(b) / float(n) if n > 0 else None for b, n in gathered]
            self.balance = self.balance.measured(per_sample, self.damping)
            busy = [float(b) for b, _ in gathered]
            if imbalance(busy) > self.threshold:
                reasons.append(
                    ("imbalance", f"compute imbalance {imbalance(busy):.0%} over the last {self.every} steps")
                )
        if not reasons:
            return None
        roles = self.balance.split(self.roles, self.global_batch, self.footprint)
        if all(cause == "imbalance" for cause, _ in reasons) and _work(roles) == _work(self.roles):
            # Integer shares rarely balance to within the threshold: a split the new estimates
            # leave as it is, is no re-split.
            return None
        self.roles = roles
        return Change(roles=list(self.roles), reasons=reasons, mine=mine_decision)


def _work(roles: Sequence[WorkerRole | None]) -> list[tuple[int, int] | None]:
    """What each rank computes in a step: its share and micro-batch."""
    return [(r.local_batch, r.micro_batch) if r else None for r in roles]
