"""GPU health: NVML readings per device, emulated readings, and the policy that acts on them.

A real reading holds what NVML reports and nothing else: a query the device or
driver does not support leaves its field ``None``. An emulated device has no
sensors, so its reading carries only what the emulation really measures
(utilisation = modelled busy time ÷ step time, memory = bytes in use ÷ the
type's cap), is labelled ``emulated=True``, and leaves temperature, power and
clocks ``None``. ``HealthPolicy.decide`` turns a device's recent readings (and
the OOMs the loop counted) into keep / shrink its share / exclude it, with a
one-line reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

# Clock-event ("throttle") reason bits, from nvml.h (nvmlClocksEventReason*): part of NVML's stable ABI.
THROTTLE_REASONS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
THERMAL_REASONS = frozenset({"sw_thermal_slowdown", "hw_thermal_slowdown"})

# XIDs NVIDIA's XID catalogue attributes to the application (13 graphics engine exception,
# 31 memory page fault, 43 GPU stopped processing, 45 preemptive cleanup): a bug in a
# program, not a failing card, so they do not count against the device.
APPLICATION_XIDS = frozenset({13, 31, 43, 45})


@dataclass(frozen=True, kw_only=True)
class HealthReading:
    """One GPU at one moment. ``None``: the device or driver does not report it (never a guess)."""

    node: str
    index: int
    """NVML index on the node (emulated: the worker's local device index)."""
    name: str
    """NVML device name, or the catalog type of an emulated device."""
    emulated: bool
    time_s: float
    """Wall clock (``time.time()``) when read."""
    utilisation: float | None
    """Fraction of the sample period a kernel ran (NVML); emulated: modelled busy time ÷ step time."""
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    temperature_c: float | None = None
    slowdown_temperature_c: float | None = None
    """Where the device starts slowing its clocks to cool down (NVML's threshold)."""
    shutdown_temperature_c: float | None = None
    power_w: float | None = None
    sm_clock_mhz: int | None = None
    throttle_reasons: tuple[str, ...] | None = None
    ecc_uncorrected: int | None = None
    """Volatile uncorrected ECC errors since the driver last loaded."""
    xids: tuple[int, ...] | None = None
    """Critical XID events since the previous reading; ``None`` where NVML cannot deliver events."""
    gpu_lost: bool = False
    errors: tuple[str, ...] = ()
    """NVML failures other than "not supported", one line each (``field: message``)."""


def emulated_reading(
    *,
    node: str,
    index: int,
    gpu_type: str,
    busy_s: float,
    step_s: float,
    memory_used_bytes: int,
    memory_total_bytes: int,
) -> HealthReading:
    """An emulated device's reading: only the figures the emulation measures, labelled emulated."""
    return HealthReading(
        node=node,
        index=index,
        name=gpu_type,
        emulated=True,
        time_s=time.time(),
        utilisation=min(busy_s / step_s, 1.0) if step_s > 0 else None,
        memory_used_bytes=memory_used_bytes,
        memory_total_bytes=memory_total_bytes,
    )


def decode_throttle_reasons(mask: int) -> tuple[str, ...]:
    """Names of the bits set in an NVML clock-event mask; unknown bits as ``bit_0x…``."""
    names = [name for bit, name in THROTTLE_REASONS.items() if mask & bit]
    rest = mask & ~sum(THROTTLE_REASONS)
    names += [f"bit_{1 << i:#x}" for i in range(64) if rest >> i & 1]
    return tuple(names)


class NvmlSampler:
    """Reads NVML on this node for the GPUs at ``indices`` (NVML's numbering, not CUDA_VISIBLE_DEVICES').

    ``nvml`` is the binding module (``pynvml`` from nvidia-ml-py by default); tests
    pass a stand-in. Registering for XID events can fail (unsupported on some
    platforms, or no permission); readings then have ``xids=None``.
    """

    def __init__(self, indices: Sequence[int], *, node: str, nvml: Any = None) -> None:
        if nvml is None:
            import pynvml as nvml
        self.nvml, self.node = nvml, node
        nvml.nvmlInit()
        self._unsupported = {
            getattr(nvml, code)
            for code in ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_FUNCTION_NOT_FOUND")
            if hasattr(nvml, code)
        }
        self.devices = [(i, nvml.nvmlDeviceGetHandleByIndex(i)) for i in indices]
        self._uuids = {nvml.nvmlDeviceGetUUID(h): i for i, h in self.devices}
        self._events = self._register_xid_events()

    def _register_xid_events(self) -> Any:
        nvml = self.nvml
        try:
            events = nvml.nvmlEventSetCreate()
            for _, handle in self.devices:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, events)
        except nvml.NVMLError:
            return None
        return events

    def _drain_xids(self) -> dict[int, list[int]]:
        """XIDs queued since the last call, by device index (a zero timeout never blocks)."""
        seen: dict[int, list[int]] = {i: [] for i, _ in self.devices}
        while True:
            try:
                event = self.nvml.nvmlEventSetWait(self._events, 0)
            except self.nvml.NVMLError_Timeout:
                return seen
            index = self._uuids.get(self.nvml.nvmlDeviceGetUUID(event.device))
            if index is not None:
                seen[index].append(int(event.eventData))

    def sample(self) -> list[HealthReading]:
        """One reading per GPU."""
        xids = self._drain_xids() if self._events is not None else None
        return [
            self._read(index, handle, None if xids is None else tuple(xids[index])) for index, handle in self.devices
        ]

    def _read(self, index: int, handle: Any, xids: tuple[int, ...] | None) -> HealthReading:
        nvml = self.nvml
        errors: list[str] = []
        lost = False

        def query(what: str, call: Callable[[], Any]) -> Any:
            nonlocal lost
            try:
                return call()
            except nvml.NVMLError as exc:
                if exc.value in self._unsupported:
                    return None
                lost |= exc.value == getattr(nvml, "NVML_ERROR_GPU_IS_LOST", None)
                errors.append(f"{what}: {exc}")
                return None

        util = query("utilisation", lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
        memory = query("memory", lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
        power_mw = query("power", lambda: nvml.nvmlDeviceGetPowerUsage(handle))
        throttle = query("throttle_reasons", lambda: nvml.nvmlDeviceGetCurrentClocksEventReasons(handle))
        return HealthReading(
            node=self.node,
            index=index,
            name=query("name", lambda: nvml.nvmlDeviceGetName(handle)) or "unknown",
            emulated=False,
            time_s=time.time(),
            utilisation=util.gpu / 100 if util is not None else None,
            memory_used_bytes=int(memory.used) if memory is not None else None,
            memory_total_bytes=int(memory.total) if memory is not None else None,
            temperature_c=query(
                "temperature", lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
            ),
            slowdown_temperature_c=query(
                "slowdown_temperature",
                lambda: nvml.nvmlDeviceGetTemperatureThreshold(handle, nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
            ),
            shutdown_temperature_c=query(
                "shutdown_temperature",
                lambda: nvml.nvmlDeviceGetTemperatureThreshold(handle, nvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN),
            ),
            power_w=power_mw / 1000 if power_mw is not None else None,
            sm_clock_mhz=query("sm_clock", lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)),
            throttle_reasons=decode_throttle_reasons(throttle) if throttle is not None else None,
            ecc_uncorrected=query(
                "ecc",
                lambda: nvml.nvmlDeviceGetTotalEccErrors(
                    handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
                ),
            ),
            xids=xids,
            gpu_lost=lost,
            errors=tuple(errors),
        )

    def close(self) -> None:
        """Free the event set and shut NVML down."""
        if self._events is not None:
            self.nvml.nvmlEventSetFree(self._events)
        self.nvml.nvmlShutdown()


Action = Literal["keep", "shrink", "exclude"]


@dataclass(frozen=True, kw_only=True)
class HealthDecision:
    """What to do with one device at the next (re)plan, and why in one line."""

    action: Action
    reason: str
    share_factor: float
    """Multiplies the device's planned share: 1 keep, (0, 1) shrink, 0 exclude."""


@dataclass(frozen=True, kw_only=True)
class HealthPolicy:
    """Thresholds that turn a device's recent readings and OOM count into a decision.

    Temperatures are judged against the device's own NVML thresholds unless
    ``shrink_temperature_c`` is set; a device that reports no temperature (an
    emulated one) is never judged on it.
    """

    exclude_after_xids: int = 2
    """Critical XIDs (outside ``application_xids``) in the window that exclude the device."""
    exclude_after_ecc: int = 1
    """Volatile uncorrected ECC errors that exclude the device (NVIDIA advises draining it)."""
    shrink_after_ooms: int = 1
    exclude_after_ooms: int = 3
    shrink_factor: float = 0.5
    shrink_temperature_c: float | None = None
    """Shrink at or above this; ``None``: the device's slowdown threshold."""
    shutdown_margin_c: float = 2.0
    """Exclude within this many degrees of the device's shutdown threshold."""
    application_xids: frozenset[int] = field(default=APPLICATION_XIDS)

    def __post_init__(self) -> None:
        if not 0 < self.shrink_factor < 1:
            raise ValueError(f"HealthPolicy.shrink_factor must be in (0, 1), got {self.shrink_factor}")
        if not 1 <= self.shrink_after_ooms <= self.exclude_after_ooms:
            raise ValueError("HealthPolicy needs 1 <= shrink_after_ooms <= exclude_after_ooms")

    def decide(self, readings: Sequence[HealthReading], ooms: int = 0) -> HealthDecision:
        """Decide for one device from its readings over the window (oldest first) and its OOM count."""
        if not readings:
            raise ValueError("HealthPolicy.decide needs at least one reading")
        last = readings[-1]
        who = f"GPU {last.index} ({last.name}) on node {last.node[:8]}"
        xids = [x for r in readings for x in (r.xids or ()) if x not in self.application_xids]

        def exclude(why: str) -> HealthDecision:
            return HealthDecision(action="exclude", reason=f"exclude {who}: {why}", share_factor=0.0)

        def shrink(why: str) -> HealthDecision:
            reason = f"shrink {who}'s share to {self.shrink_factor:g}×: {why}"
            return HealthDecision(action="shrink", reason=reason, share_factor=self.shrink_factor)

        if last.gpu_lost:
            return exclude("NVML reports the GPU lost")
        if len(xids) >= self.exclude_after_xids:
            return exclude(f"{len(xids)} critical XID errors {sorted(set(xids))} (limit {self.exclude_after_xids})")
        if last.ecc_uncorrected is not None and last.ecc_uncorrected >= self.exclude_after_ecc:
            return exclude(f"{last.ecc_uncorrected} uncorrected ECC errors (limit {self.exclude_after_ecc})")
        if ooms >= self.exclude_after_ooms:
            return exclude(f"{ooms} out-of-memory errors (limit {self.exclude_after_ooms})")
        temp = last.temperature_c
        if temp is not None and last.shutdown_temperature_c is not None:
            if temp >= last.shutdown_temperature_c - self.shutdown_margin_c:
                return exclude(f"{temp:g} °C, within {self.shutdown_margin_c:g} °C of shutdown")
        if ooms >= self.shrink_after_ooms:
            return shrink(f"{ooms} out-of-memory error{'s' * (ooms > 1)}")
        hot_at = self.shrink_temperature_c if self.shrink_temperature_c is not None else last.slowdown_temperature_c
        if temp is not None and hot_at is not None and temp >= hot_at:
            return shrink(f"{temp:g} °C, at or above {hot_at:g} °C")
        thermal = THERMAL_REASONS & set(last.throttle_reasons or ())
        if thermal:
            return shrink(f"clocks throttled ({', '.join(sorted(thermal))})")
        return HealthDecision(action="keep", reason=f"keep {who}: healthy", share_factor=1.0)
