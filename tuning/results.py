"""A sweep's results: the trial table (pandas, CSV), the throughput plot (PNG), the best shares as a run config (YAML)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import yaml

from hetero_ray.output import write_atomically
from tuning.settings import SweepError
from tuning.space import MICRO_BATCH_KEY, WEIGHT_PREFIX, ShareSpace
from tuning.trial import FINAL_METRIC, METRIC

if TYPE_CHECKING:
    from ray.tune import ResultGrid


def trials_frame(grid: ResultGrid, space: ShareSpace) -> pd.DataFrame:
    """One row per trial, in the order Tune created them: its weights, the integer shares they gave, and the
    samples/s of its last window; ``complete`` when it ran every window (ASHA stops the others early).

    Tune's own table (``grid.get_dataframe()``, each trial's last report), with the trials that failed before
    their first report added from the grid, and Tune's ``config/`` prefix dropped.
    """
    frame = grid.get_dataframe()
    results = {r.metrics["trial_id"]: r for r in grid}
    reported = set(frame["trial_id"]) if "trial_id" in frame else set()
    silent = [
        {**{f"config/{k}": v for k, v in _config(r).items()}, "trial_id": i}
        for i, r in results.items()
        if i not in reported
    ]
    frame = pd.concat([frame, pd.DataFrame(silent)], ignore_index=True).rename(
        columns=lambda c: c.removeprefix("config/")
    )
    # Tune numbers its trials as it creates them, in the experiment tag it adds to their results
    # ("<number>_<params>"; trial ids are random); a trial that never reported has no number and goes last.
    tag = {i: r.metrics.get("experiment_tag") for i, r in results.items()}
    frame["trial"] = frame["trial_id"].map(lambda i: int(tag[i].split("_", 1)[0]) if tag[i] else None)
    frame["path"] = frame["trial_id"].map({i: r.path for i, r in results.items()})
    frame[f"{WEIGHT_PREFIX}{space.reference}"] = 1.0
    # A trial's error is a remote traceback; its last line names the exception.
    frame["error"] = frame["trial_id"].map(
        {i: str(r.error).strip().splitlines()[-1] for i, r in results.items() if r.error}
    )
    frame["complete"] = frame[FINAL_METRIC].notna() if FINAL_METRIC in frame else False
    frame = frame.rename(columns={"window": "windows"})
    columns = [
        "trial",
        "trial_id",
        *(f"{WEIGHT_PREFIX}{t}" for t in space.predicted),
        *([MICRO_BATCH_KEY] if space.micro_batch_caps else []),
        *sorted(c for c in frame if c.startswith(("share:", "micro_batch:"))),
        METRIC,
        "step_s",
        "windows",
        "complete",
        "overrun_steps",
        "emulated",
        "error",
        "path",
    ]
    return frame.reindex(columns=columns).sort_values("trial", na_position="last", ignore_index=True)


def _config(result) -> dict[str, Any]:
    # A grid read back from disk has no config for a trial that never reported; Tune's params.json in the
    # trial's folder has it.
    if result.config is not None:
        return result.config
    return json.loads((Path(result.path) / "params.json").read_text())


def best_trial(grid: ResultGrid, trials: pd.DataFrame) -> pd.Series:
    """The row of ``trials`` (from ``trials_frame(grid, …)``) for Tune's best trial: the highest samples/s of a
    last window among the trials that ran every window."""
    try:
        best = grid.get_best_result(metric=FINAL_METRIC, mode="max", scope="last")
    except RuntimeError:  # no trial reported it
        best = None
    # With a single trial Tune returns it whatever it reported.
    if best is None or FINAL_METRIC not in (best.metrics or {}):
        raise SweepError("no trial ran to its last window; run more trials or give ASHA a longer grace period")
    return trials.loc[trials["trial_id"] == best.metrics["trial_id"]].iloc[0]


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
