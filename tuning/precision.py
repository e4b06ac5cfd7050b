"""The precision sweep: fp32 against each GPU type's half precision, every combination run side by side.

``hetero-ray tune --search precision`` runs one trial per combination (a grid: the types whose fastest
precision is half give two choices, fp32 and that one), each the same short training on all the workers
with the shares the planner gives that combination, and each evaluating the held-out loss after its last
step. The choice follows a stated rule: the fastest combination whose held-out loss is within
``--loss-tolerance`` (1 %) of the all-fp32 trial's. Writes ``trials.csv``, ``precision.png`` (throughput
against loss) and ``best.yaml`` (the config with ``train.precision`` per type).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import yaml
from rich.console import Console

from hetero_ray.cluster.catalog import load_catalog
from hetero_ray.config import RunConfig, parse_config
from hetero_ray.output import write_atomically
from hetero_ray.strict_yaml import load_yaml
from hetero_ray.train.precision import choose_precision
from tuning.settings import SweepError, SweepSettings
from tuning.trial import FINAL_METRIC, METRIC, PRECISION_PREFIX

if TYPE_CHECKING:
    from ray.tune import ResultGrid

RESULT_FILES = ("trials.csv", "precision.png", "best.yaml")


def precision_choices(cfg: RunConfig) -> dict[str, list[str]]:
    """Per GPU type of ``cfg``, the precisions a trial may give it: fp32, and the card's half precision (bf16
    where it has it, fp16 on Volta/Turing) when it has one. ``SweepError`` when no type has a choice."""
    catalog = load_catalog(cfg.gpus_file)
    choices = {}
    for gpu_type in cfg.devices:
        fastest = choose_precision(catalog.get(gpu_type), "auto")
        choices[gpu_type] = ["fp32"] if fastest == "fp32" else ["fp32", fastest]
    if all(len(c) == 1 for c in choices.values()):
        raise SweepError(f"devices: none of {', '.join(cfg.devices)} has a half precision to weigh against fp32")
    return choices


def precision_base(base: RunConfig, eval_samples: int) -> RunConfig:
    """A trial's run: ``base`` (``trial_base``) evaluating ``eval_samples`` held-out samples after its last step,
    emulated devices computing in its precision (``emulation.autocast``), on the config's split when it names
    one, else the split the planner gives each combination (its predicted speeds change with the precision)."""
    # A split the config names stays: each trial's speed then differs by its precision alone.
    split = base.train.split if isinstance(base.train.split, dict) else "proportional"
    train = base.train.model_copy(update={"eval_every": base.train.steps, "eval_samples": eval_samples, "split": split})
    update: dict[str, Any] = {"train": train}
    if base.emulation is not None:
        # A trial must compute in the precision it names, or every trial's loss would be fp32's.
        update["emulation"] = base.emulation.model_copy(update={"autocast": True})
    return base.model_copy(update=update)


def precision_frame(grid: ResultGrid, choices: Mapping[str, list[str]]) -> pd.DataFrame:
    """One row per trial: its precision per type, the samples/s and held-out loss of its last window, the error
    of a trial that failed."""
    rows = []
    for result in grid:
        config, metrics = result.config or {}, result.metrics or {}
        rows.append(
            {
                **{f"{PRECISION_PREFIX}{t}": config.get(f"{PRECISION_PREFIX}{t}", "fp32") for t in choices},
                METRIC: metrics.get(FINAL_METRIC),
                "eval_loss": metrics.get("eval_loss"),
                "emulated": metrics.get("emulated"),
                "overrun_steps": metrics.get("overrun_steps"),
                "error": str(result.error).strip().splitlines()[-1] if result.error else None,
            }
        )
    return pd.DataFrame(rows)


@dataclass(frozen=True, kw_only=True)
class Choice:
    """The rule's pick: its row, the all-fp32 row it is judged against, and per type the pick's precision and the
    trial changing that type alone, as ratios to all-fp32 (samples/s, held-out loss)."""

    best: pd.Series
    fp32: pd.Series
    per_type: dict[str, dict[str, Any]]


def choose(trials: pd.DataFrame, choices: Mapping[str, list[str]], loss_tolerance: float) -> Choice:
    """The fastest trial whose held-out loss is within ``loss_tolerance`` of the all-fp32 trial's."""
    columns = [f"{PRECISION_PREFIX}{t}" for t in choices]
    done = trials.dropna(subset=[METRIC, "eval_loss"])
    all_fp32 = done[(done[columns] == "fp32").all(axis=1)]
    if all_fp32.empty:
        raise SweepError("the all-fp32 trial did not finish, so no loss to hold the others to; see trials.csv")
    fp32 = all_fp32.iloc[0]
    within = done[done["eval_loss"] <= fp32["eval_loss"] * (1 + loss_tolerance)]
    best = within.loc[within[METRIC].idxmax()]
    per_type = {}
    for gpu_type, options in choices.items():
        column = f"{PRECISION_PREFIX}{gpu_type}"
        others = [c for c in columns if c != column]
        alone = done[(done[column] == options[-1]) & (done[others] == "fp32").all(axis=1)]
        entry: dict[str, Any] = {"chosen": best[column], "half": options[-1] if len(options) > 1 else None}
        if len(options) > 1 and not alone.empty:
            entry["half_samples_per_s_over_fp32"] = float(alone.iloc[0][METRIC] / fp32[METRIC])
            entry["half_loss_over_fp32"] = float(alone.iloc[0]["eval_loss"] / fp32["eval_loss"])
        per_type[gpu_type] = entry
    return Choice(best=best, fp32=fp32, per_type=per_type)


def write_plot(
    trials: pd.DataFrame,
    choice: Choice,
    choices: Mapping[str, list[str]],
    path: Path,
    *,
    loss_tolerance: float,
    mode: str | None,
) -> None:
    """Samples/s against held-out loss, one point per combination, labelled; the rule's bound and pick marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    done = trials.dropna(subset=[METRIC, "eval_loss"])
    ax.scatter(done["eval_loss"], done[METRIC])
    for _, row in done.iterrows():
        label = ", ".join(f"{t} {row[f'{PRECISION_PREFIX}{t}']}" for t in choices)
        ax.annotate(
            label, (row["eval_loss"], row[METRIC]), fontsize="x-small", xytext=(4, 4), textcoords="offset points"
        )
    ax.axvline(
        choice.fp32["eval_loss"] * (1 + loss_tolerance),
        color="C1",
        linestyle="--",
        label=f"all-fp32 loss + {loss_tolerance:.0%}",
    )
    ax.scatter(
        [choice.best["eval_loss"]], [choice.best[METRIC]], s=160, facecolors="none", edgecolors="C2", label="chosen"
    )
    ax.set_xlabel("held-out loss after the trial")
    ax.set_ylabel("samples/s" + (f" (emulated, {mode})" if mode else ""))
    ax.legend(fontsize="small")
    fig.suptitle("precision per GPU type" + (f" — emulated devices, {mode}" if mode else ""))
    fig.tight_layout()
    write_atomically(path, lambda p: fig.savefig(p, format="png", dpi=100))
    plt.close(fig)


def write_best_config(base: Mapping[str, Any], choice: Choice, choices: Mapping[str, list[str]], path: Path) -> dict:
    """The user's config with ``train.precision`` set per type to the rule's pick."""
    picked = {t: str(choice.best[f"{PRECISION_PREFIX}{t}"]) for t in choices}
    data = {**base, "train": {**base.get("train", {}), "precision": picked}}
    write_atomically(path, lambda p: p.write_text(yaml.safe_dump(data, sort_keys=False)))
    return data


def chosen_config(path: Path) -> tuple[RunConfig, dict[str, Any]]:
    """The grid's ``best.yaml`` as the config a share sweep starts from, and the YAML its ``best.yaml`` is built
    on: emulated devices compute in its precisions (``emulation.autocast``), as the grid's trials did, so the
    shares are measured at the precisions chosen."""
    data = load_yaml(path.read_text(encoding="utf-8"), str(path))
    if "emulation" in data:
        data = {**data, "emulation": {**data["emulation"], "autocast": True}}
    return parse_config(data, str(path)), data


@dataclass(frozen=True, kw_only=True)
class PrecisionSweep:
    """A finished precision sweep: every trial, the rule's choice and where the files are."""

    trials: pd.DataFrame
    choice: Choice
    csv: Path
    plot: Path
    best_config: Path
    seconds: float


def run_precision_sweep(
    cfg: RunConfig, base_yaml: Mapping[str, Any], settings: SweepSettings, console: Console
) -> PrecisionSweep:
    """Run every precision combination of ``cfg`` on the cluster this process is connected to; write the CSV,
    the PNG and the best config."""
    from ray import tune

    from tuning.sweep import predicted_speeds, run_trials, trial_base

    started = time.monotonic()
    choices = precision_choices(cfg)
    base = precision_base(trial_base(cfg, settings), settings.eval_samples)
    _, dilation = predicted_speeds(cfg, settings)
    mode = cfg.emulation.mode if cfg.emulation else None
    combinations = 1
    for options in choices.values():
        combinations *= len(options)
    console.print(
        f"[bold]precision sweep[/bold]{f' (emulated devices, {mode})' if mode else ''}: "
        + ", ".join(f"{t} {' or '.join(o)}" for t, o in choices.items())
        + f"; {combinations} trials of {settings.steps} steps, held-out loss on {settings.eval_samples} samples"
    )
    grid = run_trials(
        base,
        next(iter(cfg.devices)),
        settings,
        dilation,
        param_space={f"{PRECISION_PREFIX}{t}": tune.grid_search(o) for t, o in choices.items() if len(o) > 1},
        search=None,
        console=console,
        name=base.run.name,
    )
    trials = precision_frame(grid, choices)
    choice = choose(trials, choices, settings.loss_tolerance)
    csv, plot, best_path = (settings.output_dir / f for f in RESULT_FILES)
    write_atomically(csv, lambda p: trials.to_csv(p, index=False))
    write_plot(trials, choice, choices, plot, loss_tolerance=settings.loss_tolerance, mode=mode)
    write_best_config(base_yaml, choice, choices, best_path)
    return PrecisionSweep(
        trials=trials, choice=choice, csv=csv, plot=plot, best_config=best_path, seconds=time.monotonic() - started
    )
