"""Health readings from NVML (a stand-in module here: no GPU on this machine), emulated readings, the policy."""

from __future__ import annotations

import re
import sys
from dataclasses import replace

import pynvml
import pytest

from hetero_ray.monitor.health import (
    APPLICATION_XIDS,
    THROTTLE_REASONS,
    HealthPolicy,
    HealthReading,
    NvmlSampler,
    decode_throttle_reasons,
    emulated_reading,
)

GiB = 2**30
UNSUPPORTED = pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)


class FakeEvent:
    def __init__(self, device: int, xid: int):
        self.device, self.eventData = device, xid


class FakeNvml:
    """STAND-IN for the ``pynvml`` module: fixed devices, no driver.

    pynvml's own error classes, constants and structs, so the sampler meets the same
    exceptions and values as with the real binding. A device value that is an
    ``NVMLError`` instance is raised instead of returned.
    """

    NVMLError = pynvml.NVMLError
    NVMLError_Timeout = pynvml.NVMLError_Timeout
    NVML_ERROR_NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_FUNCTION_NOT_FOUND = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    NVML_ERROR_GPU_IS_LOST = pynvml.NVML_ERROR_GPU_IS_LOST
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
    NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
    NVML_TEMPERATURE_THRESHOLD_SHUTDOWN = pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN
    NVML_CLOCK_SM = pynvml.NVML_CLOCK_SM
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    NVML_VOLATILE_ECC = pynvml.NVML_VOLATILE_ECC
    nvmlEventTypeXidCriticalError = pynvml.nvmlEventTypeXidCriticalError

    def __init__(self, devices: list[dict], *, events_error: pynvml.NVMLError | None = None):
        self.devices, self.events_error = devices, events_error
        self.queue: list[FakeEvent] = []
        self.open = self.event_set_freed = False
        self.registered: set[int] = set()

    def _get(self, handle: int, key: str, *args):
        assert self.open, "NVML used outside nvmlInit/nvmlShutdown"
        value = self.devices[handle][key]
        if isinstance(value, pynvml.NVMLError):
            raise value
        return value

    def nvmlInit(self) -> None:
        self.open = True

    def nvmlShutdown(self) -> None:
        self.open = False

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return f"GPU-{handle:04d}"

    def nvmlDeviceGetName(self, handle: int) -> str:
        return self._get(handle, "name")

    def nvmlDeviceGetUtilizationRates(self, handle: int):
        return pynvml.c_nvmlUtilization_t(gpu=self._get(handle, "util"), memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: int):
        used, total = self._get(handle, "memory")
        return pynvml.c_nvmlMemory_t(total=total, free=total - used, used=used)

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._get(handle, "temp")

    def nvmlDeviceGetTemperatureThreshold(self, handle: int, which: int) -> int:
        return self._get(handle, {pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: "slowdown"}.get(which, "shutdown"))

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        return self._get(handle, "power_mw")

    def nvmlDeviceGetClockInfo(self, handle: int, clock: int) -> int:
        assert clock == pynvml.NVML_CLOCK_SM
        return self._get(handle, "sm_mhz")

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: int) -> int:
        return self._get(handle, "throttle")

    def nvmlDeviceGetTotalEccErrors(self, handle: int, kind: int, counter: int) -> int:
        assert (kind, counter) == (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
        return self._get(handle, "ecc")

    def nvmlEventSetCreate(self) -> str:
        if self.events_error is not None:
            raise self.events_error
        return "event-set"

    def nvmlDeviceRegisterEvents(self, handle: int, kinds: int, event_set: str) -> None:
        assert kinds == pynvml.nvmlEventTypeXidCriticalError and event_set == "event-set"
        self.registered.add(handle)

    def nvmlEventSetWait(self, event_set: str, timeout_ms: int) -> FakeEvent:
        assert timeout_ms == 0, "the sampler must never block on events"
        if not self.queue:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        return self.queue.pop(0)

    def nvmlEventSetFree(self, event_set: str) -> None:
        self.event_set_freed = True


def a100(**changes) -> dict:
    device = {
        "name": "NVIDIA A100-SXM4-80GB",
        "util": 87,
        "memory": (30 * GiB, 80 * GiB),
        "temp": 64,
        "slowdown": 87,
        "shutdown": 92,
        "power_mw": 312_500,
        "sm_mhz": 1410,
        "throttle": 0,
        "ecc": 0,
    }
    return {**device, **changes}


def test_real_reading_carries_what_nvml_reports() -> None:
    nvml = FakeNvml([a100(), a100(throttle=0x4 | 0x40)])
    sampler = NvmlSampler([1], node="node-abcdef12", nvml=nvml)
    (reading,) = sampler.sample()
    assert reading == replace(
        reading,
        node="node-abcdef12",
        index=1,
        name="NVIDIA A100-SXM4-80GB",
        emulated=False,
        utilisation=0.87,
        memory_used_bytes=30 * GiB,
        memory_total_bytes=80 * GiB,
        temperature_c=64,
        slowdown_temperature_c=87,
        shutdown_temperature_c=92,
        power_w=312.5,
        sm_clock_mhz=1410,
        throttle_reasons=("sw_power_cap", "hw_thermal_slowdown"),
        ecc_uncorrected=0,
        xids=(),
        gpu_lost=False,
        errors=(),
    )
    sampler.close()
    assert not nvml.open and nvml.event_set_freed


def test_unsupported_queries_are_none_not_invented() -> None:
    # A consumer card: no ECC, no power reading, no thermal thresholds.
    nvml = FakeNvml(
        [a100(name="NVIDIA GeForce RTX 3090", ecc=UNSUPPORTED, power_mw=UNSUPPORTED, slowdown=UNSUPPORTED)],
        events_error=UNSUPPORTED,
    )
    (reading,) = NvmlSampler([0], node="n", nvml=nvml).sample()
    assert (reading.ecc_uncorrected, reading.power_w, reading.slowdown_temperature_c, reading.xids) == (None,) * 4
    assert reading.temperature_c == 64 and reading.errors == ()


def test_other_nvml_failures_are_named_and_a_lost_gpu_is_flagged() -> None:
    lost = pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
    nvml = FakeNvml([a100(temp=lost, util=lost)])
    (reading,) = NvmlSampler([0], node="n", nvml=nvml).sample()
    assert reading.gpu_lost and reading.temperature_c is None and reading.utilisation is None
    assert reading.errors == ("utilisation: GPU is lost", "temperature: GPU is lost")


def test_xid_events_go_to_their_device_once() -> None:
    nvml = FakeNvml([a100(), a100()])
    sampler = NvmlSampler([0, 1], node="n", nvml=nvml)
    assert nvml.registered == {0, 1}
    nvml.queue = [FakeEvent(1, 79), FakeEvent(0, 13), FakeEvent(1, 48)]
    first = sampler.sample()
    assert [r.xids for r in first] == [(13,), (79, 48)]
    # Drained: the next reading has none.
    assert [r.xids for r in sampler.sample()] == [(), ()]


def test_default_binding_is_pynvml(monkeypatch) -> None:
    fake = FakeNvml([a100()])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    sampler = NvmlSampler([0], node="n")
    assert sampler.nvml is fake and sampler.sample()[0].sm_clock_mhz == 1410


def test_throttle_bits_match_pynvml_and_decode() -> None:
    for bit, name in THROTTLE_REASONS.items():
        camel = "".join(part.title() for part in name.split("_"))
        assert getattr(pynvml, f"nvmlClocksEventReason{camel}") == bit, name
    assert decode_throttle_reasons(0) == ()
    assert decode_throttle_reasons(0x1 | 0x20 | 0x1000) == ("gpu_idle", "sw_thermal_slowdown", "bit_0x1000")


def test_emulated_reading_has_no_sensors() -> None:
    reading = emulated_reading(
        node="n",
        index=0,
        gpu_type="V100-16GB",
        busy_s=0.3,
        step_s=0.4,
        memory_used_bytes=4 * GiB,
        memory_total_bytes=16 * GiB,
    )
    assert reading.emulated and reading.name == "V100-16GB"
    assert reading.utilisation == pytest.approx(0.75)
    assert (reading.memory_used_bytes, reading.memory_total_bytes) == (4 * GiB, 16 * GiB)
    sensors = (reading.temperature_c, reading.power_w, reading.sm_clock_mhz, reading.throttle_reasons, reading.xids)
    assert sensors == (None,) * 5 and reading.ecc_uncorrected is None


def reading(**changes) -> HealthReading:
    base = HealthReading(
        node="abcdef1234",
        index=2,
        name="NVIDIA A100-SXM4-80GB",
        emulated=False,
        time_s=0.0,
        utilisation=0.9,
        memory_used_bytes=GiB,
        memory_total_bytes=80 * GiB,
        temperature_c=60,
        slowdown_temperature_c=87,
        shutdown_temperature_c=92,
        throttle_reasons=(),
        ecc_uncorrected=0,
        xids=(),
    )
    return replace(base, **changes)


POLICY = HealthPolicy()


@pytest.mark.parametrize(
    ("readings", "ooms", "action", "reason"),
    [
        ([reading()], 0, "keep", r"^keep GPU 2 \(NVIDIA A100-SXM4-80GB\) on node abcdef12: healthy$"),
        ([reading(xids=(79,)), reading(xids=(48,))], 0, "exclude", r"2 critical XID errors \[48, 79\] \(limit 2\)"),
        ([reading(xids=(79,)), reading()], 0, "keep", "healthy"),
        ([reading(xids=(13, 31, 43))], 0, "keep", "healthy"),
        ([reading(ecc_uncorrected=1)], 0, "exclude", r"1 uncorrected ECC errors \(limit 1\)"),
        ([reading(gpu_lost=True, temperature_c=None)], 0, "exclude", "NVML reports the GPU lost"),
        ([reading()], 3, "exclude", r"3 out-of-memory errors \(limit 3\)"),
        ([reading()], 1, "shrink", r"shrink GPU 2 .* share to 0\.5×: 1 out-of-memory error$"),
        ([reading(temperature_c=88)], 0, "shrink", "88 °C, at or above 87 °C"),
        ([reading(temperature_c=90.5)], 0, "exclude", "90.5 °C, within 2 °C of shutdown"),
        ([reading(throttle_reasons=("hw_thermal_slowdown",))], 0, "shrink", r"clocks throttled \(hw_thermal"),
        ([reading(throttle_reasons=("sw_power_cap", "gpu_idle"))], 0, "keep", "healthy"),
        ([reading(temperature_c=99, slowdown_temperature_c=None, shutdown_temperature_c=None)], 0, "keep", "healthy"),
    ],
    ids=[
        "healthy",
        "repeated-xid",
        "single-xid",
        "application-xids",
        "ecc",
        "lost",
        "repeated-oom",
        "one-oom",
        "hot",
        "near-shutdown",
        "thermal-throttle",
        "power-cap-is-not-health",
        "no-thresholds-no-judgement",
    ],
)
def test_policy_decisions(readings, ooms: int, action: str, reason: str) -> None:
    decision = POLICY.decide(readings, ooms)
    assert decision.action == action, decision.reason
    assert decision.share_factor == {"keep": 1.0, "shrink": 0.5, "exclude": 0.0}[action]
    assert "\n" not in decision.reason
    assert re.search(reason, decision.reason), decision.reason


def test_policy_on_emulated_readings_judges_only_ooms() -> None:
    emulated = emulated_reading(
        node="n",
        index=0,
        gpu_type="V100-16GB",
        busy_s=1,
        step_s=1,
        memory_used_bytes=16 * GiB,
        memory_total_bytes=16 * GiB,
    )
    assert HealthPolicy(shrink_temperature_c=0).decide([emulated]).action == "keep"
    assert HealthPolicy().decide([emulated], ooms=1).action == "shrink"


def test_policy_overrides_and_guards() -> None:
    assert HealthPolicy(shrink_temperature_c=70).decide([reading(temperature_c=71)]).action == "shrink"
    assert HealthPolicy(application_xids=frozenset()).decide([reading(xids=(13, 13))]).action == "exclude"
    assert 13 in APPLICATION_XIDS
    with pytest.raises(ValueError, match="shrink_factor"):
        HealthPolicy(shrink_factor=1.0)
    with pytest.raises(ValueError, match="shrink_after_ooms"):
        HealthPolicy(shrink_after_ooms=4, exclude_after_ooms=3)
    with pytest.raises(ValueError, match="at least one reading"):
        POLICY.decide([])
