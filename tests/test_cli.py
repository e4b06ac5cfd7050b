"""The command line itself: --version, `env`, a description and choices for every subcommand, no torch for --help.

Fast: no Ray cluster; `env` reads this machine and must not start or join one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from importlib import metadata

import pytest

from hetero_ray.cli import build_parser, main
from hetero_ray.cluster.catalog import load_catalog
from hetero_ray.cluster.cpu_slices import CgroupError, find_cpu_root
from hetero_ray.cluster.discovery import probe_local_gpus


def test_version_is_the_installed_one(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"hetero-ray {metadata.version('hetero-ray')}"


def test_parser_and_help_import_neither_torch_nor_ray_nor_pandas():
    """What makes `--help` fast (bench/cli.py times it): the heavy modules wait for the commands that use them."""
    code = (
        "import contextlib, io, sys\n"
        "from hetero_ray.cli import main\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['--help'])\n"
        "print(sorted(m for m in ('torch', 'ray', 'pandas', 'deepspeed') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"


def subcommands() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def test_every_subcommand_has_a_description():
    parsers = subcommands()
    assert {"train", "demo", "discover", "profile", "plan", "simulate", "tune", "env"} <= set(parsers)
    for name, parser in parsers.items():
        assert parser.description and len(parser.description.split()) >= 5, name


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_enumerations_are_choices_with_did_you_mean(command, capsys):
    parser = subcommands()[command]
    choices = {a.dest: a.choices for a in parser._actions if a.choices}
    assert choices == {"optimizer": ("adam", "onebit_adam", "zero_one_adam"), "schedule": ("1f1b", "gpipe")}
    with pytest.raises(SystemExit) as exit_:
        main([command, "--optimizer", "onebit"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        f"hetero-ray {command}: error: argument --optimizer: unknown optimizer 'onebit' "
        "(did you mean 'onebit_adam'?); use one of adam, onebit_adam, zero_one_adam"
    )


def test_env_reports_this_machine_without_a_cluster(monkeypatch, capsys):
    import ray

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    assert main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert not ray.is_initialized()
    for name in ("hetero-ray", "ray", "torch", "deepspeed"):
        assert report["versions"][name] == metadata.version(name)
    assert report["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert report["ray"] == {"address": "127.0.0.1:6379", "auth_mode": "token"}
    gpus, problem = probe_local_gpus(load_catalog())
    assert [g["nvml_name"] for g in report["gpus"]] == [g.nvml_name for g in gpus]
    assert report["gpu_problem"] == problem
    try:
        root = str(find_cpu_root())
    except CgroupError as exc:
        assert report["cgroup"] == {"throttled_devices": False, "reason": str(exc)}
    else:
        assert report["cgroup"] == {"throttled_devices": True, "cpu_root": root}
    # The table form names the same things.
    monkeypatch.delenv("RAY_ADDRESS")
    assert main(["env"]) == 0
    table = capsys.readouterr().out
    assert "deepspeed" in table and metadata.version("deepspeed") in table and "RAY_ADDRESS not set" in table
