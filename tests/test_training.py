"""End to end on a real emulated cluster: `ray job submit` of jobs/train.py, split invariance, resume.

The session's Ray cluster (tests/conftest.py): a head plus labelled raylets for 2 × A100-80GB
and 2 × V100-16GB (emulated), started with `ray start` and token authentication.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from cluster_jobs import (
    HELD_OUT,
    REPO,
    STEPS,
    final_params,
    held_out_loss,
    job_status,
    max_abs_diff,
    ray_cli,
    run_config,
    single_process_reference,
    submit,
    wait_for,
)

from hetero_ray.config import parse_config
from hetero_ray.monitor.metrics import DEFINITIONS, prometheus_name
from hetero_ray.plan import search
from hetero_ray.plan.cost import ring_allreduce_bytes
from hetero_ray.plan.data_parallel import plan_data_parallel
from hetero_ray.plan.plan import Exclusion, Infeasible, Plan
from hetero_ray.train.onebit import fused_allreduce_bytes
from hetero_ray.train.prepare import prepare, topology_for

TINY_MEMORY = REPO / "tests" / "data" / "tiny-memory-gpus.yaml"
SMALL_MEMORY = REPO / "tests" / "data" / "small-memory-gpus.yaml"


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    job_id, out = submit(cluster, tmp, run_config(tmp / "runs", "uninterrupted", evaluate=True))
    status = wait_for(cluster, job_id)
    assert status == "SUCCEEDED", ray_cli(cluster, "job", "logs", job_id)[-3000:]
    result = json.loads(out.read_text())
    # The same result beside the run's checkpoints, in its storage, where the user reads it.
    assert json.loads((tmp / "runs" / "uninterrupted" / "result.json").read_text()) == result
    return result


def test_job_submit_reports_result(uninterrupted):
    """The submitted job succeeded and its result names loss and per-device throughput, labelled emulated."""
    m = uninterrupted["metrics"]
    assert m["emulated"] is True
    assert m["step"] == STEPS - 1
    losses = [loss for _, loss in m["losses"]]
    assert losses[-1] < losses[0]
    shares = sorted((d["gpu_type"], d["local_batch"]) for d in m["devices"])
    assert shares == [("A100-80GB", 4), ("A100-80GB", 4), ("V100-16GB", 2), ("V100-16GB", 2)]
    assert all(d["samples_per_s"] > 0 and d["precision"] == "fp32" for d in m["devices"])
    assert uninterrupted["summary"]["samples_per_s"] > 0


def test_split_invariance(uninterrupted):
    """2 fast + 2 slow workers at 2:1 end where one process on the full batch ends (fp32, 20 steps, 48 samples
    held out), and their evaluation, shared by the four, is that model's loss on the held-out samples."""
    reference = single_process_reference(held_out=HELD_OUT)
    assert max_abs_diff(final_params(uninterrupted), reference) <= 1e-5
    evaluation = uninterrupted["metrics"]["eval"]
    assert evaluation["step"] == STEPS - 1
    assert evaluation["loss"] == pytest.approx(held_out_loss(reference), abs=1e-5)


def test_memory_caps_force_a_pipeline_that_trains_like_one_process(cluster, tmp_path):
    """With 0.75 MiB per device the model fits on no device whole: data parallelism is infeasible,
    the planner cuts the model into pipeline stages, and the run ends where one process on the full batch ends."""
    cfg = run_config(tmp_path / "runs", "pipelined")
    cfg["gpus_file"] = str(TINY_MEMORY)
    cfg["train"] = {**cfg["train"], "split": "proportional"}
    prepared = prepare(parse_config(cfg))
    types = ["A100-80GB"] * 2 + ["V100-16GB"] * 2
    assert isinstance(
        plan_data_parallel(types, prepared.catalog, prepared.footprint, global_batch=12, precision="fp32"), Infeasible
    )
    job_id, out = submit(cluster, tmp_path, cfg)
    assert wait_for(cluster, job_id) == "SUCCEEDED", ray_cli(cluster, "job", "logs", job_id)[-3000:]
    result = json.loads(out.read_text())
    plan = Plan.from_dict(result["metrics"]["plan"])
    assert plan.is_pipelined and plan.num_pipelines < len(plan.roles)
    assert all(r.predicted_memory_bytes <= r.memory_cap_bytes for r in plan.roles)
    assert max_abs_diff(final_params(result), single_process_reference()) <= 1e-5


def searched(cfg: dict, **options) -> list[Plan]:
    """The placement search's plans for ``cfg``'s 2 A100 + 2 V100 (fp32, emulated), with ``options``."""
    parsed = parse_config(cfg)
    prepared = prepare(parsed)
    types = ["A100-80GB"] * 2 + ["V100-16GB"] * 2
    return search.plan(
        types,
        prepared.catalog,
        prepared.footprint,
        global_batch=12,
        topology=topology_for(parsed, prepared.catalog, types),
        precision="fp32",
        emulated=True,
        **options,
    )


def mixed_degree_plan(cfg: dict) -> Plan:
    """One pipeline whose stages differ in tensor-parallel degree and whose first stage spans two GPU types: the
    embedding and block 0 split 5 : 3 over an A100 and a V100 (from the planner's best plan of degree 2, whose
    first replica is an A100 pair, its second member moved to a V100), block 1 and the head on the other V100;
    the other A100 idle."""
    pair = [r for r in searched(cfg, tensor_parallel=(2,), top_k=1)[0].roles if r.gpu_type == "A100-80GB"]
    v100 = {"gpu_type": "V100-16GB", "memory_cap_bytes": 16 * 2**30}
    split = [replace(pair[0], tp_weights=(5.0, 3.0)), replace(pair[1], tp_weights=(5.0, 3.0), **v100)]
    staged = [replace(r, layers=(0, 2)) for r in split]
    staged.append(replace(pair[0], stage=1, layers=(2, 4), tp_weights=None, tp_rank=0, **v100))
    return Plan(
        global_batch=12,
        split="by hand",
        emulated=True,
        roles=tuple(replace(r, local_batch=12, micro_batch=6, sample_offset=0) for r in staged),
        predicted_compute_s=0.0,
        excluded=(Exclusion(gpu_type="A100-80GB", count=1, reason="an A100 and two V100s hold the stages"),),
        schedule="1f1b",
    )


def test_a_stage_split_across_gpu_types_then_one_device_trains_like_one_process_and_resumes_on_another(
    cluster, tmp_path
):
    """A pipeline of a tensor-parallel stage over an A100 and a V100 (every GPT block's heads and MLP columns split
    5 : 3 across the two types), then one V100, run by our own 1F1B schedule, submitted with --plan and stopped
    half-way, then resumed on the config's own data-parallel plan: the run ends where one process on the full
    batch ends (clipping and the schedule included), its checkpoints holding the whole model."""
    cfg = run_config(tmp_path / "runs", "tensor-parallel")
    plan = mixed_degree_plan(cfg)
    assert plan.tensor_parallel == 2 and [r.tp_degree for r in plan.roles] == [2, 2, 1]
    assert [r.gpu_type for r in plan.roles] == ["A100-80GB", "V100-16GB", "V100-16GB"]
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps({**plan.to_dict(), "workload": cfg["workload"]}))
    job_id, _ = submit(cluster, tmp_path, cfg, plan=plan_file)
    snapshot = tmp_path / "runs" / "tensor-parallel" / "checkpoint_manager_snapshot.json"
    deadline = time.monotonic() + 240
    while not snapshot.exists() and time.monotonic() < deadline:
        assert job_status(cluster, job_id) in ("PENDING", "RUNNING"), ray_cli(cluster, "job", "logs", job_id)[-3000:]
        time.sleep(0.5)
    ray_cli(cluster, "job", "stop", job_id)
    assert wait_for(cluster, job_id) == "STOPPED", "the run finished before it could be stopped"
    # The checkpoints the stopped run left were written under the tensor-parallel plan, in the whole layout.
    states = list((tmp_path / "runs" / "tensor-parallel").rglob("state.json"))
    assert states and all(Plan.from_dict(json.loads(p.read_text())["plan"]).tensor_parallel == 2 for p in states)

    job_id, out = submit(cluster, tmp_path, cfg)
    assert wait_for(cluster, job_id) == "SUCCEEDED", ray_cli(cluster, "job", "logs", job_id)[-3000:]
    resumed = json.loads(out.read_text())
    assert resumed["metrics"]["resumed_from_step"] > 0
    assert Plan.from_dict(resumed["metrics"]["plan"]).tensor_parallel == 1
    assert max_abs_diff(final_params(resumed), single_process_reference()) <= 1e-5


def test_batch_norm_under_an_uneven_split_trains_like_one_process(cluster, tmp_path):
    """A CNN with BatchNorm split 2 : 1 over an A100 and a V100: weights and running statistics end where one
    process on the full batch ends (1e-5, fp32). Each device normalising by its own samples alone ends 1e-2
    away (measured); the statistics are shared (train/batch_norm.py)."""
    cnn = {"name": "cnn", "options": {"samples": 512}}
    cfg = run_config(tmp_path / "runs", "batch-norm") | {"workload": cnn, "emulation": {}}
    cfg["devices"] = {"A100-80GB": 1, "V100-16GB": 1}
    job_id, out = submit(cluster, tmp_path, cfg)
    assert wait_for(cluster, job_id) == "SUCCEEDED", ray_cli(cluster, "job", "logs", job_id)[-3000:]
    result = json.loads(out.read_text())
    assert sorted((d["gpu_type"], d["local_batch"]) for d in result["metrics"]["devices"]) == [
        ("A100-80GB", 8),
        ("V100-16GB", 4),
    ]
    got, want = final_params(result), single_process_reference(workload=cnn)
    assert any("running_var" in k for k in got)
    assert max_abs_diff(got, want) <= 1e-5


def test_devices_the_plan_leaves_out_are_not_reserved(cluster, tmp_path):
    """With 0.8 MiB V100s the plan gives the tests' model to the A100s alone: only their two workers start (the
    V100s stay free for other work), on the plan made before launch, and the run ends where one process ends."""
    cfg = run_config(tmp_path / "runs", "left-out") | {"gpus_file": str(SMALL_MEMORY)}
    job_id, out = submit(cluster, tmp_path, cfg)
    assert wait_for(cluster, job_id) == "SUCCEEDED", ray_cli(cluster, "job", "logs", job_id)[-3000:]
    result = json.loads(out.read_text())
    assert sorted(d["gpu_type"] for d in result["metrics"]["devices"]) == ["A100-80GB", "A100-80GB"]
    plan = Plan.from_dict(result["metrics"]["plan"])
    assert plan.excluded[0].gpu_type == "V100-16GB" and plan.excluded[0].count == 2
    assert max_abs_diff(final_params(result), single_process_reference()) <= 1e-5


def test_zero_stage_3_trains_on_cards_too_small_for_the_whole_state_like_one_process(cluster, tmp_path):
    """With 2 MiB A100s and 0.8 MiB V100s (tests/data/small-memory-gpus.yaml) plain data parallelism leaves
    the V100s out. ZeRO-3 shards weights, gradients and Adam's state by spare memory: all four train at 2 : 1
    under their emulated memory caps (each charged what it holds whole and its own shard), the run ends where
    one process ends (1e-5), its evaluation (3 forwards on an A100, 6 on a V100, each gathering every layer:
    the A100s run 3 more, uncounted) is that model's held-out loss, and its checkpoint holds the whole
    optimizer state, gathered from the shards."""
    cfg = run_config(tmp_path / "runs", "zero-3", evaluate=True) | {"gpus_file": str(SMALL_MEMORY)}
    plain = prepare(parse_config(cfg)).plan
    assert {r.gpu_type for r in plain.roles} == {"A100-80GB"} and plain.excluded[0].gpu_type == "V100-16GB"
    cfg["optimizer"] = {"zero_stage": 3}
    assert all(r.predicted_memory_bytes <= r.memory_cap_bytes for r in prepare(parse_config(cfg)).plan.roles)
    job_id, out = submit(cluster, tmp_path, cfg)
    assert wait_for(cluster, job_id) == "SUCCEEDED", ray_cli(cluster, "job", "logs", job_id)[-3000:]
    result = json.loads(out.read_text())
    devices = result["metrics"]["devices"]
    assert sorted((d["gpu_type"], d["local_batch"]) for d in devices) == [
        ("A100-80GB", 4),
        ("A100-80GB", 4),
        ("V100-16GB", 2),
        ("V100-16GB", 2),
    ]
    assert all(0 < d["peak_memory_bytes"] <= d["memory_cap_bytes"] for d in devices)
    reference = single_process_reference(held_out=HELD_OUT)
    assert max_abs_diff(final_params(result), reference) <= 1e-5
    assert result["metrics"]["eval"]["loss"] == pytest.approx(held_out_loss(reference), abs=1e-5)
    optimizer_state = torch.load(Path(result["checkpoint_path"]) / "optimizer.pt")
    params = final_params(result)
    assert [s["exp_avg"].shape for _, s in sorted(optimizer_state["state"].items())] == [
        p.shape for p in params.values()
    ]


def test_zero_1_inside_pipelines_trains_like_one_process(cluster, tmp_path):
    """The planner's pipelined ZeRO-1 plan of two pipelines cut alike (A100 stage → V100 stage), run from its
    plan file: each stage's Adam state is sharded over its two replicas, the run ends where one process ends
    (1e-5) and its checkpoint holds the whole optimizer state, gathered from the shards."""
    cfg = run_config(tmp_path / "runs", "zero-1-pipelines")
    cfg["train"] = {**cfg["train"], "split": "proportional"}
    cfg["optimizer"] = {"zero_stage": 1}
    plans = searched(cfg, zero_stage=1, top_k=20)

    def stages(p: Plan, pipeline: int) -> list:
        return sorted((r.stage, r.gpu_type, r.layers) for r in p.roles if r.pipeline == pipeline)

    # Two replicas of one kind, pipelines cut alike: every stage has a replica to shard with.
    plan = next(p for p in plans if p.num_pipelines == 2 and stages(p, 0) == stages(p, 1) and p.is_pipelined)
    assert plan.zero_stage == 1 and "ZeRO-1: each stage's Adam state is sharded over the 2 replicas" in plan.explanation
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps({**plan.to_dict(), "workload": cfg["workload"]}))
    job_id, out = submit(cluster, tmp_path, cfg, plan=plan_file)
    assert wait_for(cluster, job_id) == "SUCCEEDED", ray_cli(cluster, "job", "logs", job_id)[-3000:]
    result = json.loads(out.read_text())
    assert Plan.from_dict(result["metrics"]["plan"]).zero_stage == 1
    params = final_params(result)
    assert max_abs_diff(params, single_process_reference()) <= 1e-5
    optimizer_state = torch.load(Path(result["checkpoint_path"]) / "optimizer.pt")
    assert [s["exp_avg"].shape for _, s in sorted(optimizer_state["state"].items())] == [
        p.shape for p in params.values()
    ]


def test_discover_cli_labels_emulated_nodes(cluster):
    """`hetero-ray discover --json` on the live cluster: every node reported, emulated GPUs said so, no crash without NVML."""
    out = subprocess.run(
        [sys.executable, "-m", "hetero_ray.cli", "discover", "--json"],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    reports = json.loads(out.stdout.strip().splitlines()[-1])
    emulated = sorted((r["emulated_gpu_type"], r["emulated_gpu_count"]) for r in reports if r["emulated_gpu_type"])
    assert emulated == [("A100-80GB", 2), ("V100-16GB", 2)]
    assert len(reports) == 3
    assert all(not r["gpus"] and "no NVIDIA GPU" in r["error"] for r in reports)


def test_onebit_adam_compresses_and_resumes_with_its_optimizer_state(cluster, tmp_path):
    """DeepSpeed 1-bit Adam on the workers: past its warm-up only compressed momentum crosses the
    emulated 1 Gbit/s link (bytes counted at the backend), and a longer run of the same name resumes
    from the checkpoint, optimizer state included."""
    cfg = run_config(tmp_path / "runs", "onebit")
    # Small enough that 1 Gbit/s warm-up steps take about a second each.
    cfg["emulation"] = {"dilation": 1_000}
    cfg["link"] = {"bandwidth_gbps": 1, "latency_us": 10}
    cfg["optimizer"] = {"name": "onebit_adam", "freeze_step": 4, "betas": [0.9, 0.95]}
    # DeepSpeed's compressed momentum is not clipped (refused); the schedule applies to its rate alike.
    cfg["train"] |= {"steps": 10, "checkpoint_every": 10, "report_every": 5, "grad_clip": None}
    job_id, out = submit(cluster, tmp_path, cfg)
    assert wait_for(cluster, job_id) == "SUCCEEDED", ray_cli(cluster, "job", "logs", job_id)[-3000:]
    result = json.loads(out.read_text())
    first = result["metrics"]
    tensors = torch.load(Path(result["checkpoint_path"]) / "model.pt").values()
    assert all(d["compressed"] for d in first["devices"])
    # The model is one flat tensor compressed in one call with a scale per original tensor,
    # plus the 2-element loss/stop vote.
    expected = fused_allreduce_bytes([t.numel() for t in tensors], 4) + ring_allreduce_bytes(8, 4)
    assert {d["bytes_sent"] for d in first["devices"]} == {expected}
    assert first["losses"][-1][1] < first["losses"][0][1]

    cfg["train"] |= {"steps": 14}
    job_id, out = submit(cluster, tmp_path, cfg)
    assert wait_for(cluster, job_id) == "SUCCEEDED", ray_cli(cluster, "job", "logs", job_id)[-3000:]
    resumed = json.loads(out.read_text())["metrics"]
    assert resumed["resumed_from_step"] == 10 and resumed["step"] == 13
    assert all(d["compressed"] for d in resumed["devices"])


def scrape(ports: list[int]) -> list[tuple[str, dict[str, str]]]:
    """(name, labels) of every sample on the cluster's Prometheus endpoints."""
    samples = []
    for port in ports:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        except OSError:
            continue
        for line in text.splitlines():
            found = re.match(r"^(\w+)\{(.*)\} \S+$", line)
            if found:
                samples.append((found.group(1), dict(re.findall(r'(\w+)="([^"]*)"', found.group(2)))))
    return samples


@pytest.fixture(scope="module")
def prometheus(cluster, tmp_path_factory):
    """A real Prometheus (Debian's package; .ci/run installs it) scraping the cluster every second through the
    service-discovery file Ray keeps in its session folder; yields its query URL."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus is not installed: apt-get install prometheus (.ci/run does)")
    tmp = tmp_path_factory.mktemp("prometheus")
    targets = cluster.workdir / "r" / "session_latest" / "prom_metrics_service_discovery.json"
    (tmp / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s}\n"
        f"scrape_configs: [{{job_name: ray, file_sd_configs: [{{files: ['{targets}'], refresh_interval: 1s}}]}}]\n"
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp / "prometheus.log", "wb")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/-/ready", timeout=2)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, (tmp / "prometheus.log").read_text()[-2000:]
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def promql(url: str, query: str) -> list[dict]:
    """The result vector of an instant PromQL query."""
    answer = json.load(urllib.request.urlopen(f"{url}/api/v1/query?query={urllib.parse.quote(query)}", timeout=10))
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def test_metrics_endpoint_has_every_metric_with_its_tags(cluster, prometheus, tmp_path):
    """A running job's figures reach the raylets' Prometheus endpoints, per rank and GPU type, labelled emulated,
    and a real Prometheus scraping the cluster answers a PromQL query with the values the run reported."""
    cfg = run_config(tmp_path / "runs", "metrics")
    cfg["train"] = {**cfg["train"], "steps": 400, "report_every": 2, "checkpoint_every": 400}
    job_id, _ = submit(cluster, tmp_path, cfg)
    per_device = [
        "step_seconds",
        "samples_per_second",
        "share",
        "local_batch",
        "compute_fraction",
        "comm_seconds",
        "sent_bytes",
        "emulation_overrun_steps",
        "gpu_utilization_ratio",
        "gpu_memory_used_bytes",
        "gpu_memory_total_bytes",
    ]
    run_wide = ["run_samples_per_second", "balance_efficiency", "loss", "steps", "excluded_workers"]
    wanted = {prometheus_name(DEFINITIONS[f"hetero_ray_{n}"]): n for n in per_device + run_wide}
    deadline, missing = time.monotonic() + 120, None
    try:
        while time.monotonic() < deadline:
            samples = [(n, labels) for n, labels in scrape(cluster.metrics_ports) if labels.get("run") == "metrics"]
            ranks: dict[str, set[tuple[str, str]]] = {}
            for name, labels in samples:
                if name in wanted:
                    ranks.setdefault(name, set()).add((labels.get("rank", ""), labels.get("gpu_type", "")))
                    assert labels["emulated"] == "true"
            expected_devices = {("0", "A100-80GB"), ("1", "A100-80GB"), ("2", "V100-16GB"), ("3", "V100-16GB")}
            missing = [n for n in wanted if n not in ranks] + [
                wanted[n] for n in wanted if wanted[n] in per_device and n in ranks and ranks[n] != expected_devices
            ]
            if not missing:
                break
            assert job_status(cluster, job_id) in ("PENDING", "RUNNING"), ray_cli(cluster, "job", "logs", job_id)[
                -2000:
            ]
            time.sleep(3)
        # Each rank's local batch as the run reports it (the plan's split, 4 : 4 : 2 : 2), through PromQL.
        query = f'{prometheus_name(DEFINITIONS["hetero_ray_local_batch"])}{{run="metrics"}}'
        found: dict[tuple[str, str], float] = {}
        while not missing and time.monotonic() < deadline:
            found = {
                (r["metric"]["rank"], r["metric"]["gpu_type"]): float(r["value"][1]) for r in promql(prometheus, query)
            }
            if len(found) == 4:
                break
            time.sleep(2)
    finally:
        ray_cli(cluster, "job", "stop", job_id)
    assert not missing, f"not on the metrics endpoints (or not for every rank): {missing}"
    assert found == {("0", "A100-80GB"): 4, ("1", "A100-80GB"): 4, ("2", "V100-16GB"): 2, ("3", "V100-16GB"): 2}
