"""The search space of a share sweep: one weight per GPU type, relative to the slowest type, around the prediction.

A run's split ``{gpu_type: weight}`` is scale-free (``split_batch`` water-fills by
weight), so the slowest predicted type is held at weight 1 and every other type's
weight is searched log-uniformly within ``spread``× of its predicted ratio: the
prediction sits in the middle of the space, and the first trial evaluates it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hetero_ray.config import RunConfig
from hetero_ray.perf.model import PerfModel
from hetero_ray.plan.plan import Plan
from tuning.settings import SweepError

WEIGHT_PREFIX = "weight:"
MICRO_BATCH_KEY = "max_micro_batch"


@dataclass(frozen=True, kw_only=True)
class ShareSpace:
    """Weights per GPU type: ``reference`` is fixed at 1, each type of ``bounds`` searched in (low, high)."""

    reference: str
    predicted: Mapping[str, float]
    bounds: Mapping[str, tuple[float, float]]
    micro_batch_caps: tuple[int, ...] = ()
    devices: Mapping[str, int] = field(default_factory=dict)  # devices per type, for ``balanced_point``
    global_batch: int = 0

    def tune_space(self) -> dict:
        """The Tune ``param_space``: a log-uniform weight per searched type (and a micro-batch cap choice)."""
        from ray import tune

        space: dict = {f"{WEIGHT_PREFIX}{t}": tune.loguniform(lo, hi) for t, (lo, hi) in self.bounds.items()}
        if self.micro_batch_caps:
            space[MICRO_BATCH_KEY] = tune.choice(list(self.micro_batch_caps))
        return space

    def first_point(self) -> dict:
        """The prediction as a Tune config (Optuna's ``points_to_evaluate``); the largest cap when caps are searched."""
        point: dict = {f"{WEIGHT_PREFIX}{t}": self.predicted[t] for t in self.bounds}
        if self.micro_batch_caps:
            point[MICRO_BATCH_KEY] = max(self.micro_batch_caps)
        return point

    def measured_point(self, speeds: Mapping[str, float], like: Mapping[str, object]) -> dict | None:
        """The Tune config that splits by ``speeds`` (samples/s per type of each device's own compute, as a trial
        measured them), each weight held inside its bounds, other keys as in ``like``; ``None`` without a
        positive speed for every type."""
        if not all(speeds.get(t, 0) > 0 for t in (self.reference, *self.bounds)):
            return None
        return self._point({t: speeds[t] / speeds[self.reference] for t in self.bounds}, like)

    def balanced_point(self, measured: Sequence[Measured], like: Mapping[str, object]) -> dict | None:
        """The Tune config whose devices all finish their compute together, by each type's compute time fitted
        as ``fixed + per_sample × share`` (least squares) over the trials ``measured``; the split by the last
        trial's speeds (``measured_point``) while a type has no fit (one share measured, or a slope the noise
        made non-positive), or when the balance needs a share below zero."""
        if not measured:
            return None
        fits = {
            t: _line([(m.shares[t], m.shares[t] / m.speeds[t]) for m in measured if m.has(t)]) for t in self.devices
        }
        if not self.global_batch or not fits or any(f is None for f in fits.values()):
            return self.measured_point(measured[-1].speeds, like)
        # Every type done at T: share_t = (T - fixed_t) / per_sample_t, and the shares sum to the batch.
        inverse = sum(self.devices[t] / b for t, (_, b) in fits.items())
        common = (self.global_batch + sum(self.devices[t] * a / b for t, (a, b) in fits.items())) / inverse
        shares = {t: (common - a) / b for t, (a, b) in fits.items()}
        if min(shares.values()) <= 0:
            return self.measured_point(measured[-1].speeds, like)
        return self._point({t: shares[t] / shares[self.reference] for t in self.bounds}, like)

    def _point(self, weights: Mapping[str, float], like: Mapping[str, object]) -> dict:
        """``like`` with each searched type's weight, held inside its bounds."""
        point = dict(like)
        for t, (lo, hi) in self.bounds.items():
            point[f"{WEIGHT_PREFIX}{t}"] = min(hi, max(lo, weights[t]))
        return point

    def grid(self, gpu_type: str, points: int) -> list[float]:
        """``points`` weights of ``gpu_type`` spaced evenly in log over its bounds (a bench's fine grid)."""
        if points < 2:
            raise SweepError(f"grid points: {points}; use at least 2")
        lo, hi = self.bounds[gpu_type]
        return [math.exp(math.log(lo) + i * (math.log(hi) - math.log(lo)) / (points - 1)) for i in range(points)]


@dataclass(frozen=True)
class Measured:
    """One trial's local batch per device and samples/s of its own compute, by GPU type (``trial.window_result``)."""

    shares: Mapping[str, int]
    speeds: Mapping[str, float]

    def has(self, gpu_type: str) -> bool:
        return self.shares.get(gpu_type, 0) > 0 and self.speeds.get(gpu_type, 0) > 0


def _line(points: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares ``(intercept, slope)`` of ``y = a + b x``; ``None`` under two distinct x or for b <= 0."""
    xs = [x for x, _ in points]
    if len(set(xs)) < 2:
        return None
    mean_x, mean_y = sum(xs) / len(xs), sum(y for _, y in points) / len(points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x in xs)
    return (mean_y - slope * mean_x, slope) if slope > 0 else None


def weights_of(params: Mapping[str, object], reference: str) -> dict[str, float]:
    """The split ``{gpu_type: weight}`` a Tune config stands for (the reference type at 1)."""
    weights = {reference: 1.0}
    weights.update({k.removeprefix(WEIGHT_PREFIX): float(v) for k, v in params.items() if k.startswith(WEIGHT_PREFIX)})
    return weights


def plan_speeds(plan: Plan) -> dict[str, float]:
    """Samples/s per GPU type the planner assumed: local batch ÷ predicted compute time of its roles."""
    return {r.gpu_type: r.local_batch / r.predicted_compute_s for r in plan.roles if r.predicted_compute_s > 0}


def model_speeds(model: PerfModel, plan: Plan) -> dict[str, float]:
    """Samples/s per GPU type from a fitted performance model, at each type's planned micro-batch and precision."""
    return {r.gpu_type: model.samples_per_second(r.gpu_type, r.micro_batch, r.precision) for r in plan.roles}


def share_space(
    cfg: RunConfig, speeds: Mapping[str, float], *, spread: float = 3.0, micro_batch_caps: Sequence[int] = ()
) -> ShareSpace:
    """The space around ``speeds`` (predicted samples/s per type) for the devices of ``cfg``."""
    if spread <= 1:
        raise SweepError(f"spread: {spread:g}; use a factor > 1 (3 searches from a third to three times the ratio)")
    if len(cfg.devices) < 2:
        raise SweepError(
            f"devices: {dict(cfg.devices)} has one GPU type; a share sweep needs at least two types to weigh"
        )
    missing = sorted(set(cfg.devices) - set(speeds))
    if missing:
        raise SweepError(f"devices: no predicted speed for {missing} (excluded by the plan?); sweep the usable types")
    bad_caps = [c for c in micro_batch_caps if c < 1]
    if bad_caps:
        raise SweepError(f"micro-batch caps: {bad_caps} must be >= 1")
    reference = min(cfg.devices, key=lambda t: speeds[t])
    predicted = {t: speeds[t] / speeds[reference] for t in cfg.devices}
    bounds = {t: (w / spread, w * spread) for t, w in predicted.items() if t != reference}
    return ShareSpace(
        reference=reference,
        predicted=predicted,
        bounds=bounds,
        micro_batch_caps=tuple(sorted(set(micro_batch_caps))),
        devices=dict(cfg.devices),
        global_batch=cfg.train.global_batch,
    )
