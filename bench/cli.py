"""How fast the command line answers: `hetero-ray --help` and `hetero-ray --version`, each a fresh process.

Prints one JSON object:
- help_s: the median wall seconds of ``--runs`` runs of ``hetero-ray --help`` (target < 1 s; torch, Ray
  and pandas are imported only by the commands that use them);
- version_s, subcommand_help_s: the same for ``--version`` and ``hetero-ray plan --help``;
- runs_s: every run's seconds, per command; the command line timed; this machine's load.
The console script next to this Python is timed when it exists, else ``python -m hetero_ray.cli``.

Usage: python bench/cli.py [--runs 7] [--output docs/measurements/cli.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from hetero_ray.output import write_json

MEASUREMENTS = Path(__file__).resolve().parent.parent / "docs" / "measurements"


def entry_point() -> list[str]:
    """The `hetero-ray` console script of this environment, or the module when it is not installed."""
    script = Path(sys.executable).parent / "hetero-ray"
    return [str(script)] if script.exists() else [sys.executable, "-m", "hetero_ray.cli"]


def timed_runs(argv: list[str], runs: int) -> list[float]:
    """Wall seconds of ``runs`` fresh processes of ``argv``, each checked to succeed."""
    seconds = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        seconds.append(time.perf_counter() - started)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="processes per command (the median is reported)")
    parser.add_argument("--output", default=str(MEASUREMENTS / "cli.json"), help="where to write the JSON")
    args = parser.parse_args()
    base = entry_point()
    commands = {"help_s": ["--help"], "version_s": ["--version"], "subcommand_help_s": ["plan", "--help"]}
    runs = {name: timed_runs([*base, *extra], args.runs) for name, extra in commands.items()}
    result = {
        **{name: statistics.median(seconds) for name, seconds in runs.items()},
        "runs_s": runs,
        "command": " ".join([Path(base[0]).name, *base[1:]]),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],
    }
    write_json(args.output, result, force=True)  # a measurement replaces the last one
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
