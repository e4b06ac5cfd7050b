"""Discovery: NVML reading (real binding and a stub), reports, and a real Ray cluster with an emulated node."""

from __future__ import annotations

import json
import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest
import ray
from nvml_fake import StubNvml
from ray._private.authentication_test_utils import reset_auth_token_state
from rich.console import Console

from hetero_ray.cluster.catalog import Catalog, load_catalog
from hetero_ray.cluster.discovery import (
    GpuInfo,
    NodeReport,
    _node_report,
    discover,
    probe_local_gpus,
    render_table,
    reports_from_json,
    reports_to_json,
    unknown_gpu_message,
)
from hetero_ray.cluster.emulation import EMULATED_LABEL, EMULATED_RESOURCE, GPU_TYPE_LABEL

GiB = 2**30


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    return load_catalog()


A100 = {"name": "NVIDIA A100-SXM4-80GB", "memory": 80 * GiB, "cc": (8, 0)}
A10G = {"name": "NVIDIA A10G", "memory": 23 * GiB, "cc": (8, 6)}


def test_probe_reads_names_memory_cc_and_nvlink_peers(catalog: Catalog) -> None:
    nvml = StubNvml([A100, A100, A100, A10G], nvlinks={frozenset((0, 1)), frozenset((0, 2)), frozenset((1, 2))})
    gpus, problem = probe_local_gpus(catalog, nvml=nvml)
    assert problem is None and not nvml.open
    assert [g.catalog_name for g in gpus] == ["A100-80GB"] * 3 + [None]
    assert gpus[0] == GpuInfo(
        index=0,
        nvml_name="NVIDIA A100-SXM4-80GB",
        catalog_name="A100-80GB",
        memory_total_bytes=80 * GiB,
        compute_capability=(8, 0),
        uuid="GPU-stub-0",
        nvlink_peers=("GPU-stub-1", "GPU-stub-2"),
    )
    assert gpus[3].nvlink_peers == ()


def test_probe_keeps_readable_gpus_and_names_the_lost_one(catalog: Catalog) -> None:
    gpus, problem = probe_local_gpus(catalog, nvml=StubNvml([A100, {"lost": True}, A100]))
    assert [g.index for g in gpus] == [0, 2]
    assert problem == "GPU 1 unreadable (NVML: GPU is lost)"


@pytest.mark.parametrize(
    ("nvml", "expected"),
    [
        (StubNvml([], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED), "NVML: Driver Not Loaded"),
        (StubNvml([]), "NVML: no devices"),
    ],
)
def test_probe_without_gpus_reports_why(catalog: Catalog, nvml: StubNvml, expected: str) -> None:
    assert probe_local_gpus(catalog, nvml=nvml) == ((), expected)


def test_probe_with_the_real_binding_does_not_crash(catalog: Catalog) -> None:
    """The real pynvml on this machine: a GPU host lists its GPUs, a CPU host says why it has none."""
    gpus, problem = probe_local_gpus(catalog)
    assert gpus or problem.startswith("NVML: ")
    for gpu in gpus:
        assert gpu.memory_total_bytes > 0 and gpu.uuid


def _report(node_id: str, gpus: tuple[GpuInfo, ...], error: str | None, emulated: str | None = None) -> NodeReport:
    labels = {GPU_TYPE_LABEL: emulated, EMULATED_LABEL: "true"} if emulated else {}
    return NodeReport(
        node_id=node_id,
        node_ip="10.0.0.1",
        labels=labels,
        gpus=gpus,
        error=error,
        emulated_gpu_type=emulated,
        emulated_gpu_count=2 if emulated else 0,
    )


def test_unknown_gpu_message_names_models_nodes_and_the_fix(catalog: Catalog) -> None:
    gpus, _ = probe_local_gpus(catalog, nvml=StubNvml([A100, A10G, A10G]))
    known, _ = probe_local_gpus(catalog, nvml=StubNvml([A100]))
    assert unknown_gpu_message([_report("aaaaaaaa11", known, None)]) is None
    message = unknown_gpu_message([_report("aaaaaaaa11", gpus, None), _report("bbbbbbbb22", gpus, None)])
    assert message is not None and "\n" not in message
    assert "'NVIDIA A10G' (node aaaaaaaa, bbbbbbbb)" in message
    assert "--gpus FILE" in message and "HETERO_RAY_GPUS" in message and "A100" not in message


def test_table_shows_real_emulated_and_failed_nodes(catalog: Catalog) -> None:
    gpus, _ = probe_local_gpus(catalog, nvml=StubNvml([A100, A100, A10G], nvlinks={frozenset((0, 1))}))
    reports = [
        _report("aaaaaaaa11", gpus, None),
        _report("bbbbbbbb22", (), "no NVIDIA GPU on node bbbbbbbb (NVML: Driver Not Loaded)", emulated="V100-16GB"),
    ]
    console = Console(record=True, width=250)
    render_table(reports, console)
    text = console.export_text()
    assert "A100-80GB" in text and "80.0 GiB" in text and "1 each" in text
    assert "NVIDIA A10G" in text and "not in catalog" in text
    assert "V100-16GB (emulated)" in text and "no NVIDIA GPU on node bbbbbbbb" in text


def test_node_report_flags_an_emulated_type_missing_from_the_catalog(catalog: Catalog) -> None:
    # One entry of ray.nodes(), as Ray 2.60 returns it (fields discovery reads).
    node = {
        "NodeID": "dddddddd" + "0" * 48,
        "NodeManagerAddress": "10.0.0.4",
        "Labels": {GPU_TYPE_LABEL: "X100", EMULATED_LABEL: "true"},
        "Resources": {"CPU": 1.0, EMULATED_RESOURCE: 4.0},
    }
    report = _node_report(node, (), "NVML: Driver Not Loaded", catalog)
    assert report.emulated_gpu_type == "X100" and report.emulated_gpu_count == 4
    assert report.error == (
        "no NVIDIA GPU on node dddddddd (NVML: Driver Not Loaded); "
        "emulated node dddddddd: label hetero-ray/gpu-type='X100' is not a catalog type"
    )


# --- a real Ray cluster: one emulated node on this (GPU-less) machine ---------------


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    with (
        tempfile.TemporaryDirectory(prefix="hr-", ignore_cleanup_errors=True) as tmp,
        pytest.MonkeyPatch.context() as env,
    ):
        # Ray 2.60 requires token auth; this cluster gets its own token. A short
        # temp dir keeps Ray's socket paths under the Unix limit and apart from
        # any other cluster on this machine.
        token = Path(tmp) / "auth_token"
        token.write_text(secrets.token_hex(32))
        env.setenv("RAY_AUTH_MODE", "token")
        env.setenv("RAY_AUTH_TOKEN_PATH", str(token))
        env.delenv("RAY_ADDRESS", raising=False)
        # Ray caches the auth mode and token at import; make it re-read them.
        reset_auth_token_state()
        ray.init(
            address="local",
            _temp_dir=tmp,
            num_cpus=1,
            object_store_memory=80 * 2**20,
            include_dashboard=False,
            labels={GPU_TYPE_LABEL: "A100-80GB", EMULATED_LABEL: "true"},
            resources={EMULATED_RESOURCE: 2},
        )
        try:
            yield
        finally:
            ray.shutdown()
            env.undo()
            reset_auth_token_state()


@pytest.fixture(scope="module")
def reports(ray_cluster: None, catalog: Catalog) -> list[NodeReport]:
    return discover(catalog)


def test_discover_reports_the_emulated_node_and_no_gpu(reports: list[NodeReport]) -> None:
    (report,) = reports
    assert report.node_id == ray.get_runtime_context().get_node_id()
    assert report.emulated_gpu_type == "A100-80GB" and report.emulated_gpu_count == 2
    if not report.gpus:  # a CPU-only machine, as in CI
        assert report.error.startswith(f"no NVIDIA GPU on node {report.node_id[:8]} (NVML: ")
        assert "\n" not in report.error
    assert unknown_gpu_message(reports) is None


def test_discover_table_labels_emulated(reports: list[NodeReport]) -> None:
    console = Console(record=True, width=250)
    render_table(reports, console)
    text = console.export_text()
    assert "A100-80GB (emulated)" in text and reports[0].node_id[:8] in text


def test_reports_round_trip_through_json(reports: list[NodeReport], catalog: Catalog) -> None:
    gpus, _ = probe_local_gpus(catalog, nvml=StubNvml([A100, A100], nvlinks={frozenset((0, 1))}))
    every_kind = [*reports, _report("cccccccc33", gpus, None)]
    data = json.loads(json.dumps(reports_to_json(every_kind)))
    assert data[0]["emulated_gpu_type"] == "A100-80GB" and data[0]["labels"][EMULATED_LABEL] == "true"
    assert data[1]["gpus"][0]["compute_capability"] == [8, 0]
    assert reports_from_json(data) == every_kind
