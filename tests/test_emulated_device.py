"""Emulated GPU: steps padded to the modelled time, memory capped like a real card."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hetero_ray.cluster.catalog import GPUS_ENV_VAR, GpuSpec, load_catalog
from hetero_ray.cluster.emulated_device import EmulatedDevice, EmulatedOOM

# A user-declared type with 2**-19 GiB = 2048 bytes of memory.
TINY_GPUS_YAML = """
gpus:
  Tiny-2KB:
    architecture: test
    compute_capability: [8, 0]
    memory_gib: 1.9073486328125e-06
    memory_bandwidth_gbs: 1
    peak_tflops: {fp32: 1, fp16: 2}
    interconnect: none
    interconnect_gbs: 1
    nvml_names: []
    source: test fixture
"""
STATIC_BYTES = 32 * 16  # Linear(8, 4) without bias: 32 parameters, weights + grads + Adam state


@pytest.fixture(autouse=True)
def _no_user_gpus_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(GPUS_ENV_VAR, raising=False)


@pytest.fixture
def tiny(tmp_path: Path) -> GpuSpec:
    path = tmp_path / "gpus.yaml"
    path.write_text(TINY_GPUS_YAML)
    spec = load_catalog(path).get("Tiny-2KB")
    assert spec.memory_bytes == 2048
    return spec


def a100_device(dilation: float) -> EmulatedDevice:
    # 1.56e12 FLOPs per sample at 312e12 bf16 × 0.5 efficiency: 0.01 s per sample before dilation.
    return EmulatedDevice(
        spec=load_catalog().get("A100-80GB"),
        precision="bf16",
        flops_per_sample=1.56e12,
        efficiency=0.5,
        dilation=dilation,
    )


def test_pad_sleeps_to_the_modelled_time() -> None:
    device = a100_device(dilation=10.0)  # 2 samples × 0.01 s × 10 = 0.2 s
    started = time.perf_counter()
    modelled = device.pad(started, samples=2)
    elapsed = time.perf_counter() - started
    assert modelled == pytest.approx(0.2, rel=1e-9)
    # At least its modelled time; no upper bound, which would time this host's scheduler, not the padding.
    assert elapsed >= 0.2
    assert device.overrun_steps == 0


def test_pad_counts_an_overrun_when_the_step_was_slower(monkeypatch: pytest.MonkeyPatch) -> None:
    device = a100_device(dilation=10.0)
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    modelled = device.pad(time.perf_counter() - 1.0, samples=2)  # the step already took 1 s > 0.2 s
    assert slept == []  # an overrun step is not padded
    assert modelled == pytest.approx(0.2, rel=1e-9)
    assert device.overrun_steps == 1


def step(device: EmulatedDevice, batch: int) -> None:
    """One forward and backward of Linear(8, 4) + MSE under the device's memory cap."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4, bias=False)
    x, y = torch.randn(batch, 8), torch.randn(batch, 4)
    with device.memory_cap(model, STATIC_BYTES):
        F.mse_loss(model(x), y).backward()


def tiny_device(spec: GpuSpec, precision: str) -> EmulatedDevice:
    return EmulatedDevice(spec=spec, precision=precision, flops_per_sample=1.0, efficiency=1.0, dilation=1.0)


# Saved per sample: x (8 floats), MSE's input and target (4 each) = 64 bytes at fp32, 32 at half width.
@pytest.mark.parametrize(
    ("precision", "batch"),
    [("fp32", 4), ("fp32", 24), ("fp16", 48)],  # 512 + 256, 512 + 1536 = 2048 (full), 512 + 1536
)
def test_memory_cap_lets_a_fitting_step_run(tiny: GpuSpec, precision: str, batch: int) -> None:
    step(tiny_device(tiny, precision), batch)


@pytest.mark.parametrize(
    ("precision", "batch"),
    [("fp32", 40), ("fp16", 64)],  # 512 + 2560 = 3072 > 2048; 512 + 2048 = 2560 > 2048
)
def test_memory_cap_raises_an_emulated_oom(tiny: GpuSpec, precision: str, batch: int) -> None:
    with pytest.raises(torch.OutOfMemoryError) as caught:
        step(tiny_device(tiny, precision), batch)
    assert isinstance(caught.value, EmulatedOOM)
    assert "Tiny-2KB" in str(caught.value)
