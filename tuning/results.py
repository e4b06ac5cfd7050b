"""A sweep's results: the trial table (pandas, CSV), the throughput plot (PNG), the best shares as a run config (YAML)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from hetero_ray.output import write_atomically
from tuning.settings import SweepError
from tuning.space import MICRO_BATCH_KEY, WEIGHT_PREFIX, ShareSpace, weights_of
from tuning.trial import METRIC


def trials_frame(results: list[Mapping[str, Any]], space: ShareSpace, max_windows: int) -> pd.DataFrame:
    """One row per trial: its weights, the integer shares they gave, and the samples/s of its last window.

    ``results`` are each trial's ``{"config": …, "metrics": …}``; a trial is ``complete``
    when it reported ``max_windows`` windows (ASHA stops the others early).
    """
    rows = []
    for i, r in enumerate(results):
        params, m = r["config"], r.get("metrics") or {}
        weights = weights_of(params, space.reference)
        rows.append(
            {
                "trial": i,
                **{f"weight:{t}": weights[t] for t in space.predicted},
                "max_micro_batch": params.get(MICRO_BATCH_KEY),
                **{k: v for k, v in m.items() if k.startswith(("share:", "micro_batch:"))},
                METRIC: m.get(METRIC, float("nan")),
                "step_s": m.get("step_s", float("nan")),
                "windows": m.get("window", 0),
                "complete": m.get("window", 0) >= max_windows,
                "overrun_steps": m.get("overrun_steps", 0),
                "emulated": bool(m.get("emulated", False)),
                "error": r.get("error"),
            }
        )
    return pd.DataFrame(rows)


def best_trial(trials: pd.DataFrame) -> pd.Series:
    """The trial of highest measured samples/s among those that ran every window (early-stopped ones are partial)."""
    done = trials[trials["complete"] & trials[METRIC].notna()]
    if done.empty:
        raise SweepError("no trial ran to its last window; run more trials or give ASHA a longer grace period")
    return done.loc[done[METRIC].idxmax()]


def write_csv(trials: pd.DataFrame, path: Path) -> None:
    """The trial table as CSV."""
    write_atomically(path, lambda p: trials.to_csv(p, index=False))


def write_plot(trials: pd.DataFrame, space: ShareSpace, path: Path, *, emulated: bool) -> None:
    """Samples/s against each searched type's weight (relative to the reference type), one panel per type;
    the prediction marked, early-stopped trials hollow."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    searched = list(space.bounds)
    fig, axes = plt.subplots(1, len(searched), figsize=(5.5 * len(searched), 4), squeeze=False)
    for ax, gpu_type in zip(axes[0], searched):
        x = trials[f"{WEIGHT_PREFIX}{gpu_type}"]
        done = trials["complete"]
        ax.scatter(x[done], trials[METRIC][done], label="ran every window")
        ax.scatter(x[~done], trials[METRIC][~done], facecolors="none", edgecolors="C0", label="stopped early (ASHA)")
        ax.axvline(space.predicted[gpu_type], color="C1", linestyle="--", label="predicted")
        ax.set_xscale("log")
        ax.set_xlabel(f"weight {gpu_type} : {space.reference}")
        ax.set_ylabel("samples/s" + (" (emulated)" if emulated else ""))
        ax.legend(fontsize="small")
    fig.suptitle("share sweep" + (" — emulated devices" if emulated else ""))
    fig.tight_layout()
    write_atomically(path, lambda p: fig.savefig(p, format="png", dpi=100))
    plt.close(fig)


def write_best_config(base: Mapping[str, Any], best: pd.Series, space: ShareSpace, path: Path) -> dict[str, Any]:
    """The user's config with ``train.split`` set to the best trial's weights (and its micro-batch cap): a file
    ``jobs/train.py --config`` accepts. Everything else, steps included, stays as the user wrote it."""
    weights = {t: round(float(best[f"{WEIGHT_PREFIX}{t}"]), 4) for t in space.predicted}
    train = {**base.get("train", {}), "split": weights}
    if space.micro_batch_caps:
        train["max_micro_batch"] = int(best["max_micro_batch"])
    data = {**base, "train": train}
    write_atomically(path, lambda p: p.write_text(yaml.safe_dump(data, sort_keys=False)))
    return data
