"""Ray metrics for hetero-ray: what is emitted (pure records) apart from how (``ray.util.metrics``).

``report_records`` / ``health_records`` / ``restart_records`` / ``decision_records``
turn the loop's report dict, health readings and events into ``Record`` values
(name, value, tags) and never touch Ray; ``RayMetrics.apply`` hands them to
``ray.util.metrics`` Gauges and Counters, which export only inside a Ray driver
or worker connected to a cluster. Prometheus sees each name with Ray's ``ray_``
prefix, and counters with ``_total`` appended (``prometheus_name``).

Every worker records its own device's figures (tagged with its own node); rank 0
also records the run-wide ones. A figure the report or the device does not have
is not emitted: absent, never zero.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from hetero_ray.monitor.health import HealthDecision, HealthReading

DEVICE_TAGS = ("run", "node", "gpu_type", "rank", "emulated")
RUN_TAGS = ("run", "emulated")


@dataclass(frozen=True)
class MetricDef:
    """One metric as declared to Ray."""

    name: str
    kind: Literal["gauge", "counter"]
    description: str
    tag_keys: tuple[str, ...]


@dataclass(frozen=True)
class Record:
    """One value to set (gauge) or add (counter)."""

    name: str
    value: float
    tags: Mapping[str, str]


# Descriptions in ASCII: Ray's C++ metrics layer encodes them as ASCII and raises otherwise.
_DEFS = [
    # Per device, from the loop's report (means over the steps since the previous report).
    ("step_seconds", "gauge", "Mean step time of this worker over the report window.", DEVICE_TAGS),
    ("samples_per_second", "gauge", "This worker's local batch / its mean step time.", DEVICE_TAGS),
    ("share", "gauge", "This worker's fraction of the global batch.", DEVICE_TAGS),
    ("local_batch", "gauge", "Samples this worker computes per step.", DEVICE_TAGS),
    ("compute_fraction", "gauge", "Compute time (emulated: modelled) / step time of this worker.", DEVICE_TAGS),
    ("comm_seconds", "gauge", "Mean gradient-synchronisation time per step of this worker.", DEVICE_TAGS),
    ("sent_bytes", "counter", "Bytes this worker sent for gradient synchronisation.", DEVICE_TAGS),
    (
        "emulation_overrun_steps",
        "gauge",
        "Steps this emulated device could not pad: its times are the CPU's.",
        DEVICE_TAGS,
    ),
    # Run-wide, recorded by rank 0.
    ("run_samples_per_second", "gauge", "Global batch / the slowest worker's step time.", RUN_TAGS),
    ("balance_efficiency", "gauge", "Achieved samples/s / the sum of each device's standalone samples/s.", RUN_TAGS),
    ("loss", "gauge", "Training loss at the last report.", RUN_TAGS),
    ("steps", "counter", "Optimizer steps completed (steps re-done after a restart count again).", RUN_TAGS),
    ("restarts", "counter", "Times the worker group (re)started from a checkpoint.", RUN_TAGS),
    ("rebalances", "counter", "Times the workers re-split the batch, by cause.", (*RUN_TAGS, "cause")),
    ("excluded_workers", "gauge", "Workers the plan gives no samples, by GPU type.", (*RUN_TAGS, "gpu_type")),
    # Per device, from health readings.
    (
        "gpu_utilization_ratio",
        "gauge",
        "Fraction of time a kernel ran (NVML); emulated: busy / step time.",
        DEVICE_TAGS,
    ),
    ("gpu_memory_used_bytes", "gauge", "Device memory in use (emulated: bytes under the cap).", DEVICE_TAGS),
    ("gpu_memory_total_bytes", "gauge", "Device memory (emulated: the type's cap).", DEVICE_TAGS),
    ("gpu_temperature_celsius", "gauge", "GPU temperature (real GPUs only).", DEVICE_TAGS),
    ("gpu_power_watts", "gauge", "Board power draw (real GPUs only).", DEVICE_TAGS),
    ("gpu_sm_clock_hertz", "gauge", "SM clock (real GPUs only).", DEVICE_TAGS),
    ("gpu_throttled", "gauge", "1 for each clock-event (throttle) reason now active.", (*DEVICE_TAGS, "reason")),
    ("gpu_ecc_uncorrected_errors", "gauge", "Volatile uncorrected ECC errors since the driver loaded.", DEVICE_TAGS),
    ("gpu_xid_events", "counter", "Critical XID events, by XID.", (*DEVICE_TAGS, "xid")),
    ("health_decisions", "counter", "Health policy decisions to shrink or exclude a device.", (*DEVICE_TAGS, "action")),
]
DEFINITIONS: dict[str, MetricDef] = {
    f"hetero_ray_{name}": MetricDef(f"hetero_ray_{name}", kind, description, tags)  # type: ignore[arg-type]
    for name, kind, description, tags in _DEFS
}


def prometheus_name(metric: MetricDef) -> str:
    """The name Prometheus scrapes: Ray adds ``ray_``; counters get ``_total`` (OpenMetrics)."""
    return f"ray_{metric.name}" + ("_total" if metric.kind == "counter" else "")


def _flag(emulated: bool) -> str:
    return "true" if emulated else "false"


def _record(name: str, value: float, tags: Mapping[str, str]) -> Record:
    metric = DEFINITIONS[name]
    assert set(tags) == set(metric.tag_keys), (name, sorted(tags))  # a programming error, caught by the tests
    return Record(name, float(value), dict(tags))


def window_steps(report: Mapping[str, Any]) -> int:
    """Steps the report's window covers: since the previous report, or since the run (or resume) began.

    ``losses`` holds (step, loss) for every report so far, this one last; after a
    resume it starts with the checkpoint's history, whose last step precedes the
    first step run.
    """
    losses = report["losses"]
    previous = losses[-2][0] if len(losses) >= 2 else -1
    return report["step"] - previous


def compute_rate(device: Mapping[str, Any]) -> float | None:
    """A device's samples/s of its own compute in a report window (local batch ÷ its compute time): its
    standalone speed. ``None`` for a device without samples or compute time."""
    busy = device["utilisation"] * device["step_s"]
    return device["local_batch"] / busy if device["local_batch"] > 0 and busy > 0 else None


def balance_efficiency(report: Mapping[str, Any]) -> float | None:
    """Achieved samples/s ÷ ideal, the sum of each device's standalone samples/s (``compute_rate``).

    Devices without samples are left out; ``None`` when no device has compute time.
    """
    ideal = sum(r for r in map(compute_rate, report["devices"]) if r is not None)
    return report["samples_per_s"] / ideal if ideal > 0 else None


def report_records(report: Mapping[str, Any], *, rank: int, node: str, run: str) -> list[Record]:
    """This worker's figures from the loop's report dict, and the run-wide ones on rank 0."""
    device = report["devices"][rank]
    emulated = _flag(report["emulated"])
    tags = {"run": run, "node": node, "gpu_type": device["gpu_type"], "rank": str(rank), "emulated": emulated}
    steps = window_steps(report)
    out = [
        _record("hetero_ray_step_seconds", device["step_s"], tags),
        _record("hetero_ray_samples_per_second", device["samples_per_s"], tags),
        _record("hetero_ray_share", device["share"], tags),
        _record("hetero_ray_local_batch", device["local_batch"], tags),
        _record("hetero_ray_compute_fraction", device["utilisation"], tags),
        _record("hetero_ray_comm_seconds", device["comm_s"], tags),
    ]
    sent = device["bytes_sent"] * steps
    if sent > 0:
        out.append(_record("hetero_ray_sent_bytes", sent, tags))
    if report["emulated"]:
        out.append(_record("hetero_ray_emulation_overrun_steps", device["overrun_steps"], tags))
    if rank != 0:
        return out
    run_tags = {"run": run, "emulated": emulated}
    out += [
        _record("hetero_ray_run_samples_per_second", report["samples_per_s"], run_tags),
        _record("hetero_ray_loss", report["loss"], run_tags),
        _record("hetero_ray_steps", steps, run_tags),
    ]
    efficiency = balance_efficiency(report)
    if efficiency is not None:
        out.append(_record("hetero_ray_balance_efficiency", efficiency, run_tags))
    excluded: dict[str, int] = {}
    for e in report["plan"].get("excluded", ()):
        excluded[e["gpu_type"]] = excluded.get(e["gpu_type"], 0) + e["count"]
    # Every type the run has, so a type whose exclusion ended reads 0 again.
    for gpu_type in sorted({d["gpu_type"] for d in report["devices"]} | set(excluded)):
        out.append(
            _record("hetero_ray_excluded_workers", excluded.get(gpu_type, 0), {**run_tags, "gpu_type": gpu_type})
        )
    return out


def health_records(reading: HealthReading, *, rank: int, gpu_type: str, run: str) -> list[Record]:
    """A health reading's figures; fields the device does not report are not emitted."""
    tags = {
        "run": run,
        "node": reading.node,
        "gpu_type": gpu_type,
        "rank": str(rank),
        "emulated": _flag(reading.emulated),
    }
    fields = {
        "hetero_ray_gpu_utilization_ratio": reading.utilisation,
        "hetero_ray_gpu_memory_used_bytes": reading.memory_used_bytes,
        "hetero_ray_gpu_memory_total_bytes": reading.memory_total_bytes,
        "hetero_ray_gpu_temperature_celsius": reading.temperature_c,
        "hetero_ray_gpu_power_watts": reading.power_w,
        "hetero_ray_gpu_sm_clock_hertz": None if reading.sm_clock_mhz is None else reading.sm_clock_mhz * 1e6,
        "hetero_ray_gpu_ecc_uncorrected_errors": reading.ecc_uncorrected,
    }
    out = [_record(name, value, tags) for name, value in fields.items() if value is not None]
    out += [_record("hetero_ray_gpu_throttled", 1, {**tags, "reason": r}) for r in reading.throttle_reasons or ()]
    counts: dict[int, int] = {}
    for xid in reading.xids or ():
        counts[xid] = counts.get(xid, 0) + 1
    out += [_record("hetero_ray_gpu_xid_events", n, {**tags, "xid": str(x)}) for x, n in sorted(counts.items())]
    return out


def restart_records(*, run: str, emulated: bool) -> list[Record]:
    """One restart: record it once, on rank 0, when a run resumes from a checkpoint."""
    return [_record("hetero_ray_restarts", 1, {"run": run, "emulated": _flag(emulated)})]


def rebalance_records(cause: str, *, run: str, emulated: bool) -> list[Record]:
    """One re-split of the batch (recorded on rank 0): ``imbalance``, ``out_of_memory`` or ``health``."""
    return [_record("hetero_ray_rebalances", 1, {"run": run, "emulated": _flag(emulated), "cause": cause})]


def decision_records(
    decision: HealthDecision, *, rank: int, node: str, gpu_type: str, run: str, emulated: bool
) -> list[Record]:
    """A shrink or exclude decision (keeping a device is not an event)."""
    if decision.action == "keep":
        return []
    tags = {"run": run, "node": node, "gpu_type": gpu_type, "rank": str(rank), "emulated": _flag(emulated)}
    return [_record("hetero_ray_health_decisions", 1, {**tags, "action": decision.action})]


class RayMetrics:
    """The ``ray.util.metrics`` objects for ``DEFINITIONS``, created on first use in this process."""

    def __init__(self) -> None:
        self._metrics: dict[str, Any] = {}

    def _metric(self, name: str) -> Any:
        if name not in self._metrics:
            from ray.util.metrics import Counter, Gauge

            d = DEFINITIONS[name]
            cls = Gauge if d.kind == "gauge" else Counter
            self._metrics[name] = cls(d.name, description=d.description, tag_keys=d.tag_keys)
        return self._metrics[name]

    def apply(self, records: Iterable[Record]) -> None:
        """Set each gauge, add to each counter."""
        for r in records:
            metric = self._metric(r.name)
            if DEFINITIONS[r.name].kind == "gauge":
                metric.set(r.value, tags=dict(r.tags))
            elif r.value > 0:
                metric.inc(r.value, tags=dict(r.tags))
