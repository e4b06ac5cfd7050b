"""GPU catalog: data sanity, NVML normalisation, user types, errors, and agreement with measured throughput."""

from __future__ import annotations

import dataclasses
import itertools
import pickle
from pathlib import Path

import pandas as pd
import pytest

from hetero_ray.cluster.catalog import (
    GPUS_ENV_VAR,
    PRECISIONS,
    Catalog,
    CatalogError,
    GpuSpec,
    UnknownGpuType,
    load_catalog,
)

LAMBDA_CSV_NAME = "lambda-pytorch-train-throughput-fp32.csv"
LAMBDA_MODELS = (
    "ssd",
    "bert_base_squad",
    "bert_large_squad",
    "gnmt",
    "ncf",
    "resnet50",
    "tacotron2",
    "transformerxlbase",
    "transformerxllarge",
    "waveglow",
)
ARCH_CC_MAJOR = {"volta": 7, "turing": 7, "ampere": 8, "ada": 8, "hopper": 9}


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    return load_catalog()


@pytest.fixture(autouse=True)
def _no_user_gpus_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # A developer's own HETERO_RAY_GPUS must not change what these tests see.
    monkeypatch.delenv(GPUS_ENV_VAR, raising=False)


@pytest.fixture(scope="module")
def lambda_one_gpu(reference_data: Path) -> pd.DataFrame:
    # Fail, never skip: the file is part of the tree (data/reference/), so a missing one is a broken checkout.
    csv = reference_data / LAMBDA_CSV_NAME
    assert csv.is_file(), f"reference data missing: {csv}"
    table = pd.read_csv(csv)
    return table[table["num_gpu"] == 1].set_index("name_gpu")


def training_tflops(spec: GpuSpec) -> float:
    """The catalog's figure for fp32 training: TF32 tensor cores where the card has them, else fp32."""
    return max(spec.peak_tflops[p] for p in ("fp32", "tf32") if p in spec.peak_tflops)


# --- the packaged data ---------------------------------------------------------


def test_packaged_catalog_holds_the_required_types(catalog: Catalog) -> None:
    required = {
        "V100-16GB", "V100-32GB", "A100-40GB", "A100-80GB", "H100-80GB", "H200",
        "RTX-3090", "RTX-4090", "A10", "L4", "T4", "A6000",
    }  # fmt: skip
    assert required <= set(catalog)
    assert len(catalog) == len(catalog.names()) == len(set(catalog))


def test_figures_are_dense_and_consistent(catalog: Catalog) -> None:
    for name in catalog:
        spec = catalog.get(name)
        peak = spec.peak_tflops
        assert set(peak) <= set(PRECISIONS), name
        for half in ("fp16", "bf16", "tf32"):
            if half in peak:
                assert peak[half] >= peak["fp32"], (name, half)
        if "bf16" in peak and "fp16" in peak:
            assert peak["bf16"] == peak["fp16"], name
        assert spec.compute_capability[0] == ARCH_CC_MAJOR[spec.architecture], name
        # bf16 and TF32 tensor cores arrived together with Ampere (compute capability 8.0).
        assert spec.supports_bf16 == spec.supports_tf32 == (spec.compute_capability >= (8, 0)), name
        assert spec.memory_bytes == int(spec.memory_gib * 2**30)
        assert spec.peak_flops("fp32") == peak["fp32"] * 1e12


@pytest.mark.parametrize(
    ("name", "precision", "dense_tflops"),
    [
        # Datasheet figures marked "with sparsity" are twice these.
        ("A100-80GB", "bf16", 312),
        ("A100-80GB", "tf32", 156),
        ("H100-80GB", "bf16", 989.5),
        ("H100-80GB", "tf32", 494.5),
        ("H200", "fp16", 989.5),
        ("L4", "bf16", 121),
        ("A10", "tf32", 62.5),
        # GeForce: FP32-accumulate rate, half the FP16-accumulate one.
        ("RTX-3090", "fp16", 71),
        ("RTX-4090", "bf16", 165.2),
        ("V100-16GB", "fp16", 125),
        ("T4", "fp16", 65),
    ],
)
def test_dense_figures_match_datasheets(catalog: Catalog, name: str, precision: str, dense_tflops: float) -> None:
    assert catalog.get(name).peak_tflops[precision] == dense_tflops


def test_volta_and_turing_lack_bf16_and_tf32(catalog: Catalog) -> None:
    for name in ("V100-16GB", "V100-32GB", "T4"):
        spec = catalog.get(name)
        assert not spec.supports_bf16 and not spec.supports_tf32
        assert set(spec.peak_tflops) == {"fp32", "fp16"}


def test_every_type_names_its_source(catalog: Catalog) -> None:
    for name in catalog:
        source = catalog.get(name).source
        assert "NVIDIA" in source and any(str(year) in source for year in range(2017, 2026)), name


def test_missing_precision_error_is_one_line(catalog: Catalog) -> None:
    with pytest.raises(ValueError) as info:
        catalog.get("V100-16GB").peak_flops("bf16")
    message = str(info.value)
    assert "\n" not in message
    assert "V100-16GB" in message and "bf16" in message and "fp32, fp16" in message


def test_specs_are_immutable_and_pickle(catalog: Catalog) -> None:
    spec = catalog.get("A100-80GB")
    with pytest.raises(TypeError):
        spec.peak_tflops["bf16"] = 1.0  # type: ignore[index]
    # Ray ships specs to workers by pickling them.
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert hash(spec) == hash(catalog.get("A100-80GB"))


# --- NVML names ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("nvml_name", "expected"),
    [
        ("Tesla V100-SXM2-16GB", "V100-16GB"),
        ("Tesla V100-PCIE-16GB", "V100-16GB"),
        ("Tesla V100-SXM2-32GB", "V100-32GB"),
        ("Tesla T4", "T4"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA A100-PCIE-40GB", "A100-40GB"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA A100 80GB PCIe", "A100-80GB"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA GeForce RTX 3090", "RTX-3090"),
        ("NVIDIA GeForce RTX 4090", "RTX-4090"),
        ("NVIDIA RTX A6000", "A6000"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA H100 80GB HBM3", "H100-80GB"),
        ("NVIDIA H100 PCIe", "H100-PCIe"),
        ("NVIDIA H200", "H200"),
        # Older drivers print names without the vendor word; spacing and case vary.
        ("A100-SXM4-80GB", "A100-80GB"),
        ("GeForce RTX 3090", "RTX-3090"),
        ("  nvidia a100-sxm4-80gb ", "A100-80GB"),
        # Different boards that merely share a prefix are not guessed.
        ("NVIDIA A10G", None),
        ("NVIDIA H200 NVL", None),
        ("Tesla V100S-PCIE-32GB", None),
        ("NVIDIA B200", None),
    ],
)
def test_normalises_nvml_names(catalog: Catalog, nvml_name: str, expected: str | None) -> None:
    assert catalog.normalise(nvml_name) == expected


# --- errors and user types -----------------------------------------------------


def test_unknown_type_error_is_one_line_and_lists_valid_names(catalog: Catalog) -> None:
    with pytest.raises(UnknownGpuType) as info:
        catalog.get("X100")
    message = str(info.value)
    assert "\n" not in message
    assert "'X100'" in message and "A100-80GB, A6000" in message and GPUS_ENV_VAR in message
    assert "X100" not in catalog


USER_YAML = """
gpus:
  A10G:
    architecture: ampere
    compute_capability: [8, 6]
    memory_gib: 24
    memory_bandwidth_gbs: 600
    peak_tflops: {fp32: 31.2, tf32: 35, fp16: 70, bf16: 70}
    interconnect: PCIe Gen4 x16, 64 GB/s
    interconnect_gbs: 64
    nvml_names: [NVIDIA A10G]
    source: measured on our g5 fleet, 2025
  V100-16GB:
    architecture: volta
    compute_capability: [7, 0]
    memory_gib: 16
    memory_bandwidth_gbs: 900
    peak_tflops: {fp32: 14, fp16: 112}
    interconnect: PCIe Gen3 x16, 32 GB/s
    interconnect_gbs: 32
    nvml_names: [Tesla V100-PCIE-16GB]
    source: NVIDIA V100 datasheet (2020), PCIe column
    price_per_hour_usd: 2.5
"""


def test_user_yaml_adds_a_type_and_overrides_one(tmp_path: Path, catalog: Catalog) -> None:
    user = tmp_path / "gpus.yaml"
    user.write_text(USER_YAML)
    merged = load_catalog(user)
    assert len(merged) == len(catalog) + 1
    assert merged.normalise("NVIDIA A10G") == "A10G"
    assert merged.get("A10G").peak_flops("bf16") == 70e12
    v100 = merged.get("V100-16GB")
    assert v100.peak_tflops["fp32"] == 14 and v100.price_per_hour_usd == 2.5
    # The replacement's NVML names replace the packaged ones.
    assert merged.normalise("Tesla V100-PCIE-16GB") == "V100-16GB"
    assert merged.normalise("Tesla V100-SXM2-16GB") is None
    # The packaged (cached) catalog is untouched.
    assert load_catalog().get("V100-16GB").peak_tflops["fp32"] == 15.7


def test_user_yaml_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    user = tmp_path / "gpus.yaml"
    user.write_text(USER_YAML)
    monkeypatch.setenv(GPUS_ENV_VAR, str(user))
    assert "A10G" in load_catalog()


def test_with_types_adds_python_built_specs(catalog: Catalog) -> None:
    base = catalog.get("A100-80GB")
    custom = dataclasses.replace(base, name="A100-80GB-capped", nvml_names=())
    extended = catalog.with_types([custom])
    assert extended.get("A100-80GB-capped").peak_tflops == base.peak_tflops
    assert "A100-80GB-capped" not in catalog


GOOD_ENTRY = USER_YAML.split("  V100-16GB:")[0]


def _bad(text: str, expected: str, case: str) -> pytest.ParameterSet:
    return pytest.param(text, expected, id=case)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        _bad(
            GOOD_ENTRY.replace("memory_gib: 24", "memory_gib: -3"),
            "entry 'A10G': memory_gib: input should be greater than 0 (got -3)",
            "negative",
        ),
        _bad(
            GOOD_ENTRY.replace("memory_gib: 24", "memroy_gib: 24"),
            "entry 'A10G': memroy_gib: unknown field; valid fields: architecture,",
            "misspelt",
        ),
        _bad(
            GOOD_ENTRY.replace("    memory_gib: 24\n", ""),
            "entry 'A10G': memory_gib: required field is missing",
            "missing",
        ),
        _bad(
            GOOD_ENTRY.replace("bf16: 70", "fp8: 140"),
            "entry 'A10G': peak_tflops.fp8: input should be 'fp32', 'tf32', 'fp16' or 'bf16'",
            "precision",
        ),
        _bad(
            GOOD_ENTRY.replace("fp32: 31.2, ", ""),
            "entry 'A10G': peak_tflops: must include fp32",
            "no-fp32",
        ),
        _bad(
            GOOD_ENTRY.replace("compute_capability: [8, 6]", "compute_capability: 8.6"),
            "entry 'A10G': compute_capability: input should be a valid tuple (got 8.6)",
            "cc-type",
        ),
        _bad(
            GOOD_ENTRY.replace("A10G:", "A10 G:"),
            "entry 'A10 G': name: must be usable as a Ray label value",
            "name",
        ),
        _bad(
            GOOD_ENTRY + GOOD_ENTRY.split("gpus:\n")[1].replace("  A10G:", "  A10G-copy:"),
            "entry 'A10G-copy': nvml_names: 'NVIDIA A10G' is already claimed by 'A10G'",
            "nvml-twice",
        ),
        _bad("gpus:\n  A10G: 3\n", "entry 'A10G': must be a mapping of fields (got 3)", "entry-type"),
        _bad("- A10G\n", "must be a mapping with the single key 'gpus", "top-level"),
        _bad("gpus: {A10G: [unclosed\n", "line 2, column 1: malformed YAML", "yaml"),
        _bad(
            GOOD_ENTRY + GOOD_ENTRY.split("gpus:\n")[1],
            "line 13, column 3: duplicate key 'A10G' (first at line 3)",
            "entry-twice",
        ),
    ],
)
def test_bad_user_yaml_gives_one_line_error(tmp_path: Path, text: str, expected: str) -> None:
    user = tmp_path / "bad-gpus.yaml"
    user.write_text(text)
    with pytest.raises(CatalogError) as info:
        load_catalog(user)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{user}: ")
    assert expected in message


def test_missing_user_file_names_the_env_var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GPUS_ENV_VAR, str(tmp_path / "nope.yaml"))
    with pytest.raises(CatalogError, match=rf"nope\.yaml \(from {GPUS_ENV_VAR}\): cannot read GPU types file"):
        load_catalog()


# --- agreement with measured throughput (Lambda, fp32/TF32, 1 GPU) -------------------


def test_benchmark_row_names_exist(catalog: Catalog, lambda_one_gpu: pd.DataFrame) -> None:
    claimed = [row for name in catalog for row in catalog.get(name).lambda_benchmark_names]
    assert len(claimed) == len(set(claimed))
    assert set(claimed) <= set(lambda_one_gpu.index)


@pytest.mark.parametrize("a100_row", ["A100 80GB SXM4", "LambdaCloud A100 40GB PCIe"])
def test_catalog_orders_a100_v100_3090_like_measured_training(
    catalog: Catalog, lambda_one_gpu: pd.DataFrame, a100_row: str, record_property: pytest.RecordProperty
) -> None:
    """The catalog's fp32/TF32 figure ranks A100 > RTX 3090 > V100; so does measured throughput on most models."""
    a100 = "A100-80GB" if "80GB" in a100_row else "A100-40GB"
    rows = {a100: a100_row, "V100-16GB": "LambdaCloud V100 16GB", "RTX-3090": "RTX 3090"}
    for name, row in rows.items():
        assert row in catalog.get(name).lambda_benchmark_names
    predicted = sorted(rows, key=lambda n: training_tflops(catalog.get(n)), reverse=True)
    assert predicted == [a100, "RTX-3090", "V100-16GB"]
    agree, disagree = [], []
    for model in LAMBDA_MODELS:
        measured = lambda_one_gpu.loc[list(rows.values()), model]
        if (measured == 0).any():  # 0 = not measured
            continue
        measured_order = [name for name, row in sorted(rows.items(), key=lambda kv: -measured[kv[1]])]
        (agree if measured_order == predicted else disagree).append(model)
    print(f"\n{a100_row}: catalog order {predicted}; agree on {agree}; disagree on {disagree}")
    record_property("agree", ",".join(agree))
    record_property("disagree", ",".join(disagree))
    assert len(agree) > len(agree + disagree) / 2


def test_catalog_ranks_all_benchmarked_types_mostly_like_measured(
    catalog: Catalog, lambda_one_gpu: pd.DataFrame, record_property: pytest.RecordProperty
) -> None:
    """Pairwise, over every catalog type Lambda measured: peak fp32/TF32 orders most pairs as measured.

    Known exceptions (peak FLOP/s is not the whole story): the A10 (150 W, 600 GB/s)
    has 1.8x the RTX 3090's TF32 peak but trains slower on every model, and slower
    than the V100 on some; the A6000 (768 GB/s against the 3090's 936) is no faster
    than the RTX 3090 on ncf and tacotron2 despite 2.2x its TF32 peak. Ratios are
    further off than orders: the catalog puts A100 at 10x V100, measured is 2.4-6.4x.
    """
    specs = [catalog.get(name) for name in catalog]
    rows = {spec.name: spec.lambda_benchmark_names[0] for spec in specs if spec.lambda_benchmark_names}
    for model in LAMBDA_MODELS:
        concordant, discordant = 0, []
        for a, b in itertools.combinations(rows, 2):
            ta, tb = lambda_one_gpu.loc[rows[a], model], lambda_one_gpu.loc[rows[b], model]
            fa, fb = training_tflops(catalog.get(a)), training_tflops(catalog.get(b))
            if ta == 0 or tb == 0 or fa == fb:
                continue
            if (ta > tb) == (fa > fb):
                concordant += 1
            else:
                discordant.append(f"{a}/{b}")
        share = concordant / (concordant + len(discordant))
        print(f"{model}: {share:.0%} of pairs ordered as measured; out of order: {discordant}")
        record_property(model, f"{share:.2f} {discordant}")
        assert share >= 0.8, (model, discordant)
