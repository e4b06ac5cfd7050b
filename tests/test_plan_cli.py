"""`hetero-ray plan` and `hetero-ray simulate`: plans written as Plan JSON; bad input is one line, exit 2, no file."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from hetero_ray.cli import main
from hetero_ray.cluster.catalog import load_catalog
from hetero_ray.plan.plan import Plan
from hetero_ray.plan.plan_file import load_plan

TINY = '{"n_layer": 2, "n_embd": 64, "n_head": 4, "block_size": 64, "corpus_bytes": 200000}'
# One block of 12 × 10240² ≈ 1.26 G parameters: 18.8 GiB of weights, gradients and Adam state on one device.
HUGE = '{"n_layer": 1, "n_embd": 10240, "n_head": 8, "block_size": 16, "corpus_bytes": 20000}'

# As small as Ray's launcher schema allows (plan refuses what `ray up` would).
CLUSTER = """\
cluster_name: plan-test
provider: {type: aws, region: us-west-2}
available_node_types:
  head: {resources: {CPU: 8, GPU: 0}, max_workers: 0, node_config: {}}
  a100: {resources: {GPU: 2}, max_workers: 1, node_config: {},
         labels: {hetero-ray/gpu-type: A100-80GB, hetero-ray/network-gbps: "100"}}
  v100: {resources: {GPU: 4}, max_workers: 1, node_config: {},
         labels: {hetero-ray/gpu-type: V100-16GB, hetero-ray/network-gbps: "25"}}
"""


@pytest.fixture
def cluster(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(CLUSTER)
    return path


def test_plan_writes_a_plan_that_from_dict_reads(cluster: Path, tmp_path: Path, capsys):
    out = tmp_path / "plans" / "plan.json"
    argv = ["plan", "--cluster", str(cluster), "--model-options", TINY, "--global-batch", "48", "--output", str(out)]
    assert main([*argv, "--json", "--top", "3"]) == 0
    printed = json.loads(capsys.readouterr().out)
    plan = Plan.from_dict(json.loads(out.read_text()))
    # What `jobs/train.py --plan` reads: the file passes its checks.
    assert load_plan(str(out), catalog=load_catalog(), n_layers=4) == plan
    assert plan == Plan.from_dict(printed["plans"][0])
    assert plan.global_batch == 48 and sum(r.gpu_type == "V100-16GB" for r in plan.roles) <= 4
    assert len(printed["plans"]) <= 3 and plan.explanation
    # The table form prints the chosen plan's explanation too (replacing the file needs --force).
    assert main([*argv, "--force"]) == 0
    assert "chosen:" in capsys.readouterr().out


def test_plan_from_a_run_config_is_the_plan_train_makes_and_records_its_workload(tmp_path: Path, capsys):
    """`plan --config run.yaml` plans the config's devices, workload and batch through the path `train` takes;
    the file names the workload, and `train --plan` accepts it for that config."""
    import yaml

    from hetero_ray.config import load_config
    from hetero_ray.train.prepare import given_plan, prepare

    run = tmp_path / "run.yaml"
    options = json.loads(TINY)
    run.write_text(
        yaml.safe_dump(
            {
                "devices": {"A100-80GB": 2, "V100-16GB": 4},
                "emulation": {"dilation": 1000},
                "workload": {"name": "gpt", "options": options},
                "train": {"global_batch": 48},
                "run": {"name": "plan-test", "storage_path": str(tmp_path / "runs")},
            }
        )
    )
    out = tmp_path / "plan.json"
    assert main(["plan", "--config", str(run), "--output", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    plan = load_plan(str(out), catalog=load_catalog())
    cfg = load_config(str(run))
    prepared = prepare(cfg)
    assert plan == Plan.from_dict(printed["plans"][0]) == prepared.plan
    assert plan.workload == {"name": "gpt", "options": options}
    assert given_plan(str(out), cfg, prepared.catalog, prepared.footprint).roles == plan.roles
    assert main(["plan", "--config", str(run), "--cluster", "cluster.yaml"]) == 2
    assert "--config and --cluster" in capsys.readouterr().err
    assert main(["plan", "--config", str(run), "--global-batch", "96", "--model", "gpt"]) == 2
    assert "--global-batch: --config plans what the run config says" in capsys.readouterr().err


def test_output_has_normal_permissions_and_is_not_replaced_without_force(cluster: Path, tmp_path: Path, capsys):
    out = tmp_path / "plan.json"
    argv = ["plan", "--cluster", str(cluster), "--model-options", TINY, "--global-batch", "48", "--output", str(out)]
    umask = os.umask(0o022)
    try:
        assert main(argv) == 0
    finally:
        os.umask(umask)
    # What `open()` would have made under umask 022, not mkstemp's 0600: the user's group may read it.
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    out.write_text("mine")
    assert main(argv) == 2
    assert "exists; pass --force to replace it" in capsys.readouterr().err
    assert out.read_text() == "mine"
    assert main([*argv, "--force"]) == 0
    assert json.loads(out.read_text())["global_batch"] == 48
    # Nothing left beside it: no temporary file from either run.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cluster.yaml", "plan.json"]


def test_simulate_devices_and_mix(tmp_path: Path, capsys):
    args = ["--model-options", TINY, "--global-batch", "64", "--json"]
    assert main(["simulate", "--devices", "V100-16GB=6,A100-80GB=2", "--inter-node-gbps", "10", *args]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["modelled"] and result["devices"] == {"V100-16GB": 6, "A100-80GB": 2}
    Plan.from_dict(result["plans"][0])
    assert main(["simulate", "--mix", "A100-80GB,V100-16GB", "--budget-gpus", "4", *args]) == 0
    rows = json.loads(capsys.readouterr().out)["mixes"]
    assert len(rows) == 5  # 0..4 A100s
    per_usd = [r["samples_per_usd"] for r in rows]
    assert per_usd == sorted(per_usd, reverse=True)
    # Dollars are the catalog's per-GPU prices times the counts.
    four_v100 = next(r for r in rows if r["devices"] == {"V100-16GB": 4})
    assert four_v100["usd_per_hour"] == pytest.approx(4 * 3.06)
    # --mix-step counts every type but the last in steps: 0, 2 or 4 A100s.
    assert main(["simulate", "--mix", "A100-80GB,V100-16GB", "--budget-gpus", "4", "--mix-step", "2", *args]) == 0
    stepped = json.loads(capsys.readouterr().out)["mixes"]
    assert sorted(r["devices"].get("A100-80GB", 0) for r in stepped) == [0, 2, 4]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--model-options", "{n_layer: 2}"], "--model-options: not valid JSON"),
        (["plan", "--model-options", TINY, "--global-batch", "0"], "--global-batch: must be >= 1 (got 0)"),
        (["plan", "--model-options", TINY, "--model", "nosuch"], "workload.name: unknown workload 'nosuch'"),
        (
            ["simulate", "--devices", "V100-16GB:4", "--model-options", TINY],
            "--devices: 'V100-16GB:4' is not TYPE=COUNT",
        ),
        (["simulate", "--devices", "B200=4", "--model-options", TINY], "unknown GPU type 'B200'"),
        (["simulate", "--model-options", TINY], "simulate: give either --devices"),
        (["simulate", "--mix", "A100-80GB,T4", "--budget-gpus", "2", "--model-options", TINY], "T4 has no price"),
        (
            ["simulate", "--devices", "T4=2", "--model-options", HUGE],
            "model needs 18.8 GiB per device at micro-batch 1",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2_nothing_written(cluster: Path, tmp_path: Path, capsys, argv, message):
    out = tmp_path / "out.json"
    extra = ["--cluster", str(cluster)] if argv[0] == "plan" else []
    assert main([*argv, *extra, "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hetero-ray: error: ") and "\n" not in err
    assert message in err
    assert not out.exists() and list(tmp_path.iterdir()) == [cluster]


def test_missing_cluster_file(tmp_path: Path, capsys):
    assert main(["plan", "--cluster", str(tmp_path / "nope.yaml"), "--output", str(tmp_path / "p.json")]) == 2
    assert "nope.yaml: cannot read cluster file" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_a_run_config_lets_the_planner_split_a_block_no_v100_holds(tmp_path: Path, capsys):
    """A block whose 18.8 GiB of state no V100-16GB holds: on V100s alone the planner finds no plan; with
    `train.max_tensor_parallel: 4` it splits every block over groups of a node's V100s, which `train` would run
    (the plan the config route makes), and says which degree it chose against the others."""
    import yaml

    def plan_for(max_tp: int) -> int:
        run = tmp_path / f"run-{max_tp}.yaml"
        config = {
            "devices": {"V100-16GB": 4},
            "workload": {"name": "gpt", "options": json.loads(HUGE)},
            "train": {"global_batch": 8, "max_tensor_parallel": max_tp},
            "run": {"name": "plan-test", "storage_path": str(tmp_path / "runs")},
        }
        run.write_text(yaml.safe_dump(config))
        return main(["plan", "--config", str(run), "--output", str(tmp_path / f"plan-{max_tp}.json"), "--json"])

    assert plan_for(1) == 2
    assert "V100-16GB has 16 GiB" in capsys.readouterr().err
    assert plan_for(4) == 0
    plan = Plan.from_dict(json.loads(capsys.readouterr().out)["plans"][0])
    assert plan.tensor_parallel in (2, 4) and len(plan.roles) == 4
    assert all(r.predicted_memory_bytes <= r.memory_cap_bytes for r in plan.roles)
    assert f"tensor-parallel degree {plan.tensor_parallel}" in plan.explanation
    assert "none fits at degree 1" in plan.explanation


def test_a_run_config_lets_the_planner_split_a_block_across_an_a100_and_a_v100(tmp_path: Path, capsys):
    """The same block on an A100-80GB and a V100-16GB: the V100 holds no block alone and has no V100 to pair
    with, so it gets the head alone; with `train.tensor_parallel_across: [[A100-80GB, V100-16GB]]` the planner
    splits the whole model over the two, the V100's part in proportion to its speed, and the step is shorter
    (the plan `train` would run)."""
    import yaml

    def planned(across: list) -> Plan:
        run = tmp_path / "run.yaml"
        config = {
            "devices": {"A100-80GB": 1, "V100-16GB": 1},
            "workload": {"name": "gpt", "options": json.loads(HUGE)},
            "train": {"global_batch": 8, "max_tensor_parallel": 2, "tensor_parallel_across": across},
            "run": {"name": "plan-test", "storage_path": str(tmp_path / "runs")},
        }
        run.write_text(yaml.safe_dump(config))
        assert main(["plan", "--config", str(run), "--output", str(tmp_path / "plan.json"), "--json", "--force"]) == 0
        return Plan.from_dict(json.loads(capsys.readouterr().out)["plans"][0])

    alone = planned([])
    assert [(r.gpu_type, r.layers) for r in alone.roles] == [("A100-80GB", (0, 2)), ("V100-16GB", (2, 3))]
    split = planned([["A100-80GB", "V100-16GB"]])
    assert split.predicted_step_s < alone.predicted_step_s
    assert [(r.gpu_type, r.tp_rank) for r in split.roles] == [("A100-80GB", 0), ("V100-16GB", 1)]
    a100, v100 = split.roles[0].tp_weights
    assert 0.5 < a100 < 0.9 and a100 + v100 == pytest.approx(1.0)
    assert all(r.predicted_memory_bytes <= r.memory_cap_bytes for r in split.roles)
    assert "split across its types by speed" in split.explanation


def planned_from_config(tmp_path: Path, capsys, devices: dict, gpt: dict, global_batch: int, stage) -> Plan:
    """`hetero-ray plan --config` on a run config of ``devices`` and the GPT of ``gpt`` at ZeRO ``stage`` (100
    Gbit/s between devices): the chosen plan."""
    import yaml

    run = tmp_path / f"run-{stage}.yaml"
    config = {
        "devices": devices,
        "workload": {"name": "gpt", "options": gpt},
        "train": {"global_batch": global_batch},
        "optimizer": {"zero_stage": stage},
        "link": {"bandwidth_gbps": 100},
        "run": {"name": "plan-test", "storage_path": str(tmp_path / "runs")},
    }
    run.write_text(yaml.safe_dump(config))
    assert main(["plan", "--config", str(run), "--output", str(tmp_path / f"plan-{stage}.json"), "--json"]) == 0
    return Plan.from_dict(json.loads(capsys.readouterr().out)["plans"][0])


def test_a_run_config_shards_by_memory_at_the_zero_stage_it_names_or_the_fastest(tmp_path: Path, capsys):
    """A GPT of 1.6 G parameters, whose 26 GB of state only the A100s hold whole: `optimizer.zero_stage: 3`
    trains it on all six cards, each within its memory; `auto` weighs every stage and says so."""

    def plan_for(stage) -> Plan:
        gpt = {"n_layer": 8, "n_head": 32, "n_embd": 4096, "block_size": 256}
        return planned_from_config(tmp_path, capsys, {"A100-80GB": 2, "V100-16GB": 4}, gpt, 24, stage)

    three = plan_for(3)
    assert three.zero_stage == 3 and len(three.roles) == 6 and "ZeRO-3:" in three.explanation
    assert all(r.predicted_memory_bytes <= r.memory_cap_bytes for r in three.roles)
    auto = plan_for("auto")
    assert f"ZeRO stage {auto.zero_stage} (" in auto.explanation
    assert all(f"at ZeRO-{s}" in auto.explanation for s in range(4) if s != auto.zero_stage)


def test_zero_stage_1_shards_each_pipeline_stage_over_its_replicas_when_that_is_faster(tmp_path: Path, capsys):
    """8 A100 + 16 V100 + 16 T4 and a GPT of 9.1 G parameters: without ZeRO the T4s' 8-stage pipelines do not
    fit and 8 T4s stay unused; `optimizer.zero_stage: 1` shards each stage's Adam state over the replicas of
    its pipeline (half each on the V100s and T4s), every device trains, each within its memory, and the step
    is shorter; `auto` takes it and says why."""

    def plan_for(stage) -> Plan:
        gpt = {"n_layer": 24, "n_head": 44, "n_embd": 5632, "block_size": 512}
        return planned_from_config(tmp_path, capsys, {"A100-80GB": 8, "V100-16GB": 16, "T4": 16}, gpt, 256, stage)

    unsharded, sharded = plan_for(0), plan_for(1)
    assert sum(e.count for e in unsharded.excluded if e.gpu_type == "T4") == 8
    assert sharded.zero_stage == 1 and sharded.is_pipelined and len(sharded.roles) == 40 and not sharded.excluded
    assert all(r.predicted_memory_bytes <= r.memory_cap_bytes for r in sharded.roles)
    assert "1/2 each over 2 × (8 × T4)" in sharded.explanation
    assert sharded.predicted_step_s < unsharded.predicted_step_s
    auto = plan_for("auto")
    assert auto.zero_stage == 1 and auto.predicted_step_s == sharded.predicted_step_s
    assert "ZeRO stage 1 (" in auto.explanation and "at ZeRO-0" in auto.explanation


def test_a_cluster_file_plans_data_parallelism_sharded_at_the_zero_stage_asked(cluster: Path, tmp_path: Path, capsys):
    """`--zero-stage 3` plans data parallelism over every device of the file, sharded by memory; `auto` ranks
    every stage's plan beside the placement search's and says which stage won against the others."""
    argv = ["plan", "--cluster", str(cluster), "--model-options", TINY, "--global-batch", "48", "--json"]
    assert main([*argv, "--zero-stage", "3", "--output", str(tmp_path / "three.json")]) == 0
    (three,) = [Plan.from_dict(p) for p in json.loads(capsys.readouterr().out)["plans"]]
    assert three.zero_stage == 3 and len(three.roles) == 6 and not three.is_pipelined
    assert main([*argv, "--zero-stage", "auto", "--output", str(tmp_path / "auto.json"), "--top", "8"]) == 0
    plans = [Plan.from_dict(p) for p in json.loads(capsys.readouterr().out)["plans"]]
    assert f"ZeRO stage {plans[0].zero_stage} (" in plans[0].explanation
    assert all(f"at ZeRO-{s}" in plans[0].explanation for s in range(4) if s != plans[0].zero_stage)
    assert [p.predicted_step_s for p in plans[1:]] == sorted(p.predicted_step_s for p in plans[1:])
