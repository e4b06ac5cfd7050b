"""`hetero-ray profile` on a real emulated cluster: `ray job submit` of jobs/profile_gpus.py, then the CLI again.

One Ray cluster for the module: a head plus one labelled raylet each for an
A100-80GB and a V100-16GB (emulated), started with `ray start` and token
authentication, as in tests/test_training.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cluster_jobs import REPO, ray_cli, submit_command, wait_for

from hetero_ray.cluster.catalog import load_catalog
from hetero_ray.cluster.emulation import EmulatedCluster
from hetero_ray.config import EmulationConfig
from hetero_ray.perf import history
from hetero_ray.perf.footprint import measure_footprint
from hetero_ray.perf.history import HOST_MEMORY, options_hash
from hetero_ray.perf.model import fit_perf_model
from hetero_ray.plan.cost import compute_seconds
from hetero_ray.workloads import build_workload

OPTIONS = {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16, "corpus_bytes": 20_000}
ARGS = ["--options", json.dumps(OPTIONS), "--micro-batches", "1,2,4", "--precisions", "fp32,bf16", "--repeats", "2"]


@pytest.fixture(scope="module")
def cluster():
    with EmulatedCluster({"A100-80GB": 1, "V100-16GB": 1}, gpus_per_node=1) as c:
        yield c


@pytest.fixture(scope="module")
def first_profile(cluster, tmp_path_factory) -> Path:
    """`ray job submit -- python jobs/profile_gpus.py` writes a new history."""
    path = tmp_path_factory.mktemp("profile") / "history.parquet"
    job_id = submit_command(
        cluster, [sys.executable, str(REPO / "jobs" / "profile_gpus.py"), "--history", str(path), *ARGS]
    )
    status = wait_for(cluster, job_id)
    assert status == "SUCCEEDED", ray_cli(cluster, "job", "logs", job_id)[-3000:]
    return path


def test_job_profiles_every_gpu_type_as_emulated(first_profile):
    """One row per (type, precision, micro-batch) the type has, each the emulated device's modelled time."""
    table = history.load(first_profile)
    got = sorted(zip(table["gpu_type"], table["precision"], table["micro_batch"]))
    want = [("A100-80GB", p, b) for p in ("bf16", "fp32") for b in (1, 2, 4)] + [
        ("V100-16GB", "fp32", b) for b in (1, 2, 4)
    ]
    assert got == want
    assert table["emulated"].all() and (table["memory_source"] == HOST_MEMORY).all()
    assert (table["clock"] == "modelled").all()
    assert (table["workload"] == "gpt").all() and (table["workload_hash"] == options_hash(OPTIONS)).all()
    catalog = load_catalog()
    flops = measure_footprint(lambda: build_workload("gpt", OPTIONS)).flops_per_sample
    efficiency = EmulationConfig().efficiency
    for row in table.itertuples():
        modelled = compute_seconds(catalog.get(row.gpu_type), row.precision, row.micro_batch * flops, efficiency)
        assert row.step_s == pytest.approx(modelled, rel=1e-9)
    fp32 = table[table["precision"] == "fp32"].sort_values(["gpu_type", "micro_batch"])
    for _, rows in fp32.groupby("gpu_type"):
        assert rows["peak_memory_bytes"].is_monotonic_increasing


def test_cli_appends_to_the_history_and_the_model_reads_it(cluster, first_profile):
    """A second profile (the CLI, --json) keeps the first one's rows; the emulated model predicts from both."""
    before = history.load(first_profile)
    out = subprocess.run(
        [sys.executable, "-m", "hetero_ray.cli", "profile", "--history", str(first_profile), "--json", *ARGS],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    printed = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(printed["rows"]) == len(before)
    assert {s["precision"] for s in printed["skipped"]["V100-16GB"]} == {"bf16"}
    after = history.load(first_profile)
    assert len(after) == 2 * len(before)
    assert after.iloc[: len(before)].equals(before)

    model = fit_perf_model(after, "gpt", emulated=True)
    a100 = after[(after["gpu_type"] == "A100-80GB") & (after["precision"] == "fp32") & (after["micro_batch"] == 2)]
    assert model.step_seconds("A100-80GB", 2, "fp32") == pytest.approx(a100["step_s"].iloc[0], rel=1e-3)
    # An emulated type the cluster lacks, from the catalog: the A100's modelled time × the fp32 peak ratio.
    catalog = load_catalog()
    ratio = catalog.get("A100-80GB").peak_flops("fp32") / catalog.get("RTX-3090").peak_flops("fp32")
    assert model.step_seconds("RTX-3090", 2, "fp32") == pytest.approx(a100["step_s"].iloc[0] * ratio, rel=1e-3)
