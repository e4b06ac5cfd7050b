"""A sweep's settings and the command line that sets them (``hetero-ray tune``, ``python -m tuning.sweep``).

Apart from the sweep itself so that the CLI can build its parser, and ``--help`` answer,
without importing pandas, Ray or torch.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

SEARCHES = ("shares", "precision", "precision+shares")


class SweepError(ValueError):
    """Bad sweep input: one line saying what, where and what would be valid."""


@dataclass(frozen=True, kw_only=True)
class SweepSettings:
    """How much to search: trials, each trial's length and metric windows, the space's width, early stopping."""

    trials: int = 8
    steps: int = 12
    windows: int = 3
    grace_windows: int = 1
    spread: float = 3.0
    random_trials: int = 2
    seed: int = 0
    micro_batch_caps: tuple[int, ...] = ()
    history: str | None = None
    output_dir: Path = field(default_factory=lambda: Path("tune-out"))
    # "shares" searches the split; "precision" runs fp32 against each type's half precision (tuning/precision.py);
    # "precision+shares" the precision grid, then the shares at the precision it chose.
    search: str = "shares"
    loss_tolerance: float = 0.01
    eval_samples: int = 256

    def __post_init__(self) -> None:
        if self.trials < 1:
            raise SweepError(f"--trials: {self.trials}; use at least 1 (the first evaluates the prediction)")
        if self.windows < 1 or self.steps < self.windows or self.steps % self.windows:
            raise SweepError(
                f"--steps {self.steps} / --windows {self.windows}: steps must be a positive multiple of windows "
                "(each window reports samples/s to Tune)"
            )
        if not 1 <= self.grace_windows <= self.windows:
            raise SweepError(f"--grace-windows: {self.grace_windows}; use 1..{self.windows}")
        if self.random_trials < 0:
            raise SweepError(f"--random-trials: {self.random_trials}; use 0 or more")
        if self.search not in SEARCHES:
            raise SweepError(f"--search: {self.search!r}; use one of {', '.join(SEARCHES)}")
        if not 0 <= self.loss_tolerance < 1:
            raise SweepError(f"--loss-tolerance: {self.loss_tolerance:g}; use a fraction in [0, 1), e.g. 0.01")
        if self.eval_samples < 1:
            raise SweepError(f"--eval-samples: {self.eval_samples}; use at least 1")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The sweep's command-line options (``hetero-ray tune`` and ``python -m tuning.sweep``)."""
    d = SweepSettings()
    p.add_argument("--config", required=True, help="run config YAML (its devices, workload and global batch)")
    p.add_argument("--trials", type=int, default=d.trials, help=f"trials, the prediction first (default {d.trials})")
    p.add_argument("--steps", type=int, default=d.steps, help=f"training steps per trial (default {d.steps})")
    p.add_argument("--windows", type=int, default=d.windows, help=f"samples/s reports per trial (default {d.windows})")
    p.add_argument("--grace-windows", type=int, default=d.grace_windows, help="windows before ASHA may stop a trial")
    p.add_argument("--spread", type=float, default=d.spread, help="search weights within ×/÷ this of the prediction")
    p.add_argument("--random-trials", type=int, default=d.random_trials, help="random trials before TPE's model")
    p.add_argument(
        "--search",
        choices=SEARCHES,
        default=d.search,
        help="shares: the split per type (default); precision: fp32 against each type's half precision, side by "
        "side; precision+shares: that grid, then the shares at the precision it chose",
    )
    p.add_argument(
        "--loss-tolerance",
        type=float,
        default=d.loss_tolerance,
        help="precision: the fastest within this fraction of all-fp32's held-out loss wins (default 0.01)",
    )
    p.add_argument(
        "--eval-samples", type=int, default=d.eval_samples, help="precision: held-out samples each trial is scored on"
    )
    p.add_argument("--micro-batch-caps", help="also search a micro-batch cap among these, e.g. 8,16,32")
    p.add_argument("--history", help="profile history (parquet): start from the performance model, not the catalog")
    p.add_argument("--seed", type=int, default=d.seed, help="the sampler's seed")
    p.add_argument("--output-dir", default=str(d.output_dir), help="where trials.csv, throughput.png, best.yaml go")
    p.add_argument("--force", action="store_true", help="replace the files of an earlier sweep in --output-dir")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the sweep interrupted in --output-dir (Tune's Tuner.restore: finished trials kept)",
    )
    p.add_argument("--address", help="Ray address (default: RAY_ADDRESS or a local cluster)")


def settings_from(args: argparse.Namespace) -> SweepSettings:
    """Validated settings from parsed arguments; ``SweepError`` (one line) on bad values."""
    caps: tuple[int, ...] = ()
    if args.micro_batch_caps:
        parts = args.micro_batch_caps.split(",")
        if not all(s.strip().isdigit() and int(s) > 0 for s in parts):
            raise SweepError(f"--micro-batch-caps: comma-separated positive integers (got {args.micro_batch_caps})")
        caps = tuple(int(s) for s in parts)
    if args.history and not Path(args.history).is_file():
        raise SweepError(f"--history: {args.history} is not a file; profile first (hetero-ray profile --history …)")
    return SweepSettings(
        trials=args.trials,
        steps=args.steps,
        windows=args.windows,
        grace_windows=args.grace_windows,
        spread=args.spread,
        random_trials=args.random_trials,
        seed=args.seed,
        micro_batch_caps=caps,
        history=args.history,
        output_dir=Path(args.output_dir),
        search=args.search,
        loss_tolerance=args.loss_tolerance,
        eval_samples=args.eval_samples,
    )
