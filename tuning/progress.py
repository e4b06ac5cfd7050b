"""Rich progress for a sweep: a Tune callback with one bar over the trials and one line per finished trial.

Imports Ray Tune, so it is imported only once the process is connected to a cluster.
"""

from __future__ import annotations

from ray import tune
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tuning.space import weights_of
from tuning.trial import METRIC, PRECISION_PREFIX


class RichProgress(tune.Callback):
    """Live bar of finished trials with the running trial's last window; a line per trial as it ends."""

    def __init__(self, console: Console, total: int, reference: str) -> None:
        self.console, self.reference, self.total = console, reference, total
        self.bar = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
        )
        self.task = self.bar.add_task("starting the first trial…", total=total)

    def __getstate__(self) -> dict:
        # Tune pickles its run config into the experiment state; a live display does not pickle.
        return {"reference": self.reference, "total": self.total}

    def __setstate__(self, state: dict) -> None:
        # Tuner.restore unpickles it in the process that resumes the sweep: that process's terminal.
        self.__init__(Console(), state["total"], state["reference"])

    def setup(self, **info) -> None:
        self.bar.start()

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        emulated = " (emulated)" if result.get("emulated") else ""
        self.bar.update(
            self.task,
            description=f"trial {trial.trial_id} window {result['window']}: {result[METRIC]:.1f} samples/s{emulated}",
        )

    def _finished(self, trial, how: str) -> None:
        last = trial.last_result or {}
        precisions = {
            k.removeprefix(PRECISION_PREFIX): v for k, v in trial.config.items() if k.startswith(PRECISION_PREFIX)
        }
        if precisions:
            what = "precision " + ", ".join(f"{t} {p}" for t, p in precisions.items())
        else:
            what = "weights " + ", ".join(f"{t} {w:.3g}" for t, w in weights_of(trial.config, self.reference).items())
        rate = f"{last[METRIC]:.1f} samples/s" if METRIC in last else "no window measured"
        loss = f", held-out loss {last['eval_loss']:.4f}" if "eval_loss" in last else ""
        self.console.print(f"trial {trial.trial_id}: {what} → {rate}{loss} ({how})")
        self.bar.advance(self.task)

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        self._finished(trial, f"{(trial.last_result or {}).get('window', 0)} windows")

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        self._finished(trial, "failed")

    def on_experiment_end(self, trials, **info) -> None:
        self.bar.stop()
