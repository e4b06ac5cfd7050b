"""Profiler, history and performance model, on this machine's CPU and on synthetic data (no Ray)."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import numpy as np
import pandas as pd
import pytest

from hetero_ray.cluster.catalog import load_catalog
from hetero_ray.cluster.emulated_device import EmulatedDevice
from hetero_ray.perf import history
from hetero_ray.perf.history import CPU, HOST_MEMORY, HistoryError, Measurement, Software, options_hash
from hetero_ray.perf.model import (
    CrossType,
    NoHistory,
    StepCurve,
    cross_type_terms,
    expected_slowest,
    fit_cross_type,
    fit_memory_line,
    fit_perf_model,
    fit_step_curve,
)
from hetero_ray.perf.profiler import Emulation, ProfileError, ProfileSpec, Target, profile
from hetero_ray.plan.cost import compute_seconds
from hetero_ray.workloads import build_workload

TINY = {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16, "corpus_bytes": 20_000}
BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


def tiny_gpt():
    return build_workload("gpt", TINY)


def measurement(**overrides) -> Measurement:
    fields = {
        "gpu_type": "A100-80GB",
        "emulated": False,
        "workload": "gpt",
        "workload_hash": options_hash({}),
        "workload_options": "{}",
        "micro_batch": 4,
        "precision": "fp32",
        "step_s": 0.01,
        "step_s_spread": 0.001,
        "repeats": 5,
        "clock": "wall",
        "threads": 0,
        "peak_memory_bytes": 1000,
        "memory_source": "cuda_max_allocated",
    }
    return Measurement(**{**fields, **overrides})


def synthetic_history(curves: dict[tuple[str, str], StepCurve], batches=BATCHES, workload="gpt") -> pd.DataFrame:
    return history.to_frame(
        measurement(gpu_type=t, precision=p, micro_batch=b, step_s=c(b), workload=workload, peak_memory_bytes=100 + b)
        for (t, p), c in curves.items()
        for b in batches
    )


# --- the step-time curve ----------------------------------------------------------


def test_fit_recovers_overhead_per_sample_and_exponent():
    truth = StepCurve(overhead_s=0.012, per_sample_s=0.0021, exponent=0.85)
    fitted = fit_step_curve(BATCHES, [truth(b) for b in BATCHES])
    assert fitted.exponent == pytest.approx(0.85)
    assert fitted.overhead_s == pytest.approx(0.012, rel=1e-6)
    assert fitted.per_sample_s == pytest.approx(0.0021, rel=1e-6)
    assert fitted.saturation == 1 and fitted.points == len(BATCHES)


def test_fit_finds_where_a_gpu_saturates():
    """Flat until 8 samples fill the device, then linear: the GPU shape."""
    truth = StepCurve(overhead_s=0.004, per_sample_s=0.0005, saturation=8)
    batches = (1, 2, 4, 8, 16, 32, 64)
    fitted = fit_step_curve(batches, [truth(b) for b in batches])
    assert (fitted.saturation, fitted.exponent) == (8, 1.0)
    assert fitted.overhead_s == pytest.approx(0.004, rel=1e-6)
    assert fitted(3) == pytest.approx(truth(8))


def test_few_points_fit_few_parameters():
    assert fit_step_curve([4], [0.02]) == StepCurve(overhead_s=0.0, per_sample_s=0.005, points=1)
    two = fit_step_curve([2, 6], [0.03, 0.07])
    assert (two.overhead_s, two.per_sample_s, two.exponent) == (pytest.approx(0.01), pytest.approx(0.01), 1.0)
    with pytest.raises(ValueError, match="positive"):
        fit_step_curve([0, 2], [0.1, 0.2])


def test_fit_is_least_relative_error_under_noise():
    """±3% multiplicative noise: the fit predicts unseen batches within a few percent."""
    rng = np.random.default_rng(0)
    truth = StepCurve(overhead_s=0.008, per_sample_s=0.0012, exponent=1.1)
    train = [b for i, b in enumerate(BATCHES) if i % 3 != 2]
    fitted = fit_step_curve(train, [truth(b) * (1 + rng.uniform(-0.03, 0.03)) for b in train])
    held_out = [b for i, b in enumerate(BATCHES) if i % 3 == 2]
    assert max(abs(fitted(b) / truth(b) - 1) for b in held_out) < 0.03


def test_memory_line_recovers_static_and_per_sample():
    line = fit_memory_line([1, 2, 4, 8], [5000 + 300 * b for b in (1, 2, 4, 8)])
    assert (line.static_bytes, line.per_sample_bytes) == (pytest.approx(5000), pytest.approx(300))
    assert fit_memory_line([4], [1200]).per_sample_bytes == 300


# --- across GPU types ----------------------------------------------------------------


def test_cross_type_recovers_compute_and_memory_terms(catalog):
    truth = CrossType(flops=3e9, bytes=2e6)
    points = [(catalog.get(t), p, truth.seconds_per_sample(catalog.get(t), p)) for t, p in
              [("A100-80GB", "bf16"), ("V100-16GB", "fp16"), ("RTX-3090", "fp32"), ("T4", "fp32")]]  # fmt: skip
    fitted = fit_cross_type(points)
    assert (fitted.flops, fitted.bytes) == (pytest.approx(3e9), pytest.approx(2e6))


def test_cross_type_learns_host_time_from_four_types_and_more(catalog):
    truth = CrossType(flops=3e9, bytes=2e6, host_s=4e-4)
    pairs = [("A100-80GB", "bf16"), ("V100-16GB", "fp16"), ("RTX-3090", "fp32"), ("T4", "fp32"), ("L4", "bf16")]
    points = [(catalog.get(t), p, truth.seconds_per_sample(catalog.get(t), p)) for t, p in pairs]
    fitted = fit_cross_type(points)
    assert (fitted.flops, fitted.bytes, fitted.host_s) == pytest.approx((3e9, 2e6, 4e-4), rel=1e-5)
    # Three types admit two terms: the host time is then absorbed, not fitted.
    assert fit_cross_type(points[:3]).host_s == 0.0
    assert cross_type_terms(2) == ("compute",) and cross_type_terms(9, max_terms=2) == ("compute", "bandwidth")


def test_cross_type_with_two_types_is_peak_times_efficiency(catalog):
    a100, v100 = catalog.get("A100-80GB"), catalog.get("V100-16GB")
    fitted = fit_cross_type(
        [(a100, "fp32", 1e9 / a100.peak_flops("fp32")), (v100, "fp32", 1e9 / v100.peak_flops("fp32"))]
    )
    assert (fitted.flops, fitted.bytes) == (pytest.approx(1e9), 0.0)


def test_model_falls_back_to_the_catalog_for_a_type_without_history(catalog):
    truth = CrossType(flops=5e9, bytes=4e6)
    known = [("A100-80GB", "fp32"), ("V100-16GB", "fp32"), ("RTX-3090", "fp32")]
    curves = {
        (t, p): StepCurve(overhead_s=0.0, per_sample_s=truth.seconds_per_sample(catalog.get(t), p)) for t, p in known
    }
    model = fit_perf_model(synthetic_history(curves), "gpt", catalog=catalog)
    assert model.has_history("A100-80GB", "fp32") and not model.has_history("H100-80GB", "bf16")
    expected = 16 * truth.seconds_per_sample(catalog.get("H100-80GB"), "bf16")
    assert model.step_seconds("H100-80GB", 16, "bf16") == pytest.approx(expected, rel=1e-6)
    assert model.samples_per_second("H100-80GB", 16, "bf16") == pytest.approx(16 / expected, rel=1e-6)
    assert "no history" in model.explain("H100-80GB", "bf16") and "fitted" in model.explain("A100-80GB", "fp32")
    # Memory does not depend on the card: the others' line, with activations halved in bf16.
    assert model.peak_memory_bytes("A100-80GB", 8, "fp32") == pytest.approx(108)
    assert model.peak_memory_bytes("H100-80GB", 8, "fp32") == pytest.approx(108)
    assert model.peak_memory_bytes("H100-80GB", 8, "bf16") == pytest.approx(104)


def test_model_uses_history_where_it_has_it(catalog):
    curve = StepCurve(overhead_s=0.01, per_sample_s=0.002, exponent=1.0)
    model = fit_perf_model(synthetic_history({("V100-16GB", "fp16"): curve}), "gpt", catalog=catalog)
    assert model.step_seconds("V100-16GB", 5, "fp16") == pytest.approx(curve(5), rel=1e-6)
    # One type only: the fallback is its peak ratio (A100 bf16 312 vs V100 fp16 125 TFLOP/s) on its per-sample time.
    assert model.step_seconds("A100-80GB", 8, "bf16") == pytest.approx(curve(8) * 125 / 312, rel=1e-6)
    with pytest.raises(ValueError, match="micro_batch"):
        model.step_seconds("V100-16GB", 0, "fp16")


def test_model_refuses_what_the_history_cannot_answer(catalog):
    curves = {("A100-80GB", "fp32"): StepCurve(overhead_s=0.01, per_sample_s=0.001)}
    table = synthetic_history(curves)
    with pytest.raises(NoHistory, match="no measured history for workload 'mlp'.*gpt"):
        fit_perf_model(table, "mlp", catalog=catalog)
    with pytest.raises(NoHistory, match="no emulated history"):
        fit_perf_model(table, "gpt", emulated=True, catalog=catalog)
    other = table.assign(workload_hash="abc")
    with pytest.raises(NoHistory, match="several option sets"):
        fit_perf_model(pd.concat([table, other]), "gpt", catalog=catalog)
    assert fit_perf_model(pd.concat([table, other]), "gpt", workload_hash="abc", catalog=catalog).workload_hash == "abc"
    cpu_only = fit_perf_model(synthetic_history({(CPU, "fp32"): curves[("A100-80GB", "fp32")]}), "gpt", catalog=catalog)
    with pytest.raises(NoHistory, match="no profiled catalog GPU type"):
        cpu_only.step_seconds("A100-80GB", 4, "fp32")


# --- the history table ---------------------------------------------------------------


def test_history_append_keeps_old_rows_and_the_schema(tmp_path):
    path = tmp_path / "profiles" / "history.parquet"
    first = history.append(path, [measurement(micro_batch=1), measurement(micro_batch=2)])
    second = history.append(path, [measurement(micro_batch=4, gpu_type="V100-16GB")])
    table = history.load(path)
    assert len(first) == 2 and len(second) == len(table) == 3
    assert list(table["micro_batch"]) == [1, 2, 4]
    assert tuple(table.columns) == history.COLUMNS
    assert {c: str(t) for c, t in table.dtypes.items()} == history.DTYPES
    assert table["torch_version"].iloc[0] == Software.installed().torch_version != ""
    assert table["timestamp"].dt.tz is not None
    assert sorted(p.name for p in path.parent.iterdir() if not p.name.endswith(".lock")) == ["history.parquet"]


def test_history_schema_matches_the_measurement_row():
    assert set(measurement().to_row()) == set(history.COLUMNS)
    assert history.load("/nonexistent/history.parquet").empty


def test_history_rejects_a_table_of_another_schema(tmp_path):
    with pytest.raises(HistoryError, match="missing columns.*step_s"):
        history.append(tmp_path / "h.parquet", history.to_frame([measurement()]).drop(columns=["step_s"]))
    bad = tmp_path / "bad.parquet"
    pd.DataFrame({"x": [1]}).to_parquet(bad)
    with pytest.raises(HistoryError, match=f"{bad}: missing columns"):
        history.load(bad)
    assert not (tmp_path / "h.parquet").exists()


def test_append_is_atomic_when_the_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "h.parquet"
    history.append(path, [measurement()])

    def broken(self, *args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(pd.DataFrame, "to_parquet", broken)
    with pytest.raises(OSError, match="disk full"):
        history.append(path, [measurement(micro_batch=8)])
    monkeypatch.undo()
    assert len(history.load(path)) == 1
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".h.parquet.lock")] == ["h.parquet"]


# --- the profiler ----------------------------------------------------------------------


def test_profiler_measures_a_tiny_workload_on_this_cpu():
    progress: list[tuple[int, int]] = []
    spec = ProfileSpec(micro_batches=(4, 1), precisions=("fp32", "bf16"), warmup=1, repeats=3)
    result = profile(
        tiny_gpt, spec, workload_name="gpt", options=TINY, on_progress=lambda d, t: progress.append((d, t))
    )
    rows = result.measurements
    assert [(m.micro_batch, m.precision) for m in rows] == [(1, "fp32"), (4, "fp32")]
    # Measured wall times: that they were taken, not how long this host took.
    assert all(m.step_s > 0 and m.step_s_spread >= 0 for m in rows)
    assert all(m.repeats == 3 and m.threads == 1 and m.gpu_type == CPU and not m.emulated for m in rows)
    assert all(m.clock == "wall" for m in rows)
    assert all(m.memory_source == HOST_MEMORY and m.workload_hash == options_hash(TINY) for m in rows)
    # Same weights and optimizer state, four times the saved activations.
    assert rows[0].peak_memory_bytes < rows[1].peak_memory_bytes < 4 * rows[0].peak_memory_bytes
    assert [(s.precision, s.reason) for s in result.skipped] == [("bf16", "a CPU profiles in fp32 only")] * 2
    assert progress[-1] == (spec.steps(False) * 2,) * 2
    assert [d for d, _ in progress] == sorted(d for d, _ in progress)


def test_profiler_keeps_computing_after_its_last_point_until_told_to_stop():
    """A device profiled beside slower ones keeps the host as busy as training will: after its last timed step
    it steps on, untimed, asking ``until`` before each step, and returns once it says every device is done."""
    events: list[str] = []

    def counted():
        workload = tiny_gpt()
        loss_fn = workload.loss_fn

        def loss(model, batch):
            events.append("step")
            return loss_fn(model, batch)

        return dataclasses.replace(workload, loss_fn=loss)

    def until() -> bool:
        events.append("ask")
        return events.count("ask") == 3

    spec = ProfileSpec(micro_batches=(1, 2), warmup=1, repeats=2)
    steps = spec.steps(False)
    profile(counted, spec, workload_name="gpt", options=TINY, until=until)
    # The timed points' steps (the memory probe's included), then two more, each after a question.
    assert events == ["step"] * steps + ["ask", "step", "ask", "step", "ask"]


def test_profiler_prices_an_emulated_device_with_its_model_and_enforces_its_memory(catalog):
    v100 = catalog.get("V100-16GB")
    small = dataclasses.replace(v100, name="V100-tiny", memory_gib=1e-3)
    flops = 1e9
    spec = ProfileSpec(micro_batches=(1, 2, 64), precisions=("fp16", "bf16"), repeats=2)
    target = Target(gpu_type="V100-tiny", emulated=Emulation(spec=small, efficiency=0.5, flops_per_sample=flops))
    result = profile(tiny_gpt, spec, workload_name="gpt", options=TINY, target=target)
    assert [m.micro_batch for m in result.measurements] == [1, 2]
    for m in result.measurements:
        assert m.emulated and m.repeats == 0 and m.step_s_spread == 0 and m.clock == "modelled"
        assert m.step_s == pytest.approx(compute_seconds(v100, "fp16", m.micro_batch * flops, 0.5))
    reasons = {(s.micro_batch, s.precision): s.reason for s in result.skipped}
    assert reasons[(64, "fp16")].startswith("out of memory: emulated V100-tiny")
    assert "no bf16 peak" in reasons[(1, "bf16")]


def test_profiler_times_a_throttled_device_under_the_memory_cap_it_trains_under(catalog, monkeypatch):
    """Training steps on an emulated device run under its memory cap's saved-tensor hooks (2 % of a V100 slice's
    step); a throttled device's profile times every step under the same cap, and only its untimed memory probe,
    which counts saved bytes with hooks of its own, without."""
    capped = [False]
    real = EmulatedDevice.memory_cap

    @contextlib.contextmanager
    def watched(self, model, static_bytes):
        with real(self, model, static_bytes):
            capped[0] = True
            try:
                yield
            finally:
                capped[0] = False

    monkeypatch.setattr(EmulatedDevice, "memory_cap", watched)
    under_cap: list[bool] = []

    def counted():
        workload = tiny_gpt()
        loss_fn = workload.loss_fn

        def loss(model, batch):
            under_cap.append(capped[0])
            return loss_fn(model, batch)

        return dataclasses.replace(workload, loss_fn=loss)

    throttled = Emulation(spec=catalog.get("V100-16GB"), efficiency=0.5, flops_per_sample=1e9, padded=False)
    spec = ProfileSpec(micro_batches=(1,), warmup=1, repeats=2)
    target = Target(gpu_type="V100-16GB", emulated=throttled)
    result = profile(counted, spec, workload_name="gpt", options=TINY, target=target)
    assert [(m.clock, m.repeats) for m in result.measurements] == [("wall", 2)]
    assert under_cap[0] is False and len(under_cap) > 3 and all(under_cap[1:])


def test_profile_spec_rejects_bad_requests():
    with pytest.raises(ProfileError, match="micro_batches"):
        ProfileSpec(micro_batches=(0, 2))
    with pytest.raises(ProfileError, match="fp8 not known"):
        ProfileSpec(micro_batches=(1,), precisions=("fp8",))
    with pytest.raises(ProfileError, match="repeats"):
        ProfileSpec(micro_batches=(1,), repeats=0)
    with pytest.raises(ProfileError, match="thread_cpu.*threads=1"):
        ProfileSpec(micro_batches=(1,), clock="thread_cpu", threads=2)
    assert ProfileSpec(micro_batches=(8, 2, 8)).micro_batches == (2, 8)


def test_profile_on_the_thread_clock_feeds_the_model():
    """Rows straight from the profiler (thread CPU time) fit a model that reproduces them closely."""
    spec = ProfileSpec(micro_batches=(1, 2, 4, 8), repeats=3, clock="thread_cpu")
    rows = profile(tiny_gpt, spec, workload_name="gpt", options=TINY).measurements
    assert {m.clock for m in rows} == {"thread_cpu"}
    model = fit_perf_model(history.to_frame(rows), "gpt")
    for m in rows:
        assert math.isclose(model.step_seconds(CPU, m.micro_batch, "fp32"), m.step_s, rel_tol=0.5)
        assert model.peak_memory_bytes(CPU, m.micro_batch, "fp32") == pytest.approx(m.peak_memory_bytes, rel=0.05)


def test_expected_slowest_is_the_mean_of_the_largest_of_normals():
    """The closed forms: two alike σ/√π, one varying beside one that does not σ/√(2π), two unlike
    √(σ₁² + σ₂²)/√(2π); four alike 1.0294 σ (the tabulated expected maximum of four standard normals)."""
    assert expected_slowest([0.02, 0.02]) == pytest.approx(0.02 / math.sqrt(math.pi), rel=1e-6)
    assert expected_slowest([0.02, 0.0]) == pytest.approx(0.02 / math.sqrt(2 * math.pi), rel=1e-5)
    assert expected_slowest([0.03, 0.01]) == pytest.approx(math.sqrt(0.001) / math.sqrt(2 * math.pi), rel=1e-6)
    assert expected_slowest([0.02] * 4) == pytest.approx(0.02 * 1.02938, rel=1e-4)
    assert expected_slowest([0.02] * 8) > expected_slowest([0.02] * 4)  # more workers, a later slowest
    assert expected_slowest([0.05]) == expected_slowest([0.0, 0.0]) == expected_slowest([]) == 0.0


def test_model_keeps_each_types_spread_from_its_repeats(catalog):
    """The spread is the repeats' relative IQR in σ (÷ 1.349), the median over a type's points; a modelled row
    (no repeats) gives none, and a type without one does not vary."""
    rows = [
        measurement(gpu_type="A100-80GB", micro_batch=b, step_s=0.1 * b, step_s_spread=0.1 * b * rel)
        for b, rel in ((1, 0.01), (2, 0.03), (4, 0.02))
    ] + [measurement(gpu_type="V100-16GB", micro_batch=b, step_s=0.2 * b, step_s_spread=0.0, repeats=0) for b in (1, 2)]
    model = fit_perf_model(history.to_frame(rows), "gpt", catalog=catalog)
    assert model.spreads == {("A100-80GB", "fp32"): pytest.approx(0.02 / 1.349)}
    two_a100s = [("A100-80GB", "fp32")] * 2
    assert model.straggler_factor(two_a100s) == pytest.approx(1 + 0.02 / 1.349 / math.sqrt(math.pi))
    assert model.straggler_factor([("A100-80GB", "fp32"), ("V100-16GB", "fp32")]) == pytest.approx(
        1 + 0.02 / 1.349 / math.sqrt(2 * math.pi), rel=1e-5
    )
    assert model.straggler_factor([("A100-80GB", "fp32")]) == 1.0


def test_planner_prices_the_slowest_of_workers_whose_steps_vary(tmp_path):
    """Two devices whose profiled steps varied by a relative IQR of 4 % are planned at the expected slower of the
    two (1 + 0.04 / 1.349 / √π over one device's step), and the plan says so; without spread, at one's step."""
    from hetero_ray.config import parse_config
    from hetero_ray.train.prepare import prepare

    options = {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16, "corpus_bytes": 20_000}
    same = StepCurve(overhead_s=0.0, per_sample_s=0.01, exponent=1.0)
    plans = {}
    for rel in (0.0, 0.04):
        rows = history.to_frame(
            measurement(
                gpu_type=t,
                micro_batch=b,
                step_s=same(b),
                step_s_spread=rel * same(b),
                workload_hash=options_hash(options),
            )
            for t in ("A100-80GB", "V100-16GB")
            for b in BATCHES
        )
        path = tmp_path / f"h{rel}.parquet"
        history.append(path, rows)
        cfg = {
            "devices": {"A100-80GB": 1, "V100-16GB": 1},
            "workload": {"name": "gpt", "options": options},
            "train": {"global_batch": 40, "precision": "fp32"},
            "profile_history": str(path),
        }
        plans[rel] = prepare(parse_config(cfg)).plan
    steady, varying = plans[0.0], plans[0.04]
    assert steady.predicted_compute_s == pytest.approx(20 * 0.01)
    assert varying.predicted_compute_s == pytest.approx(20 * 0.01 * (1 + 0.04 / 1.349 / math.sqrt(math.pi)))
    assert [r.local_batch for r in varying.roles] == [r.local_batch for r in steady.roles] == [20, 20]
    assert "priced at the slowest of 2 workers: 1.7%" in varying.explanation
    assert "priced at the slowest" not in steady.explanation


def test_planner_prices_types_with_the_profiled_model(tmp_path):
    """With a profile history in the config, the plan splits by the measured speeds, not the catalog's."""
    from hetero_ray.config import parse_config
    from hetero_ray.train.prepare import prepare

    options = {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16, "corpus_bytes": 20_000}
    same = StepCurve(overhead_s=0.0, per_sample_s=0.01, exponent=1.0)
    rows = history.to_frame(
        measurement(gpu_type=t, precision="fp32", micro_batch=b, step_s=same(b), workload_hash=options_hash(options))
        for t in ("A100-80GB", "V100-16GB")
        for b in BATCHES
    )
    history.append(tmp_path / "h.parquet", rows)
    base = {
        "devices": {"A100-80GB": 1, "V100-16GB": 1},
        "workload": {"name": "gpt", "options": options},
        "train": {"global_batch": 40, "precision": "fp32"},
    }
    catalog_split = [r.local_batch for r in prepare(parse_config(base)).plan.roles]
    profiled = [
        r.local_batch
        for r in prepare(parse_config({**base, "profile_history": str(tmp_path / "h.parquet")})).plan.roles
    ]
    assert catalog_split[0] > catalog_split[1]  # the catalog: A100 fp32 19.5 vs V100 15.7 TFLOP/s
    assert profiled == [20, 20]  # measured: the same speed
