"""Bad input through the real CLI: one line on stderr, exit code 2, no traceback, no result file.

Every case fails in ``load_config`` or ``prepare``, before any Ray connection. As a
safety net RAY_ADDRESS points at a closed port, so a case that got past ``prepare``
could never reach a running cluster, and each case has a timeout.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from hetero_ray.cluster.catalog import GPUS_ENV_VAR
from hetero_ray.config import load_config
from hetero_ray.train.prepare import prepare

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 60
TINY_GPT = {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16, "corpus_bytes": 20_000}
BASE: dict = {
    "devices": {"A100-80GB": 1, "V100-16GB": 1},
    "emulation": {},
    "workload": {"name": "gpt", "options": TINY_GPT},
    "train": {"global_batch": 4, "steps": 2},
}
HUGE_GPT = {"n_layer": 48, "n_embd": 8192, "n_head": 64, "block_size": 2048}


def config(**changes) -> str:
    """YAML of the base config with each ``section`` or ``section__key`` set to its value."""
    data = copy.deepcopy(BASE)
    for where, value in changes.items():
        section, _, key = where.partition("__")
        if key:
            data[section][key] = value
        else:
            data[section] = value
    return yaml.safe_dump(data)


def bad_gpus_file(tmp_path: Path) -> str:
    (tmp_path / "gpus.yaml").write_text(
        "gpus:\n  Tiny-GPU:\n    architecture: test\n    compute_capability: [8, 0]\n    memory_gib: -1\n"
        "    memory_bandwidth_gbs: 1\n    peak_tflops: {fp32: 1}\n    interconnect: none\n"
        "    interconnect_gbs: 1\n    nvml_names: []\n    source: test\n"
    )
    return config(gpus_file=str(tmp_path / "gpus.yaml"))


# (config text from tmp_path, or None for a missing file; regex the message must match).
# In the regex, {config} stands for the config file's path and {dir} for tmp_path.
CASES = [
    pytest.param(
        lambda d: "devices: {A100-80GB: 1\n", r"{config}: line 2, column 1: malformed YAML", id="malformed-yaml"
    ),
    pytest.param(lambda d: "", r"{config}: expected a mapping", id="empty-file"),
    pytest.param(lambda d: None, r"{config}: cannot read config", id="missing-file"),
    pytest.param(lambda d: config(bogus=1), r"{config}: bogus: unknown key", id="unknown-top-level-key"),
    pytest.param(lambda d: config(train__bogus=1), r"{config}: train\.bogus: unknown key", id="unknown-train-key"),
    pytest.param(lambda d: config(devices={"Z100": 1}), r"devices: unknown GPU type 'Z100'", id="unknown-gpu"),
    pytest.param(
        lambda d: config(train__global_batch=0),
        r"{config}: train\.global_batch: .*greater than 0",
        id="zero-global-batch",
    ),
    pytest.param(
        lambda d: config(train__global_batch=-3),
        r"{config}: train\.global_batch: .*greater than 0",
        id="negative-global-batch",
    ),
    pytest.param(
        lambda d: config(devices={"A100-80GB": 0, "V100-16GB": 1}),
        r"{config}: devices: .*>= 1",
        id="zero-workers",
    ),
    pytest.param(
        lambda d: config(train__global_batch=1),
        r"train\.global_batch: 1 is smaller than the 2 workers",
        id="batch-smaller-than-workers",
    ),
    pytest.param(
        lambda d: config(workload__name="nosuch"),
        r"workload\.name: unknown workload 'nosuch'",
        id="unknown-workload",
    ),
    pytest.param(
        lambda d: config(workload__name="hetero_ray.workloads.gpt:no_such_factory"),
        r"workload\.name: cannot load 'hetero_ray\.workloads\.gpt:no_such_factory'",
        id="missing-function",
    ),
    pytest.param(
        lambda d: config(workload__name="no_such_module_xyz:build"),
        r"workload\.name: cannot load 'no_such_module_xyz:build'",
        id="missing-module",
    ),
    pytest.param(
        lambda d: config(workload__options={**TINY_GPT, "n_layers": 2}),
        r"workload\.options: .*n_layers",
        id="unknown-workload-option",
    ),
    pytest.param(
        lambda d: config(workload__options={**TINY_GPT, "n_head": 3}),
        r"n_head",
        id="n_embd-not-multiple-of-n_head",
    ),
    # 200 bytes of corpus in 16-byte windows: (200 - 1) // 16 = 12 samples, fewer than the global batch of 64.
    pytest.param(
        lambda d: config(workload__options={**TINY_GPT, "corpus_bytes": 200}, train__global_batch=64),
        r"global.batch",
        id="dataset-smaller-than-global-batch",
    ),
    pytest.param(bad_gpus_file, r"{dir}/gpus\.yaml: entry 'Tiny-GPU': memory_gib", id="bad-gpus-file-entry"),
    pytest.param(
        lambda d: config(optimizer={"name": "onebit_adam", "zero_stage": 2}),
        r"{config}: optimizer: onebit_adam is not compatible with ZeRO \(stage 2\); set optimizer\.zero_stage: 0",
        id="onebit-with-zero",
    ),
    pytest.param(
        lambda d: config(optimizer={"name": "lamb"}),
        r"{config}: optimizer\.name: .*'adam', 'onebit_adam' or 'zero_one_adam'",
        id="unknown-optimizer",
    ),
    pytest.param(
        lambda d: config(link={"bandwidth_gbps": 0}),
        r"{config}: link\.bandwidth_gbps: .*greater than 0",
        id="zero-link-bandwidth",
    ),
]


def run_cli(command: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:1"}
    env.pop(GPUS_ENV_VAR, None)
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def assert_one_line_error(proc: subprocess.CompletedProcess, pattern: str, output: Path) -> str:
    """The contract for bad input; returns the message after the prefix."""
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].strip(), proc.stderr
    assert lines[0].startswith("hetero-ray: error: "), lines[0]
    assert re.search(pattern, lines[0]), lines[0]
    assert not output.exists()
    return lines[0].removeprefix("hetero-ray: error: ")


@pytest.mark.parametrize(("make", "pattern"), CASES)
def test_bad_config_gets_one_line_error(tmp_path: Path, make: Callable[[Path], str | None], pattern: str) -> None:
    path, output = tmp_path / "run.yaml", tmp_path / "result.json"
    text = make(tmp_path)
    if text is not None:
        path.write_text(text)
    proc = run_cli([sys.executable, "-m", "hetero_ray.cli", "train", "--config", str(path), "--output", str(output)])
    assert_one_line_error(proc, pattern.format(config=re.escape(str(path)), dir=re.escape(str(tmp_path))), output)


def test_gpt_too_big_for_any_device_names_the_need_and_the_largest_device(tmp_path: Path) -> None:
    path, output = tmp_path / "run.yaml", tmp_path / "result.json"
    path.write_text(config(devices={"V100-16GB": 2}, workload__options=HUGE_GPT))
    proc = run_cli([sys.executable, "-m", "hetero_ray.cli", "train", "--config", str(path), "--output", str(output)])
    message = assert_one_line_error(proc, r"needs [\d.]+ GiB .*largest device \(V100-16GB\) has 16 GiB", output)
    # 38,680,805,376 parameters × 16 bytes of static state alone are 576.4 GiB; activations come on top.
    assert float(re.search(r"needs ([\d.]+) GiB", message)[1]) > 576.4


def test_job_entry_point_reports_bad_input_the_same_way(tmp_path: Path) -> None:
    path, output = tmp_path / "run.yaml", tmp_path / "result.json"
    path.write_text(config(train__bogus=1))
    proc = run_cli([sys.executable, "jobs/train.py", "--config", str(path), "--output", str(output)])
    assert_one_line_error(proc, rf"{re.escape(str(path))}: train\.bogus: unknown key", output)


def test_base_config_is_valid(tmp_path: Path) -> None:
    """Control: each case above fails because of its own change, not the base."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(BASE))
    prepared = prepare(load_config(path))
    assert [r.gpu_type for r in prepared.plan.roles] == ["A100-80GB", "V100-16GB"]
