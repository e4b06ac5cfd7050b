"""Profile a workload on every GPU type of a live Ray cluster: one actor per type, placed by its label.

Each actor lands on a node labelled ``hetero-ray/gpu-type=<type>`` (Ray's label
selector), reads its own device type and whether it is emulated the way training
workers do, and runs the local profiler there. Padded emulated nodes give the
type's modelled time; on throttled ones the actor joins a device slice first and
times real steps; both in rows marked ``emulated=True``. Rows come back to the driver, which
alone appends them to the history file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import ray
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from hetero_ray.cluster.catalog import Catalog, load_catalog
from hetero_ray.cluster.cpu_slices import join_device_slice
from hetero_ray.cluster.emulation import EMULATED_LABEL, EMULATED_RESOURCE, GPU_TYPE_LABEL
from hetero_ray.config import EmulationConfig, RunConfig
from hetero_ray.perf import history
from hetero_ray.perf.footprint import measure_footprint
from hetero_ray.perf.history import Measurement
from hetero_ray.perf.profiler import Emulation, ProfileError, ProfileResult, ProfileSpec, Skipped, Target, profile
from hetero_ray.train.device import torch_device, worker_gpu_type
from hetero_ray.train.precision import choose_precision
from hetero_ray.workloads import build_workload

TypeProgress = Callable[[str, int, int], None]


@dataclass(frozen=True, kw_only=True)
class ClusterProfile:
    """Rows from every GPU type, and the points each type skipped (with why)."""

    measurements: tuple[Measurement, ...]
    skipped: Mapping[str, tuple[Skipped, ...]]


def cluster_gpu_types() -> dict[str, bool]:
    """GPU type → emulated?, over the alive nodes that carry the ``hetero-ray/gpu-type`` label."""
    types: dict[str, bool] = {}
    for node in ray.nodes():
        labels = node.get("Labels", {})
        if node["Alive"] and GPU_TYPE_LABEL in labels:
            types[labels[GPU_TYPE_LABEL]] = labels.get(EMULATED_LABEL) == "true"
    return types


@ray.remote
class _TypeProfiler:
    """Runs the profiler on the node Ray placed it on."""

    def run(self, payload: dict[str, Any], queue: Any, stop: Any) -> ProfileResult:
        catalog = load_catalog(payload["gpus_file"])
        gpu_type, emulated = worker_gpu_type(catalog)
        emulation = None
        if emulated:
            # Kept on the actor: the claim on a throttled device's slice lasts as long as the process.
            self.claim = join_device_slice()
            emulation = Emulation(
                spec=catalog.get(gpu_type),
                efficiency=payload["efficiency"],
                flops_per_sample=payload["flops_per_sample"],
                padded=self.claim is None,
            )
        name, options = payload["workload"], payload["options"]
        return profile(
            lambda: build_workload(name, options),
            ProfileSpec(**payload["spec"]),
            workload_name=name,
            options=options,
            target=Target(gpu_type=gpu_type, device=torch_device(emulated), emulated=emulation),
            on_progress=lambda done, total: queue.put_nowait((payload["label"], done, total)),
            until=lambda: not stop.empty(),
        )


def profile_cluster(
    workload: str,
    options: Mapping[str, Any],
    spec: ProfileSpec,
    *,
    flops_per_sample: float,
    efficiency: float,
    gpus_file: str | None = None,
    gpu_types: Mapping[str, bool] | None = None,
    per_type: Mapping[str, int] | None = None,
    on_progress: TypeProgress | None = None,
) -> ClusterProfile:
    """Profile ``workload`` on one device of every GPU type of the connected cluster, all types at once.

    ``gpu_types`` (type → emulated?) defaults to every labelled type alive;
    ``per_type`` profiles that many devices of a type at once (every device of a run: each is timed
    while the others compute, as in training, and every one's rows go to the history); a device done before
    the others keeps computing until the last is done;
    ``flops_per_sample`` and ``efficiency`` price emulated devices.
    ``on_progress(device, done, total)`` is called as steps finish (``device``: a label from ``device_labels``).
    """
    from ray.util.queue import Empty

    from hetero_ray.local_queue import local_queue

    types = dict(gpu_types if gpu_types is not None else cluster_gpu_types())
    if not types:
        raise ProfileError(
            f"the cluster has no alive node labelled {GPU_TYPE_LABEL}; start GPU nodes with "
            f"--labels {GPU_TYPE_LABEL}=<catalog name> (cluster.yaml does)"
        )
    queue = local_queue()
    # Set once every device has run its last timed step: until then the early ones keep the host as busy as
    # training will.
    stop = local_queue()
    payload = {
        "workload": workload,
        "options": dict(options),
        "spec": asdict(spec),
        "gpus_file": gpus_file,
        "efficiency": efficiency,
        "flops_per_sample": flops_per_sample,
    }
    labels = device_labels(types, per_type)
    actors, pending = [], {}
    for label, gpu_type in labels.items():
        resources = {"num_cpus": 1, "resources": {EMULATED_RESOURCE: 1}} if types[gpu_type] else {"num_gpus": 1}
        actors.append(_TypeProfiler.options(label_selector={GPU_TYPE_LABEL: gpu_type}, **resources).remote())
        pending[actors[-1].run.remote({**payload, "label": label}, queue, stop)] = label
    results: dict[str, ProfileResult] = {}
    timed: set[str] = set()
    stopped = False
    try:
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=0.2)
            while not queue.empty():
                try:
                    label, steps, total = queue.get_nowait()
                except Empty:
                    break
                if steps == total:
                    timed.add(label)
                if on_progress is not None:
                    on_progress(label, steps, total)
            if not stopped and len(timed | set(results)) == len(labels):
                stop.put_nowait(True)
                stopped = True
            for ref in done:
                results[pending.pop(ref)] = ray.get(ref)
    finally:
        for actor in actors:
            ray.kill(actor)
        queue.shutdown()
        stop.shutdown()
    return ClusterProfile(
        measurements=tuple(m for label in labels for m in results[label].measurements),
        skipped={t: results[next(k for k, v in labels.items() if v == t)].skipped for t in types},
    )


def device_labels(types: Mapping[str, bool], per_type: Mapping[str, int] | None) -> dict[str, str]:
    """Label → GPU type of each device a profile runs on: the type's name, with ``#i`` when it profiles several."""
    labels = {}
    for gpu_type, emulated in types.items():
        n = (per_type or {}).get(gpu_type, 1)
        tag = f"{gpu_type}{' (emulated)' if emulated else ''}"
        labels |= {(f"{tag} #{i}" if n > 1 else tag): gpu_type for i in range(n)}
    return labels


@contextmanager
def progress_bars(console: Console, labels: Iterable[str]) -> Iterator[TypeProgress]:
    """A rich progress display with one bar per device label; yields the ``on_progress`` callback."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as bar:
        tasks = {label: bar.add_task(label, total=None) for label in labels}

        def update(label: str, done: int, total: int) -> None:
            bar.update(tasks[label], completed=done, total=total)

        yield update


def profile_to_history(
    history_path: str,
    workload: str,
    options: Mapping[str, Any],
    spec: ProfileSpec,
    *,
    efficiency: float,
    gpus_file: str | None,
    console: Console,
    per_type: Mapping[str, int] | None = None,
) -> ClusterProfile:
    """Profile every GPU type of the connected cluster with progress bars, then append the rows to the history
    (``per_type``: as ``profile_cluster``)."""
    types = cluster_gpu_types()
    # Only emulated devices need the FLOP count (it prices their modelled time).
    flops = (
        measure_footprint(lambda: build_workload(workload, options)).flops_per_sample if any(types.values()) else 0.0
    )
    with progress_bars(console, device_labels(types, per_type)) as update:
        result = profile_cluster(
            workload,
            options,
            spec,
            flops_per_sample=flops,
            efficiency=efficiency,
            gpus_file=gpus_file,
            gpu_types=types,
            per_type=per_type,
            on_progress=update,
        )
    history.append(history_path, result.measurements)
    return result


def render(result: ClusterProfile, console: Console) -> None:
    """The measured rows as a table, then one line per skipped group of points."""
    table = Table(title="profile (step = forward + backward + optimizer)")
    for column in ("GPU type", "precision", "micro-batch", "step ms", "spread ms", "samples/s", "peak MiB"):
        table.add_column(column, justify="left" if column in ("GPU type", "precision") else "right")
    for m in result.measurements:
        table.add_row(
            f"{m.gpu_type}{' (emulated)' if m.emulated else ''}",
            m.precision,
            str(m.micro_batch),
            f"{m.step_s * 1e3:.3g}",
            f"{m.step_s_spread * 1e3:.2g}",
            f"{m.micro_batch / m.step_s:.4g}",
            f"{m.peak_memory_bytes / 2**20:.1f}",
        )
    console.print(table)
    for gpu_type, skipped in result.skipped.items():
        reasons: dict[str, list[str]] = {}
        for s in skipped:
            reasons.setdefault(f"{s.precision}: {s.reason}", []).append(str(s.micro_batch))
        for reason, batches in reasons.items():
            console.print(f"{gpu_type} skipped micro-batches {', '.join(batches)} ({reason})")


def run_profile_spec(cfg: RunConfig, catalog: Catalog, repeats: int = 5) -> ProfileSpec:
    """What to profile before planning ``cfg``: each type's training precision, at micro-batches around an even
    share of the global batch (the planner prices data parallelism there) and at one sample (a step's fixed
    cost, which a pipeline pays on every micro-batch), wall clock."""
    even = max(1, cfg.train.global_batch // cfg.num_workers)
    return ProfileSpec(
        micro_batches=tuple(sorted({1, max(1, even // 2), even, 2 * even})),
        precisions=tuple(sorted({choose_precision(catalog.get(t), cfg.train.precision) for t in cfg.devices})),
        repeats=repeats,
    )


def profile_run(cfg: RunConfig, history_path: str, console: Console) -> RunConfig:
    """Profile ``cfg``'s workload on every device of the connected cluster that the run will use, all at once
    (each then computes beside the others, as in the run), append the rows to ``history_path``, and return
    ``cfg`` planned from that history (``profile_history``)."""
    catalog = load_catalog(cfg.gpus_file)
    profile_to_history(
        history_path,
        cfg.workload.name,
        cfg.workload.options,
        run_profile_spec(cfg, catalog),
        efficiency=cfg.emulation.efficiency if cfg.emulation else EmulationConfig().efficiency,
        gpus_file=cfg.gpus_file,
        console=console,
        per_type=cfg.devices,
    )
    return cfg.model_copy(update={"profile_history": history_path})
