"""The share sweep: its search space, result files and best config (fast), and one small sweep on an emulated cluster.

The end-to-end test starts one emulated Ray cluster for the module (1 × A100-80GB +
1 × V100-16GB) and runs two short trials through Tune, Optuna and ASHA.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import yaml
from rich.console import Console

from hetero_ray.cluster.catalog import load_catalog
from hetero_ray.config import load_config, parse_config
from hetero_ray.perf.footprint import measure_footprint
from hetero_ray.plan.data_parallel import plan_data_parallel
from hetero_ray.workloads import build_workload
from tuning.precision import choose
from tuning.results import best_trial, trials_frame, write_best_config, write_csv, write_plot
from tuning.settings import SweepError, SweepSettings, add_arguments, settings_from
from tuning.space import plan_speeds, share_space, weights_of
from tuning.sweep import command, predicted_speeds
from tuning.trial import trial_config, window_result

WORKLOAD = {
    "name": "gpt",
    "options": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "corpus_bytes": 200_000},
}


def config(devices=None, **train) -> dict:
    return {
        "devices": devices or {"A100-80GB": 1, "V100-16GB": 1},
        "emulation": {"dilation": "auto", "gpus_per_node": 2},
        "workload": WORKLOAD,
        "train": {"global_batch": 24, "steps": 100, "precision": "auto", **train},
        "run": {"name": "tune-test", "storage_path": "/tmp/hetero-ray-tune-test"},
    }


def test_space_centres_on_the_planners_speeds():
    cfg = parse_config(config({"V100-16GB": 2, "A100-80GB": 1, "T4": 1}))
    fp = measure_footprint(lambda: build_workload(cfg.workload.name, cfg.workload.options))
    plan = plan_data_parallel(
        ["V100-16GB", "V100-16GB", "A100-80GB", "T4"], load_catalog(), fp, global_batch=24, split="equal"
    )
    speeds = plan_speeds(plan)
    space = share_space(cfg, speeds, spread=2.0)
    # The slowest type is the reference, at weight 1; the others at their speed ratio, bounded ×/÷ spread.
    assert space.reference == "T4"
    assert space.predicted["A100-80GB"] == pytest.approx(speeds["A100-80GB"] / speeds["T4"])
    lo, hi = space.bounds["V100-16GB"]
    assert lo * 2 == pytest.approx(space.predicted["V100-16GB"]) == pytest.approx(hi / 2)
    assert set(space.tune_space()) == {"weight:A100-80GB", "weight:V100-16GB"}
    assert weights_of(space.first_point(), space.reference) == pytest.approx(space.predicted)
    # bf16 A100 : fp16 V100 is the catalog's 312 : 125 TFLOP/s.
    assert space.predicted["A100-80GB"] / space.predicted["V100-16GB"] == pytest.approx(312 / 125)
    grid = space.grid("A100-80GB", 5)
    assert grid[0] == pytest.approx(space.bounds["A100-80GB"][0]) and grid[-1] == pytest.approx(
        space.bounds["A100-80GB"][1]
    )
    assert grid[2] == pytest.approx(space.predicted["A100-80GB"])


@pytest.mark.parametrize(
    ("devices", "spread", "caps", "match"),
    [
        ({"A100-80GB": 2}, 3.0, (), "at least two types"),
        (None, 1.0, (), "factor > 1"),
        (None, 3.0, (0, 8), "must be >= 1"),
    ],
)
def test_space_rejects_bad_input(devices, spread, caps, match):
    cfg = parse_config(config(devices))
    with pytest.raises(SweepError, match=match):
        share_space(cfg, dict.fromkeys(cfg.devices, 1.0), spread=spread, micro_batch_caps=caps)


def test_micro_batch_caps_are_searched_and_reach_the_trial():
    cfg = parse_config(config())
    space = share_space(cfg, {"A100-80GB": 2.0, "V100-16GB": 1.0}, micro_batch_caps=(16, 4))
    assert space.tune_space()["max_micro_batch"].categories == [4, 16]
    trial = trial_config(cfg, {"weight:A100-80GB": 3.0, "max_micro_batch": 4}, space.reference, 1234.0)
    assert trial.train.split == {"V100-16GB": 1.0, "A100-80GB": 3.0}
    assert trial.train.max_micro_batch == 4 and trial.emulation.dilation == 1234.0
    assert trial.run.name != cfg.run.name


def test_a_window_reports_each_types_measured_speed():
    devices = [
        {
            "gpu_type": "A100-80GB",
            "local_batch": 18,
            "micro_batch": 18,
            "overrun_steps": 0,
            "utilisation": 0.9,
            "step_s": 2.0,
        },
        {
            "gpu_type": "V100-16GB",
            "local_batch": 3,
            "micro_batch": 3,
            "overrun_steps": 0,
            "utilisation": 0.5,
            "step_s": 2.0,
        },
        {
            "gpu_type": "V100-16GB",
            "local_batch": 3,
            "micro_batch": 3,
            "overrun_steps": 0,
            "utilisation": 1.0,
            "step_s": 2.0,
        },
    ]
    metrics = {"samples_per_s": 12.0, "step_s": 2.0, "step": 5, "emulated": True, "devices": devices}
    result = window_result(metrics, 2, final=True)
    assert result["speed:A100-80GB"] == pytest.approx(10.0)  # 18 samples in 1.8 s of its own compute
    assert result["speed:V100-16GB"] == pytest.approx((3.0 + 1.5) / 2)
    space = share_space(parse_config(config()), {"A100-80GB": 2.5, "V100-16GB": 1.0}, spread=3.0)
    speeds = {t.removeprefix("speed:"): v for t, v in result.items() if t.startswith("speed:")}
    assert space.measured_point(speeds, like={"weight:A100-80GB": 2.5}) == {
        "weight:A100-80GB": pytest.approx(10 / 2.25)
    }
    assert space.measured_point({"A100-80GB": 40.0, "V100-16GB": 2.0}, like={}) == {"weight:A100-80GB": 7.5}  # edge
    assert space.measured_point({"A100-80GB": 4.0, "V100-16GB": 2.0}, like={}) == {"weight:A100-80GB": 2.0}
    assert space.measured_point({"A100-80GB": 4.0}, like={}) is None


def _completed(weight: float, rate: float, speeds: dict[str, float]) -> dict:
    return {
        "samples_per_s": rate,
        "config": {"weight:A100-80GB": weight},
        **{f"speed:{t}": v for t, v in speeds.items()},
    }


@pytest.mark.parametrize(
    ("speeds", "second"),
    [
        ({"A100-80GB": 45.0, "V100-16GB": 10.0}, 4.5),  # the devices run 4.5 : 1, the prediction said 2.5
        ({"A100-80GB": 25.5, "V100-16GB": 10.0}, None),  # they run as predicted: no repeat, TPE goes on
    ],
)
def test_the_search_follows_the_splits_the_trials_measured(tmp_path, speeds, second):
    """Through Tune's searcher interface: the prediction, then the split by the first trial's measured speeds
    (unless that is the prediction again), then the split by that trial's speeds while it is new, then TPE
    inside the space; Optuna is told every result, and the state survives Tune's save and restore (what
    --resume loads)."""
    from tuning.search import MeasuredBalanceSearch

    space = share_space(parse_config(config()), {"A100-80GB": 2.5, "V100-16GB": 1.0}, spread=3.0)
    search = MeasuredBalanceSearch(space, seed=0)
    search.set_search_properties("samples_per_s", "max", space.tune_space())
    assert search.suggest("t0") == space.first_point()
    search.on_trial_complete("t0", _completed(2.5, 400.0, speeds))
    search.save(str(tmp_path / "searcher.pkl"))
    restored = MeasuredBalanceSearch(space)
    restored.restore(str(tmp_path / "searcher.pkl"))
    point = restored.suggest("t1")
    lo, hi = space.bounds["A100-80GB"]
    if second is None:
        assert point != space.first_point() and lo <= point["weight:A100-80GB"] <= hi
        return
    assert point == {"weight:A100-80GB": pytest.approx(second)}
    restored.on_trial_result("t1", {"samples_per_s": 500.0})
    # At 4.5 the A100s get more of the batch and run faster per sample: their speeds call for 5 : 1.
    restored.on_trial_complete("t1", _completed(second, 520.0, {**speeds, "A100-80GB": 50.0}))
    assert restored.suggest("t2") == {"weight:A100-80GB": pytest.approx(5.0)}
    # 5 : 1 measures 5.1 : 1, within 5 % of a point tried: the chain ends and TPE goes on.
    restored.on_trial_complete("t2", _completed(5.0, 540.0, {**speeds, "A100-80GB": 51.0}))
    fourth = restored.suggest("t3")
    assert lo <= fourth["weight:A100-80GB"] <= hi and fourth["weight:A100-80GB"] not in (2.5, second, 5.0)
    # Optuna knows every result: the prediction's and the measured points'.
    assert sorted(t.value for t in restored._ot_study.trials if t.value is not None) == [400.0, 520.0, 540.0]


def _timed(shares: dict[str, int]) -> dict:
    """A trial's result on devices whose compute takes fixed + per-sample × share: A100s 0.1 s + 5 ms a sample,
    V100s 0.05 s + 40 ms."""
    line = {"A100-80GB": (0.1, 0.005), "V100-16GB": (0.05, 0.04)}
    weight = shares["A100-80GB"] / shares["V100-16GB"]
    return {
        "samples_per_s": 100.0,
        "config": {"weight:A100-80GB": weight},
        **{f"share:{t}": n for t, n in shares.items()},
        **{f"speed:{t}": n / (line[t][0] + line[t][1] * n) for t, n in shares.items()},
    }


def test_from_two_measured_splits_the_search_goes_where_every_device_finishes_together():
    """Two trials' shares and compute times fix each type's fixed and per-sample time; the next point is the
    split at which all four devices finish together: A100s 9.56, V100s 2.44 of a batch of 24 (0.148 s each). The
    second trial's speeds alone would say 3.52 : 1: a fixed cost makes a split by speed undershoot."""
    from tuning.search import MeasuredBalanceSearch

    space = share_space(parse_config(config({"A100-80GB": 2, "V100-16GB": 2})), {"A100-80GB": 2.5, "V100-16GB": 1})
    search = MeasuredBalanceSearch(space, seed=0)
    search.set_search_properties("samples_per_s", "max", space.tune_space())
    search.suggest("t0")
    search.on_trial_complete("t0", _timed({"A100-80GB": 8, "V100-16GB": 4}))
    second = search.suggest("t1")
    assert second == {"weight:A100-80GB": pytest.approx((8 / 0.14) / (4 / 0.21))}  # one trial: by its speeds
    search.on_trial_complete("t1", _timed({"A100-80GB": 9, "V100-16GB": 3}))
    common = (24 + 2 * 0.1 / 0.005 + 2 * 0.05 / 0.04) / (2 / 0.005 + 2 / 0.04)
    balanced = ((common - 0.1) / 0.005) / ((common - 0.05) / 0.04)
    assert balanced == pytest.approx(9.556 / 2.444, rel=1e-3)
    assert search.suggest("t2") == {"weight:A100-80GB": pytest.approx(balanced)}


# Real Tune experiments, run by a stand-in trainable in their own process (a local Ray), read back from disk as
# ResultGrids: "mixed" has a complete trial, one that ASHA would have stopped after one window, another complete
# one and one that fails before its first report; "partial" only the early-stopped and the failed ones.
SCRIPTED = textwrap.dedent(
    """
    import os, secrets, sys, tempfile
    from pathlib import Path

    tmp = tempfile.mkdtemp(prefix="hr-")
    (Path(tmp) / "token").write_text(secrets.token_hex(32))
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(Path(tmp) / "token"))
    os.environ.pop("RAY_ADDRESS", None)
    import ray
    from ray import tune
    from tuning.trial import window_result

    TRIALS = {2.5: (3, 40.0, 17), 1.1: (1, 20.0, 13), 4.0: (3, 30.0, 19)}

    def trainable(config):
        if config["weight:A100-80GB"] not in TRIALS:
            raise RuntimeError("no worker could start")
        windows, rate, a100 = TRIALS[config["weight:A100-80GB"]]
        devices = [
            {"gpu_type": t, "local_batch": b, "micro_batch": b, "overrun_steps": 0, "utilisation": 0.9, "step_s": 24 / rate}
            for t, b in (("A100-80GB", a100), ("V100-16GB", 24 - a100))
        ]
        for w in range(1, windows + 1):
            metrics = {"samples_per_s": rate, "step_s": 24 / rate, "step": 4 * w - 1, "emulated": True, "devices": devices}
            tune.report(window_result(metrics, w, final=w == 3))

    ray.init(address="local", _temp_dir=tmp, num_cpus=1, object_store_memory=80 * 2**20, include_dashboard=False)
    for name, weights in (("mixed", [2.5, 1.1, 4.0, 0.5]), ("partial", [1.1, 0.5])):
        tune.Tuner(
            trainable,
            param_space={"weight:A100-80GB": tune.grid_search(weights)},
            tune_config=tune.TuneConfig(max_concurrent_trials=1),
            run_config=tune.RunConfig(name=name, storage_path=sys.argv[1], verbose=0),
        ).fit()
    ray.shutdown()
    """
)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("tune")
    done = subprocess.run([sys.executable, "-c", SCRIPTED, str(store)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return store


def _grid(store: Path, name: str):
    from ray.tune import ExperimentAnalysis, ResultGrid

    return ResultGrid(ExperimentAnalysis(str(store / name)))


def test_results_table_plot_and_best_config(scripted, tmp_path):
    base = config(split="proportional")
    cfg = parse_config(base)
    space = share_space(cfg, {"A100-80GB": 2.5, "V100-16GB": 1.0})
    grid = _grid(scripted, "mixed")
    trials = trials_frame(grid, space)
    # Tune's order, each trial's last window; the failed one is kept, with its error's last line.
    assert trials["weight:A100-80GB"].tolist() == [2.5, 1.1, 4.0, 0.5]
    assert list(trials["complete"]) == [True, False, True, False]
    assert trials["windows"].tolist()[:3] == [3, 1, 3] and trials["share:A100-80GB"].tolist()[:3] == [17, 13, 19]
    assert trials["error"].isna().tolist() == [True, True, True, False]
    assert "RuntimeError: no worker could start" in trials["error"].iloc[3]
    best = best_trial(grid, trials)
    assert best["samples_per_s"] == 40.0 and best["weight:A100-80GB"] == 2.5
    write_csv(trials, tmp_path / "t.csv")
    assert pd.read_csv(tmp_path / "t.csv")["samples_per_s"].tolist()[:3] == [40.0, 20.0, 30.0]
    write_plot(trials, space, tmp_path / "t.png", emulated=True)
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    write_best_config(base, best, space, tmp_path / "best.yaml")
    loaded = load_config(tmp_path / "best.yaml")
    assert loaded.train.split == {"A100-80GB": 2.5, "V100-16GB": 1.0}
    # The user's run stays as written: only the split changes.
    assert loaded.train.steps == 100 and loaded.emulation.dilation == "auto"


def test_no_complete_trial_is_an_error(scripted):
    cfg = parse_config(config())
    space = share_space(cfg, {"A100-80GB": 2.5, "V100-16GB": 1.0})
    grid = _grid(scripted, "partial")
    trials = trials_frame(grid, space)
    assert not trials["complete"].any()
    with pytest.raises(SweepError, match="no trial ran"):
        best_trial(grid, trials)


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--trials", "0"], "--trials: 0"),
        (["--steps", "10", "--windows", "3"], "multiple of windows"),
        (["--micro-batch-caps", "8,x"], "--micro-batch-caps"),
        (["--history", "/nonexistent.parquet"], "--history"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(tmp_path, capsys, argv, match):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config()))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--config", str(path), *argv])
    assert command(args, Console(quiet=True)) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and match in err, err
    with pytest.raises(SweepError):
        settings_from(args)


def test_an_earlier_sweeps_files_are_kept_without_force(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config()))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "best.yaml").write_text("mine")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--config", str(path), "--output-dir", str(tmp_path / "out"), "--address", "127.0.0.1:1"]
    assert command(parser.parse_args(argv), Console(quiet=True)) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == f"hetero-ray: error: --output-dir: {tmp_path / 'out' / 'best.yaml'} exists; pass --force to replace it, or name another path"
    )
    assert (tmp_path / "out" / "best.yaml").read_text() == "mine"


def test_one_type_config_is_refused_before_any_cluster(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config({"A100-80GB": 2})))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert command(parser.parse_args(["--config", str(path), "--address", "127.0.0.1:1"]), Console(quiet=True)) == 2
    assert "at least two types" in capsys.readouterr().err


@pytest.fixture(scope="module")
def cluster():
    from hetero_ray.cluster.emulation import EmulatedCluster

    with EmulatedCluster({"A100-80GB": 1, "V100-16GB": 1}, gpus_per_node=2) as c:
        yield c


def _tune(cluster, argv: list[str]) -> subprocess.Popen:
    # Its own process, as a user runs it: Ray keeps one auth token per process.
    return subprocess.Popen(
        [sys.executable, "-m", "hetero_ray.cli", "tune", *argv],
        env={**cluster.env, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"},  # a trial's line unwrapped
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_small_sweep_interrupted_and_resumed(cluster, tmp_path):
    """`hetero-ray tune`, two trials on the live emulated cluster, stopped by SIGTERM once the first has finished
    and resumed with --resume (Tuner.restore): the first trial is kept, not run again, the second runs, and the
    files are written from real measurements, distinct per share."""
    base = config(global_batch=24)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(base))
    out = tmp_path / "out"
    argv = ["--config", str(tmp_path / "run.yaml"), "--trials", "2", "--steps", "6", "--windows", "2"]
    argv += ["--random-trials", "1", "--output-dir", str(out)]
    first = _tune(cluster, argv)
    before = []
    for line in first.stdout:
        before.append(line)
        if line.startswith("trial ") and "→" in line:  # the first trial has finished
            first.send_signal(signal.SIGTERM)
            break
    stdout, stderr = first.communicate(timeout=300)
    assert first.returncode == 128 + signal.SIGTERM, "".join(before) + stdout + stderr[-3000:]
    assert "interrupted after 1 of 2 trials" in stderr and "--resume" in stderr, stderr[-3000:]
    assert not (out / "trials.csv").exists()
    finished = before[-1].split(":")[0]  # "trial <id>"

    resumed = _tune(cluster, [*argv, "--resume"])
    stdout, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, stderr[-3000:]
    assert "resumed" in stdout and "best:" in stdout and "(emulated)" in stdout, stdout
    assert f"{finished}:" not in stdout, stdout  # kept from the first run, not run again
    trials = pd.read_csv(out / "trials.csv")
    assert len(trials) == 2 and trials["error"].isna().all() and trials["complete"].all(), trials.to_dict("records")
    assert f"{trials['samples_per_s'].iloc[0]:.1f} samples/s" in before[-1], (before[-1], trials.to_dict("records"))
    assert trials["emulated"].all() and (trials["samples_per_s"] > 0).all()
    # The first trial is the prediction: the planner's A100 : V100 speed ratio.
    cfg = parse_config(base)
    settings = SweepSettings()
    predicted = share_space(cfg, predicted_speeds(cfg, settings)[0], spread=settings.spread).predicted
    assert trials["weight:A100-80GB"].iloc[0] == pytest.approx(predicted["A100-80GB"])
    by_share = trials.groupby("share:A100-80GB")["samples_per_s"].mean()
    assert len(by_share) >= 2 and by_share.nunique() == len(by_share), trials.to_dict("records")
    assert (out / "throughput.png").read_bytes()[:4] == b"\x89PNG"
    best_cfg = load_config(out / "best.yaml")
    best = trials.loc[trials["samples_per_s"].idxmax()]
    assert best_cfg.train.split["A100-80GB"] == pytest.approx(best["weight:A100-80GB"], rel=1e-3)
    assert best_cfg.train.steps == 100


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({}, "no sweep was started in"),
        ({"state": True, "argv": ["--trials", "3"]}, "was started with --trials 2"),
        ({"state": True, "global_batch": 48}, "--config differs"),
    ],
)
def test_resume_is_refused_before_any_cluster(tmp_path, capsys, change, match):
    """--resume with nothing to resume, other settings or another config: one line, exit 2, no cluster reached."""
    from tuning.sweep import STATE_FILE

    out = tmp_path / "out"
    if change.get("state"):
        cfg = parse_config(config())
        state = {"name": "tune-x", "config": cfg.model_dump(mode="json"), "speeds": {}, "dilation": None}
        state["settings"] = {**{k: v for k, v in vars(SweepSettings(trials=2)).items() if k != "output_dir"}}
        state["settings"]["micro_batch_caps"] = []
        (out / STATE_FILE).parent.mkdir(parents=True)
        (out / STATE_FILE).write_text(json.dumps(state))
        (out / "tune" / "tune-x").mkdir()  # Tune's experiment folder, as an interrupted sweep leaves it
        (out / "tune" / "tune-x" / "tuner.pkl").write_bytes(b"")
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump(config(**({"global_batch": change["global_batch"]} if "global_batch" in change else {})))
    )
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--config", str(path), "--output-dir", str(out), "--trials", "2", "--resume", "--address", "127.0.0.1:1"]
    assert command(parser.parse_args([*argv, *change.get("argv", [])]), Console(quiet=True)) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and match in err, err


def precision_rows(*rows: tuple[str, str, float, float]) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {"precision:A100-80GB": a, "precision:V100-16GB": v, "samples_per_s": rate, "eval_loss": loss}
            for a, v, rate, loss in rows
        ]
    )


def test_the_precision_rule_takes_the_fastest_within_the_loss_tolerance():
    """bf16 + fp16 is fastest but 3 % worse than all-fp32: the rule (1 %) takes bf16 + fp32; per type the trial
    changing that type alone gives its ratios to all-fp32."""
    trials = precision_rows(
        ("fp32", "fp32", 100.0, 2.00),
        ("bf16", "fp32", 150.0, 2.01),
        ("fp32", "fp16", 120.0, 2.06),
        ("bf16", "fp16", 180.0, 2.06),
    )
    choices = {"A100-80GB": ["fp32", "bf16"], "V100-16GB": ["fp32", "fp16"]}
    choice = choose(trials, choices, loss_tolerance=0.01)
    assert (choice.best["precision:A100-80GB"], choice.best["precision:V100-16GB"]) == ("bf16", "fp32")
    assert choice.per_type["A100-80GB"] == {
        "chosen": "bf16",
        "half": "bf16",
        "half_samples_per_s_over_fp32": 1.5,
        "half_loss_over_fp32": pytest.approx(1.005),
    }
    assert choice.per_type["V100-16GB"]["chosen"] == "fp32"
    assert choice.per_type["V100-16GB"]["half_loss_over_fp32"] == pytest.approx(1.03)
    with pytest.raises(SweepError, match="all-fp32 trial did not finish"):
        choose(trials.iloc[1:], choices, loss_tolerance=0.01)


def test_precision_sweep_runs_every_combination_picks_by_the_rule_then_sweeps_the_shares(cluster, tmp_path):
    """`hetero-ray tune --search precision+shares` on the live emulated cluster: four trials (A100 fp32/bf16 ×
    V100 fp32/fp16), each computing in its precision (the losses differ) and scored on held-out samples, whose
    best.yaml holds the rule's pick (recomputed here from trials.csv); then a share sweep (one trial) at that
    precision, whose best.yaml keeps the pick and adds the shares."""
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config(global_batch=24)))
    out = tmp_path / "out"
    argv = ["--config", str(tmp_path / "run.yaml"), "--search", "precision+shares", "--steps", "4", "--windows", "1"]
    # One share trial: the share sweep itself is tested above; here, that it starts from the grid's pick.
    run = _tune(cluster, [*argv, "--trials", "1", "--eval-samples", "24", "--output-dir", str(out)])
    stdout, stderr = run.communicate(timeout=600)
    assert run.returncode == 0, stderr[-3000:]
    assert "precision per GPU type" in stdout, stdout
    grid = out / "precision"
    trials = pd.read_csv(grid / "trials.csv")
    assert len(trials) == 4 and trials["error"].isna().all(), trials.to_dict("records")
    assert (trials["samples_per_s"] > 0).all() and (trials["eval_loss"] > 0).all()
    assert trials["eval_loss"].nunique() == 4, trials.to_dict("records")  # each trial computed in its own precision
    fp32 = trials[(trials["precision:A100-80GB"] == "fp32") & (trials["precision:V100-16GB"] == "fp32")].iloc[0]
    within = trials[trials["eval_loss"] <= fp32["eval_loss"] * 1.01]
    best = within.loc[within["samples_per_s"].idxmax()]
    picked = {"A100-80GB": best["precision:A100-80GB"], "V100-16GB": best["precision:V100-16GB"]}
    assert load_config(grid / "best.yaml").train.precision == picked
    assert (grid / "precision.png").read_bytes()[:4] == b"\x89PNG"
    shares = pd.read_csv(out / "trials.csv")
    assert len(shares) == 1 and (shares["samples_per_s"] > 0).all(), shares.to_dict("records")
    final = load_config(out / "best.yaml")
    assert final.train.precision == picked and isinstance(final.train.split, dict)
    assert final.emulation.autocast  # the shares were measured computing in the picked precisions
