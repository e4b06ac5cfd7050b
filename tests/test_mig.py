"""MIG instances as GPU types: the profile table, derived specs, discovery through a faithful NVML fake, planning."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pynvml
import pytest
from nvml_fake import LGIP, StubNvml, mig
from rich.console import Console

import hetero_ray.cluster.discovery as discovery
import hetero_ray.cluster.mig as mig_module
from hetero_ray.cluster.catalog import GPUS_ENV_VAR, Catalog, load_catalog
from hetero_ray.cluster.discovery import (
    NodeReport,
    gpu_type_label,
    label_problems,
    probe_local_gpus,
    render_table,
    reports_from_json,
    reports_to_json,
)
from hetero_ray.cluster.emulation import GPU_TYPE_LABEL
from hetero_ray.cluster.mig import (
    MEMORY_SLICES,
    MIG_GUIDE,
    MIG_PARENTS,
    UnknownMigProfile,
    find_profile,
    mig_spec,
    mig_type_name,
    profile_name,
    with_mig_types,
)
from hetero_ray.perf.footprint import Footprint
from hetero_ray.plan.data_parallel import plan_data_parallel, split_batch
from hetero_ray.plan.plan import Plan

GiB = 2**30
A100 = {"name": "NVIDIA A100-SXM4-80GB", "memory": 80 * GiB, "cc": (8, 0)}
H100 = {"name": "NVIDIA H100 80GB HBM3", "memory": 80 * GiB, "cc": (9, 0)}
V100 = {"name": "Tesla V100-SXM2-16GB", "memory": 16 * GiB, "cc": (7, 0)}
# Profile IDs as `nvidia-smi mig -lgip` prints them.
P_1G_10GB, P_3G_40GB, P_7G_80GB = 19, 9, 0
ON, OFF = pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_DISABLE


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(GPUS_ENV_VAR, raising=False)
        return load_catalog()


# --- the profile table -----------------------------------------------------------------


@pytest.mark.parametrize(("parent", "gpu"), [("A100-80GB", A100["name"]), ("H100-80GB", H100["name"])])
def test_table_matches_the_guides_lgip_listing(parent: str, gpu: str) -> None:
    """Two transcriptions of the guide, one in the code and one in the fake, agree."""
    ours = {p.profile_id: p for p in MIG_PARENTS[parent].profiles}
    lgip = LGIP[gpu]
    assert set(ours) == set(lgip)
    for profile_id, listed in lgip.items():
        p = ours[profile_id]
        assert (p.name, p.gpu_slices, p.memory_slices, p.sms, p.max_instances) == (
            listed.name,
            listed.gpu_slices,
            listed.memory_slices,
            listed.sms,
            listed.max_instances,
        )
        # What NVML reports of an instance names it: slices and memory rounded up to whole GiB.
        assert profile_name(listed.gpu_slices, listed.memory_mib) == p.name


def test_table_is_consistent_with_nvml_and_the_parents(catalog: Catalog) -> None:
    nvml_index = {
        (1, 1): pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE,
        (1, 2): pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2,
        (2, 2): pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE,
        (3, 4): pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE,
        (4, 4): pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE,
        (7, 8): pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE,
    }
    for parent_name, parent in MIG_PARENTS.items():
        spec = catalog.get(parent_name)
        assert parent.profiles[-1].gpu_slices == 7 and parent.sms >= parent.profiles[-1].sms
        for p in parent.profiles:
            assert p.nvml_profile == nvml_index[p.gpu_slices, p.memory_slices], (parent_name, p.name)
            # The name's GB is the instance's share of the datasheet memory.
            assert p.name == f"{p.gpu_slices}g.{spec.memory_gib * p.memory_slices / MEMORY_SLICES:g}gb"
        # More slices, more SMs; never more than the whole GPU (an H100 1g.20gb has 26 SMs, more than 132/7).
        sms = [p.sms for p in sorted(parent.profiles, key=lambda p: (p.gpu_slices, p.memory_slices))]
        assert sms == sorted(sms) and sms[-1] <= parent.sms


def test_mig_type_name() -> None:
    assert mig_type_name("A100-80GB", "3g.40gb") == "A100-80GB-MIG-3g.40gb"


# --- derived specs ---------------------------------------------------------------------


def test_a100_3g_40gb_is_42_of_108_sms_and_half_the_memory(catalog: Catalog) -> None:
    a100 = catalog.get("A100-80GB")
    spec = mig_spec(a100, "3g.40gb")
    assert spec.name == "A100-80GB-MIG-3g.40gb"
    assert dict(spec.peak_tflops) == pytest.approx({p: t * 42 / 108 for p, t in a100.peak_tflops.items()})
    assert spec.peak_flops("bf16") == pytest.approx(312e12 * 42 / 108)
    assert spec.memory_gib == 40 and spec.memory_bandwidth_gbs == pytest.approx(2039 / 2)
    assert spec.interconnect_gbs == 64 and "no NVLink" in spec.interconnect
    assert (spec.architecture, spec.compute_capability, spec.nvml_names) == ("ampere", (8, 0), ())
    assert MIG_GUIDE in spec.source and "42/108 SMs" in spec.source


@pytest.mark.parametrize(
    ("parent", "profile", "sm_share", "memory_gib"),
    [
        ("A100-80GB", "1g.10gb", 14 / 108, 10),
        ("A100-80GB", "1g.20gb", 14 / 108, 20),
        ("A100-80GB", "7g.80gb", 98 / 108, 80),
        ("A100-40GB", "1g.5gb", 14 / 108, 5),
        ("A100-40GB", "3g.20gb", 42 / 108, 20),
        ("H100-80GB", "3g.40gb", 60 / 132, 40),
        ("H100-80GB", "7g.80gb", 1.0, 80),
    ],
)
def test_derived_specs(catalog: Catalog, parent: str, profile: str, sm_share: float, memory_gib: float) -> None:
    whole = catalog.get(parent)
    spec = mig_spec(whole, profile)
    assert spec.peak_flops("fp32") == pytest.approx(whole.peak_flops("fp32") * sm_share)
    assert spec.memory_gib == memory_gib
    assert spec.memory_bandwidth_gbs == pytest.approx(whole.memory_bandwidth_gbs * memory_gib / whole.memory_gib)


def test_unknown_parent_or_profile_is_a_one_line_error(catalog: Catalog) -> None:
    with pytest.raises(UnknownMigProfile, match=r"^A100-80GB has no MIG profile '3g\.20gb'; it has 1g\.10gb, "):
        mig_spec(catalog.get("A100-80GB"), "3g.20gb")
    with pytest.raises(UnknownMigProfile, match=r"^no MIG profile table for GPU type 'V100-16GB'; .*A100-80GB"):
        mig_spec(catalog.get("V100-16GB"), "1g.5gb")
    with pytest.raises(UnknownMigProfile, match="no MIG profile table for GPU type 'H200'"):
        find_profile("H200", 1, 18 * 1024)


def test_catalog_with_mig_types(catalog: Catalog) -> None:
    cards = Catalog([catalog.get(n) for n in catalog if "-MIG-" not in n])
    extended = with_mig_types(cards)
    for parent, profiles in (("A100-40GB", 6), ("A100-80GB", 6), ("H100-80GB", 6)):
        assert sum(name.startswith(f"{parent}-MIG-") for name in extended) == profiles
    assert len(extended) == len(cards) + 18
    assert sorted(extended) == sorted(catalog)  # load_catalog holds them already
    assert extended.get("A100-80GB-MIG-3g.40gb") == mig_spec(catalog.get("A100-80GB"), "3g.40gb")
    # NVML names still map to the whole GPUs.
    assert extended.normalise("NVIDIA A100-SXM4-80GB") == "A100-80GB"
    # A user's own figures for a MIG type are kept.
    own = dataclasses.replace(mig_spec(catalog.get("A100-80GB"), "1g.10gb"), memory_gib=9.5)
    assert with_mig_types(catalog.with_types([own])).get(own.name).memory_gib == 9.5


# --- discovery ---------------------------------------------------------------------------

MACHINE = [
    mig(A100, {0: P_3G_40GB, 2: P_3G_40GB}),  # MIG device indices need not be contiguous
    mig(A100, dict.fromkeys(range(7), P_1G_10GB)),
    A100,  # MIG off
    mig(A100, {}, current=OFF, pending=ON),  # MIG on after the next reset: the whole GPU until then
]
ALL_NVLINKED = {frozenset((a, b)) for a in range(4) for b in range(a + 1, 4)}


def test_discovery_reports_mig_devices_as_their_types(catalog: Catalog) -> None:
    nvml = StubNvml(MACHINE, nvlinks=ALL_NVLINKED)
    gpus, problem = probe_local_gpus(catalog, nvml=nvml)
    assert problem is None and not nvml.open and nvml.forbidden_calls == []
    types = [g.catalog_name for g in gpus]
    assert types == ["A100-80GB-MIG-3g.40gb"] * 2 + ["A100-80GB-MIG-1g.10gb"] * 7 + ["A100-80GB"] * 2
    first, second = gpus[0], gpus[1]
    assert (first.index, first.mig_parent_index, first.mig_profile, first.uuid) == (0, 0, "3g.40gb", "MIG-stub-0-0")
    assert (second.index, second.uuid) == (2, "MIG-stub-0-2")
    assert first.memory_total_bytes == 40192 * 2**20 and first.nvml_name == "NVIDIA A100-SXM4-80GB"
    assert {g.mig_parent_index for g in gpus[2:9]} == {1} and [g.index for g in gpus[2:9]] == list(range(7))
    # MIG devices have no NVLink; the two whole GPUs still reach each other.
    assert all(g.nvlink_peers == () for g in gpus[:9])
    assert gpus[9].nvlink_peers == ("GPU-stub-3",) and gpus[10].nvlink_peers == ("GPU-stub-2",)
    assert gpus[9].mig_profile is None and gpus[9].note is None
    assert gpus[10].note == "MIG mode pending: on after the next GPU reset" and gpus[10].index == 3
    # Every type discovered is one the extended catalog prices.
    extended = with_mig_types(catalog)
    assert all(g.catalog_name in extended for g in gpus)


def test_h100_instances_and_a_pending_switch_off(catalog: Catalog) -> None:
    nvml = StubNvml([mig(H100, {0: P_7G_80GB}, pending=OFF), V100])
    gpus, problem = probe_local_gpus(catalog, nvml=nvml)
    assert problem is None
    assert [g.catalog_name for g in gpus] == ["H100-80GB-MIG-7g.80gb", "V100-16GB"]
    assert gpus[0].note == "MIG mode pending: off after the next GPU reset" and gpus[1].mig_profile is None


def test_unknown_profile_names_the_gpu_and_the_size(catalog: Catalog) -> None:
    odd = {"slices": 1, "memory_mib": 12 * 1024, "sms": 14}  # no A100-80GB profile has 1 slice and 12 GiB
    nvml = StubNvml([A100, mig(A100, {0: P_3G_40GB, 1: odd})])
    gpus, problem = probe_local_gpus(catalog, nvml=nvml)
    assert [g.catalog_name for g in gpus] == ["A100-80GB", "A100-80GB-MIG-3g.40gb"]
    assert problem == (
        "GPU 1 (NVIDIA A100-SXM4-80GB) MIG device 1: a 1-slice MIG instance of 12 GiB (12288 MiB, 1g.12gb) "
        "matches no A100-80GB MIG profile (1g.10gb, 1g.20gb, 2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb; "
        f"{MIG_GUIDE}); left out"
    )


def test_compute_instances_sharing_a_gpu_instance_are_left_out(catalog: Catalog) -> None:
    shared = {"slices": 3, "ci_slices": 1, "memory_mib": 40192, "sms": 42}
    gpus, problem = probe_local_gpus(catalog, nvml=StubNvml([mig(A100, {0: shared, 1: P_3G_40GB})]))
    assert [g.catalog_name for g in gpus] == ["A100-80GB-MIG-3g.40gb"]
    assert problem.startswith("GPU 0 (NVIDIA A100-SXM4-80GB) MIG device 0: a compute instance of 1 of the 3 slices")
    assert "whole GPU instances only" in problem and "\n" not in problem


def test_mig_mode_without_instances_says_how_to_make_them(catalog: Catalog) -> None:
    gpus, problem = probe_local_gpus(catalog, nvml=StubNvml([mig(A100, {}), V100]))
    assert [g.catalog_name for g in gpus] == ["V100-16GB"]
    assert problem == (
        "GPU 0 (NVIDIA A100-SXM4-80GB) is in MIG mode with no MIG devices; create GPU and compute instances "
        "(nvidia-smi mig -cgi <profiles> -C) or turn MIG mode off: hetero-ray never changes MIG settings"
    )


def test_mig_of_a_parent_without_a_profile_table(catalog: Catalog) -> None:
    # The H200 has MIG (1g.18gb and up); hetero-ray's table does not cover it yet.
    one = {"slices": 1, "memory_mib": 16640, "sms": 16}
    h200 = {
        "name": "NVIDIA H200",
        "memory": 141 * GiB,
        "cc": (9, 0),
        "mig": {"current": ON, "pending": ON, "instances": {0: one}},
    }
    gpus, problem = probe_local_gpus(catalog, nvml=StubNvml([h200]))
    assert gpus == ()
    assert problem == (
        "GPU 0 (NVIDIA H200) is in MIG mode but hetero-ray has no MIG profile table for H200 "
        "(it has A100-40GB, A100-80GB, H100-80GB); its MIG devices are left out"
    )


def test_gpu_type_label_is_the_mig_type_on_a_mig_node(catalog: Catalog) -> None:
    def label(devices: list[dict]) -> str | None:
        return gpu_type_label(probe_local_gpus(catalog, nvml=StubNvml(devices))[0])

    assert label([mig(A100, {0: P_3G_40GB, 1: P_3G_40GB}), mig(A100, {2: P_3G_40GB})]) == "A100-80GB-MIG-3g.40gb"
    assert label([A100, A100]) == "A100-80GB"
    assert label([mig(A100, {0: P_3G_40GB}), A100]) is None  # two types: one label cannot say it
    assert label([]) is None


def test_a_node_labelled_with_the_card_while_in_mig_mode_is_named(catalog: Catalog) -> None:
    """`hetero-ray discover` warns about a node whose label is the whole card but whose GPUs are MIG instances."""

    def report(devices: list[dict], label: str) -> NodeReport:
        gpus, _ = probe_local_gpus(catalog, nvml=StubNvml(devices))
        return NodeReport(
            node_id="bbbbbbbb22",
            node_ip="10.0.0.2",
            labels={GPU_TYPE_LABEL: label},
            gpus=gpus,
            error=None,
            emulated_gpu_type=None,
            emulated_gpu_count=0,
        )

    mig_node = [mig(A100, {0: P_3G_40GB, 1: P_3G_40GB})]
    assert label_problems([report(mig_node, "A100-80GB")]) == [
        f"node bbbbbbbb: label {GPU_TYPE_LABEL}=A100-80GB but its GPUs are A100-80GB-MIG-3g.40gb; label it "
        "A100-80GB-MIG-3g.40gb (cluster.yaml's node type labels)"
    ]
    assert label_problems([report(mig_node, "A100-80GB-MIG-3g.40gb"), report([A100], "A100-80GB")]) == []


def test_table_and_json_show_mig_devices(catalog: Catalog) -> None:
    gpus, _ = probe_local_gpus(catalog, nvml=StubNvml(MACHINE))
    report = NodeReport(
        node_id="aaaaaaaa11",
        node_ip="10.0.0.1",
        labels={},
        gpus=gpus,
        error=None,
        emulated_gpu_type=None,
        emulated_gpu_count=0,
    )
    console = Console(record=True, width=250)
    render_table([report], console)
    text = console.export_text()
    assert re.search(r"A100-80GB-MIG-3g\.40gb \(on GPU 0\)\s+│\s+2 │\s+39\.2 GiB .* none \(MIG\)", text)
    assert re.search(r"A100-80GB-MIG-1g\.10gb \(on GPU 1\)\s+│\s+7 │", text)
    assert "ok; MIG mode pending: on after the next GPU reset" in text
    data = json.loads(json.dumps(reports_to_json([report])))
    assert data[0]["gpus"][0]["mig_profile"] == "3g.40gb" and data[0]["gpus"][0]["mig_parent_index"] == 0
    assert reports_from_json(data) == [report]
    # JSON written before MIG support (no MIG fields) still reads.
    for gpu in data[0]["gpus"]:
        del gpu["mig_profile"], gpu["mig_parent_index"], gpu["note"]
    assert reports_from_json(data)[0].gpus[-2].catalog_name == "A100-80GB"


# --- never changing MIG settings -----------------------------------------------------------


def test_the_fake_refuses_every_nvml_call_that_changes_state() -> None:
    nvml = StubNvml([A100])
    for name in ("nvmlDeviceSetMigMode", "nvmlDeviceCreateGpuInstance", "nvmlGpuInstanceCreateComputeInstance"):
        with pytest.raises(AssertionError, match="must only read NVML"):
            getattr(nvml, name)
    assert nvml.forbidden_calls == [
        "nvmlDeviceSetMigMode",
        "nvmlDeviceCreateGpuInstance",
        "nvmlGpuInstanceCreateComputeInstance",
    ]
    assert nvml.nvmlDeviceGetMigMode.__name__ == "nvmlDeviceGetMigMode"  # readers pass


def test_discovery_code_names_no_nvml_setter() -> None:
    for module in (discovery, mig_module):
        source = Path(module.__file__).read_text(encoding="utf-8")
        assert not re.findall(r"nvml\w*?(?:Set|Create|Destroy|Reset|Clear)(?![a-z])", source), module.__name__


# --- planning over discovered MIG types ------------------------------------------------------


def test_plan_over_mig_instances_and_a_v100(catalog: Catalog) -> None:
    machine = [mig(A100, {0: P_3G_40GB, 1: P_3G_40GB}), mig(A100, {0: P_1G_10GB}), V100]
    gpus, _ = probe_local_gpus(catalog, nvml=StubNvml(machine))
    types = [g.catalog_name for g in gpus]
    assert types == ["A100-80GB-MIG-3g.40gb", "A100-80GB-MIG-3g.40gb", "A100-80GB-MIG-1g.10gb", "V100-16GB"]
    # 1 GiB of weights, gradients and Adam state, 11 GiB of fp32 activations per sample: 12 GiB at
    # micro-batch 1, more than a 1g.10gb holds; a 3g.40gb fits 3 samples, a V100-16GB one.
    fp = Footprint(
        param_count=2**26, dataset_samples=10_000, flops_per_sample=1e12, activation_bytes_per_sample=11 * GiB
    )
    plan = plan_data_parallel(types, with_mig_types(catalog), fp, global_batch=100, precision="fp32")
    assert isinstance(plan, Plan), plan
    speeds = [19.5 * 42 / 108, 19.5 * 42 / 108, 15.7]  # fp32 TFLOP/s: 42 of the A100's 108 SMs, and a V100
    assert [r.gpu_type for r in plan.roles] == types[:2] + ["V100-16GB"]
    assert [r.local_batch for r in plan.roles] == split_batch(100, speeds)
    assert all(r.micro_batch <= fits for r, fits in zip(plan.roles, (3, 3, 1)))
    assert all(
        r.predicted_memory_bytes <= catalog_bytes for r, catalog_bytes in zip(plan.roles, (40 * GiB,) * 2 + (16 * GiB,))
    )
    a100 = catalog.get("A100-80GB").peak_flops("fp32")
    mig_role = plan.roles[0]
    assert mig_role.predicted_compute_s == pytest.approx(mig_role.local_batch * 1e12 / (a100 * 42 / 108 * 0.4))
    (excluded,) = plan.excluded
    assert excluded.gpu_type == "A100-80GB-MIG-1g.10gb" and excluded.count == 1
