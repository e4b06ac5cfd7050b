"""The performance model: step time, throughput and peak memory per (GPU type, micro-batch, precision).

Fitted per workload from the profile history (``perf/history.py``):

- **Step time**, per (type, precision) with history, ``StepCurve``:
  ``step_s(b) = overhead_s + per_sample_s · max(b, saturation)^exponent``. The
  overhead is what a step costs regardless of batch (kernel launches, Python, the
  optimizer update); below ``saturation`` samples the device is not filled and the
  time stops falling (GPUs); ``exponent`` lets the per-sample cost fall with batch
  (< 1: larger matrix products use a CPU better) or grow (> 1: the working set
  leaves the caches), within [0.5, 1.5]. The fit minimises relative error (MAPE is
  the target): for each (saturation, exponent) on a grid, weighted linear least
  squares for (overhead, per-sample) ≥ 0. Fewer points, fewer parameters: 1 point
  → proportional, 2 → overhead + linear, 3–4 → + exponent, ≥ 5 → + saturation.
- **Types without history**, ``CrossType``: seconds per sample on type T at
  precision p = ``flops / peak_T(p) + bytes / bandwidth_T + host_s`` — a step is
  partly compute-bound (matrix products, at the catalog's peak for p), partly
  memory-bound (normalisation, activations, optimizer, at the catalog's HBM
  bandwidth) and partly spent where the card does not matter (the host's Python and
  data loading, kernel launches). ``flops``, ``bytes`` and ``host_s`` (all ≥ 0,
  "effective": FLOPs at the achieved efficiency, bytes at the achieved bandwidth)
  are learnt from the types that have history, at the same micro-batch. A fit keeps
  at least one more type than terms, so that the data checks it: with two types only
  the compute term (the catalog's peak × an efficiency learnt from the others), with
  three + bandwidth, with four or more + host time.
- **Peak memory**, ``MemoryLine``: ``static_bytes + per_sample_bytes · b`` by least
  squares; a type without history takes the median line of the others (activation
  bytes scaled by ``activation_scale`` across precisions).
- **Spread**, per (type, precision) with timed repeats: how much one device's step
  varies from step to step, as a relative standard deviation (the repeats'
  interquartile range ÷ their median ÷ 1.349, a normal's IQR in σ; the median over the
  type's points). A synchronous step waits for the slowest of its workers, so
  ``straggler_factor`` prices every modelled time at the expected slowest of them:
  ``1 + E[max_i σ_i Z_i]`` (``expected_slowest``), independent normal steps.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from hetero_ray.cluster.catalog import Catalog, GpuSpec, load_catalog
from hetero_ray.plan.cost import activation_scale

# A normal distribution's interquartile range in standard deviations (2 × 0.6745).
IQR_PER_SIGMA = 1.349
EXPONENTS = tuple(float(x) for x in np.round(np.linspace(0.5, 1.5, 21), 2))
# Cross-type terms, in the order a growing number of profiled types admits them.
CROSS_TYPE_TERMS = ("compute", "bandwidth", "host")

TypePrecision = tuple[str, str]
"""(GPU type, precision): the key of every per-device table here."""


class NoHistory(ValueError):
    """The history holds nothing to predict from; the message says what it does hold."""


@dataclass(frozen=True, kw_only=True)
class StepCurve:
    """``step_s(b) = overhead_s + per_sample_s · max(b, saturation)^exponent``, fitted to ``points`` micro-batches."""

    overhead_s: float
    per_sample_s: float
    exponent: float = 1.0
    saturation: float = 1.0
    points: int = 0

    def __call__(self, micro_batch: float) -> float:
        """Predicted seconds of one step at ``micro_batch``."""
        return self.overhead_s + self.per_sample_s * max(micro_batch, self.saturation) ** self.exponent


def _relative_lstsq(columns: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float] | None:
    """Non-negative weights ``w`` minimising Σ((columns·w − y)/y)², and that sum; None if only w = 0 fits.

    Few columns: every subset of them is solved unconstrained and the best
    non-negative solution kept (exact non-negative least squares for 2–3 columns).
    """
    a = columns / y[:, None]
    target = np.ones(len(y))
    best: tuple[np.ndarray, float] | None = None
    k = columns.shape[1]
    for subset in itertools.chain.from_iterable(itertools.combinations(range(k), r) for r in range(1, k + 1)):
        cols = list(subset)
        w, *_ = np.linalg.lstsq(a[:, cols], target, rcond=None)
        if (w < 0).any():
            continue
        loss = float(((a[:, cols] @ w - target) ** 2).sum())
        if best is None or loss < best[1]:
            full = np.zeros(k)
            full[cols] = w
            best = (full, loss)
    return best


def fit_step_curve(micro_batches: Sequence[float], step_s: Sequence[float]) -> StepCurve:
    """The ``StepCurve`` of least relative error through (micro-batch, step seconds) points."""
    b = np.asarray(micro_batches, dtype=float)
    y = np.asarray(step_s, dtype=float)
    if len(b) == 0 or len(b) != len(y) or (b <= 0).any() or (y <= 0).any():
        raise ValueError(f"step curve: need matching positive micro-batches and times (got {list(b)}, {list(y)})")
    distinct = np.unique(b)
    if len(distinct) == 1:
        return StepCurve(overhead_s=0.0, per_sample_s=float(np.median(y / b)), points=1)
    exponents = EXPONENTS if len(distinct) >= 3 else (1.0,)
    # Saturation at a measured micro-batch: between two, the fit could not tell where.
    saturations = (1.0, *distinct[distinct > 1][:-2]) if len(distinct) >= 5 else (1.0,)
    best: tuple[float, StepCurve] | None = None
    for sat, exp in itertools.product(saturations, exponents):
        columns = np.stack([np.ones_like(b), np.maximum(b, sat) ** exp], axis=1)
        solved = _relative_lstsq(columns, y)
        if solved is None or solved[0][1] <= 0:
            continue
        (t0, c), loss = solved
        if best is None or loss < best[0] - 1e-12:
            curve = StepCurve(
                overhead_s=float(t0), per_sample_s=float(c), exponent=exp, saturation=float(sat), points=len(distinct)
            )
            best = (loss, curve)
    if best is None:
        # Time does not grow with batch at all: a flat curve is the honest fit.
        return StepCurve(overhead_s=float(np.median(y)), per_sample_s=0.0, points=len(distinct))
    return best[1]


@dataclass(frozen=True, kw_only=True)
class MemoryLine:
    """``peak_bytes(b) = static_bytes + per_sample_bytes · b``."""

    static_bytes: float
    per_sample_bytes: float

    def __call__(self, micro_batch: float) -> float:
        """Predicted peak bytes of one step at ``micro_batch``."""
        return self.static_bytes + self.per_sample_bytes * micro_batch


def fit_memory_line(micro_batches: Sequence[float], peak_bytes: Sequence[float]) -> MemoryLine:
    """Least-squares line through (micro-batch, peak bytes); one point is read as all per-sample (conservative above it)."""
    b = np.asarray(micro_batches, dtype=float)
    y = np.asarray(peak_bytes, dtype=float)
    if len(np.unique(b)) == 1:
        return MemoryLine(static_bytes=0.0, per_sample_bytes=float(np.median(y / b)))
    slope, intercept = np.polyfit(b, y, 1)
    if intercept < 0 or slope < 0:
        # Noise in a near-constant or near-proportional table: keep the term that explains it.
        slope, intercept = (max(slope, 0.0), 0.0) if intercept < 0 else (0.0, float(np.mean(y)))
    return MemoryLine(static_bytes=float(intercept), per_sample_bytes=float(slope))


def expected_slowest(spreads: Sequence[float]) -> float:
    """``E[max_i σ_i Z_i]`` for independent standard normals ``Z_i``: how much later than a balanced step's mean
    the slowest of workers whose steps vary by the relative standard deviations ``spreads`` ends (0 for one worker
    or none that varies; 0.5642 σ for two alike, 1.0294 σ for four). By ``E[M] = ∫₀^∞ (1 − F(x)) dx − ∫₋∞^0 F(x)
    dx`` with ``F(x) = Π Φ(x / σ_i)``, to 8 of the largest σ either side."""
    varying = Counter(s for s in spreads if s > 0)
    if len(spreads) < 2 or not varying:
        return 0.0
    erf = np.vectorize(math.erf)

    def cdf(x: np.ndarray) -> np.ndarray:
        return np.prod([(0.5 * (1 + erf(x / (s * math.sqrt(2))))) ** n for s, n in varying.items()], axis=0)

    x = np.linspace(0.0, 8 * max(varying), 2001)
    late = np.trapezoid(1 - cdf(x), x)
    # A worker that does not vary ends at the mean, so the slowest never ends before it.
    early = np.trapezoid(cdf(-x), x) if sum(varying.values()) == len(spreads) else 0.0
    return float(late - early)


@dataclass(frozen=True, kw_only=True)
class CrossType:
    """Seconds per sample on any catalog type: ``flops / peak(precision) + bytes / bandwidth + host_s``."""

    flops: float
    """Effective FLOPs per sample (the workload's FLOPs ÷ the efficiency achieved)."""
    bytes: float = 0.0
    """Effective bytes moved per sample through memory (0 when fitted from fewer than 3 types)."""
    host_s: float = 0.0
    """Seconds per sample that no card shortens (0 when fitted from fewer than 4 types)."""

    def seconds_per_sample(self, spec: GpuSpec, precision: str) -> float:
        """Predicted seconds per sample on ``spec`` at ``precision``."""
        return float(np.dot(_features(spec, precision), (self.flops, self.bytes, self.host_s)))


def _features(spec: GpuSpec, precision: str) -> list[float]:
    return [1.0 / spec.peak_flops(precision), 1.0 / (spec.memory_bandwidth_gbs * 1e9), 1.0]


def cross_type_terms(n_types: int, max_terms: int = len(CROSS_TYPE_TERMS)) -> tuple[str, ...]:
    """The ``CrossType`` terms a fit to ``n_types`` profiled types uses: one fewer than the types, at least one."""
    return CROSS_TYPE_TERMS[: max(1, min(max_terms, n_types - 1))]


def fit_cross_type(
    points: Sequence[tuple[GpuSpec, str, float]], *, max_terms: int = len(CROSS_TYPE_TERMS)
) -> CrossType:
    """Fit ``CrossType`` to (spec, precision, seconds per sample) measured on other types, by relative error.

    ``max_terms=1`` keeps only the compute term (peak × a learnt efficiency), as two
    types do anyway; see ``cross_type_terms``.
    """
    if not points:
        raise NoHistory("cross-type fit: no measured GPU type to learn from")
    y = np.array([s for _, _, s in points], dtype=float)
    x = np.array([_features(spec, p) for spec, p, _ in points])
    terms = cross_type_terms(len({spec.name for spec, _, _ in points}), max_terms)
    solved = _relative_lstsq(x[:, : len(terms)], y)
    if solved is None:
        raise NoHistory(f"cross-type fit: no non-negative fit to {len(points)} points")
    flops, bytes_, host_s = np.pad(solved[0], (0, len(CROSS_TYPE_TERMS) - len(terms)))
    return CrossType(flops=float(flops), bytes=float(bytes_), host_s=float(host_s))


@dataclass(frozen=True, kw_only=True)
class PerfModel:
    """Predictions for one workload: fitted curves where history exists, the catalog elsewhere.

    Build it with ``fit_perf_model``. Predictions for an emulated model are emulated
    devices' modelled times and never stand for a GPU measurement.
    """

    workload: str
    workload_hash: str
    emulated: bool
    curves: Mapping[TypePrecision, StepCurve]
    memory: Mapping[TypePrecision, MemoryLine]
    spreads: Mapping[TypePrecision, float] = field(default_factory=dict)
    """Relative standard deviation of one device's step, by (type, precision) with timed repeats."""
    catalog: Catalog = field(compare=False, repr=False)

    def has_history(self, gpu_type: str, precision: str) -> bool:
        """Whether (``gpu_type``, ``precision``) was profiled (else predictions come from the catalog)."""
        return (gpu_type, precision) in self.curves

    def step_seconds(self, gpu_type: str, micro_batch: int, precision: str) -> float:
        """Seconds of one forward+backward+optimizer step of ``micro_batch`` samples."""
        if micro_batch < 1:
            raise ValueError(f"micro_batch: must be >= 1 (got {micro_batch})")
        curve = self.curves.get((gpu_type, precision))
        if curve is not None:
            return curve(micro_batch)
        return micro_batch * self.cross_type(micro_batch).seconds_per_sample(self.catalog.get(gpu_type), precision)

    def fixed_seconds(self, gpu_type: str, precision: str) -> float:
        """The part of a step's time that does not grow with its batch (the fitted curve's overhead); 0 where
        (``gpu_type``, ``precision``) has no history (the catalog's prediction has no fixed part)."""
        curve = self.curves.get((gpu_type, precision))
        return curve.overhead_s if curve is not None else 0.0

    def samples_per_second(self, gpu_type: str, micro_batch: int, precision: str) -> float:
        """Training throughput of one device running steps of ``micro_batch`` samples."""
        return micro_batch / self.step_seconds(gpu_type, micro_batch, precision)

    def peak_memory_bytes(self, gpu_type: str, micro_batch: int, precision: str) -> float:
        """Peak bytes of one step of ``micro_batch`` samples."""
        line = self.memory.get((gpu_type, precision))
        if line is not None:
            return line(micro_batch)
        same = [m for (_, p), m in self.memory.items() if p == precision]
        scaled = same or [
            MemoryLine(
                static_bytes=m.static_bytes,
                per_sample_bytes=m.per_sample_bytes * activation_scale(precision) / activation_scale(p),
            )
            for (_, p), m in self.memory.items()
        ]
        if not scaled:
            raise NoHistory(f"{self.workload}: no memory history at all")
        return statistics.median(m(micro_batch) for m in scaled)

    def straggler_factor(self, workers: Sequence[TypePrecision]) -> float:
        """What a synchronous step of ``workers`` (one (type, precision) each) costs over one balanced worker's
        modelled step: ``1 + expected_slowest`` of their spreads (a type without timed repeats does not vary)."""
        return 1.0 + expected_slowest([self.spreads.get(w, 0.0) for w in workers])

    def cross_type(self, micro_batch: int) -> CrossType:
        """The catalog fallback at ``micro_batch``, learnt from every catalog type with history."""
        points = [
            (self.catalog.get(t), p, curve(micro_batch) / micro_batch)
            for (t, p), curve in self.curves.items()
            if t in self.catalog
        ]
        if not points:
            raise NoHistory(
                f"{self.workload}: no profiled catalog GPU type to learn from (profiled: "
                f"{', '.join(f'{t}/{p}' for t, p in self.curves) or 'nothing'})"
            )
        return fit_cross_type(points)

    def explain(self, gpu_type: str, precision: str) -> str:
        """One line saying where predictions for (type, precision) come from."""
        kind = "emulated " if self.emulated else ""
        curve = self.curves.get((gpu_type, precision))
        if curve is not None:
            return (
                f"{gpu_type}/{precision}: fitted to {curve.points} profiled {kind}micro-batches "
                f"(overhead {curve.overhead_s * 1e3:.3g} ms, exponent {curve.exponent:g}, "
                f"saturation {curve.saturation:g})"
            )
        others = sorted({t for t, _ in self.curves if t in self.catalog})
        terms = " + ".join(cross_type_terms(len(others)))
        return f"{gpu_type}/{precision}: no {kind}history; catalog terms {terms}, learnt from {', '.join(others)}"


def fit_perf_model(
    history: pd.DataFrame,
    workload: str,
    *,
    workload_hash: str | None = None,
    emulated: bool = False,
    catalog: Catalog | None = None,
) -> PerfModel:
    """Fit the model of ``workload`` from ``history`` rows of that workload and emulated flag.

    ``workload_hash`` picks one set of options when the history holds several.
    Repeated measurements of one point are combined by their median, and so are the relative spreads of a
    type's points (rows without timed repeats, such as a padded device's modelled ones, give none).
    """
    rows = history[(history["workload"] == workload) & (history["emulated"] == emulated)]
    hashes = sorted(rows["workload_hash"].unique())
    if workload_hash is None and len(hashes) > 1:
        raise NoHistory(f"{workload}: the history holds several option sets ({', '.join(hashes)}); pick one by hash")
    chosen = workload_hash or (hashes[0] if hashes else None)
    rows = rows[rows["workload_hash"] == chosen]
    if rows.empty:
        kind = "emulated" if emulated else "measured"
        present = sorted(set(zip(history["workload"], history["workload_hash"])))
        raise NoHistory(
            f"no {kind} history for workload {workload!r}"
            + (f" with options hash {workload_hash}" if workload_hash else "")
            + f"; the history holds {', '.join(f'{w} ({h})' for w, h in present) or 'nothing'}; "
            "profile it first (hetero-ray profile)"
        )
    points = rows.groupby(["gpu_type", "precision", "micro_batch"])[["step_s", "peak_memory_bytes"]].median()
    curves: dict[TypePrecision, StepCurve] = {}
    memory: dict[TypePrecision, MemoryLine] = {}
    for (gpu_type, precision), group in points.groupby(level=["gpu_type", "precision"]):
        b = group.index.get_level_values("micro_batch").to_numpy()
        curves[(gpu_type, precision)] = fit_step_curve(b, group["step_s"].to_numpy())
        memory[(gpu_type, precision)] = fit_memory_line(b, group["peak_memory_bytes"].to_numpy())
    timed = rows[(rows["repeats"] >= 2) & (rows["step_s"] > 0)]
    relative = (timed["step_s_spread"] / timed["step_s"] / IQR_PER_SIGMA).groupby(
        [timed["gpu_type"], timed["precision"]]
    )
    spreads = {key: float(value) for key, value in relative.median().items()}
    return PerfModel(
        workload=workload,
        workload_hash=str(chosen),
        emulated=emulated,
        curves=curves,
        memory=memory,
        spreads=spreads,
        catalog=catalog or load_catalog(),
    )
