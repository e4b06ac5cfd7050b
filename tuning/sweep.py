"""The share sweep: Optuna TPE from the prediction, ASHA early stopping, one trial at a time on the live cluster.

``hetero-ray tune --config run.yaml`` (or ``python -m tuning.sweep``) connects to the
cluster (``RAY_ADDRESS``), runs ``--trials`` short trainings on all the workers, and
writes ``trials.csv``, ``throughput.png`` and ``best.yaml`` (a config
``jobs/train.py --config`` accepts) under ``--output-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
from rich.console import Console

from hetero_ray.config import ConfigError, RunConfig, load_config
from hetero_ray.output import OutputError, check_output, write_json
from hetero_ray.strict_yaml import load_yaml
from tuning.results import best_trial, trials_frame, write_best_config, write_csv, write_plot
from tuning.settings import SweepError, SweepSettings, add_arguments, settings_from
from tuning.space import ShareSpace, model_speeds, plan_speeds, share_space
from tuning.trial import METRIC, run_trial, trial_resources

if TYPE_CHECKING:
    from ray.tune import ResultGrid

# What a sweep writes under --output-dir: the trial table, the throughput plot, the best config.
RESULT_FILES = ("trials.csv", "throughput.png", "best.yaml")
# What a sweep started in --output-dir: its Tune experiment's name and what the trials were built from, so
# that --resume runs the same trials (the dilation is not calibrated again, the prediction not made again).
STATE_FILE = Path("tune") / "sweep.json"


class SweepInterrupted(Exception):
    """The sweep stopped on SIGINT or SIGTERM before its last trial; Tune saved its state for ``--resume``."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum


@dataclass(frozen=True, kw_only=True)
class Sweep:
    """A finished sweep: every trial, the space it searched, the best complete trial and where the files are."""

    trials: pd.DataFrame
    space: ShareSpace
    best: pd.Series
    dilation: float | None
    csv: Path
    plot: Path
    best_config: Path
    seconds: float


def trial_base(cfg: RunConfig, settings: SweepSettings, name: str | None = None) -> RunConfig:
    """``cfg`` cut to a trial: ``settings.steps`` steps reported in ``settings.windows`` windows, one checkpoint
    at the end, no restarts (a failed trial is a result), runs stored under the output directory, named ``name``
    (default: ``tune-`` and the time; the sweep's Tune experiment takes the same name)."""
    train = cfg.train.model_copy(
        update={
            "steps": settings.steps,
            "report_every": settings.steps // settings.windows,
            "checkpoint_every": settings.steps,
            "duration_s": None,
            "max_failures": 0,
            "min_workers": None,
        }
    )
    run = cfg.run.model_copy(
        update={
            "name": name or f"tune-{time.strftime('%Y%m%d-%H%M%S')}",
            "storage_path": str(settings.output_dir / "runs"),
        }
    )
    return cfg.model_copy(update={"train": train, "run": run})


def predicted_speeds(cfg: RunConfig, settings: SweepSettings) -> tuple[dict[str, float], float | None]:
    """Samples/s per GPU type the sweep starts from (the planner's, or the performance model's with a history),
    and a padded emulation's dilation, calibrated once so that every trial runs under the same one (``None``
    for throttled devices and real GPUs, which run in real time)."""
    from hetero_ray.train.prepare import prepare

    # An explicit equal split keeps the plan data-parallel; its per-type speeds do not depend on the split.
    prepared = prepare(cfg.model_copy(update={"train": cfg.train.model_copy(update={"split": "equal"})}))
    dilation = prepared.dilation if cfg.emulation is not None and not cfg.emulation.throttled else None
    if settings.history is None:
        return plan_speeds(prepared.plan), dilation
    from hetero_ray.perf import history
    from hetero_ray.perf.model import fit_perf_model

    model = fit_perf_model(history.load(settings.history), cfg.workload.name, emulated=cfg.emulation is not None)
    return model_speeds(model, prepared.plan), dilation


def run_trials(
    base: RunConfig,
    reference: str,
    settings: SweepSettings,
    dilation: float | None,
    *,
    param_space: Mapping[str, Any],
    search: ShareSpace | None,
    console: Console,
    name: str,
    resume: bool = False,
) -> ResultGrid:
    """Run trials of ``base`` one at a time; ``search``: Optuna TPE over that space from the prediction with ASHA,
    else every point of ``param_space`` (a grid) to the end. ``reference``: the type a split's weights are
    relative to. ``resume``: continue the experiment ``name`` where it stopped (``Tuner.restore``: finished trials
    kept, the running one started again, the searcher's state restored). Raises ``SweepInterrupted`` when the
    sweep stopped on a signal before its last trial."""
    import optuna
    from ray import tune

    from tuning.progress import RichProgress

    trainable = tune.with_resources(
        tune.with_parameters(run_trial, base=base.model_dump(), reference=reference, dilation=dilation),
        trial_resources(base.emulation is not None),
    )
    if search is not None:
        total = settings.trials
    else:
        total = 1
        for v in param_space.values():
            total *= len(v["grid_search"]) if isinstance(v, dict) else 1
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    path = experiment_path(settings, name)
    if resume:
        tuner = tune.Tuner.restore(str(path), trainable, resume_unfinished=True, param_space=dict(param_space))
    else:
        tuner = tune.Tuner(
            trainable,
            param_space=dict(param_space),
            tune_config=_tune_config(search, settings) if search else tune.TuneConfig(max_concurrent_trials=1),
            run_config=tune.RunConfig(
                name=name,
                storage_path=str(path.parent),
                verbose=0,
                callbacks=[RichProgress(console, total, reference)],
            ),
        )
    # Tune ends the sweep cleanly on SIGINT (its state saved for a restore); SIGTERM, as `kill` and schedulers
    # send it, is taken the same way.
    received = [signal.SIGINT]

    def forward(signum, frame):
        received[0] = signum
        os.kill(os.getpid(), signal.SIGINT)

    held = signal.signal(signal.SIGTERM, forward)
    try:
        grid = tuner.fit()
    finally:
        signal.signal(signal.SIGTERM, held)
    done = grid.num_terminated + grid.num_errors
    if done < total:
        raise SweepInterrupted(
            f"sweep interrupted after {done} of {total} trials; continue it: the same command with --resume",
            received[0],
        )
    return grid


def _tune_config(space: ShareSpace, settings: SweepSettings):
    """The prediction, then the split its trial's measured speeds give, then Optuna TPE (``tuning/search.py``),
    with ASHA stopping the trials behind after their grace windows."""
    import optuna
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    from tuning.search import MeasuredBalanceSearch

    return tune.TuneConfig(
        metric=METRIC,
        mode="max",
        num_samples=settings.trials,
        max_concurrent_trials=1,
        search_alg=MeasuredBalanceSearch(
            space,
            # The enqueued prediction counts as one of TPE's start-up trials, the measured point as another.
            sampler=optuna.samplers.TPESampler(n_startup_trials=1 + settings.random_trials, seed=settings.seed),
        ),
        scheduler=ASHAScheduler(
            time_attr="training_iteration",
            max_t=settings.windows,
            grace_period=settings.grace_windows,
            reduction_factor=2,
        ),
    )


def experiment_path(settings: SweepSettings, name: str) -> Path:
    """Where Tune keeps the experiment ``name`` of a sweep (its state, for ``Tuner.restore``)."""
    return (settings.output_dir / "tune" / name).resolve()


@dataclass(frozen=True)
class Resumable:
    """An interrupted sweep, as its state file recorded it: what its trials are built from."""

    name: str
    speeds: dict[str, float]
    dilation: float | None


def run_sweep(
    cfg: RunConfig,
    base_yaml: Mapping[str, Any],
    settings: SweepSettings,
    console: Console,
    *,
    resume: Resumable | None = None,
) -> Sweep:
    """Sweep the shares of ``cfg`` on the cluster this process is connected to; write the CSV, PNG and best config.
    ``resume``: continue that interrupted sweep (``resumable``) instead of starting one."""
    started = time.monotonic()
    base = trial_base(cfg, settings, name=resume.name if resume else None)
    speeds, dilation = (resume.speeds, resume.dilation) if resume else predicted_speeds(cfg, settings)
    space = share_space(cfg, speeds, spread=settings.spread, micro_batch_caps=settings.micro_batch_caps)
    emulated = cfg.emulation is not None
    console.print(
        f"[bold]share sweep[/bold]{' (emulated devices)' if emulated else ''}"
        f"{', resumed' if resume else ''}: predicted weights "
        + ", ".join(f"{t} {w:.3g}" for t, w in space.predicted.items())
        + f"; searching ×/÷{settings.spread:g} around them, {settings.trials} trials of {settings.steps} steps"
        + (f", dilation {dilation:.3g}" if dilation else "")
    )
    if not resume:
        write_json(settings.output_dir / STATE_FILE, _state(cfg, settings, base.run.name, speeds, dilation), force=True)
    grid = run_trials(
        base,
        space.reference,
        settings,
        dilation,
        param_space=space.tune_space(),
        search=space,
        console=console,
        name=base.run.name,
        resume=resume is not None,
    )
    trials = trials_frame(grid, space)
    csv, plot, best_path = (settings.output_dir / f for f in RESULT_FILES)
    write_csv(trials, csv)
    write_plot(trials, space, plot, emulated=emulated)
    best = best_trial(grid, trials)
    write_best_config(base_yaml, best, space, best_path)
    return Sweep(
        trials=trials,
        space=space,
        best=best,
        dilation=dilation,
        csv=csv,
        plot=plot,
        best_config=best_path,
        seconds=time.monotonic() - started,
    )


def _search_settings(settings: SweepSettings) -> dict[str, Any]:
    """The settings that shape a sweep's trials, as its state file holds them (tuples as lists, as they read back)."""
    return json.loads(json.dumps({k: v for k, v in asdict(settings).items() if k != "output_dir"}))


def _state(cfg: RunConfig, settings: SweepSettings, name: str, speeds, dilation) -> dict[str, Any]:
    return {
        "name": name,
        "config": cfg.model_dump(mode="json"),
        "settings": _search_settings(settings),
        "speeds": speeds,
        "dilation": dilation,
    }


def resumable(cfg: RunConfig, settings: SweepSettings) -> Resumable:
    """The interrupted sweep in ``settings.output_dir``, checked before any cluster is reached: ``SweepError``
    (one line) if none was started there, it left no Tune state, or it was started from another config or
    other settings."""
    from ray import tune

    path = settings.output_dir / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        raise SweepError(
            f"--resume: no sweep was started in {settings.output_dir} ({path} is missing); start one without --resume"
        ) from None
    if not tune.Tuner.can_restore(str(experiment_path(settings, state["name"]))):
        raise SweepError(f"--resume: the sweep in {settings.output_dir} left no Tune state to restore")
    if state["config"] != cfg.model_dump(mode="json"):
        raise SweepError(
            f"--resume: --config differs from the config the sweep in {settings.output_dir} started with; "
            "resume with that config, or start a new sweep without --resume"
        )
    now = _search_settings(settings)
    changed = sorted(k for k in now if now[k] != state["settings"].get(k))
    if changed:
        was = ", ".join(f"--{k.replace('_', '-')} {state['settings'].get(k)}" for k in changed)
        raise SweepError(f"--resume: the sweep in {settings.output_dir} was started with {was}; resume with the same")
    return Resumable(state["name"], state["speeds"], state["dilation"])


def command(args: argparse.Namespace, console: Console) -> int:
    """Run the sweep the arguments describe; bad input is one line on stderr and exit code 2."""
    from hetero_ray.perf.history import HistoryError
    from hetero_ray.perf.model import NoHistory
    from hetero_ray.plan.plan import PlanError
    from tuning import precision

    try:
        settings = settings_from(args)
        by_precision, by_shares = "precision" in settings.search, "shares" in settings.search
        # Both: the precision grid's files in a folder of their own, the shares' where a share sweep puts them.
        grid = replace(settings, output_dir=settings.output_dir / "precision") if by_shares else settings
        outputs = [grid.output_dir / n for n in precision.RESULT_FILES] if by_precision else []
        outputs += [settings.output_dir / n for n in RESULT_FILES] if by_shares else []
        for path in outputs:
            check_output(path, force=args.force, option="--output-dir")
        cfg = load_config(args.config)
        base_yaml = load_yaml(Path(args.config).read_text(), args.config)  # load_config read it already
        # Checked before any cluster is reached.
        if by_precision:
            precision.precision_choices(cfg)
            if args.resume:
                raise SweepError("--resume: a precision sweep is a short grid; run it again without --resume")
        if by_shares:
            share_space(cfg, dict.fromkeys(cfg.devices, 1.0), spread=settings.spread)
        resume = resumable(cfg, settings) if args.resume else None
        import ray

        ray.init(address=args.address or os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=False)
        try:
            if by_precision:
                chosen = precision.run_precision_sweep(cfg, base_yaml, grid, console)
                _report_precision(chosen, console)
                if not by_shares:
                    return 0
                cfg, base_yaml = precision.chosen_config(chosen.best_config)
            sweep = run_sweep(cfg, base_yaml, settings, console, resume=resume)
        finally:
            ray.shutdown()
    except (SweepError, ConfigError, PlanError, HistoryError, NoHistory, OutputError) as exc:
        print(f"hetero-ray: error: {exc}", file=sys.stderr)
        return 2
    except SweepInterrupted as exc:
        print(f"hetero-ray: {exc}", file=sys.stderr)
        return 128 + exc.signum
    best = ", ".join(f"{t} {sweep.best[f'share:{t}']:.0f}" for t in sweep.space.predicted if f"share:{t}" in sweep.best)
    console.print(
        f"best: {sweep.best[METRIC]:.1f} samples/s{' (emulated)' if sweep.best['emulated'] else ''} with shares "
        f"{best} per worker; {len(sweep.trials)} trials in {sweep.seconds:.0f} s"
    )
    console.print(f"wrote {sweep.csv}, {sweep.plot}, {sweep.best_config} (run it: jobs/train.py --config)")
    return 0


def _report_precision(sweep, console: Console) -> int:
    """The precision sweep's choice per type, as a table."""
    from rich.table import Table

    table = Table(title="precision per GPU type (the fastest within the loss tolerance of all-fp32)")
    for column in ("GPU type", "chosen", "half", "half samples/s ÷ fp32", "half loss ÷ fp32"):
        table.add_column(column)
    for gpu_type, entry in sweep.choice.per_type.items():
        ratios = [entry.get(k) for k in ("half_samples_per_s_over_fp32", "half_loss_over_fp32")]
        table.add_row(gpu_type, entry["chosen"], entry["half"] or "-", *(f"{r:.3f}" if r else "-" for r in ratios))
    console.print(table)
    console.print(
        f"wrote {sweep.csv}, {sweep.plot}, {sweep.best_config} ({len(sweep.trials)} trials, {sweep.seconds:.0f} s)"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m tuning.sweep``: the same as ``hetero-ray tune``."""
    parser = argparse.ArgumentParser(prog="python -m tuning.sweep", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return command(parser.parse_args(argv), Console())


if __name__ == "__main__":
    sys.exit(main())
