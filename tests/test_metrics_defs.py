"""What the metrics recorder emits for a report, health readings and events; the dashboard shows exactly that."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed import HashStore

from hetero_ray.monitor.health import HealthDecision, HealthReading, emulated_reading
from hetero_ray.monitor.metrics import (
    DEFINITIONS,
    RayMetrics,
    balance_efficiency,
    decision_records,
    health_records,
    prometheus_name,
    rebalance_records,
    report_records,
    restart_records,
    window_steps,
)
from hetero_ray.plan.plan import Exclusion, Plan, WorkerRole
from hetero_ray.train.loop import Window, _metrics
from hetero_ray.train.sync import Synced

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "hetero-ray-dashboard.json"
GiB = 2**30


def role(gpu_type: str, local_batch: int, offset: int) -> WorkerRole:
    return WorkerRole(
        gpu_type=gpu_type,
        local_batch=local_batch,
        micro_batch=local_batch,
        sample_offset=offset,
        precision="fp32",
        predicted_compute_s=0.1,
        predicted_memory_bytes=GiB,
        memory_cap_bytes=16 * GiB,
    )


def device(rank: int, gpu_type: str, local_batch: int, step_s: float, busy_s: float, bytes_sent: float) -> dict:
    """One entry of the report's ``devices`` (the shape ``loop._metrics`` builds)."""
    return {
        "rank": rank,
        "gpu_type": gpu_type,
        "local_batch": local_batch,
        "share": local_batch / 72,
        "micro_batch": local_batch,
        "precision": "bf16",
        "step_s": step_s,
        "samples_per_s": local_batch / step_s,
        "utilisation": busy_s / step_s,
        "comm_s": step_s - busy_s,
        "bytes_sent": bytes_sent,
        "compressed": False,
        "overrun_steps": 0,
        "comm_overruns": 0,
    }


# Two A100s at 48 samples in 0.8 s of compute, one V100 at 24 samples in 0.9 s; everyone's step 1.0 s.
# Achieved: 72 / 1.0 = 72 samples/s. Ideal: 48/0.8 + 24/0.9 = 60 + 26.67 = 86.67. Efficiency 0.8308.
REPORT = {
    "step": 29,
    "loss": 2.5,
    "step_s": 1.0,
    "samples_per_s": 72.0,
    "emulated": True,
    "devices": [device(0, "A100-80GB", 48, 1.0, 0.8, 1000.0), device(1, "V100-16GB", 24, 1.0, 0.9, 1000.0)],
    "plan": {"global_batch": 72, "excluded": [{"gpu_type": "T4", "count": 2, "reason": "too small"}]},
    "resumed_from_step": 20,
    # Resumed at step 20 from a checkpoint whose history ends at step 19, then reported at 29.
    "losses": [[9, 3.0], [19, 2.8], [29, 2.5]],
    "elapsed_s": 12.0,
}


def by_name(records) -> dict:
    return {r.name: r for r in records}


def test_window_steps_fresh_and_resumed() -> None:
    assert window_steps(REPORT) == 10
    assert window_steps({"step": 9, "losses": [[9, 3.0]]}) == 10
    # The first report after resuming at step 20 (checkpoint at step 19).
    assert window_steps({"step": 24, "losses": [[19, 2.8], [24, 2.6]]}) == 5


def test_balance_efficiency_worked_by_hand() -> None:
    assert balance_efficiency(REPORT) == pytest.approx(72 / (48 / 0.8 + 24 / 0.9))
    idle = {**REPORT, "devices": [{**d, "local_batch": 0} for d in REPORT["devices"]]}
    assert balance_efficiency(idle) is None


def test_rank_0_records_its_device_and_the_run() -> None:
    records = by_name(report_records(REPORT, rank=0, node="node-a", run="r1"))
    tags = {"run": "r1", "node": "node-a", "gpu_type": "A100-80GB", "rank": "0", "emulated": "true"}
    assert records["hetero_ray_step_seconds"].tags == tags
    assert records["hetero_ray_samples_per_second"].value == pytest.approx(48.0)
    assert records["hetero_ray_share"].value == pytest.approx(48 / 72)
    assert records["hetero_ray_compute_fraction"].value == pytest.approx(0.8)
    assert records["hetero_ray_comm_seconds"].value == pytest.approx(0.2)
    # Counters add the window: 1000 bytes per step × 10 steps.
    assert records["hetero_ray_sent_bytes"].value == 10_000
    assert records["hetero_ray_steps"].value == 10
    assert records["hetero_ray_balance_efficiency"].value == pytest.approx(0.8308, abs=1e-4)
    assert records["hetero_ray_run_samples_per_second"].tags == {"run": "r1", "emulated": "true"}
    excluded = [
        r for r in report_records(REPORT, rank=0, node="n", run="r1") if r.name == "hetero_ray_excluded_workers"
    ]
    assert {r.tags["gpu_type"]: r.value for r in excluded} == {"A100-80GB": 0, "T4": 2, "V100-16GB": 0}


def test_other_ranks_record_only_their_own_device() -> None:
    records = report_records(REPORT, rank=1, node="node-b", run="r1")
    assert {r.tags["rank"] for r in records} == {"1"} and {r.tags["gpu_type"] for r in records} == {"V100-16GB"}
    assert "hetero_ray_balance_efficiency" not in by_name(records)


def test_real_runs_do_not_emit_emulation_figures() -> None:
    real = {**REPORT, "emulated": False}
    names = by_name(report_records(real, rank=0, node="n", run="r"))
    assert "hetero_ray_emulation_overrun_steps" not in names and names["hetero_ray_loss"].tags["emulated"] == "false"


def test_emulated_health_emits_no_sensor_figures() -> None:
    reading = emulated_reading(
        node="n",
        index=0,
        gpu_type="V100-16GB",
        busy_s=0.9,
        step_s=1.0,
        memory_used_bytes=GiB,
        memory_total_bytes=16 * GiB,
    )
    records = by_name(health_records(reading, rank=1, gpu_type="V100-16GB", run="r"))
    assert set(records) == {
        "hetero_ray_gpu_utilization_ratio",
        "hetero_ray_gpu_memory_used_bytes",
        "hetero_ray_gpu_memory_total_bytes",
    }
    assert records["hetero_ray_gpu_utilization_ratio"].value == pytest.approx(0.9)
    assert records["hetero_ray_gpu_utilization_ratio"].tags["emulated"] == "true"


def real_reading() -> HealthReading:
    return HealthReading(
        node="n",
        index=3,
        name="NVIDIA A100-SXM4-80GB",
        emulated=False,
        time_s=0.0,
        utilisation=0.5,
        memory_used_bytes=GiB,
        memory_total_bytes=80 * GiB,
        temperature_c=70,
        power_w=300.0,
        sm_clock_mhz=1410,
        throttle_reasons=("sw_power_cap", "hw_slowdown"),
        ecc_uncorrected=0,
        xids=(79, 48, 79),
    )


def test_real_health_emits_every_reported_field() -> None:
    records = health_records(real_reading(), rank=0, gpu_type="A100-80GB", run="r")
    throttled = {r.tags["reason"] for r in records if r.name == "hetero_ray_gpu_throttled"}
    xids = {r.tags["xid"]: r.value for r in records if r.name == "hetero_ray_gpu_xid_events"}
    assert throttled == {"sw_power_cap", "hw_slowdown"} and xids == {"48": 1, "79": 2}
    assert by_name(records)["hetero_ray_gpu_power_watts"].value == 300.0
    # Base units, as Prometheus names them: NVML's MHz are exported in hertz.
    assert by_name(records)["hetero_ray_gpu_sm_clock_hertz"].value == 1410e6


def test_events() -> None:
    assert [r.name for r in restart_records(run="r", emulated=False)] == ["hetero_ray_restarts"]
    keep = HealthDecision(action="keep", reason="keep", share_factor=1.0)
    exclude = HealthDecision(action="exclude", reason="exclude", share_factor=0.0)
    kw = {"rank": 2, "node": "n", "gpu_type": "V100-16GB", "run": "r", "emulated": True}
    assert decision_records(keep, **kw) == []
    (record,) = decision_records(exclude, **kw)
    assert record.tags["action"] == "exclude" and record.value == 1


def everything_emitted() -> list:
    decision = HealthDecision(action="shrink", reason="", share_factor=0.5)
    emu = emulated_reading(
        node="n", index=0, gpu_type="A", busy_s=1, step_s=2, memory_used_bytes=1, memory_total_bytes=2
    )
    return [
        *report_records(REPORT, rank=0, node="n", run="r"),
        *report_records(REPORT, rank=1, node="n", run="r"),
        *health_records(real_reading(), rank=0, gpu_type="A100-80GB", run="r"),
        *health_records(emu, rank=1, gpu_type="V100-16GB", run="r"),
        *restart_records(run="r", emulated=True),
        *rebalance_records("imbalance", run="r", emulated=True),
        *decision_records(decision, rank=0, node="n", gpu_type="A100-80GB", run="r", emulated=True),
    ]


def test_every_definition_is_emitted_with_its_declared_tags() -> None:
    records = everything_emitted()
    assert {r.name for r in records} == set(DEFINITIONS)
    for r in records:
        assert set(r.tags) == set(DEFINITIONS[r.name].tag_keys), r.name
        assert all(isinstance(v, str) for v in r.tags.values()), r
    assert all(name.startswith("hetero_ray_") for name in DEFINITIONS)


def test_ray_metric_objects_accept_the_records() -> None:
    # Outside a cluster Ray's metrics record nothing, but they still check names and tag keys.
    RayMetrics().apply(everything_emitted())


def test_dashboard_shows_every_metric_and_no_other() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\bray_hetero_ray_\w+", e)}
    assert used == {prometheus_name(d) for d in DEFINITIONS.values()}
    # Every metric the dashboard filters by a tag has that tag (or is Ray's own label), and every series is
    # filtered by the Ray session chosen at the top, so two clusters' runs of one name do not mix.
    for e in exprs:
        for name, labels in re.findall(r"\b(ray_hetero_ray_\w+)\{([^}]*)\}", e):
            (d,) = [d for d in DEFINITIONS.values() if prometheus_name(d) == name]
            keys = {k for k, _ in re.findall(r'(\w+)=~?"([^"]*)"', labels)}
            assert keys - {"SessionName"} <= set(d.tag_keys), e
            assert 'SessionName=~"$SessionName"' in labels, e
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource", "SessionName", "run"]
    panel_ids = [p["id"] for p in dashboard["panels"]]
    assert len(panel_ids) == len(set(panel_ids))


def test_the_loops_report_has_the_shape_the_recorder_reads() -> None:
    """``loop._metrics`` itself on a one-process gloo group: the recorder reads every key it needs."""
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        plan = Plan(
            global_batch=8,
            split="proportional",
            emulated=True,
            roles=(role("A100-80GB", 8, 0),),
            predicted_compute_s=0.1,
            excluded=(Exclusion(gpu_type="T4", count=1, reason="too small"),),
        )
        window = Window()
        for _ in range(5):
            window.add(0.5, 0.4, 0.1, Synced(loss_total=1.0, stop=False, bytes_sent=64.0, messages=1, compressed=False))
        report = _metrics(4, 2.0, window, plan, list(plan.roles), ["A100-80GB"], None, None, 0, [(4, 2.0)], 0.0)
    finally:
        dist.destroy_process_group()
    records = by_name(report_records(report, rank=0, node="n", run="r"))
    assert records["hetero_ray_sent_bytes"].value == pytest.approx(64.0 * 5)
    assert records["hetero_ray_steps"].value == 5
    assert records["hetero_ray_balance_efficiency"].value == pytest.approx((8 / 0.5) / (8 / 0.4))


def test_monitoring_doc_lists_every_metric_and_no_other() -> None:
    doc = (DASHBOARD.parents[1] / "monitoring.md").read_text()
    assert set(re.findall(r"\bray_hetero_ray_\w+", doc)) == {prometheus_name(d) for d in DEFINITIONS.values()}
