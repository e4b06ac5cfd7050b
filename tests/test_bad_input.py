"""Bad input across every entry point: one clear line, exit code 2 from a CLI, nothing written.

Each case runs through its real entry point: ``hetero_ray.cli.main`` in this process
(``hetero-ray train / demo / discover``), ``python jobs/train.py`` and
``python -m hetero_ray.cli`` as subprocesses for a few, ``load_plan`` for Plan JSON
files, and Ray's own cluster-launcher validator for ``cluster.yaml`` (as
``tests/test_cluster_yaml.py`` and ``ray up`` run it). Every case must fail before any
Ray connection: in this process ``ray.init`` raises if reached; subprocesses get a
closed port in RAY_ADDRESS and a timeout.

``test_bad_inputs_doc_is_current`` rebuilds ``docs/bad-inputs.md`` from the cases
and fails when the committed file differs; ``HETERO_RAY_UPDATE_DOCS=1`` rewrites it.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import re
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from hetero_ray.cli import main
from hetero_ray.cluster.catalog import GPUS_ENV_VAR, load_catalog
from hetero_ray.config import load_config
from hetero_ray.plan.plan import PlanError
from hetero_ray.plan.plan_file import load_plan
from hetero_ray.train.prepare import prepare

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "bad-inputs.md"
TIMEOUT_S = 120
TINY_GPT = {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16, "corpus_bytes": 20_000}
BASE: dict = {
    "devices": {"A100-80GB": 1, "V100-16GB": 1},
    "emulation": {},
    "workload": {"name": "gpt", "options": TINY_GPT},
    "train": {"global_batch": 4, "steps": 2},
}
HUGE_GPT = {"n_layer": 48, "n_embd": 8192, "n_head": 64, "block_size": 2048}
CLOSED_PORT = "127.0.0.1:1"
NO_EXIT = "—"


@dataclass(frozen=True)
class Outcome:
    """What an entry point did with a bad input."""

    stderr: str
    exit_code: int | str
    """The process's exit code, or ``NO_EXIT`` for a library call (which raised)."""
    traceback: bool


@dataclass(frozen=True)
class Case:
    id: str
    entry: str
    shown: str
    """The bad input, as the table shows it."""
    run: Callable[[Path], Outcome]
    pattern: str
    """Regex the error line must match; ``{dir}`` stands for the case's directory."""


# --- inputs -----------------------------------------------------------------------------


def config(d: Path, **changes) -> str:
    """YAML of the base config with each ``section`` or ``section__key`` set; run storage inside ``d``."""
    data = copy.deepcopy(BASE) | {"run": {"name": "bad", "storage_path": str(d / "runs")}}
    for where, value in changes.items():
        section, _, key = where.partition("__")
        if key:
            data[section][key] = value
        else:
            data[section] = value
    return yaml.safe_dump(data)


BAD_GPUS_YAML = (
    "gpus:\n  Tiny-GPU:\n    architecture: test\n    compute_capability: [8, 0]\n    memory_gib: -1\n"
    "    memory_bandwidth_gbs: 1\n    peak_tflops: {fp32: 1}\n    interconnect: none\n"
    "    interconnect_gbs: 1\n    nvml_names: []\n    source: test\n"
)


def bad_gpus_file(d: Path) -> Path:
    (d / "gpus.yaml").write_text(BAD_GPUS_YAML)
    return d / "gpus.yaml"


def twice_gpus_file(d: Path) -> Path:
    """A gpus file whose one entry appears twice (the second valid: only the repetition is wrong)."""
    entry = BAD_GPUS_YAML.removeprefix("gpus:\n").replace("memory_gib: -1", "memory_gib: 8")
    (d / "gpus.yaml").write_text(f"gpus:\n{entry}{entry}")
    return d / "gpus.yaml"


def plan_dict() -> dict:
    """A sound Plan for 1 × A100-80GB + 2 × V100-16GB, global batch 8 (built by the planner)."""
    cfg = {**BASE, "devices": {"A100-80GB": 1, "V100-16GB": 2}, "train": {"global_batch": 8, "steps": 2}}
    from hetero_ray.config import parse_config

    return prepare(parse_config(cfg)).plan.to_dict()


def pipeline_plan_dict() -> dict:
    """Two 2-stage pipelines over 4 layers (A100 holds 3 layers, V100 1), each half the batch."""
    role = {
        "gpu_type": "A100-80GB",
        "local_batch": 4,
        "micro_batch": 2,
        "sample_offset": 0,
        "precision": "bf16",
        "predicted_compute_s": 0.1,
        "predicted_memory_bytes": 1e9,
        "memory_cap_bytes": 80 * 2**30,
    }
    roles = []
    for p in range(2):
        roles.append({**role, "pipeline": p, "stage": 0, "layers": [0, 3], "sample_offset": 4 * p})
        roles.append({**role, "gpu_type": "V100-16GB", "precision": "fp16", "pipeline": p, "stage": 1,
                      "layers": [3, 4], "sample_offset": 4 * p, "memory_cap_bytes": 16 * 2**30})  # fmt: skip
    return {"global_batch": 8, "split": "proportional", "emulated": True, "roles": roles, "predicted_compute_s": 0.3}


def tp_plan_dict(members: int, weights: list | None = None) -> dict:
    """One 2-stage pipeline whose stages are tensor-parallel groups of two A100s (``members`` of stage 0's
    listed)."""
    role = {**pipeline_plan_dict()["roles"][0], "local_batch": 8, "tp_weights": weights or [1, 1]}
    roles = [{**role, "tp_rank": k} for k in range(members)]
    roles += [{**role, "stage": 1, "layers": [3, 4], "tp_rank": k} for k in range(2)]
    return {"global_batch": 8, "split": "proportional", "emulated": True, "roles": roles, "predicted_compute_s": 0.3}


def split_first(data: dict) -> dict:
    """``data`` with its first role a tensor-parallel pair, the other roles as they are."""
    split = {**data["roles"][0], "tp_weights": [1, 1]}
    data["roles"] = [*({**split, "tp_rank": k} for k in range(2)), *data["roles"][1:]]
    return data


def split_differs_plan() -> dict:
    """``pipeline_plan_dict`` with pipeline 0's stage 0 a tensor-parallel pair, pipeline 1's whole."""
    return split_first(pipeline_plan_dict())


def two_stage_plan() -> dict:
    """BASE's devices as one pipeline: the A100 holds TINY_GPT's embedding and block, the V100 its head."""
    roles = [
        {**role, "stage": stage, "layers": layers}
        for role, stage, layers in zip(two_device_plan()["roles"], (0, 1), ([0, 2], [2, 3]))
    ]
    for role in roles:
        role.update(local_batch=4, micro_batch=2, sample_offset=0, pipeline=0)
    return {**two_device_plan(), "roles": roles}


def tensor_parallel_pair_plan() -> dict:
    """Two A100s as one tensor-parallel stage holding the whole model, at ZeRO-1."""
    role = {**two_device_plan()["roles"][0], "local_batch": 4, "micro_batch": 4, "sample_offset": 0}
    roles = [{**role, "pipeline": 0, "stage": 0, "tp_weights": [1, 1], "tp_rank": k} for k in range(2)]
    return {**two_device_plan(), "roles": roles, "excluded": [], "zero_stage": 1}


def edit(data: dict, path: str, value) -> dict:
    """``data`` with the value at a dotted ``path`` (list indices as numbers) set; ``...`` deletes it."""
    data = copy.deepcopy(data)
    *parents, last = [int(k) if k.isdigit() else k for k in path.split(".")]
    node = data
    for key in parents:
        node = node[key]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return data


# --- runners ----------------------------------------------------------------------------


class ReachedRay(Exception):
    """A bad input got as far as connecting to Ray: it was not rejected before launch."""


@contextlib.contextmanager
def isolated_env(**env: str):
    """One in-process case: no user GPU file unless given, and ``ray.init`` fails at once if reached."""
    saved = dict(os.environ)
    os.environ.pop(GPUS_ENV_VAR, None)
    os.environ.update({"RAY_ADDRESS": CLOSED_PORT, **env})
    try:
        with mock.patch("ray.init", side_effect=ReachedRay("ray.init was reached")):
            yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def cli(argv: Callable[[Path], list[str]], **env: Callable[[Path], str]) -> Callable[[Path], Outcome]:
    """``hetero_ray.cli.main(argv)`` in this process; argparse's exits are caught as exit codes."""

    def run(d: Path) -> Outcome:
        err, out = io.StringIO(), io.StringIO()
        tb = False
        with isolated_env(**{k: f(d) for k, f in env.items()}):
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
                try:
                    code = main(argv(d))
                except SystemExit as exc:
                    code = exc.code
                except Exception:  # an escaped exception is what this test exists to catch
                    traceback.print_exc(file=err)
                    code, tb = 1, True
        return Outcome(stderr=err.getvalue() + out.getvalue(), exit_code=code, traceback=tb)

    return run


def process(argv: Callable[[Path], list[str]]) -> Callable[[Path], Outcome]:
    """A real process, as ``ray job submit`` would start it."""

    def run(d: Path) -> Outcome:
        env = {**os.environ, "RAY_ADDRESS": CLOSED_PORT}
        env.pop(GPUS_ENV_VAR, None)
        proc = subprocess.run(argv(d), cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        text = proc.stderr + proc.stdout
        return Outcome(stderr=proc.stderr, exit_code=proc.returncode, traceback="Traceback" in text)

    return run


def plan_file(make: Callable[[], dict | str], **kwargs) -> Callable[[Path], Outcome]:
    """``load_plan`` on a file holding ``make()`` (JSON-encoded unless already text)."""

    def run(d: Path) -> Outcome:
        path = d / "plan.json"
        data = make()
        if data is not None:
            path.write_text(data if isinstance(data, str) else json.dumps(data))
        try:
            load_plan(path, **{k: v() for k, v in kwargs.items()})
        except PlanError as exc:
            return Outcome(stderr=f"{exc}\n", exit_code=NO_EXIT, traceback=False)
        return Outcome(stderr="", exit_code=NO_EXIT, traceback=False)

    return run


def cluster_yaml(mutate: Callable[[dict], None]) -> Callable[[Path], Outcome]:
    """Ray's cluster-launcher validation (what ``ray up`` runs) of the repo's cluster.yaml, changed."""

    def run(d: Path) -> Outcome:
        data = yaml.safe_load((REPO / "cluster.yaml").read_text())
        mutate(data)
        try:
            validate_config(prepare_config(data))
        except jsonschema.ValidationError as exc:
            where = ".".join(str(p) for p in exc.absolute_path) or "(top level)"
            return Outcome(stderr=f"cluster.yaml: {where}: {exc.message}\n", exit_code=NO_EXIT, traceback=False)
        except ValueError as exc:  # Ray's own checks beyond the schema
            return Outcome(stderr=f"cluster.yaml: {exc}\n", exit_code=NO_EXIT, traceback=False)
        return Outcome(stderr="", exit_code=NO_EXIT, traceback=False)

    return run


def train(make: Callable[[Path], str | None]) -> Callable[[Path], list[str]]:
    """``train --config <d>/run.yaml --output <d>/result.json`` with ``make(d)`` as the config text."""

    def argv(d: Path) -> list[str]:
        text = make(d)
        if text is not None:
            (d / "run.yaml").write_text(text)
        return ["train", "--config", str(d / "run.yaml"), "--output", str(d / "result.json")]

    return argv


CLUSTER_TEXT = (REPO / "cluster.yaml").read_text()


def two_device_plan() -> dict:
    """The planner's Plan for BASE's devices and batch."""
    from hetero_ray.config import parse_config

    return prepare(parse_config(BASE)).plan.to_dict()


def train_plan(make: Callable[[], dict | str], **changes) -> Callable[[Path], list[str]]:
    """``train`` on BASE's config (with ``changes``, as ``config`` takes them) with ``--plan <d>/plan.json``
    holding ``make()``."""

    def argv(d: Path) -> list[str]:
        data = make()
        (d / "plan.json").write_text(data if isinstance(data, str) else json.dumps(data))
        return [*train(lambda d: config(d, **changes))(d), "--plan", str(d / "plan.json")]

    return argv


def plan_cmd(make: Callable[[Path], str], *args: str) -> Callable[[Path], list[str]]:
    """``plan --cluster <d>/cluster.yaml --output <d>/out.json ARGS`` with ``make(d)`` as cluster.yaml."""

    def argv(d: Path) -> list[str]:
        (d / "cluster.yaml").write_text(make(d))
        return ["plan", "--cluster", str(d / "cluster.yaml"), "--output", str(d / "out.json"),
                *(a.replace("{dir}", str(d)) for a in args)]  # fmt: skip

    return argv


def simulate(*args: str) -> Callable[[Path], list[str]]:
    return lambda d: ["simulate", "--output", str(d / "out.json"), *args]


def profile(*args: str) -> Callable[[Path], list[str]]:
    return lambda d: ["profile", "--history", str(d / "history.parquet"), *args]


def set_node_type(key: str, value) -> Callable[[dict], None]:
    def mutate(data: dict) -> None:
        data["available_node_types"]["a100-80gb-x8"][key] = value

    return mutate


# --- the cases --------------------------------------------------------------------------

TRAIN = "hetero-ray train"
PLAN = "Plan JSON (load_plan)"
CLUSTER = "cluster.yaml (Ray's validator)"
CFG = r"{dir}/run\.yaml"
PLN = r"{dir}/plan\.json"

CASES = [
    # Run config YAML through `hetero-ray train`.
    Case("malformed-yaml", TRAIN, "`devices: {A100-80GB: 1` (unclosed)", cli(train(lambda d: "devices: {A100-80GB: 1\n")),
         rf"{CFG}: line 2, column 1: malformed YAML"),
    Case("empty-file", TRAIN, "an empty config file", cli(train(lambda d: "")), rf"{CFG}: expected a mapping"),
    Case("missing-file", TRAIN, "`--config` naming no file", cli(train(lambda d: None)), rf"{CFG}: cannot read config"),
    Case("unknown-top-level-key", TRAIN, "`bogus: 1`", cli(train(lambda d: config(d, bogus=1))),
         rf"{CFG}: bogus: unknown key"),
    Case("unknown-train-key", TRAIN, "`train: {bogus: 1}`", cli(train(lambda d: config(d, train__bogus=1))),
         rf"{CFG}: train\.bogus: unknown key"),
    Case("unknown-gpu", TRAIN, "`devices: {Z100: 1}`", cli(train(lambda d: config(d, devices={"Z100": 1}))),
         r"devices: unknown GPU type 'Z100'"),
    Case("zero-global-batch", TRAIN, "`train: {global_batch: 0}`",
         cli(train(lambda d: config(d, train__global_batch=0))), rf"{CFG}: train\.global_batch: .*greater than 0"),
    Case("negative-global-batch", TRAIN, "`train: {global_batch: -3}`",
         cli(train(lambda d: config(d, train__global_batch=-3))), rf"{CFG}: train\.global_batch: .*greater than 0"),
    Case("string-global-batch", TRAIN, "`train: {global_batch: many}`",
         cli(train(lambda d: config(d, train__global_batch="many"))), rf"{CFG}: train\.global_batch: .*valid integer"),
    Case("zero-workers", TRAIN, "`devices: {A100-80GB: 0, V100-16GB: 1}`",
         cli(train(lambda d: config(d, devices={"A100-80GB": 0, "V100-16GB": 1}))), rf"{CFG}: devices: .*>= 1"),
    Case("no-devices", TRAIN, "`devices: {}`", cli(train(lambda d: config(d, devices={}))),
         rf"{CFG}: devices: needs at least one GPU type"),
    Case("train-precision-card-lacks", TRAIN, "`train: {precision: {V100-16GB: bf16}}`",
         cli(train(lambda d: config(d, train__precision={"V100-16GB": "bf16"}))),
         r"train\.precision\.V100-16GB: V100-16GB has no bf16; use one of fp16, fp32"),
    Case("train-precision-unknown-type", TRAIN, "`train: {precision: {H100-80GB: bf16}}`",
         cli(train(lambda d: config(d, train__precision={"H100-80GB": "bf16"}))),
         rf"{CFG}: train\.precision\.H100-80GB: not a GPU type of the run"),
    Case("unknown-split", TRAIN, "`train: {split: fastest}`", cli(train(lambda d: config(d, train__split="fastest"))),
         rf"{CFG}: train\.split"),
    Case("split-weight-zero", TRAIN, "`train: {split: {A100-80GB: 0}}`",
         cli(train(lambda d: config(d, train__split={"A100-80GB": 0}))), r"weights per GPU type must be > 0"),
    Case("negative-dilation", TRAIN, "`emulation: {dilation: -1}`",
         cli(train(lambda d: config(d, emulation={"dilation": -1}))), rf"{CFG}: emulation\.dilation: .*'auto'"),
    Case("unknown-workload", TRAIN, "`workload: {name: nosuch}`", cli(train(lambda d: config(d, workload__name="nosuch"))),
         r"workload\.name: unknown workload 'nosuch'"),
    Case("missing-function", TRAIN, "`workload: {name: hetero_ray.workloads.gpt:no_such_factory}`",
         cli(train(lambda d: config(d, workload__name="hetero_ray.workloads.gpt:no_such_factory"))),
         r"workload\.name: cannot load 'hetero_ray\.workloads\.gpt:no_such_factory'"),
    Case("missing-module", TRAIN, "`workload: {name: no_such_module_xyz:build}`",
         cli(train(lambda d: config(d, workload__name="no_such_module_xyz:build"))),
         r"workload\.name: cannot load 'no_such_module_xyz:build'"),
    Case("unknown-workload-option", TRAIN, "GPT option `n_layers: 2` (it is `n_layer`)",
         cli(train(lambda d: config(d, workload__options={**TINY_GPT, "n_layers": 2}))),
         r"workload\.options\.n_layers: unknown option \(did you mean 'n_layer'\?\); hetero_ray\.workloads\.gpt:build takes "
         r"n_layer, "),
    Case("n_embd-not-multiple-of-n_head", TRAIN, "GPT `n_embd: 16, n_head: 3`",
         cli(train(lambda d: config(d, workload__options={**TINY_GPT, "n_head": 3}))), r"n_head"),
    # 200 bytes of corpus in 16-byte windows: (200 - 1) // 16 = 12 samples, fewer than the global batch of 64.
    Case("dataset-smaller-than-global-batch", TRAIN, "a 12-sample corpus, `global_batch: 64`",
         cli(train(lambda d: config(d, workload__options={**TINY_GPT, "corpus_bytes": 200}, train__global_batch=64))),
         r"global.batch"),
    Case("model-fits-no-device", TRAIN, "GPT 48 × 8192 on `devices: {V100-16GB: 2}`",
         cli(train(lambda d: config(d, devices={"V100-16GB": 2}, workload__options=HUGE_GPT))),
         r"model needs [\d.]+ GiB per device .*\(\d+ pipeline stages.* V100-16GB has 16 GiB"),
    Case("bad-gpus-file-entry", TRAIN, "`gpus_file:` with `memory_gib: -1`",
         cli(train(lambda d: config(d, gpus_file=str(bad_gpus_file(d))))), r"{dir}/gpus\.yaml: entry 'Tiny-GPU': memory_gib"),
    Case("bad-gpus-env", TRAIN, f"`{GPUS_ENV_VAR}` naming a file with `memory_gib: -1`",
         cli(train(lambda d: config(d)), **{GPUS_ENV_VAR: lambda d: str(bad_gpus_file(d))}),
         rf"{{dir}}/gpus\.yaml \(from {GPUS_ENV_VAR}\): entry 'Tiny-GPU': memory_gib"),
    Case("onebit-with-zero", TRAIN, "`optimizer: {name: onebit_adam, zero_stage: 2}`",
         cli(train(lambda d: config(d, optimizer={"name": "onebit_adam", "zero_stage": 2}))),
         rf"{CFG}: optimizer: onebit_adam is not compatible with ZeRO \(stage 2\); set optimizer\.zero_stage: 0"),
    Case("zero-stage-unknown", TRAIN, "`optimizer: {zero_stage: 4}`",
         cli(train(lambda d: config(d, optimizer={"zero_stage": 4}))),
         rf"{CFG}: optimizer\.zero_stage: Input should be 0, 1, 2, 3 or 'auto'"),
    Case("warmup-as-long-as-the-run", TRAIN, "`train: {steps: 2, lr_schedule: {warmup_steps: 2}}`",
         cli(train(lambda d: config(d, train__lr_schedule={"warmup_steps": 2}))),
         rf"{CFG}: train\.lr_schedule\.warmup_steps: 2 is not below train\.steps 2, so the rate would never "
         r"reach train\.lr; use fewer warm-up steps"),
    Case("min-lr-above-lr", TRAIN, "`train: {lr: 0.001, lr_schedule: {name: cosine, min_lr: 0.01}}`",
         cli(train(lambda d: config(d, train__lr=0.001, train__lr_schedule={"name": "cosine", "min_lr": 0.01}))),
         rf"{CFG}: train\.lr_schedule\.min_lr: 0\.01 is above train\.lr 0\.001; the decay ends below where it "
         r"starts"),
    Case("clip-with-onebit", TRAIN, "`optimizer: {name: onebit_adam}` with `train: {grad_clip: 1}`",
         cli(train(lambda d: config(d, optimizer={"name": "onebit_adam", "freeze_step": 1}, train__grad_clip=1.0))),
         rf"{CFG}: train\.grad_clip: onebit_adam applies its own compressed momentum, which hetero-ray does not "
         r"clip; use adam to clip, or drop grad_clip"),
    Case("eval-holds-out-too-much", TRAIN, "`train: {eval_every: 1, eval_samples: 1000000}`",
         cli(train(lambda d: config(d, train__eval_every=1, train__eval_samples=1_000_000))),
         r"train\.eval_samples: holding out 1000000 of the workload's \d+ samples leaves 0, fewer than "
         r"train\.global_batch 4; hold out fewer"),
    Case("eval-fewer-than-workers", TRAIN, "`train: {eval_every: 1, eval_samples: 1}` on two workers",
         cli(train(lambda d: config(d, train__eval_every=1, train__eval_samples=1))),
         r"train\.eval_samples: 1 is fewer than the 2 workers that share the evaluation; hold out at "
         r"least one sample per worker"),
    Case("deepspeed-with-adam", TRAIN, "`optimizer: {deepspeed: {wall_clock_breakdown: true}}`",
         cli(train(lambda d: config(d, optimizer={"deepspeed": {"wall_clock_breakdown": True}}))),
         rf"{CFG}: optimizer: deepspeed: adam runs on hetero-ray's own engine, not DeepSpeed; the DeepSpeed config "
         r"applies to onebit_adam and zero_one_adam"),
    Case("deepspeed-key-conflict", TRAIN,
         "`optimizer: {name: onebit_adam, deepspeed: {zero_optimization: {stage: 2}}}`",
         cli(train(lambda d: config(d, optimizer={"name": "onebit_adam", "freeze_step": 1,
                                                   "deepspeed": {"zero_optimization": {"stage": 2}}}))),
         r"optimizer\.deepspeed\.zero_optimization\.stage: 2 conflicts with hetero-ray's 0 \(set from the run "
         r"config and the plan\); drop it, or set it through the run config"),
    Case("unknown-optimizer", TRAIN, "`optimizer: {name: lamb}`", cli(train(lambda d: config(d, optimizer={"name": "lamb"}))),
         rf"{CFG}: optimizer\.name: .*'adam', 'onebit_adam' or 'zero_one_adam'"),
    Case("zero-link-bandwidth", TRAIN, "`link: {bandwidth_gbps: 0}`",
         cli(train(lambda d: config(d, link={"bandwidth_gbps": 0}))), rf"{CFG}: link\.bandwidth_gbps: .*greater than 0"),
    # A name close to a known one gets "did you mean".
    Case("gpu-type-close", TRAIN, "`devices: {A100: 1}`", cli(train(lambda d: config(d, devices={"A100": 1}))),
         r"devices: unknown GPU type 'A100' \(did you mean 'A100-40GB' or 'A100-80GB'\?\); known: "),
    Case("train-key-close", TRAIN, "`train: {stesp: 3}`", cli(train(lambda d: config(d, train__stesp=3))),
         rf"{CFG}: train\.stesp: unknown key \(did you mean 'steps'\?\)$"),
    Case("section-close", TRAIN, "`optimiser: {name: adam}`", cli(train(lambda d: config(d, optimiser={"name": "adam"}))),
         rf"{CFG}: optimiser: unknown key \(did you mean 'optimizer'\?\)$"),
    Case("optimizer-close", TRAIN, "`optimizer: {name: onebit}`", cli(train(lambda d: config(d, optimizer={"name": "onebit"}))),
         rf"{CFG}: optimizer\.name: .* \(did you mean 'onebit_adam'\?\)$"),
    Case("simulate-gpu-type-close", "hetero-ray simulate", "`--devices v100-16gb=4`",
         cli(simulate("--devices", "v100-16gb=4")), r"unknown GPU type 'v100-16gb' \(did you mean 'V100-16GB'"),
    # json gives no position and a tab-indented file is not YAML, so the strict YAML reader cannot find the line.
    Case("plan-duplicate-key-tabs", PLAN, "`global_batch` twice in a tab-indented file",
         plan_file(lambda: '{\n\t"global_batch": 8,\n\t"global_batch": 9\n}'),
         rf"{PLN}: duplicate key 'global_batch'; give each key once$"),
    Case("plan-schedule-close", PLAN, "`schedule: 1f1`", plan_file(lambda: pipeline_plan_dict() | {"schedule": "1f1"}),
         rf"{PLN}: schedule: unknown schedule '1f1' \(did you mean '1f1b'\?\); use one of 1f1b, gpipe$"),
    Case("plan-tp-member-missing", PLAN, "a tensor-parallel stage (`tp_weights: [1, 1]`) with only member 0",
         plan_file(lambda: tp_plan_dict(members=1)),
         rf"{PLN}: roles\.0\.tp_rank: stage 0 of pipeline 0 has members \[0\]; each of 0 to 1 exactly once$"),
    Case("plan-tp-split-differs", PLAN, "two pipelines whose first stages hold the same layers, one split in two",
         plan_file(split_differs_plan),
         rf"{PLN}: roles\.3\.tp_weights: unsplit, but roles\.0 holds some of the same layers split \[1\.0, 1\.0\]; "
         r"the pipelines holding a layer must split it alike \(its gradients are summed per part\)$"),
    Case("plan-tp-replica-beside-unsplit", PLAN, "a whole-model tensor-parallel pair beside a whole-model V100",
         plan_file(lambda: split_first(two_device_plan())),
         rf"{PLN}: roles\.2\.tp_weights: unsplit, but roles\.0 holds some of the same layers split \[1\.0, 1\.0\]; "
         r"the pipelines holding a layer must split it alike \(its gradients are summed per part\)$"),
    Case("plan-tp-precision-differs", PLAN, "a tensor-parallel stage whose member 1 runs fp16, member 0 bf16",
         plan_file(lambda: edit(tp_plan_dict(members=2), "roles.1.precision", "fp16")),
         rf"{PLN}: roles\.1\.precision: differs from roles\.0's; the members of a tensor-parallel stage share it$"),
    Case("plan-tp-weight-zero", PLAN, "`tp_weights: [1, 0]`",
         plan_file(lambda: tp_plan_dict(members=2, weights=[1, 0])),
         rf"{PLN}: roles\.0: tp_weights \[1\.0, 0\.0\] must all be positive and finite"),
    Case("max-tensor-parallel-not-power-of-two", TRAIN, "`train: {max_tensor_parallel: 3}`",
         cli(train(lambda d: config(d, train__max_tensor_parallel=3))),
         rf"{CFG}: train\.max_tensor_parallel: 3 is not a power of two; use 1, 2, 4 or 8$"),
    Case("max-tensor-parallel-with-onebit", TRAIN, "`train: {max_tensor_parallel: 2}`, `optimizer: {name: onebit_adam}`",
         cli(train(lambda d: config(d, train__max_tensor_parallel=2, optimizer={"name": "onebit_adam"}))),
         rf"{CFG}: train\.max_tensor_parallel: 2 needs the placement planner, and optimizer onebit_adam runs data "
         r"parallelism only; use max_tensor_parallel: 1 with it$"),
    Case("tp-across-unknown-type", TRAIN, "`train: {tensor_parallel_across: [[A100-80GB, V100-32GB]]}`",
         cli(train(lambda d: config(d, train__max_tensor_parallel=2,
                                    train__tensor_parallel_across=[["A100-80GB", "V100-32GB"]]))),
         rf"{CFG}: train\.tensor_parallel_across\[0\]: V100-32GB is not a GPU type of the run \(did you mean "
         r"'V100-16GB' or 'A100-80GB'\?\); devices has A100-80GB, V100-16GB$"),
    Case("tp-across-one-type", TRAIN, "`train: {tensor_parallel_across: [[V100-16GB, V100-16GB]]}`",
         cli(train(lambda d: config(d, train__max_tensor_parallel=2,
                                    train__tensor_parallel_across=[["V100-16GB", "V100-16GB"]]))),
         rf"{CFG}: train\.tensor_parallel_across\[0\]: \['V100-16GB', 'V100-16GB'\] must name two or more "
         r"different GPU types, each once$"),
    Case("tp-across-above-max-tp", TRAIN, "`train: {tensor_parallel_across: [[A100-80GB, V100-16GB]]}` at "
         "`max_tensor_parallel: 1`",
         cli(train(lambda d: config(d, train__tensor_parallel_across=[["A100-80GB", "V100-16GB"]]))),
         rf"{CFG}: train\.tensor_parallel_across\[0\]: a group of 2 needs train\.max_tensor_parallel >= 2 \(it is "
         r"1\)$"),
    Case("plan-cmd-max-tp", "hetero-ray plan", "`--max-tp 3`",
         cli(lambda d: ["plan", "--max-tp", "3"]), r"--max-tp: must be a power of two >= 1, e.g. 1, 2, 4, 8 \(got 3\)$"),
    Case("plan-cmd-zero-stage", "hetero-ray plan", "`--zero-stage 4`",
         cli(lambda d: ["plan", "--zero-stage", "4"]), r"--zero-stage: unknown ZeRO stage '4'; use one of 0, 1, 2, 3, auto$"),
    Case("plan-cmd-zero-with-onebit", "hetero-ray plan", "`--zero-stage 1 --optimizer onebit_adam`",
         cli(lambda d: ["plan", "--zero-stage", "1", "--optimizer", "onebit_adam"]),
         r"--zero-stage: onebit_adam is not compatible with ZeRO; use --zero-stage 0$"),
    # A key given twice, in every file hetero-ray reads (YAML would keep the last one silently).
    Case("duplicate-device", TRAIN, "`devices:` listing `A100-80GB` twice",
         cli(train(lambda d: config(d).replace("  V100-16GB: 1\n", "  V100-16GB: 1\n  A100-80GB: 2\n", 1))),
         rf"{CFG}: line 4, column 3: duplicate key 'A100-80GB' \(first at line 2\); give each key once"),
    Case("duplicate-gpus-file-entry", TRAIN, "`gpus_file:` with the entry `Tiny-GPU` twice",
         cli(train(lambda d: config(d, gpus_file=str(twice_gpus_file(d))))),
         r"{dir}/gpus\.yaml: line 12, column 3: duplicate key 'Tiny-GPU' \(first at line 2\)"),
    Case("duplicate-plan-key", TRAIN, "`--plan` file giving `global_batch` twice",
         cli(train_plan(lambda: json.dumps(two_device_plan(), indent=1).replace("{", '{"global_batch": 3,', 1))),
         r"{dir}/plan\.json: line 2, column \d+: duplicate key 'global_batch' \(first at line 1\)"),
    # Settings that can only be checked against another, checked before launch.
    Case("onebit-freeze-past-steps", TRAIN, "`optimizer: {name: onebit_adam, freeze_step: 2}` with `steps: 2`",
         cli(train(lambda d: config(d, optimizer={"name": "onebit_adam", "freeze_step": 2}))),
         rf"{CFG}: optimizer\.freeze_step: 2 is not below train\.steps 2, so compression would never engage"),
    Case("onebit-with-reduce-dtype", TRAIN, "`optimizer: {name: onebit_adam}` with `train: {reduce_dtype: bf16}`",
         cli(train(lambda d: config(d, optimizer={"name": "onebit_adam"}, train__reduce_dtype="bf16"))),
         rf"{CFG}: train\.reduce_dtype: bf16 casts adam's gradients; onebit_adam compresses its own, so use "
         r"reduce_dtype: fp32 with it"),
    Case("reduce-dtype-unknown", TRAIN, "`train: {reduce_dtype: int8}`",
         cli(train(lambda d: config(d, train__reduce_dtype="int8"))),
         rf"{CFG}: train\.reduce_dtype: .*'fp32', 'bf16' or 'fp16'"),
    Case("batch-norm-in-micro-batches", TRAIN, "`workload: {name: cnn}` with `train: {max_micro_batch: 1}`",
         cli(train(lambda d: config(d, workload={"name": "cnn", "options": {}}, train__max_micro_batch=1))),
         r"workload layer 0\.1 \(BatchNorm2d\) normalises over the whole batch, so each device must run its share "
         r"in one forward pass, but .* run in micro-batches of 1 \(train\.max_micro_batch\); raise "
         r"train\.max_micro_batch, lower train\.global_batch, or use GroupNorm/LayerNorm"),
    Case("batch-norm-with-rebalancing", TRAIN, "`workload: {name: cnn}` with `train: {rebalance_every: 5}`",
         cli(train(lambda d: config(d, workload={"name": "cnn", "options": {}}, train__rebalance_every=5))),
         r"train\.rebalance_every: workload layer 0\.1 \(BatchNorm2d\) normalises over the whole batch, and a "
         r"re-split may cut a device's share into micro-batches; drop rebalance_every, or use GroupNorm/LayerNorm"),
    Case("onebit-default-freeze-one-step", TRAIN, "`optimizer: {name: onebit_adam}` with `steps: 1`",
         cli(train(lambda d: config(d, optimizer={"name": "onebit_adam"}, train__steps=1))),
         rf"{CFG}: optimizer\.freeze_step: 1 \(the default.*use train\.steps >= 2"),
    Case("storage-path-is-a-file", TRAIN, "`run: {storage_path: <a file>}`",
         cli(train(lambda d: config(d, run={"name": "bad", "storage_path": str(d / "run.yaml")}))),
         r"run\.storage_path: {dir}/run\.yaml is a file; name a directory"),
    Case("train-plan-precision-card-lacks", TRAIN, "`--plan` giving the V100-16GB `precision: bf16`",
         cli(train_plan(lambda: edit(two_device_plan(), "roles.1.precision", "bf16"))),
         r"{dir}/plan\.json: roles\.1\.precision: V100-16GB has no bf16; use one of fp16, fp32"),
    Case("train-output-is-a-directory", TRAIN, "`--output` naming a directory",
         cli(lambda d: [*train(lambda d: config(d))(d), "--output", str(d)]),
         r"--output: {dir} is a directory; name a file in it"),
    Case("train-output-exists", TRAIN, "`--output` naming a file that exists, without `--force`",
         cli(lambda d: [*train(lambda d: config(d))(d), "--output", str(d / "run.yaml")]),
         r"--output: {dir}/run\.yaml exists; pass --force to replace it"),
    Case("train-output-under-a-file", TRAIN, "`--output <a file>/result.json`",
         cli(lambda d: [*train(lambda d: config(d))(d), "--output", str(d / "run.yaml" / "result.json")]),
         r"--output: {dir}/run\.yaml is a file, so {dir}/run\.yaml/result\.json cannot be created; name another path"),
    Case("simulate-output-is-a-directory", "hetero-ray simulate", "`--output` naming a directory",
         cli(lambda d: ["simulate", "--devices", "V100-16GB=4", "--output", str(d)]),
         r"--output: {dir} is a directory; name a file in it"),
    # Command lines (argparse prints its usage lines, then the one error line).
    Case("train-without-config", TRAIN, "no `--config`", cli(lambda d: ["train"]),
         r"the following arguments are required: --config"),
    Case("unknown-subcommand", "hetero-ray", "`hetero-ray bogus`", cli(lambda d: ["bogus"]),
         r"invalid choice: 'bogus'"),
    Case("demo-duration-not-a-number", "hetero-ray demo", "`--duration x`", cli(lambda d: ["demo", "--duration", "x"]),
         r"argument --duration: invalid float value: 'x'"),
    Case("demo-zero-duration", "hetero-ray demo", "`--duration 0`",
         cli(lambda d: ["demo", "--duration", "0", "--output", str(d / "result.json")]),
         r"argument --duration: must be > 0 seconds \(got 0\)"),
    Case("demo-negative-duration", "hetero-ray demo", "`--duration -5`",
         cli(lambda d: ["demo", "--duration", "-5", "--output", str(d / "result.json")]),
         r"argument --duration: must be > 0 seconds \(got -5\)"),
    Case("demo-without-emulation", "hetero-ray demo", "a config without `emulation:`",
         cli(lambda d: ["demo", *train(lambda d: config(d, emulation=None))(d)[1:]]),
         r"the demo needs an 'emulation' section"),
    Case("discover-bad-gpus-file", "hetero-ray discover", "`--gpus` file with `memory_gib: -1`",
         cli(lambda d: ["discover", "--gpus", str(bad_gpus_file(d))]), r"{dir}/gpus\.yaml: entry 'Tiny-GPU': memory_gib"),
    Case("discover-missing-gpus-file", "hetero-ray discover", "`--gpus` naming no file",
         cli(lambda d: ["discover", "--gpus", str(d / "none.yaml")]), r"{dir}/none\.yaml"),
    # hetero-ray train --plan (a Plan JSON checked against the config).
    Case("train-plan-pipelined-with-zero", TRAIN, "`--plan` with pipeline stages and `optimizer: {zero_stage: 2}`",
         cli(train_plan(lambda: {**two_stage_plan(), "zero_stage": 2}, optimizer={"zero_stage": 2})),
         r"{dir}/plan\.json: the plan has pipeline stages, and ZeRO stage 2 reduces and gathers on every pass, "
         r"which would tie the pipelines' schedules together; use zero_stage: 1 or 0, or a data-parallel plan"),
    Case("train-plan-tensor-parallel-with-zero", TRAIN, "`--plan` with a tensor-parallel stage and `optimizer: {zero_stage: 1}`",
         cli(train_plan(tensor_parallel_pair_plan, devices={"A100-80GB": 2}, optimizer={"zero_stage": 1})),
         r"{dir}/plan\.json: the plan has tensor-parallel stages, which ZeRO does not shard; use zero_stage: 0 or a "
         r"plan without tensor parallelism"),
    Case("train-plan-zero-stage-differs", TRAIN, "`--plan` made without ZeRO, `optimizer: {zero_stage: 1}`",
         cli(train_plan(two_device_plan, optimizer={"zero_stage": 1})),
         r"{dir}/plan\.json: the plan is for ZeRO stage 0, the config's optimizer\.zero_stage is 1; plan with the "
         r"config \(hetero-ray plan\) or set the same stage"),
    Case("train-plan-pipelined-with-eval", TRAIN, "`--plan` with pipeline stages and `train: {eval_every: 1}`",
         cli(train_plan(two_stage_plan, train={**BASE["train"], "eval_every": 1})),
         r"train\.eval_every: the evaluation runs on devices holding the whole model, and this plan pipelines "
         r"it or splits its layers; drop eval_every, or make data parallelism fit \(a smaller "
         r"train\.max_micro_batch, train\.max_tensor_parallel: 1\)"),
    Case("train-plan-other-workload", TRAIN, "`--plan` made for the GPT with `n_embd: 16`, the config's has 32",
         cli(train_plan(two_device_plan, workload={"name": "gpt", "options": {**TINY_GPT, "n_embd": 32}})),
         r'{dir}/plan\.json: the plan is for workload gpt .*"n_embd": 16.*, the config trains gpt .*"n_embd": 32.*; '
         r"plan from the config \(hetero-ray plan --config\)"),
    Case("train-plan-malformed", TRAIN, "`--plan` file `{` (cut short)", cli(train_plan(lambda: "{")),
         r"{dir}/plan\.json: line 1, column 2: malformed JSON"),
    Case("train-plan-other-devices", TRAIN, "`--plan` for 1 × A100-80GB + 2 × V100-16GB, config 1 + 1",
         cli(train_plan(plan_dict)), r"{dir}/plan\.json: the plan is for devices .*, the config has"),
    Case("train-plan-batches-do-not-sum", TRAIN, "`--plan` whose roles' batches (sum 4) miss its `global_batch: 8`",
         cli(train_plan(lambda: two_device_plan() | {"global_batch": 8})),
         r"{dir}/plan\.json: roles\.\*\.local_batch: pipelines' local batches .* sum to 4, not global_batch 8"),
    # hetero-ray plan / simulate / profile.
    Case("plan-cmd-missing-cluster", "hetero-ray plan", "`--cluster` naming no file",
         cli(lambda d: ["plan", "--cluster", str(d / "none.yaml"), "--output", str(d / "out.json")]),
         r"{dir}/none\.yaml: cannot read cluster file"),
    Case("plan-cmd-malformed-cluster", "hetero-ray plan", "`--cluster` file `available_node_types: {a: 1` (unclosed)",
         cli(plan_cmd(lambda d: "available_node_types: {a: 1\n")), r"{dir}/cluster\.yaml: line 2, column 1: malformed YAML"),
    Case("plan-cmd-duplicate-node-type", "hetero-ray plan", "cluster.yaml with two node types named `a100-80gb-x8`",
         cli(plan_cmd(lambda d: CLUSTER_TEXT.replace("  h100-80gb-x8:", "  a100-80gb-x8:"))),
         r"{dir}/cluster\.yaml: line \d+, column 3: duplicate key 'a100-80gb-x8' \(first at line \d+\)"),
    Case("plan-cmd-unknown-gpu-label", "hetero-ray plan", "cluster.yaml labelling a node type `Z100`",
         cli(plan_cmd(lambda d: CLUSTER_TEXT.replace("gpu-type: A100-80GB", "gpu-type: Z100"))),
         r"{dir}/cluster\.yaml: available_node_types\.a100-80gb-x8\.labels\.hetero-ray/gpu-type: unknown GPU type 'Z100'; "
         r"known: .*; declare it in a gpus file"),
    Case("plan-cmd-label-not-a-string", "hetero-ray plan", "cluster.yaml with `hetero-ray/network-gbps: 400` (unquoted)",
         cli(plan_cmd(lambda d: CLUSTER_TEXT.replace('network-gbps: "400"', "network-gbps: 400"))),
         r"{dir}/cluster\.yaml: available_node_types\.a100-80gb-x8\.labels\.hetero-ray/network-gbps: 400 is not of type "
         r"'string' \(Ray's cluster-launcher schema\)$"),
    Case("plan-cmd-gpu-count-not-a-number", "hetero-ray plan", "cluster.yaml with `resources: {GPU: eight}`",
         cli(plan_cmd(lambda d: CLUSTER_TEXT.replace("{CPU: 96, GPU: 8}", "{CPU: 96, GPU: eight}"))),
         r"{dir}/cluster\.yaml: available_node_types\.[\w-]+\.resources\.GPU: 'eight' is not of type 'integer' "
         r"\(Ray's cluster-launcher schema\)$"),
    Case("plan-cmd-not-a-launcher-file", "hetero-ray plan", "cluster.yaml without `cluster_name` and `provider`",
         cli(plan_cmd(lambda d: "available_node_types:\n  g: {resources: {GPU: 4}, node_config: {}}\n")),
         r"{dir}/cluster\.yaml: \(top level\): 'cluster_name' is a required property \(Ray's cluster-launcher schema\)$"),
    Case("plan-cmd-zero-global-batch", "hetero-ray plan", "`--global-batch 0`",
         cli(plan_cmd(lambda d: CLUSTER_TEXT, "--global-batch", "0")), r"--global-batch: must be >= 1 \(got 0\)"),
    Case("plan-cmd-bad-model-options", "hetero-ray plan", "`--model-options {bad`",
         cli(plan_cmd(lambda d: CLUSTER_TEXT, "--model-options", "{bad")), r"--model-options: not valid JSON"),
    Case("plan-cmd-unknown-schedule", "hetero-ray plan", "`--schedule interleaved`",
         cli(plan_cmd(lambda d: CLUSTER_TEXT, "--schedule", "interleaved")), r"unknown schedule 'interleaved'"),
    Case("plan-cmd-unknown-optimizer", "hetero-ray plan", "`--optimizer lamb`",
         cli(plan_cmd(lambda d: CLUSTER_TEXT, "--optimizer", "lamb")), r"--optimizer: unknown optimizer 'lamb'"),
    Case("plan-cmd-labels-a-string", "hetero-ray plan", "cluster.yaml with `labels: A100-80GB` (a string)",
         cli(plan_cmd(lambda d: re.sub(r"labels: \{hetero-ray/gpu-type: A100-80GB[^}]*\}", "labels: A100-80GB", CLUSTER_TEXT))),
         r"{dir}/cluster\.yaml: available_node_types\.a100-80gb-x8\.labels: 'A100-80GB' is not of type 'object' "
         r"\(Ray's cluster-launcher schema\)$"),
    Case("plan-cmd-batch-beyond-dataset", "hetero-ray plan", "`--global-batch 64` on a 12-sample corpus",
         cli(plan_cmd(lambda d: CLUSTER_TEXT, "--model-options", json.dumps({**TINY_GPT, "corpus_bytes": 200}),
                      "--global-batch", "64")),
         r"--global-batch: 64 is more than the workload's 12 samples"),
    Case("plan-cmd-output-is-a-directory", "hetero-ray plan", "`--output` naming a directory",
         cli(plan_cmd(lambda d: CLUSTER_TEXT, "--output", "{dir}")), r"--output: {dir} is a directory; name a file in it"),
    Case("plan-cmd-output-exists", "hetero-ray plan", "`--output` naming a file that exists, without `--force`",
         cli(plan_cmd(lambda d: CLUSTER_TEXT, "--output", "{dir}/cluster.yaml")),
         r"--output: {dir}/cluster\.yaml exists; pass --force to replace it"),
    Case("simulate-batch-beyond-dataset", "hetero-ray simulate", "`--global-batch 64` on a 12-sample corpus",
         cli(simulate("--devices", "V100-16GB=4", "--model-options", json.dumps({**TINY_GPT, "corpus_bytes": 200}),
                      "--global-batch", "64")),
         r"--global-batch: 64 is more than the workload's 12 samples"),
    Case("simulate-bad-count", "hetero-ray simulate", "`--devices V100-16GB=abc`",
         cli(simulate("--devices", "V100-16GB=abc")), r"--devices: 'V100-16GB=abc' is not TYPE=COUNT"),
    Case("simulate-unknown-gpu", "hetero-ray simulate", "`--devices Z100=4`", cli(simulate("--devices", "Z100=4")),
         r"unknown GPU type 'Z100'"),
    Case("simulate-mix-without-budget", "hetero-ray simulate", "`--mix A100-80GB,V100-16GB` without `--budget-gpus`",
         cli(simulate("--mix", "A100-80GB,V100-16GB")), r"--budget-gpus: --mix needs a GPU budget >= 1"),
    Case("simulate-mix-too-many", "hetero-ray simulate", "`--mix` of 3 types over `--budget-gpus 512`",
         cli(simulate("--mix", "A100-80GB,V100-16GB,H100-80GB", "--budget-gpus", "512")),
         r"--mix: 131,841 mixes of 3 types over 512 GPUs, one planner search each; at most 2,000: pass --mix-step 9 "
         r"\(1,653 mixes\)"),
    Case("simulate-nothing", "hetero-ray simulate", "neither `--devices` nor `--mix`", cli(simulate()),
         r"give either --devices"),
    Case("profile-zero-micro-batch", "hetero-ray profile", "`--micro-batches 0`",
         cli(profile("--micro-batches", "0")), r"micro_batches: need positive integers \(got \[0\]\)"),
    Case("profile-unknown-precision", "hetero-ray profile", "`--precisions fp8`", cli(profile("--precisions", "fp8")),
         r"precisions: fp8 not known; valid: fp32, tf32, fp16, bf16"),
    Case("profile-bad-options", "hetero-ray profile", "`--options {bad`", cli(profile("--options", "{bad")),
         r"Expecting property name"),
    # Real processes.
    Case("job-unknown-key", "python jobs/train.py", "`train: {bogus: 1}`",
         process(lambda d: [sys.executable, "jobs/train.py", *train(lambda d: config(d, train__bogus=1))(d)[1:]]),
         rf"{CFG}: train\.bogus: unknown key"),
    Case("job-missing-config", "python jobs/train.py", "`--config` naming no file",
         process(lambda d: [sys.executable, "jobs/train.py", *train(lambda d: None)(d)[1:]]), rf"{CFG}: cannot read config"),
    Case("module-unknown-gpu", "python -m hetero_ray.cli train", "`devices: {Z100: 1}`",
         process(lambda d: [sys.executable, "-m", "hetero_ray.cli", *train(lambda d: config(d, devices={"Z100": 1}))(d)]),
         r"devices: unknown GPU type 'Z100'"),
    # Plan JSON.
    Case("plan-missing-file", PLAN, "a path with no file", plan_file(lambda: None), rf"{PLN}: cannot read plan"),
    Case("plan-malformed-json", PLAN, "`{\"global_batch\": 8,` (cut short)", plan_file(lambda: '{"global_batch": 8,'),
         rf"{PLN}: line 1, column 20: malformed JSON"),
    Case("plan-not-an-object", PLAN, "`[1, 2]`", plan_file(lambda: [1, 2]), rf"{PLN}: expected a JSON object"),
    Case("plan-unknown-field", PLAN, "`\"speed\": 3` at the top", plan_file(lambda: plan_dict() | {"speed": 3}),
         rf"{PLN}: speed: unknown field"),
    Case("plan-missing-field", PLAN, "no `global_batch`", plan_file(lambda: edit(plan_dict(), "global_batch", ...)),
         rf"{PLN}: global_batch: Field required"),
    Case("plan-string-batch", PLAN, "`roles[0].local_batch: \"4\"`",
         plan_file(lambda: edit(plan_dict(), "roles.0.local_batch", "4")),
         rf"{PLN}: roles\.0\.local_batch: Input should be a valid integer \(got '4'\)"),
    Case("plan-zero-micro-batch", PLAN, "`roles[1].micro_batch: 0`",
         plan_file(lambda: edit(plan_dict(), "roles.1.micro_batch", 0)), rf"{PLN}: roles\.1\.micro_batch: .*greater than 0"),
    Case("plan-micro-exceeds-local", PLAN, "`roles[1].micro_batch: 5` with `local_batch: 2`",
         plan_file(lambda: edit(plan_dict(), "roles.1.micro_batch", 5)),
         rf"{PLN}: roles\.1: micro_batch 5 exceeds local_batch 2"),
    Case("plan-unknown-precision", PLAN, "`roles[0].precision: fp8`",
         plan_file(lambda: edit(plan_dict(), "roles.0.precision", "fp8")),
         rf"{PLN}: roles\.0\.precision: Input should be 'fp32', 'bf16' or 'fp16' \(got 'fp8'\)"),
    Case("plan-no-roles", PLAN, "`roles: []`", plan_file(lambda: edit(plan_dict(), "roles", [])),
         rf"{PLN}: roles: .*at least 1 item"),
    Case("plan-batches-do-not-sum", PLAN, "`roles[2].local_batch: 3` (sum 9 ≠ 8)",
         plan_file(lambda: edit(edit(plan_dict(), "roles.2.local_batch", 3), "roles.2.micro_batch", 3)),
         rf"{PLN}: roles\.\*\.local_batch: pipelines' local batches \[4, 2, 3\] sum to 9, not global_batch 8"),
    Case("plan-offsets-overlap", PLAN, "`roles[2].sample_offset: 5`",
         plan_file(lambda: edit(plan_dict(), "roles.2.sample_offset", 5)),
         rf"{PLN}: roles\.2\.sample_offset: 5; .*starts at 6"),
    Case("plan-precision-card-lacks", PLAN, "`roles[1].precision: bf16` on a V100-16GB (checked against the catalog)",
         plan_file(lambda: edit(plan_dict(), "roles.1.precision", "bf16"), catalog=load_catalog),
         rf"{PLN}: roles\.1\.precision: V100-16GB has no bf16; use one of fp16, fp32"),
    Case("plan-unknown-gpu-type", PLAN, "`roles[0].gpu_type: Z100` (checked against the catalog)",
         plan_file(lambda: edit(plan_dict(), "roles.0.gpu_type", "Z100"), catalog=load_catalog),
         rf"{PLN}: roles\.0\.gpu_type: unknown GPU type 'Z100'; known: .*A100-80GB"),
    Case("plan-old-schema", PLAN, "`schema: 1`", plan_file(lambda: edit(plan_dict(), "schema", 1)),
         rf"{PLN}: schema: Input should be 2 \(got 1\)"),
    Case("plan-unknown-schedule", PLAN, "`schedule: interleaved`",
         plan_file(lambda: pipeline_plan_dict() | {"schedule": "interleaved"}),
         rf"{PLN}: schedule: unknown schedule 'interleaved'; use one of 1f1b, gpipe$"),
    Case("plan-bad-layer-range", PLAN, "`roles[1].layers: [3, 3]`",
         plan_file(lambda: edit(pipeline_plan_dict(), "roles.1.layers", [3, 3])),
         rf"{PLN}: roles\.1: layers \[3, 3\] must be \[first, last\) with 0 <= first < last"),
    Case("plan-layer-gap", PLAN, "`roles[1].layers: [4, 5]` after a stage ending at 3",
         plan_file(lambda: edit(pipeline_plan_dict(), "roles.1.layers", [4, 5])),
         rf"{PLN}: roles\.1\.layers: starts at layer 4; stage 1 of pipeline 0 must start at 3"),
    Case("plan-pipelines-differ-in-layers", PLAN, "pipeline 1 ends at layer 5, pipeline 0 at 4",
         plan_file(lambda: edit(pipeline_plan_dict(), "roles.3.layers", [3, 5])),
         rf"{PLN}: roles\.\*\.layers: pipelines end at layers \[4, 5\]; every pipeline must hold all the layers"),
    Case("plan-duplicate-stage", PLAN, "two stage-0 workers in pipeline 0",
         plan_file(lambda: edit(pipeline_plan_dict(), "roles.1.stage", 0)),
         rf"{PLN}: roles\.\*\.stage: pipeline 0 has stages \[0, 0\]; each of 0 to 1 exactly once"),
    Case("plan-stage-batch-differs", PLAN, "`roles[1].micro_batch: 1` in a pipeline of micro-batch 2",
         plan_file(lambda: edit(pipeline_plan_dict(), "roles.1.micro_batch", 1)),
         rf"{PLN}: roles\.1\.micro_batch: 1, but stage 0 of pipeline 0 \(roles\.0\) has 2"),
    Case("plan-missing-layers", PLAN, "`roles[1].layers: null` in a 2-stage pipeline",
         plan_file(lambda: edit(pipeline_plan_dict(), "roles.1.layers", None)),
         rf"{PLN}: roles\.1\.layers: missing; every stage of a 2-stage pipeline needs a layer range"),
    Case("plan-layers-short-of-workload", PLAN, "layers end at 4, workload has 6 (`n_layers=6`)",
         plan_file(pipeline_plan_dict, n_layers=lambda: 6), rf"{PLN}: roles\.1\.layers: pipeline 0 ends at layer 4; the workload has 6"),
    # hetero-ray tune.
    Case("submit-unknown-class", "hetero-ray submit", "`--class trian`",
         cli(lambda d: ["submit", "--class", "trian", "--", "echo"]),
         r"--class: unknown job class 'trian' \(did you mean 'train'\?\); use one of train, finetune, inference"),
    Case("submit-policy-unknown-type", "hetero-ray submit", "`--policy` preferring `A100` for training",
         cli(lambda d: [(d / "policy.yaml").write_text("classes: {train: {prefer: [A100]}}"), "submit", "--class",
                        "train", "--policy", str(d / "policy.yaml"), "--", "echo"][1:]),
         r"{dir}/policy\.yaml: classes\.train\.prefer: unknown GPU type 'A100' \(did you mean"),
    Case("tune-resume-nothing-started", "hetero-ray tune", "`--resume` in an output dir where no sweep started",
         cli(lambda d: ["tune", *train(lambda d: config(d))(d)[1:3], "--output-dir", str(d / "out"), "--resume"]),
         r"--resume: no sweep was started in {dir}/out \({dir}/out/tune/sweep\.json is missing\); start one without --resume"),
    Case("tune-zero-trials", "hetero-ray tune", "`--trials 0`",
         cli(lambda d: ["tune", *train(lambda d: config(d))(d)[1:3], "--trials", "0"]),
         r"--trials: 0; use at least 1"),
    # cluster.yaml.
    Case("cluster-unknown-key", CLUSTER, "`link_gbs: 600` on a node type", cluster_yaml(set_node_type("link_gbs", 600)),
         r"available_node_types\.a100-80gb-x8: Additional properties are not allowed \('link_gbs' was unexpected\)"),
    Case("cluster-max-workers-string", CLUSTER, "`max_workers: two` on a node type",
         cluster_yaml(set_node_type("max_workers", "two")), r"available_node_types\.a100-80gb-x8\.max_workers: 'two' is not of type 'integer'"),
    Case("cluster-labels-not-a-mapping", CLUSTER, "`labels: A100-80GB` (a string)",
         cluster_yaml(set_node_type("labels", "A100-80GB")), r"available_node_types\.a100-80gb-x8\.labels: 'A100-80GB' is not of type 'object'"),
    Case("cluster-negative-max-workers", CLUSTER, "`max_workers: -1`", cluster_yaml(lambda data: data.update(max_workers=-1)),
         r"cluster\.yaml: max_workers: -1 is less than the minimum of 0"),
    Case("cluster-head-type-missing", CLUSTER, "`head_node_type: gpu-head` (no such node type)",
         cluster_yaml(lambda data: data.update(head_node_type="gpu-head")),
         r"`head_node_type` must be one of `available_node_types`"),
]  # fmt: skip


# --- the contract -----------------------------------------------------------------------

_OUTCOMES: dict[str, tuple[Outcome, Path]] = {}


def outcome(case: Case, tmp_path_factory: pytest.TempPathFactory) -> tuple[Outcome, Path]:
    """Run ``case`` once per session in a fresh directory; check nothing was written there."""
    if case.id not in _OUTCOMES:
        d = tmp_path_factory.mktemp(case.id)
        result = case.run(d)
        # Inputs the case wrote are allowed; anything else (a result file, a run directory) is not.
        inputs = {"run.yaml", "plan.json", "gpus.yaml", "cluster.yaml", "policy.yaml"}
        assert {p.name for p in d.iterdir()} <= inputs, sorted(p.name for p in d.iterdir())
        _OUTCOMES[case.id] = (result, d)
    return _OUTCOMES[case.id]


def error_line(case: Case, result: Outcome) -> str:
    """The one error line; argparse cases may print their usage lines before it."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    argparse_usage = [line for line in lines if line.startswith("usage:") or line.startswith(" ")]
    errors = [line for line in lines if line not in argparse_usage]
    assert len(errors) == 1, result.stderr
    return errors[0]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_gets_one_line(case: Case, tmp_path_factory: pytest.TempPathFactory) -> None:
    result, d = outcome(case, tmp_path_factory)
    assert not result.traceback, result.stderr
    line = error_line(case, result)
    assert re.search(case.pattern.format(dir=re.escape(str(d))), line), line
    if result.exit_code != NO_EXIT:
        assert result.exit_code == 2, result.stderr
        assert re.match(r"hetero-ray( \w+)?: error: ", line), line


def test_model_too_big_names_the_need(tmp_path_factory: pytest.TempPathFactory) -> None:
    result, _ = outcome(next(c for c in CASES if c.id == "model-fits-no-device"), tmp_path_factory)
    need, stages = re.search(r"needs ([\d.]+) GiB .*\((\d+) pipeline stages", result.stderr).groups()
    # 38,680,805,376 parameters × 16 bytes of static state are 576.4 GiB, shared by the stages; activations on top.
    assert float(need) > 576.4 / int(stages)


def test_good_inputs_pass_the_same_entry_points(tmp_path: Path) -> None:
    """Control: each case fails because of its own change, not the base it changes."""
    (tmp_path / "run.yaml").write_text(config(tmp_path))
    prepared = prepare(load_config(tmp_path / "run.yaml"))
    assert [r.gpu_type for r in prepared.plan.roles] == ["A100-80GB", "V100-16GB"]
    for make in (plan_dict, pipeline_plan_dict):
        (tmp_path / "plan.json").write_text(json.dumps(make()))
        plan = load_plan(
            tmp_path / "plan.json", catalog=load_catalog(), n_layers=4 if make is pipeline_plan_dict else None
        )
        assert plan.global_batch == 8
    assert load_plan(tmp_path / "plan.json").is_pipelined
    # Both pipelines' stage 0 split alike: stages of two members, then one, in each pipeline.
    alike = split_differs_plan()
    alike["roles"][3:4] = [{**alike["roles"][k], "pipeline": 1, "sample_offset": 4} for k in range(2)]
    (tmp_path / "plan.json").write_text(json.dumps(alike))
    assert load_plan(tmp_path / "plan.json", n_layers=4).tensor_parallel == 2
    cluster_yaml(lambda data: None)(tmp_path)  # the unchanged cluster.yaml validates (no error line)
    assert cluster_yaml(lambda data: None)(tmp_path).stderr == ""


def render_doc(tmp_path_factory: pytest.TempPathFactory) -> str:
    rows = []
    for case in CASES:
        result, d = outcome(case, tmp_path_factory)
        line = error_line(case, result).replace(str(d), "<dir>").replace(str(REPO), ".").replace("|", "¦")
        rows.append(f"| {case.entry} | {case.shown} | `` {line} `` | {result.exit_code} |")
    head = [
        "# Bad inputs and the line each produces",
        "",
        "Generated by `tests/test_bad_input.py` (it fails when this file differs from what the cases produce;",
        "`HETERO_RAY_UPDATE_DOCS=1 python -m pytest tests/test_bad_input.py` rewrites it). Every case runs",
        "through its real entry point; each produces exactly one error line and writes nothing (no result",
        "file, no run directory). A CLI exits with code 2; a library call (`load_plan`, Ray's cluster.yaml",
        f"validator) raises, shown as {NO_EXIT}. `<dir>` is the case's temporary directory. argparse prints",
        "its usage lines before the error line for command-line mistakes.",
        "",
        f"{len(CASES)} cases.",
        "",
        "| entry point | bad input | error line | exit code |",
        "|---|---|---|---|",
    ]
    return "\n".join([*head, *rows]) + "\n"


def test_bad_inputs_doc_is_current(tmp_path_factory: pytest.TempPathFactory) -> None:
    text = render_doc(tmp_path_factory)
    if os.environ.get("HETERO_RAY_UPDATE_DOCS") == "1":
        DOC.write_text(text)
    assert DOC.exists() and DOC.read_text() == text, (
        "docs/bad-inputs.md is stale: HETERO_RAY_UPDATE_DOCS=1 python -m pytest tests/test_bad_input.py"
    )
    assert len(CASES) >= 50
