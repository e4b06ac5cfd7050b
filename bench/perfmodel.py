"""Accuracy of the performance model, measured in one run; prints JSON and writes docs/measurements/perfmodel.json.

- heldout_batch_mape: this machine's CPU, single-threaded, fp32. Three workloads (the
  built-in GPT at two sizes and a small CNN defined here) are profiled at ten
  micro-batches with hetero-ray's profiler; every third micro-batch is held out,
  the model is fitted on the rest, and the figure is the mean absolute percentage
  error (as a fraction) of its step time on the held-out ones. The spread of the
  measurements (interquartile range ÷ median) is reported beside it. Steps are
  timed on the profiler's ``thread_cpu`` clock (the CPU time of the one thread that
  runs them): this host is shared, and wall time also counts other processes' time
  slices. The same profile on the wall clock follows as ``heldout_wall_clock``.
- cross_gpu_median_ape / cross_gpu_mean_ape: Lambda's measured single-GPU training
  throughput (data/reference/lambda-pytorch-train-throughput-fp32.csv). For each
  model and each GPU type, that type is left out and its throughput predicted from
  the other types and the catalog with the model's fallback (``fit_cross_type``:
  seconds per sample = flops ÷ peak + bytes ÷ memory bandwidth + host seconds, all
  learnt from the other types). Peak is the catalog's TF32 figure where the card has
  TF32 (Lambda ran fp32 with TF32 allowed, per the data's README), else fp32. The
  same with the compute term alone (peak × efficiency) and without the host term is
  reported for comparison.

Each workload is timed for about ``--budget`` seconds per clock (at least
``--min-repeats`` rounds), its repeats running in rounds across the micro-batches.

Usage: python bench/perfmodel.py [--budget 25] [--output docs/measurements/perfmodel.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from hetero_ray.cluster.catalog import Catalog, load_catalog
from hetero_ray.output import write_json
from hetero_ray.perf import history
from hetero_ray.perf.history import CPU
from hetero_ray.perf.model import fit_cross_type, fit_perf_model
from hetero_ray.perf.profiler import ProfileSpec, profile
from hetero_ray.workloads import Workload, build_workload

REPO = Path(__file__).resolve().parents[1]
REFERENCE_DATA = REPO / "data" / "reference"  # third-party data carried in the tree; see its README.md
LAMBDA_CSV = REFERENCE_DATA / "lambda-pytorch-train-throughput-fp32.csv"
MICRO_BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
GPT_SMALL = {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 64, "corpus_bytes": 200_000}
GPT_MEDIUM = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 32, "corpus_bytes": 200_000}
LAMBDA_INFO_COLUMNS = ("name_gpu", "num_gpu", "watt", "price")


def small_cnn() -> Workload:
    """Two conv blocks and two linear layers on 256 fixed random 3×32×32 images, 10 classes."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(256, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 10, (256,), generator=generator)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # (B, 16, 16, 16)
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # (B, 32, 8, 8)
        nn.Flatten(), nn.Linear(32 * 8 * 8, 128), nn.ReLU(), nn.Linear(128, 10),
    )  # fmt: skip
    return Workload(
        model=model,
        loss_fn=lambda m, batch: F.cross_entropy(m(batch[0]), batch[1]),
        dataset=TensorDataset(images, labels),
    )


WORKLOADS = {
    "gpt 2x64": (lambda: build_workload("gpt", GPT_SMALL), GPT_SMALL),
    "gpt 4x128 block 32": (lambda: build_workload("gpt", GPT_MEDIUM), GPT_MEDIUM),
    "cnn (bench/perfmodel.py)": (small_cnn, {}),
}


def repeats_for(factory, budget_s: float, min_repeats: int) -> int:
    """Timed rounds (one step per micro-batch each) that fit in ``budget_s``, at least ``min_repeats``.

    A round's time comes from a short profile (one warm-up and one timed round) now.
    """
    spec = ProfileSpec(micro_batches=MICRO_BATCHES, warmup=1, repeats=1, threads=1)
    started = time.perf_counter()
    profile(factory, spec, workload_name="probe", options={})
    # The probe ran three rounds: warm-up, memory, timed.
    return max(min_repeats, int(budget_s / ((time.perf_counter() - started) / 3)))


def heldout_batches(budget_s: float, min_repeats: int, warmup: int, clock: str) -> dict:
    """Profile each workload on this CPU, fit on two thirds of the micro-batches, score the held-out third."""
    held_out = MICRO_BATCHES[2::3]
    per_workload, errors = {}, []
    for name, (factory, options) in WORKLOADS.items():
        repeats = repeats_for(factory, budget_s, min_repeats)
        spec = ProfileSpec(
            micro_batches=MICRO_BATCHES, precisions=("fp32",), warmup=warmup, repeats=repeats, threads=1, clock=clock
        )
        started = time.perf_counter()
        table = history.to_frame(profile(factory, spec, workload_name=name, options=options).measurements)
        seconds = time.perf_counter() - started
        model = fit_perf_model(table[~table["micro_batch"].isin(held_out)], name)
        curve = model.curves[(CPU, "fp32")]
        points = []
        for row in table.itertuples():
            predicted = model.step_seconds(CPU, row.micro_batch, "fp32")
            points.append(
                {
                    "micro_batch": row.micro_batch,
                    "held_out": row.micro_batch in held_out,
                    "step_s": row.step_s,
                    "relative_spread": row.step_s_spread / row.step_s,
                    "predicted_step_s": predicted,
                    "ape": abs(predicted / row.step_s - 1),
                }
            )
        scored = [p["ape"] for p in points if p["held_out"]]
        errors += scored
        spreads = [p["relative_spread"] for p in points]
        per_workload[name] = {
            "mape": statistics.fmean(scored),
            "max_ape": max(scored),
            "median_relative_spread": statistics.median(spreads),
            "max_relative_spread": max(spreads),
            "repeats": repeats,
            "profile_s": seconds,
            "curve": {
                "overhead_s": curve.overhead_s,
                "per_sample_s": curve.per_sample_s,
                "exponent": curve.exponent,
                "saturation": curve.saturation,
            },
            "points": points,
        }
    return {
        "heldout_batch_mape": statistics.fmean(errors),
        "machine": {
            "cpu": _cpu_name(),
            "threads": 1,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "micro_batches": list(MICRO_BATCHES),
        "held_out": list(held_out),
        "warmup": warmup,
        "clock": clock,
        "relative_spread": "interquartile range of the timed repeats ÷ their median, per point",
        "per_workload": per_workload,
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def lambda_by_type(catalog: Catalog) -> tuple[pd.DataFrame, list[str]]:
    """Single-GPU throughput per catalog type (geometric mean over its rows; 0 = not measured), and unmapped rows."""
    table = pd.read_csv(LAMBDA_CSV)
    table = table[table["num_gpu"] == 1]
    row_type = {row: name for name in catalog for row in catalog.get(name).lambda_benchmark_names}
    skipped = sorted(set(table["name_gpu"]) - set(row_type))
    table = table[table["name_gpu"].isin(row_type)]
    models = [c for c in table.columns if c not in LAMBDA_INFO_COLUMNS]
    logs = np.log(table[models].where(table[models] > 0))
    return np.exp(logs.groupby(table["name_gpu"].map(row_type)).mean()), skipped


def training_precision(spec) -> str:
    """Lambda's fp32 runs allow TF32, so a card with TF32 tensor cores is priced at its TF32 peak."""
    return "tf32" if "tf32" in spec.peak_tflops else "fp32"


def leave_one_type_out(throughput: pd.DataFrame, catalog: Catalog, *, max_terms: int = 3) -> pd.DataFrame:
    """Signed relative error of each (model, type)'s predicted throughput, each type predicted from the others."""
    errors = {}
    for model in throughput.columns:
        measured = throughput[model].dropna()
        for left_out in measured.index:
            points = [
                (catalog.get(t), training_precision(catalog.get(t)), 1.0 / measured[t])
                for t in measured.index
                if t != left_out
            ]
            fitted = fit_cross_type(points, max_terms=max_terms)
            spec = catalog.get(left_out)
            predicted = 1.0 / fitted.seconds_per_sample(spec, training_precision(spec))
            errors[(model, left_out)] = predicted / measured[left_out] - 1
    return pd.Series(errors).unstack()


def ape_summary(signed: pd.DataFrame, prefix: str) -> dict:
    """Median and mean absolute percentage error (fractions) over every (model, type) of ``signed``."""
    every = signed.abs().stack().to_numpy()
    return {f"{prefix}_median_ape": float(np.median(every)), f"{prefix}_mean_ape": float(every.mean())}


def cross_gpu() -> dict:
    """Leave-one-GPU-type-out prediction of Lambda's measured throughput, per model and overall."""
    catalog = load_catalog()
    throughput, skipped = lambda_by_type(catalog)
    signed = leave_one_type_out(throughput, catalog)
    ape = signed.abs()
    return {
        **ape_summary(signed, "cross_gpu"),
        "features": "seconds/sample = flops / catalog peak (TF32 where the card has it, else fp32) "
        "+ bytes / catalog memory bandwidth + host seconds; flops, bytes, host >= 0 learnt per model "
        "from the other types",
        "per_model": {
            m: {"median_ape": float(ape.loc[m].median()), "mean_ape": float(ape.loc[m].mean())} for m in ape.index
        },
        "signed_error_per_type": {m: signed.loc[m].round(4).dropna().to_dict() for m in signed.index},
        # The same fit with fewer terms: the compute term alone, and compute + bandwidth.
        **ape_summary(leave_one_type_out(throughput, catalog, max_terms=1), "peak_only"),
        **ape_summary(leave_one_type_out(throughput, catalog, max_terms=2), "without_host"),
        "gpu_types": list(throughput.index),
        "lambda_rows_without_catalog_type": skipped,
        "data": str(LAMBDA_CSV.relative_to(REPO)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=25, help="seconds of timed steps per workload and clock")
    parser.add_argument("--min-repeats", type=int, default=31, help="timed steps per micro-batch at least")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--output", default=str(REPO / "docs" / "measurements" / "perfmodel.json"))
    args = parser.parse_args()
    cross = cross_gpu()
    held = heldout_batches(args.budget, args.min_repeats, args.warmup, "thread_cpu")
    wall = heldout_batches(args.budget, args.min_repeats, args.warmup, "wall")
    result = {
        "emulated": False,
        "heldout_batch_mape": held.pop("heldout_batch_mape"),
        "cross_gpu_median_ape": cross.pop("cross_gpu_median_ape"),
        "cross_gpu_mean_ape": cross.pop("cross_gpu_mean_ape"),
        "targets": {"heldout_batch_mape": "<= 0.05", "cross_gpu_median_ape": "<= 0.15"},
        "heldout": held,
        "heldout_wall_clock": wall,
        "cross_gpu": cross,
    }
    write_json(args.output, result, force=True)  # a measurement replaces the last one
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
