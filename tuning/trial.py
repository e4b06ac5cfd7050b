"""One trial of a share sweep: a short run of the project's own training on all the workers, reported per window.

Ray 2.60's Train v2 with Tune: the Tune trial is a function trainable that runs the
driver (``run_training`` → ``TorchTrainer.fit``); the Train controller then reserves its
own placement group, one bundle per worker with that worker's GPU-type label. Tune's
trial placement group therefore holds only the driver (one CPU on the head of an
emulated cluster, whose GPU nodes have exactly their workers' CPUs), and the sweep runs
one trial at a time (``max_concurrent_trials=1``) so each trial has every device.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

from hetero_ray.config import RunConfig
from hetero_ray.monitor.metrics import compute_rate
from tuning.space import MICRO_BATCH_KEY, weights_of

METRIC = "samples_per_s"
# Reported by a trial's last window only: the best trial is Tune's best on it (``get_best_result``), so a trial
# that ASHA stopped early, whose windows are partial, is never chosen.
FINAL_METRIC = "final_samples_per_s"
SPEED_PREFIX = "speed:"
SHARE_PREFIX = "share:"
PRECISION_PREFIX = "precision:"
# The emulated cluster labels its head so; a trial's driver must not take a GPU node's CPU.
HEAD_LABEL = {"hetero-ray/role": "head"}


def trial_config(base: RunConfig, params: Mapping[str, Any], reference: str, dilation: float | None) -> RunConfig:
    """The run a trial makes: ``base`` with the trial's split (and micro-batch cap) or its precision per type, the
    sweep's fixed dilation, and a fresh run name (a trial never resumes another's checkpoint)."""
    precisions = {k.removeprefix(PRECISION_PREFIX): v for k, v in params.items() if k.startswith(PRECISION_PREFIX)}
    train: dict[str, Any] = {"precision": precisions} if precisions else {"split": weights_of(params, reference)}
    if MICRO_BATCH_KEY in params:
        train["max_micro_batch"] = int(params[MICRO_BATCH_KEY])
    update: dict[str, Any] = {
        "train": base.train.model_copy(update=train),
        "run": base.run.model_copy(update={"name": f"{base.run.name}-{time.time_ns()}"}),
    }
    if base.emulation is not None and not base.emulation.throttled:
        # Throttled devices run in real time: there is no dilation to fix.
        update["emulation"] = base.emulation.model_copy(update={"dilation": dilation})
    return RunConfig.model_validate({**base.model_dump(), **{k: v.model_dump() for k, v in update.items()}})


def trial_resources(emulated: bool):
    """Tune's placement group for a trial: the driver's one CPU (the Train run reserves its workers itself)."""
    from ray.tune import PlacementGroupFactory

    if emulated:
        return PlacementGroupFactory([{"CPU": 1}], bundle_label_selector=[HEAD_LABEL])
    return PlacementGroupFactory([{"CPU": 1}])


def window_result(metrics: Mapping[str, Any], window: int, *, final: bool) -> dict[str, Any]:
    """What a trial reports to Tune for one metrics window of the run (rank 0's report); ``final``: its last."""
    shares: dict[str, int] = {}
    speeds: dict[str, list[float]] = {}
    for d in metrics["devices"]:
        shares.setdefault(d["gpu_type"], d["local_batch"])
        if (rate := compute_rate(d)) is not None:
            speeds.setdefault(d["gpu_type"], []).append(rate)
    return {
        METRIC: metrics["samples_per_s"],
        "step_s": metrics["step_s"],
        "step": metrics["step"],
        "window": window,
        "emulated": metrics["emulated"],
        "overrun_steps": sum(d["overrun_steps"] for d in metrics["devices"]),
        **{f"{SHARE_PREFIX}{t}": b for t, b in shares.items()},
        # Each type's samples/s of its own compute (its devices' mean): what a split by speed would use.
        **{f"{SPEED_PREFIX}{t}": sum(v) / len(v) for t, v in speeds.items()},
        **{f"micro_batch:{d['gpu_type']}": d["micro_batch"] for d in metrics["devices"]},
        **({FINAL_METRIC: metrics["samples_per_s"]} if final else {}),
        # The held-out loss, when the run evaluates (a precision sweep's trials do, after their last step).
        **({"eval_loss": metrics["eval"]["loss"]} if metrics.get("eval") else {}),
    }


def run_trial(params: dict[str, Any], *, base: dict[str, Any], reference: str, dilation: float | None) -> None:
    """Tune's function trainable: train ``base`` with the trial's shares; ``tune.report`` each window's samples/s.

    ``run_training`` runs in a thread and hands rank 0's metrics over its progress
    queue, so ASHA sees every window and can stop the trial (ending this actor ends
    the Train controller and workers it owns).
    """
    from ray import tune
    from ray.util.queue import Empty

    from hetero_ray.local_queue import local_queue
    from hetero_ray.train.trainer import run_training

    cfg = trial_config(RunConfig.model_validate(base), params, reference, dilation)
    queue = local_queue()
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["result"] = run_training(cfg, progress=queue)
        except BaseException as exc:  # re-raised in the trial's thread
            outcome["error"] = exc

    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    window = 0
    while thread.is_alive() or not queue.empty():
        try:
            metrics = queue.get(timeout=0.5)
        except Empty:
            continue
        window += 1
        tune.report(window_result(metrics, window, final=metrics["step"] + 1 >= cfg.train.steps))
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
