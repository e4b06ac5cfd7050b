"""`hetero-ray`: discover the cluster's GPUs, profile and plan them, train from a config, or run the emulated demo."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hetero_ray.config import OPTIMIZERS, ZERO_STAGES
from hetero_ray.output import check_output, write_json, write_json_uri
from hetero_ray.plan.memory import SCHEDULES
from hetero_ray.suggest import did_you_mean

# Heavy modules (torch, Ray, pandas) are imported inside the commands that use them: `hetero-ray --help`
# and a mistyped option answer at once (bench/cli.py measures it).
if TYPE_CHECKING:
    from rich.console import Console

    from hetero_ray.config import RunConfig, RunSection

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"
# What `train` leaves beside a run's checkpoints, in the run's storage.
RESULT_FILE = "result.json"


def user_errors() -> tuple[type[Exception], ...]:
    """Bad input: one line on stderr and exit code 2, never a traceback. Imported when an error is being
    handled, since the workload's module brings torch."""
    from hetero_ray.cluster.catalog import CatalogError, UnknownGpuType
    from hetero_ray.config import ConfigError
    from hetero_ray.output import OutputError
    from hetero_ray.plan.plan import PlanError
    from hetero_ray.routing.policy import PolicyError
    from hetero_ray.workloads import WorkloadError

    return (ConfigError, CatalogError, UnknownGpuType, WorkloadError, PlanError, OutputError, PolicyError)


def zero_stage(text: str) -> int | str:
    """argparse type for ``--zero-stage``: 0-3 or auto."""
    stage = next((s for s in ZERO_STAGES if str(s) == text), None)
    if stage is None:
        raise argparse.ArgumentTypeError(f"unknown ZeRO stage {text!r}; use one of {', '.join(map(str, ZERO_STAGES))}")
    return stage


def one_of(names: Sequence[str], what: str) -> Callable[[str], str]:
    """argparse type for an enumeration, with "did you mean" (argparse's own ``choices`` message lists only)."""

    def parse(text: str) -> str:
        if text not in names:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {text!r}{did_you_mean(text, names)}; use one of {', '.join(names)}"
            )
        return text

    return parse


def positive_float(text: str) -> float:
    """argparse type: a number > 0 (``--duration 0`` would otherwise mean "the config's duration")."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds (got {text})")
    return value


def _finish(
    result, args, console: Console, extra: dict[str, Any] | None = None, *, run: RunSection | None = None
) -> None:
    """Write the result to ``--output`` and, given the ``run``, beside its checkpoints as ``result.json`` (a
    job's ``--output`` lands in its working directory on the head; the run's storage, local or a URI, is where
    the user reads it); then print it."""
    from hetero_ray.train.summary import render, summarise

    out = {**result.to_dict(), "summary": summarise(result.metrics, result.dilation), **(extra or {})}
    if args.output:
        write_json(args.output, out, force=args.force)
    if run is not None:
        # The run's own record, renewed by every run of that name, as its checkpoints are.
        if run.run_dir is not None:
            write_json(run.run_dir / RESULT_FILE, out, force=True)
            where = str(run.run_dir / RESULT_FILE)
        else:
            where = write_json_uri(run.run_uri, RESULT_FILE, out)
        if not args.json:
            console.print(f"result: {where}")
    if args.json:
        print(json.dumps(out))
    else:
        render(result.metrics, result.dilation, console)


def cmd_train(args: argparse.Namespace, console: Console) -> int:
    """Train on the Ray cluster this process reaches (``ray job submit`` sets the address)."""
    from hetero_ray.config import load_config, parse_config
    from hetero_ray.routing.policy import DEVICES_ENV
    from hetero_ray.train.prepare import prepare

    if args.output:
        check_output(args.output, force=args.force)
    cfg = load_config(args.config)
    granted = os.environ.get(DEVICES_ENV)
    if granted:
        # Submitted with `hetero-ray submit`: the job plans for the devices the ledger gave it.
        cfg = parse_config({**cfg.model_dump(exclude_unset=True), "devices": json.loads(granted)}, DEVICES_ENV)
    prepared = prepare(cfg, args.plan)
    import ray

    from hetero_ray.train.trainer import run_training

    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=args.verbose)
    try:
        result = run_training(cfg, prepared)
    finally:
        ray.shutdown()
    _finish(result, args, console, run=cfg.run)
    return 0


def cmd_submit(args: argparse.Namespace, console: Console) -> int:
    """Submit a job of a class (train, finetune, inference) through Ray's Job Submission API: it runs on the GPU
    types its class prefers (the policy), or others when those are busy and the policy allows, and waits in the
    cluster's queue until they are free. A training job started so plans for the devices it got."""
    import ray

    from hetero_ray.cluster.catalog import load_catalog
    from hetero_ray.routing.client import open_ledger, submit
    from hetero_ray.routing.policy import FIRST_FIT, check_class, load_policy

    check_class(args.job_class)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    catalog = load_catalog(args.gpus_file)
    # Checked before the cluster is reached; None: the default for the cluster's types.
    policy = FIRST_FIT if args.first_fit else load_policy(args.policy, catalog) if args.policy else None
    ray.init(
        address=args.address or os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=False, logging_level="WARNING"
    )
    try:
        ledger = open_ledger(args.ledger, catalog, policy)
        only = args.only.split(",") if args.only else None
        job_id = submit(
            command, job_class=args.job_class, gpus=args.gpus, only=only, ledger=ledger, ledger_name=args.ledger
        )
    finally:
        ray.shutdown()
    print(json.dumps({"job_id": job_id, "class": args.job_class}) if args.json else job_id)
    return 0


def cmd_status(args: argparse.Namespace, console: Console) -> int:
    """Per GPU type of the cluster: devices, busy, the jobs holding them and utilisation; then the queue."""
    import ray
    from rich.table import Table

    from hetero_ray.routing.client import ledger_status

    ray.init(
        address=args.address or os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=False, logging_level="WARNING"
    )
    try:
        status = ledger_status(args.ledger)
    finally:
        ray.shutdown()
    if args.json:
        print(json.dumps({k: v for k, v in status.items() if k != "log"}))
        return 0
    table = Table(title=f"GPU types (policy {status['policy']})")
    for column in ("GPU type", "devices", "busy", "jobs", "utilisation"):
        table.add_column(column)
    for gpu_type, t in status["types"].items():
        jobs = ", ".join(f"{job} ({n})" for job, n in t["jobs"].items()) or "-"
        table.add_row(gpu_type, str(t["devices"]), str(t["busy"]), jobs, f"{t['utilisation']:.0%}")
    console.print(table)
    queue = Table(title="queue")
    for column in ("job", "class", "devices", "waiting"):
        queue.add_column(column)
    for w in status["queue"]:
        queue.add_row(w["job"], w["class"], str(w["gpus"]), f"{w['waiting_s']:.0f} s")
    console.print(queue if status["queue"] else "queue: empty")
    return 0


def _demo_config(args: argparse.Namespace, console: Console) -> RunConfig:
    from hetero_ray.cluster.cpu_slices import CgroupError, find_cpu_root
    from hetero_ray.config import ConfigError, load_config

    train = {"duration_s": args.duration} if args.duration is not None else {}
    cfg = load_config(args.config, {"train": train})
    if cfg.emulation is None:
        raise ConfigError(f"{args.config}: the demo needs an 'emulation' section")
    if cfg.run.run_dir is None:
        raise ConfigError(
            f"run.storage_path: {cfg.run.storage_path} is a URI; the demo writes its profile and plot beside the "
            "run, so give it a local folder"
        )
    if cfg.emulation.throttled:
        try:
            find_cpu_root()
        except CgroupError as exc:
            console.print(f"[yellow]{exc}: this demo runs padded devices instead[/yellow]")
            cfg = cfg.model_copy(
                update={"emulation": cfg.emulation.model_copy(update={"mode": "padded", "cpu_share": None})}
            )
    # A fresh run name each time: the demo never resumes an older demo.
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": f"demo-{time.strftime('%Y%m%d-%H%M%S')}"})})


def _train_with_progress(cfg: RunConfig, prepared, console: Console, label: str):
    """``run_training`` in a thread, with a live progress bar fed by rank 0's reports."""
    from ray.util.queue import Empty
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from hetero_ray.local_queue import local_queue
    from hetero_ray.train.trainer import run_training

    queue = local_queue()
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["result"] = run_training(cfg, prepared, progress=queue)
        except BaseException as exc:  # re-raised in the main thread
            outcome["error"] = exc

    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    total = cfg.train.duration_s or cfg.train.steps
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task(f"{label}: starting workers…", total=total)
        while thread.is_alive():
            try:
                m = queue.get(timeout=1)
            except Empty:
                continue
            done = m["elapsed_s"] if cfg.train.duration_s else m["step"] + 1
            bar.update(
                task,
                completed=min(done, total),
                description=(
                    f"{label}: step {m['step'] + 1} loss {m['loss']:.3f} {m['samples_per_s']:.1f} samples/s (emulated)"
                ),
            )
    queue.shutdown()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def cmd_demo(args: argparse.Namespace, console: Console) -> int:
    """Start the emulated cluster; on throttled devices profile them first; train an equal split, then the
    planned one, with live progress; print where each device's step time went."""
    from hetero_ray.cluster.emulation import EmulatedCluster

    if args.output:
        check_output(args.output, force=args.force)
    cfg = _demo_config(args, console)
    cluster = EmulatedCluster(cfg.devices, gpus_per_node=cfg.emulation.gpus_per_node, cpu_share=cfg.emulation.cpu_share)
    # Ray reads its authentication mode once, at import: the token must be in the
    # environment before `import ray` in this process.
    os.environ.update(cluster.env)
    import ray

    from hetero_ray.perf.remote import profile_run
    from hetero_ray.train.prepare import prepare
    from hetero_ray.train.summary import breakdown, plot_breakdown, render_speeds

    prepared = prepare(cfg)  # bad input fails here, before any cluster starts
    mode = cfg.emulation.mode
    run_dir = cfg.run.run_dir
    with contextlib.ExitStack() as stack:
        with console.status(f"starting the emulated cluster ({mode} devices, one Ray raylet per emulated node)…"):
            stack.enter_context(cluster)
        ray.init(address=cluster.address, log_to_driver=args.verbose)
        stack.callback(ray.shutdown)
        console.print(f"emulated cluster up ({mode}): {dict(cfg.devices)}; dashboard {cluster.dashboard_url}")
        if cfg.emulation.throttled:
            # Throttled devices' speeds are unknown until measured: profile, then plan from the profile.
            cfg = profile_run(cfg, str(run_dir / "profile.parquet"), console)
            prepared = prepare(cfg)
        equal_cfg = cfg.model_copy(
            update={
                # A quarter of the planned run: long enough for a warm window to compare with.
                "train": cfg.train.model_copy(
                    update={
                        "split": "equal",
                        "steps": max(1, cfg.train.steps // 4),
                        "duration_s": cfg.train.duration_s / 4 if cfg.train.duration_s else None,
                    }
                ),
                "run": cfg.run.model_copy(update={"name": f"{cfg.run.name}-equal"}),
            }
        )
        equal = _train_with_progress(equal_cfg, prepare(equal_cfg), console, "equal split")
        console.print(f"[bold]plan[/bold] (emulated, {mode}): {prepared.plan.explanation}")
        result = _train_with_progress(cfg, prepared, console, "planned split")
    png = run_dir / "step-breakdown.png"
    runs = {"equal split": equal.metrics, "planned split": result.metrics}
    plot_breakdown(runs, png, title=f"where each device's step goes (emulated, {mode})")
    extra = {
        "emulation_mode": mode,
        "equal_split": {"samples_per_s": equal.metrics["samples_per_s"], "step_s": equal.metrics["step_s"]},
        "breakdown": {label: breakdown(m) for label, m in runs.items()},
        "breakdown_png": str(png),
    }
    _finish(result, args, console, extra)
    if not args.json:
        render_speeds(result.metrics, prepared.catalog, console, profiled=cfg.profile_history is not None)
        console.print(f"step-time breakdown: {png}")
    return 0


def cmd_discover(args: argparse.Namespace, console: Console) -> int:
    """NVML on every node of a live cluster, as a table or JSON."""
    import ray

    from hetero_ray.cluster.catalog import load_catalog
    from hetero_ray.cluster.discovery import (
        discover,
        label_problems,
        render_table,
        reports_to_json,
        unknown_gpu_message,
    )

    catalog = load_catalog(args.gpus)
    ray.init(address=args.address or os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=False)
    try:
        reports = discover(catalog)
    finally:
        ray.shutdown()
    if args.json:
        print(json.dumps(reports_to_json(reports)))
    else:
        render_table(reports, console)
    for message in filter(None, [unknown_gpu_message(reports), *label_problems(reports)]):
        print(f"hetero-ray: {message}", file=sys.stderr)
    return 0


def cmd_profile(args: argparse.Namespace, console: Console) -> int:
    """Profile a workload on one device of every GPU type of a live cluster; append the rows to a history file."""
    import ray

    from hetero_ray.config import EmulationConfig
    from hetero_ray.perf.history import HistoryError
    from hetero_ray.perf.profiler import ProfileError, ProfileSpec
    from hetero_ray.perf.remote import profile_to_history, render

    try:
        options = json.loads(args.options)
        if not isinstance(options, dict):
            raise ProfileError(f"--options: must be a JSON object (got {args.options})")
        if not all(b.strip().isdigit() for b in args.micro_batches.split(",")):
            raise ProfileError(f"--micro-batches: comma-separated positive integers (got {args.micro_batches})")
        spec = ProfileSpec(
            micro_batches=tuple(int(b) for b in args.micro_batches.split(",")),
            precisions=tuple(args.precisions.split(",")),
            warmup=args.warmup,
            repeats=args.repeats,
        )
        ray.init(address=args.address or os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=False)
        try:
            efficiency = args.efficiency or EmulationConfig().efficiency
            result = profile_to_history(
                args.history, args.workload, options, spec, efficiency=efficiency, gpus_file=args.gpus, console=console
            )
        finally:
            ray.shutdown()
    except (json.JSONDecodeError, ProfileError, HistoryError) as exc:
        print(f"hetero-ray: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        rows = [m.to_row() | {"timestamp": m.timestamp.isoformat()} for m in result.measurements]
        skipped = {t: [vars(s) for s in ss] for t, ss in result.skipped.items()}
        print(json.dumps({"history": args.history, "rows": rows, "skipped": skipped}))
    else:
        render(result, console)
        console.print(f"{len(result.measurements)} rows appended to {args.history}")
    return 0


def _plan_request(args: argparse.Namespace):
    from hetero_ray.plan.report import Request, parse_model_options

    return Request(
        model=args.model,
        model_options=parse_model_options(args.model_options),
        global_batch=args.global_batch,
        optimizer=args.optimizer,
        efficiency=args.efficiency,
        max_stages=args.max_stages,
        top=args.top,
        schedule=args.schedule,
        max_tp=args.max_tp,
        zero_stage=args.zero_stage,
    )


def cmd_plan(args: argparse.Namespace, console: Console) -> int:
    """Plan the devices of a cluster-launcher file, or a run config's as `train` will; print the top plans,
    write the best."""
    from hetero_ray.cluster.catalog import load_catalog
    from hetero_ray.plan.report import plan_command, show_plans

    if args.config:
        from hetero_ray.config import ConfigError, load_config
        from hetero_ray.train.prepare import prepare

        if args.cluster:
            raise ConfigError("--config and --cluster: plan either a run config's devices or a cluster file's")
        # The options a plan of a cluster file takes; a run config says all of them itself.
        alone = vars(build_parser().parse_args(["plan", "--config", args.config]))
        given = [f"--{k.replace('_', '-')}" for k, v in vars(args).items() if k in PLAN_OPTIONS and v != alone[k]]
        if given:
            raise ConfigError(
                f"{', '.join(given)}: --config plans what the run config says; set it there, or plan a cluster "
                "file (--cluster)"
            )
        if args.output:
            check_output(args.output, force=args.force)
        cfg = load_config(args.config)
        plan = prepare(cfg).plan
        devices = ", ".join(f"{n} × {t}" for t, n in cfg.devices.items())
        show_plans([plan], f"plan for {args.config}: {devices}", args.json, args.output, args.force, console)
        return 0
    return plan_command(
        cluster=args.cluster or "cluster.yaml",
        req=_plan_request(args),
        catalog=load_catalog(args.gpus),
        as_json=args.json,
        output=args.output,
        force=args.force,
        console=console,
    )


def cmd_simulate(args: argparse.Namespace, console: Console) -> int:
    """Plan a cluster that does not exist yet, or rank mixes of GPU types by throughput per dollar."""
    from hetero_ray.cluster.catalog import load_catalog
    from hetero_ray.plan.report import simulate_command

    return simulate_command(
        devices=args.devices,
        mix=args.mix,
        budget_gpus=args.budget_gpus,
        mix_step=args.mix_step,
        inter_node_gbps=args.inter_node_gbps,
        gpus_per_node=args.gpus_per_node,
        req=_plan_request(args),
        catalog=load_catalog(args.gpus),
        as_json=args.json,
        output=args.output,
        force=args.force,
        console=console,
    )


def cmd_env(args: argparse.Namespace, console: Console) -> int:
    """This machine as hetero-ray sees it, for bug reports: versions of hetero-ray, Python, Ray, torch and
    DeepSpeed; the GPUs NVML sees; whether throttled emulated devices can be made (a writable cgroup cpu
    controller); the Ray address and authentication mode a command would use. Starts no cluster."""
    from hetero_ray.cluster.catalog import load_catalog
    from hetero_ray.cluster.environment import environment, render_environment

    report = environment(load_catalog(args.gpus))
    if args.json:
        print(json.dumps(report))
    else:
        render_environment(report, console)
    return 0


def cmd_tune(args: argparse.Namespace, console: Console) -> int:
    """Sweep batch-size shares per GPU type with Ray Tune on the connected cluster; write CSV, PNG and best config."""
    from tuning.sweep import command

    return command(args, console)


def cmd_serve(args: argparse.Namespace, console: Console) -> int:
    """Deploy a trained model from a hetero-ray checkpoint with Ray Serve on the cluster at RAY_ADDRESS: one replica
    per device of the given GPU types, placed by their label, answering POST {"text": ...} with the next byte and
    its probability, batching concurrent requests. Prints the URL. `hetero_ray.serving.app.scale` changes the
    replica count in place."""
    from hetero_ray.serving.model import ServeError

    types = [t.strip() for t in args.types.split(",")] if args.types else None
    try:
        if types is not None and not all(types):
            raise ServeError(f"--types: comma-separated GPU type names (got {args.types!r})")
        from hetero_ray.serving.app import deploy

        replicas = _serve_through_ledger(args, types) if args.ledger else args.replicas
        url = deploy(args.checkpoint, types, replicas, name=args.name, port=args.port, host=args.host)
    except ServeError as exc:
        print(f"hetero-ray: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"url": url, "name": args.name, "replicas": args.replicas, "gpu_types": types}))
    else:
        print(url)
    return 0


def _serve_through_ledger(args: argparse.Namespace, types: list[str] | None) -> int:
    """Register the application with the job ledger; the replicas it may start now (the idle devices)."""
    import ray

    from hetero_ray.cluster.catalog import load_catalog
    from hetero_ray.routing.client import open_ledger
    from hetero_ray.routing.policy import PolicyError

    if not types or len(types) != 1:
        raise PolicyError(
            "--ledger: name one GPU type in --types (the ledger counts each application's devices by type)"
        )
    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=False, logging_level="WARNING")
    ledger = open_ledger(args.ledger, load_catalog(), None)
    now = ray.get(ledger.serve.remote(args.name, types[0], args.replicas))
    if now == 0:
        raise PolicyError(f"--types: no {types[0]} is idle now; serve when one is, or on another type")
    return now


PLAN_OPTIONS = (
    "model",
    "model_options",
    "global_batch",
    "optimizer",
    "efficiency",
    "max_stages",
    "max_tp",
    "zero_stage",
    "schedule",
    "top",
    "gpus",
)


def _add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt", help="workload: a built-in name (gpt) or module:function")
    p.add_argument("--model-options", help="JSON object of the workload factory's keyword arguments")
    p.add_argument("--global-batch", type=int, default=72, help="samples per optimiser step (default 72)")
    p.add_argument("--optimizer", default="adam", type=one_of(OPTIMIZERS, "optimizer"), choices=OPTIMIZERS,
                   help="default adam")  # fmt: skip
    p.add_argument("--efficiency", type=float, default=0.4, help="fraction of catalog peak FLOP/s (default 0.4)")
    p.add_argument("--max-stages", type=int, default=8, help="most pipeline stages per pipeline (default 8)")
    p.add_argument("--max-tp", type=int, default=1,
                   help="largest tensor-parallel degree tried, a power of two (default 1: none)")  # fmt: skip
    p.add_argument("--zero-stage", default=0, type=zero_stage,
                   help="ZeRO stage of data parallelism sharded by memory: 0-3, or auto (the fastest, pipelines "
                   "too); default 0")  # fmt: skip
    p.add_argument("--schedule", default="1f1b", type=one_of(SCHEDULES, "schedule"), choices=SCHEDULES,
                   help="pipeline schedule (default 1f1b)")  # fmt: skip
    p.add_argument("--top", type=int, default=5, help="plans to show (default 5)")
    p.add_argument("--gpus", help="YAML of extra GPU types (catalog schema)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--force", action="store_true", help="replace the --output file if it exists")


def _version() -> str:
    try:
        return metadata.version("hetero-ray")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    """The `hetero-ray` command line: one subcommand per step of the user's journey, plus `env`."""
    parser = argparse.ArgumentParser(prog="hetero-ray", description=__doc__)
    parser.add_argument("--version", action="version", version=f"hetero-ray {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, func: Callable[[argparse.Namespace, Console], int], summary: str):
        # The command's docstring is its description in `hetero-ray NAME --help`: one text, never two.
        p = sub.add_parser(name, help=summary, description=func.__doc__)
        p.set_defaults(func=func)
        return p

    train = command("train", cmd_train, "train from a config on the connected Ray cluster")
    demo = command("demo", cmd_demo, "train on an emulated 2 × A100 + 4 × V100 cluster on this machine")
    for p in (train, demo):
        p.add_argument("--json", action="store_true", help="print the result as one JSON object")
        p.add_argument("--output", help="also write the result JSON to this file")
        p.add_argument("--force", action="store_true", help="replace the --output file if it exists")
        p.add_argument("--verbose", action="store_true", help="show the workers' logs")
    train.add_argument("--config", required=True, help="run config YAML (see configs/)")
    train.add_argument("--plan", help="Plan JSON to run (from `hetero-ray plan --output`) instead of planning")
    demo.add_argument("--config", default=str(DEFAULT_CONFIG), help="run config YAML with an emulation section")
    demo.add_argument(
        "--duration", type=positive_float, help="seconds to train (default: the config's train.duration_s)"
    )

    discover = command("discover", cmd_discover, "list the GPUs on every node of a live cluster")
    discover.add_argument("--address", help="Ray address (default: RAY_ADDRESS or a local cluster)")
    discover.add_argument("--gpus", help="YAML of extra GPU types to recognise")
    discover.add_argument("--json", action="store_true", help="print the nodes as one JSON object")

    profile = command("profile", cmd_profile, "time a workload on every GPU type of a live cluster into a history")
    profile.add_argument("--history", required=True, help="parquet history file to append to (created if absent)")
    profile.add_argument("--workload", default="gpt", help="built-in workload name or module:function")
    profile.add_argument("--options", default="{}", help="workload options as a JSON object")
    profile.add_argument("--micro-batches", default="1,2,4,8,16", help="comma-separated micro-batch sizes")
    profile.add_argument("--precisions", default="fp32", help="comma-separated: fp32, tf32, fp16, bf16")
    profile.add_argument("--warmup", type=int, default=2, help="untimed steps per point")
    profile.add_argument("--repeats", type=int, default=7, help="timed steps per point (the median is kept)")
    profile.add_argument("--efficiency", type=float, help="emulated devices: fraction of catalog peak (default 0.4)")
    profile.add_argument("--gpus", help="YAML of extra GPU types")
    profile.add_argument("--address", help="Ray address (default: RAY_ADDRESS or a local cluster)")
    profile.add_argument("--json", action="store_true", help="print the rows as one JSON object")

    plan = command("plan", cmd_plan, "plan pipelines and data parallelism for a cluster-launcher file")
    plan.add_argument("--cluster", help="Ray cluster-launcher YAML (default cluster.yaml)")
    plan.add_argument(
        "--config", help="a run config: plan its devices, workload and batch as `train` will (instead of --cluster)"
    )
    plan.add_argument("--output", default="plan.json", help="where to write the chosen Plan JSON (default plan.json)")
    _add_plan_arguments(plan)

    simulate = command("simulate", cmd_simulate, "plan a cluster that does not exist, or the best mix per dollar")
    simulate.add_argument("--devices", help="GPUs per type, e.g. V100-16GB=512,A100-80GB=128")
    simulate.add_argument("--mix", help="GPU types to mix, e.g. A100-80GB,V100-16GB (with --budget-gpus)")
    simulate.add_argument("--budget-gpus", type=int, help="GPUs in every mix of --mix")
    simulate.add_argument(
        "--mix-step", type=int, default=1, help="--mix: count each type but the last in steps of this"
    )
    simulate.add_argument("--inter-node-gbps", type=float, default=100.0, help="NIC Gbit/s per node (default 100)")
    simulate.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    simulate.add_argument("--output", help="also write the result JSON to this file")
    _add_plan_arguments(simulate)

    from tuning.settings import add_arguments as add_tune_arguments

    tune = command("tune", cmd_tune, "sweep batch-size shares per GPU type with Ray Tune, from the prediction")
    add_tune_arguments(tune)

    submit = command(
        "submit", cmd_submit, "submit a job of a class (train, finetune, inference) to the GPU types it prefers"
    )
    submit.add_argument("--class", dest="job_class", required=True, help="train, finetune or inference")
    submit.add_argument("--gpus", type=int, default=1, help="devices the job needs (default 1)")
    submit.add_argument("--only", help="comma-separated GPU types the job can use at all (e.g. for its memory)")
    submit.add_argument("--policy", help="policy YAML: preferred types per class, fallback, priority")
    submit.add_argument("--first-fit", action="store_true", help="no preference: Ray's own first fit (for comparison)")
    submit.add_argument("--ledger", default="default", help="the cluster's job ledger to use (default: default)")
    submit.add_argument("--gpus-file", help="YAML of extra GPU types")
    submit.add_argument("--address", help="Ray address (default: RAY_ADDRESS)")
    submit.add_argument("--json", action="store_true", help="print the job id as JSON")
    submit.add_argument("command", nargs=argparse.REMAINDER, help="-- then the job's command")
    status = command("status", cmd_status, "devices, busy devices, jobs, utilisation and queue per GPU type")
    status.add_argument("--ledger", default="default", help="the cluster's job ledger (default: default)")
    status.add_argument("--address", help="Ray address (default: RAY_ADDRESS)")
    status.add_argument("--json", action="store_true", help="print the status as one JSON object")

    serve = command("serve", cmd_serve, "serve a checkpoint's model with Ray Serve on idle GPU types")
    serve.add_argument("--checkpoint", required=True, help="checkpoint directory of a hetero-ray run")
    serve.add_argument("--types", help="GPU types to place replicas on, e.g. V100-16GB,T4 (default: any)")
    serve.add_argument("--replicas", type=int, default=1, help="replicas, one device each (default 1)")
    serve.add_argument("--name", default="hetero-ray", help="application name, the URL's path (default hetero-ray)")
    serve.add_argument("--port", type=int, default=8000, help="HTTP port of Serve's proxy (default 8000)")
    serve.add_argument("--host", default="127.0.0.1", help="address the proxy binds (default 127.0.0.1)")
    serve.add_argument("--json", action="store_true", help="print the URL as one JSON object")
    serve.add_argument(
        "--ledger",
        help="the cluster's job ledger (hetero-ray submit): the replicas take idle devices of one --types type, give "
        "them to training and fine-tuning jobs that need them and grow back when they are free",
    )

    env = command("env", cmd_env, "versions, GPUs, cgroup support and Ray settings of this machine")
    env.add_argument("--gpus", help="YAML of extra GPU types to recognise")
    env.add_argument("--json", action="store_true", help="print the report as one JSON object")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `hetero-ray` console script and of `jobs/`."""
    args = build_parser().parse_args(argv)
    from rich.console import Console

    console = Console(stderr=args.json if hasattr(args, "json") else False)
    try:
        return args.func(args, console)
    except Exception as exc:
        if not isinstance(exc, user_errors()):
            raise
        print(f"hetero-ray: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
