"""What one training worker publishes at each report: its figures, its device's health, restarts."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from hetero_ray.cluster.emulated_device import EmulatedDevice
from hetero_ray.monitor.health import HealthReading, NvmlSampler, emulated_reading
from hetero_ray.monitor.metrics import (
    RayMetrics,
    decision_records,
    health_records,
    rebalance_records,
    report_records,
    restart_records,
)

logger = logging.getLogger(__name__)


class WorkerMonitor:
    """Ray metrics of one worker, tagged with its run, node, GPU type and rank.

    A real GPU is read through NVML (the index Ray assigned); an emulated one reports
    only what the emulation measures: busy ÷ step time and its peak of live bytes.
    """

    def __init__(
        self, *, run: str, rank: int, node: str, gpu_type: str, emu: EmulatedDevice | None, gpu_index: int | None
    ):
        self.run, self.rank, self.node, self.gpu_type, self.emu = run, rank, node, gpu_type, emu
        self.metrics = RayMetrics()
        self.sampler = None
        if gpu_index is not None:
            try:
                self.sampler = NvmlSampler([gpu_index], node=node)
            except Exception as exc:  # NVML missing or broken: train on, without health readings
                logger.warning("no GPU health readings on rank %d: NVML failed (%s)", rank, exc)
        self.last_reading: HealthReading | None = None

    def restarted(self) -> None:
        """Count a restart from a checkpoint (rank 0 only, so the run counts it once)."""
        if self.rank == 0:
            self.metrics.apply(restart_records(run=self.run, emulated=self.emu is not None))

    def decided(self, change) -> None:
        """A re-split the ranks agreed on: rank 0 logs and counts it; a rank whose health decided counts that."""
        emulated = self.emu is not None
        if change.mine is not None:
            self.metrics.apply(
                decision_records(
                    change.mine, rank=self.rank, node=self.node, gpu_type=self.gpu_type, run=self.run, emulated=emulated
                )
            )
        if self.rank != 0:
            return
        for cause, text in change.reasons:
            logger.warning("hetero-ray re-split the batch (%s): %s", cause, text)
            self.metrics.apply(rebalance_records(cause, run=self.run, emulated=emulated))

    def report(self, report: Mapping[str, Any]) -> None:
        """Publish the loop's report dict and a fresh health reading."""
        records = report_records(report, rank=self.rank, node=self.node, run=self.run)
        reading = self._read(report["devices"][self.rank])
        if reading is not None:
            records += health_records(reading, rank=self.rank, gpu_type=self.gpu_type, run=self.run)
        self.last_reading = reading
        self.metrics.apply(records)

    def _read(self, device: Mapping[str, Any]) -> HealthReading | None:
        if self.sampler is not None:
            return self.sampler.sample()[0]
        if self.emu is None:
            return None
        return emulated_reading(
            node=self.node,
            index=self.rank,
            gpu_type=self.gpu_type,
            busy_s=device["utilisation"] * device["step_s"],
            step_s=device["step_s"],
            memory_used_bytes=self.emu.peak_bytes,
            memory_total_bytes=self.emu.spec.memory_bytes,
        )

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()
