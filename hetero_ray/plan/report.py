"""Bodies of `hetero-ray plan` and `hetero-ray simulate`: read the input, search, print, write the plan.

``cli.py`` only wires arguments to these functions. Every input problem raises
``ConfigError`` (or ``PlanError`` when nothing fits) before anything is written.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, replace

import torch
from rich.console import Console
from rich.table import Table

from hetero_ray.cluster.catalog import Catalog
from hetero_ray.config import OPTIMIZERS, ZERO_STAGES, ConfigError
from hetero_ray.output import check_output, write_json
from hetero_ray.perf.footprint import Footprint, measure_footprint
from hetero_ray.plan.data_parallel import fastest_zero_stage, plan_data_parallel, zero_stage_plans
from hetero_ray.plan.plan import Infeasible, Plan, PlanError
from hetero_ray.plan.search import plan, powers_of_two
from hetero_ray.plan.topology import Topology, uniform_topology
from hetero_ray.suggest import did_you_mean
from hetero_ray.workloads import build_workload

GiB = 2**30


@dataclass(frozen=True, kw_only=True)
class Request:
    """What every planning command shares: the model, the batch, the optimizer, the search's knobs."""

    model: str
    model_options: dict
    global_batch: int
    optimizer: str
    efficiency: float
    max_stages: int
    top: int
    schedule: str
    max_tp: int = 1
    zero_stage: int | str = 0


def parse_model_options(text: str | None) -> dict:
    """``--model-options`` JSON object, or a one-line ConfigError."""
    if not text:
        return {}
    try:
        options = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"--model-options: not valid JSON ({exc.msg} at column {exc.colno}); e.g. '{{\"n_layer\": 48}}'"
        ) from None
    if not isinstance(options, dict):
        raise ConfigError(
            f"--model-options: must be a JSON object of the model factory's keyword arguments (got {text})"
        )
    return options


def check_request(req: Request) -> None:
    if req.global_batch < 1:
        raise ConfigError(f"--global-batch: must be >= 1 (got {req.global_batch})")
    if req.optimizer not in OPTIMIZERS:
        raise ConfigError(
            f"--optimizer: unknown optimizer {req.optimizer!r}{did_you_mean(req.optimizer, OPTIMIZERS)}; "
            f"use one of {', '.join(OPTIMIZERS)}"
        )
    if not 0 < req.efficiency <= 1:
        raise ConfigError(f"--efficiency: must be in (0, 1] (got {req.efficiency})")
    if req.max_stages < 1 or req.top < 1:
        raise ConfigError(f"--max-stages and --top: must be >= 1 (got {req.max_stages}, {req.top})")
    if req.max_tp < 1 or req.max_tp & (req.max_tp - 1):
        raise ConfigError(f"--max-tp: must be a power of two >= 1, e.g. 1, 2, 4, 8 (got {req.max_tp})")
    if req.zero_stage not in ZERO_STAGES:
        raise ConfigError(f"--zero-stage: must be one of {', '.join(map(str, ZERO_STAGES))} (got {req.zero_stage!r})")
    if req.zero_stage != 0 and req.optimizer != "adam":
        raise ConfigError(f"--zero-stage: {req.optimizer} is not compatible with ZeRO; use --zero-stage 0")


def footprint_of(req: Request) -> Footprint:
    """The model's per-layer costs, measured on the meta device (no memory, no GPU)."""

    def factory():
        torch.manual_seed(0)
        return build_workload(req.model, req.model_options)

    footprint = measure_footprint(factory)
    problem = footprint.batch_problem(req.global_batch)
    if problem:
        raise ConfigError(f"--global-batch: {problem}")
    return footprint


def parse_devices(text: str, catalog: Catalog) -> dict[str, int]:
    """``TYPE=N,TYPE=N`` → {type: count}; one-line ConfigError naming the bad part."""
    devices: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",")):
        name, sep, count = part.partition("=")
        if not sep or not count.strip().isdigit() or int(count) < 1:
            raise ConfigError(
                f"--devices: {part!r} is not TYPE=COUNT with COUNT >= 1; e.g. V100-16GB=512,A100-80GB=128"
            )
        catalog.get(name.strip())
        devices[name.strip()] = devices.get(name.strip(), 0) + int(count)
    return devices


def search(
    devices: dict[str, int], catalog: Catalog, footprint: Footprint, topology: Topology, req: Request
) -> list[Plan]:
    """The ranked plans, or PlanError with the planner's one-line reason. At ZeRO stage 0 the placement
    search's; at stage 1 its pipelines sharding each stage's Adam state over its replicas, beside data
    parallelism sharded by memory (its collectives at the slowest NIC's speed); at 2 and 3 the latter alone;
    ``auto`` ranks every stage's and says why the first."""
    rank_types = [t for t, n in devices.items() for _ in range(n)]

    def placed(zero_stage: int) -> list[Plan] | Infeasible:
        try:
            return plan(
                rank_types,
                catalog,
                footprint,
                global_batch=req.global_batch,
                topology=topology,
                optimizer=req.optimizer,
                efficiency=req.efficiency,
                schedule=req.schedule,
                max_stages=req.max_stages,
                tensor_parallel=powers_of_two(req.max_tp),
                top_k=req.top,
                zero_stage=zero_stage,
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def sharded(zero_stage: int) -> Plan | Infeasible:
        return plan_data_parallel(
            rank_types,
            catalog,
            footprint,
            global_batch=req.global_batch,
            efficiency=req.efficiency,
            link=topology.inter(set(rank_types)),
            zero_stage=zero_stage,
        )

    stages = (0, 1, 2, 3) if req.zero_stage == "auto" else (req.zero_stage,)
    ranked = {s: zero_stage_plans(s, placed, sharded) for s in stages}
    if len(stages) == 1:
        result = ranked[stages[0]]
        if isinstance(result, Infeasible):
            raise PlanError(result.reason)
        return result
    firsts = {s: p[0] if isinstance(p, list) else p for s, p in ranked.items()}
    best = fastest_zero_stage(firsts)
    if isinstance(best, Infeasible):
        raise PlanError(best.reason)
    # After the chosen plan (its explanation now weighs the stages), every stage's others, fastest first.
    chosen = firsts[best.zero_stage]
    rest = [p for plans in ranked.values() if isinstance(plans, list) for p in plans if p is not chosen]
    return [best, *sorted(rest, key=lambda p: p.predicted_step_s)][: req.top]


def describe(p: Plan) -> str:
    """A plan's shape in a few words: pipelines by their stage types, and the tensor-parallel degree (each
    type's, where they differ)."""
    shapes: dict[tuple[str, ...], int] = {}
    firsts = [r for r in p.roles if r.tp_rank == 0]  # a tensor-parallel stage by its first member
    for pipe in sorted({r.pipeline for r in firsts}):
        stages = tuple(r.gpu_type for r in sorted((r for r in firsts if r.pipeline == pipe), key=lambda r: r.stage))
        shapes[stages] = shapes.get(stages, 0) + 1
    parts = []
    for stages, n in shapes.items():
        runs = [f"{len(list(g))}×{t}" for t, g in itertools.groupby(stages)]
        parts.append(f"{n} × DP {stages[0]}" if len(stages) == 1 else f"{n} × [{' → '.join(runs)}]")
    degrees = {r.gpu_type: r.tp_degree for r in firsts}
    if len(set(degrees.values())) > 1:
        tp = " (tensor parallel " + ", ".join(f"×{d} on {t}" for t, d in degrees.items()) + ")"
    else:
        tp = f" (tensor parallel ×{p.tensor_parallel})" if p.tensor_parallel > 1 else ""
    zero = f" (ZeRO-{p.zero_stage})" if p.zero_stage else ""
    return ", ".join(parts) + tp + zero


def plans_table(plans: list[Plan], title: str) -> Table:
    table = Table(title=title)
    for col in ("#", "pipelines", "step ms", "compute ms", "all-reduce ms", "samples/s", "max memory", "checkpointing"):
        table.add_column(col, justify="left" if col == "pipelines" else "right")
    for i, p in enumerate(plans):
        mem = max(r.predicted_memory_bytes / r.memory_cap_bytes for r in p.roles)
        table.add_row(
            str(i + 1),
            describe(p),
            f"{p.predicted_step_s * 1e3:.4g}",
            f"{p.predicted_compute_s * 1e3:.4g}",
            f"{p.predicted_comm_s * 1e3:.3g}",
            f"{p.global_batch / p.predicted_step_s:.4g}",
            f"{mem:.0%} of cap",
            str(sum(r.activation_checkpointing for r in p.roles)),
        )
    return table


def plan_command(
    *,
    cluster: str,
    req: Request,
    catalog: Catalog,
    as_json: bool,
    output: str | None,
    force: bool = False,
    console: Console,
) -> int:
    """`hetero-ray plan`: plans for the devices of a cluster-launcher file; writes the best one."""
    from hetero_ray.plan.topology import load_cluster

    if output:
        check_output(output, force=force)
    check_request(req)
    spec = load_cluster(cluster, catalog)
    workload = {"name": req.model, "options": dict(req.model_options)}
    plans = [
        replace(p, workload=workload) for p in search(spec.devices, catalog, footprint_of(req), spec.topology, req)
    ]
    show_plans(
        plans, f"plans for {', '.join(f'{n} × {t}' for t, n in spec.devices.items())}", as_json, output, force, console
    )
    return 0


def show_plans(plans: list[Plan], title: str, as_json: bool, output: str | None, force: bool, console: Console) -> None:
    """Write the best of ``plans`` to ``output`` (when given) and show them: a table and the chosen plan's
    explanation, or one JSON object."""
    if output:
        write_json(output, plans[0].to_dict(), force=force)
    if as_json:
        print(json.dumps({"plans": [p.to_dict() for p in plans], "output": output}))
    else:
        console.print(plans_table(plans, title))
        console.print(f"[bold]chosen:[/bold] {plans[0].explanation}")
        if output:
            console.print(f"wrote {output}")


# Each mix is one planner search (0.2-0.25 s at 512-4096 GPUs here, bench/planner.py): 2,000 are minutes.
MAX_MIXES = 2000


def mix_count(n_types: int, budget: int, step: int) -> int:
    """How many mixes ``mixes`` yields: counts in multiples of ``step`` for all types but the last, which takes
    the rest (stars and bars over ``budget // step`` units)."""
    return math.comb(budget // step + n_types - 1, n_types - 1)


def mixes(types: list[str], budget: int, step: int = 1) -> list[dict[str, int]]:
    """Every way to spend ``budget`` GPUs on ``types`` (0 of a type allowed, at least one GPU), each type but the
    last in multiples of ``step``."""
    out = []
    for counts in itertools.product(range(0, budget + 1, step), repeat=len(types) - 1):
        rest = budget - sum(counts)
        if rest >= 0:
            mix = dict(zip(types, (*counts, rest)))
            out.append({t: n for t, n in mix.items() if n})
    return out


def simulate_command(
    *,
    devices: str | None,
    mix: str | None,
    budget_gpus: int | None,
    inter_node_gbps: float,
    gpus_per_node: int,
    req: Request,
    catalog: Catalog,
    as_json: bool,
    mix_step: int = 1,
    output: str | None,
    force: bool = False,
    console: Console,
) -> int:
    """`hetero-ray simulate`: plans for a cluster that does not exist, or the best mix per dollar."""
    if output:
        check_output(output, force=force)
    check_request(req)
    if (devices is None) == (mix is None):
        raise ConfigError("simulate: give either --devices TYPE=N,... or --mix TYPE,TYPE --budget-gpus N")
    if inter_node_gbps <= 0 or gpus_per_node < 1:
        raise ConfigError(
            f"--inter-node-gbps must be > 0 and --gpus-per-node >= 1 (got {inter_node_gbps}, {gpus_per_node})"
        )
    if devices is not None:
        counts = parse_devices(devices, catalog)
        topology = uniform_topology(catalog, counts, gpus_per_node=gpus_per_node, inter_node_gbps=inter_node_gbps)
        plans = search(counts, catalog, footprint_of(req), topology, req)
        result = {"devices": counts, "modelled": True, "plans": [p.to_dict() for p in plans]}
        if output:
            write_json(output, result, force=force)
        if as_json:
            print(json.dumps(result))
        else:
            console.print(plans_table(plans, f"modelled plans for {devices}"))
            console.print(f"[bold]best:[/bold] {plans[0].explanation}")
        return 0
    rows = best_mixes(mix, budget_gpus, inter_node_gbps, gpus_per_node, req, catalog, mix_step)
    if output:
        write_json(output, {"modelled": True, "mixes": rows}, force=force)
    if as_json:
        print(json.dumps({"modelled": True, "mixes": rows}))
    else:
        table = Table(title=f"{budget_gpus} GPUs of {mix}: throughput per dollar (modelled)")
        for col in ("mix", "samples/s", "$/hour", "samples per $", "plan"):
            table.add_column(col)
        for r in rows:
            table.add_row(
                ", ".join(f"{n} × {t}" for t, n in r["devices"].items()),
                f"{r['samples_per_s']:.4g}" if r["samples_per_s"] else "-",
                f"{r['usd_per_hour']:.2f}",
                f"{r['samples_per_usd']:.4g}" if r["samples_per_usd"] else "-",
                r["plan"],
            )
        console.print(table)
    return 0


def best_mixes(
    mix: str,
    budget_gpus: int | None,
    inter_node_gbps: float,
    gpus_per_node: int,
    req: Request,
    catalog: Catalog,
    mix_step: int = 1,
) -> list[dict]:
    """Every mix of ``budget_gpus`` GPUs of the listed types, planned, ranked by samples per dollar."""
    types = [t.strip() for t in mix.split(",") if t.strip()]
    if not types or len(set(types)) != len(types) or len(types) > 4:
        raise ConfigError(f"--mix: give 1-4 distinct GPU types separated by commas (got {mix!r})")
    if budget_gpus is None or budget_gpus < 1:
        raise ConfigError(f"--budget-gpus: --mix needs a GPU budget >= 1 (got {budget_gpus})")
    if mix_step < 1:
        raise ConfigError(f"--mix-step: must be >= 1 (got {mix_step})")
    count = mix_count(len(types), budget_gpus, mix_step)
    if count > MAX_MIXES:
        # Refused before the first search, with the step that brings the count within bounds.
        fit = next(
            s for s in range(mix_step + 1, budget_gpus + 1) if mix_count(len(types), budget_gpus, s) <= MAX_MIXES
        )
        raise ConfigError(
            f"--mix: {count:,} mixes of {len(types)} types over {budget_gpus} GPUs, one planner search each; at most "
            f"{MAX_MIXES:,}: pass --mix-step {fit} ({mix_count(len(types), budget_gpus, fit):,} mixes), fewer types "
            "or a smaller --budget-gpus"
        )
    prices = {}
    for t in types:
        price = catalog.get(t).price_per_hour_usd
        if price is None:
            raise ConfigError(
                f"--mix: GPU type {t} has no price_per_hour_usd in the catalog; add one in a gpus file (--gpus)"
            )
        prices[t] = price
    footprint = footprint_of(req)
    topology = uniform_topology(catalog, types, gpus_per_node=gpus_per_node, inter_node_gbps=inter_node_gbps)
    rows = []
    for counts in mixes(types, budget_gpus, mix_step):
        usd = sum(prices[t] * n for t, n in counts.items())
        try:
            best = search(counts, catalog, footprint, topology, Request(**{**req.__dict__, "top": 1}))[0]
        except PlanError as exc:
            rows.append(
                {
                    "devices": counts,
                    "samples_per_s": None,
                    "usd_per_hour": usd,
                    "samples_per_usd": None,
                    "plan": f"infeasible: {exc}",
                }
            )
            continue
        rate = best.global_batch / best.predicted_step_s
        rows.append(
            {
                "devices": counts,
                "samples_per_s": rate,
                "usd_per_hour": usd,
                "samples_per_usd": rate * 3600 / usd,
                "plan": describe(best),
            }
        )
    if all(r["samples_per_s"] is None for r in rows):
        raise PlanError(f"no mix of {budget_gpus} × {mix} fits the model: {rows[0]['plan']}")
    return sorted(rows, key=lambda r: -(r["samples_per_usd"] or -math.inf))
