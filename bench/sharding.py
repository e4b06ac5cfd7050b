"""ZeRO by memory: how much larger a model trains when state is sharded in proportion to each card's memory.

- ``capacity_ratio``: on 2 × A100-80GB + 4 × V100-16GB, the largest GPT (parameters) that trains data-parallel
  on all six cards with memory-proportional ZeRO-3 ÷ the largest that trains on all six without sharding
  (every card holds the whole state, as DDP does). Beside it, the same against plain data parallelism on the
  A100s alone (the V100s left unused), which is the planner's plan without ZeRO. Modelled: the GPT family's
  costs measured on the meta device, the planner's memory rule (``plan/data_parallel.py::zero_bytes``), the
  catalog's memory; not a run.
- ``uneven_over_even``: on that mix, the largest GPT trainable with memory-proportional ZeRO-3 shards ÷ with
  even shards (ZeRO's and FSDP's rule: every card holds 1/6 of the state), both on all six cards. Modelled.
- ``three_types``: memory-bound cases on three GPU types (2 × A100-80GB + 4 × V100-16GB + 4 × T4, and four
  times that mix at four times the batch, where the search replicates pipelines); the planner's best
  modelled step without ZeRO ÷ its best with ZeRO stages in its space (``optimizer.zero_stage: auto``: data
  parallelism at stages 1-3, ZeRO-1 inside pipelines), with the devices each plan leaves unused: over the
  whole space (pipelines too), and over data parallelism alone, as for a model the planner may not
  pipeline. Modelled.
- ``predicted_over_measured``: the planner's predicted step ÷ the measured one for its data-parallel plan
  without ZeRO, at ZeRO-2 and at ZeRO-3, on ``bench/plan_accuracy.py``'s throttled cluster (emulated, CPU
  slices whose speeds the profile measures, a named 1 Gbit/s link): ``--rounds`` rounds, each a fresh profile
  then one run of each stage, the order rotated between rounds; ``by_stage`` gives every run's figure and their
  median, the one held to 0.90-1.10.

The GPT family: 24 layers, 512 tokens, 128-wide heads; the width grows in steps of 128.

Usage: python bench/sharding.py [--steps 16] [--rounds 5] [--no-measure] [--json-out docs/measurements/sharding.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from collections.abc import Callable, Sequence

import plan_accuracy as pa  # this folder's (a script's folder leads sys.path): the emulated clusters benches run

MIX = {"A100-80GB": 2, "V100-16GB": 4}
THREE = {"A100-80GB": 2, "V100-16GB": 4, "T4": 4}
# Four times that mix, where the search replicates pipeline kinds and ZeRO-1 can shard within them.
THREE_X4 = {t: 4 * n for t, n in THREE.items()}
LAYERS, TOKENS, HEAD = 24, 512, 128
STAGES = (0, 2, 3)  # measured on throttled devices: plain data parallelism beside ZeRO-2 and ZeRO-3
GLOBAL_BATCH = 64


@functools.cache
def footprint(width: int):
    """The GPT of ``width`` (a multiple of ``HEAD``), measured on the meta device."""
    from hetero_ray.perf.footprint import measure_footprint
    from hetero_ray.workloads import build_workload

    options = {"n_layer": LAYERS, "n_head": width // HEAD, "n_embd": width, "block_size": TOKENS}
    return measure_footprint(lambda: build_workload("gpt", options))


def largest_by(fits: Callable[[int], bool], low: int, high: int) -> int:
    """The largest ``n`` in ``[low, high)`` that ``fits``, by bisection (fitting is monotone); ``low`` must fit."""
    assert fits(low), f"{low} does not fit"
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def largest(fits: Callable[[object], bool]) -> int:
    """The largest width of the GPT family whose footprint ``fits``."""
    return HEAD * largest_by(lambda units: fits(footprint(units * HEAD)), 1, 160)


def ranks(devices: dict[str, int]) -> list[str]:
    return [t for t, n in devices.items() for _ in range(n)]


def trains_on_all(stage: int, devices: dict[str, int], catalog, precision: str = "auto") -> Callable[[object], bool]:
    """Whether data parallelism at ZeRO ``stage`` (memory-proportional shards) trains on every device."""
    from hetero_ray.plan.data_parallel import plan_data_parallel
    from hetero_ray.plan.plan import Plan

    def fits(fp) -> bool:
        plan = plan_data_parallel(
            ranks(devices), catalog, fp, global_batch=GLOBAL_BATCH, precision=precision, zero_stage=stage
        )
        return isinstance(plan, Plan) and not plan.excluded

    return fits


def trains_somewhere(devices: dict[str, int], catalog) -> Callable[[object], bool]:
    """Whether plain data parallelism trains on some of the devices (the others left unused)."""
    from hetero_ray.plan.data_parallel import plan_data_parallel
    from hetero_ray.plan.plan import Plan

    return lambda fp: isinstance(plan_data_parallel(ranks(devices), catalog, fp, global_batch=GLOBAL_BATCH), Plan)


def even_shards_fit(devices: dict[str, int], catalog) -> Callable[[object], bool]:
    """ZeRO-3 as DeepSpeed and FSDP shard: every device holds 1/world of the sharded state, beside what it
    holds whole and one sample's activations in its precision."""
    from hetero_ray.plan.cost import activation_scale
    from hetero_ray.plan.data_parallel import zero_bytes
    from hetero_ray.train.precision import choose_precision

    specs = [catalog.get(t) for t in ranks(devices)]

    def fits(fp) -> bool:
        held, sharded = zero_bytes(fp, 3)
        return all(
            held + sharded / len(specs) + fp.activation_bytes_per_sample * activation_scale(choose_precision(s, "auto"))
            <= s.memory_bytes
            for s in specs
        )

    return fits


def capacity(catalog) -> dict:
    widths = {
        "zero3_by_memory_on_all": largest(trains_on_all(3, MIX, catalog)),
        "zero3_even_on_all": largest(even_shards_fit(MIX, catalog)),
        "unsharded_on_all": largest(trains_on_all(0, MIX, catalog)),
        "unsharded_on_some": largest(trains_somewhere(MIX, catalog)),
    }
    params = {k: footprint(w).param_count for k, w in widths.items()}
    return {
        "devices": MIX,
        "kind": "modelled (the GPT family's costs measured on the meta device; the planner's memory rule; "
        "catalog memory; auto precision: bf16 on A100, fp16 on V100)",
        "family": f"GPT, {LAYERS} layers, {TOKENS} tokens, heads of {HEAD}; largest width in steps of {HEAD}",
        "width": widths,
        "params": params,
        "capacity_ratio": params["zero3_by_memory_on_all"] / params["unsharded_on_all"],
        "capacity_ratio_vs_a100s_alone": params["zero3_by_memory_on_all"] / params["unsharded_on_some"],
        "uneven_over_even": params["zero3_by_memory_on_all"] / params["zero3_even_on_all"],
    }


def three_types(catalog, width: int, devices: dict[str, int] = THREE, global_batch: int = GLOBAL_BATCH) -> dict:
    """The planner with and without ZeRO in its space on ``devices``, for the GPT of ``width``: over its whole
    space (pipelines, ZeRO-1 inside them, and data parallelism at every stage), and over data parallelism
    alone, as for a model it may not pipeline (batch statistics)."""
    from hetero_ray.plan.data_parallel import fastest_zero_stage, plan_data_parallel, zero_stage_plans
    from hetero_ray.plan.plan import Plan
    from hetero_ray.plan.search import plan
    from hetero_ray.plan.topology import uniform_topology

    fp = footprint(width)
    types = ranks(devices)
    gbps = 100.0
    topology = uniform_topology(catalog, devices, gpus_per_node=4, inter_node_gbps=gbps)
    # Data parallelism spans the nodes: its collectives run at the NIC's speed.
    link = (gbps * 1e9 / 8, 1e-5)
    sharded = {
        s: plan_data_parallel(types, catalog, fp, global_batch=global_batch, link=link, zero_stage=s) for s in (1, 2, 3)
    }

    def summary(p) -> dict:
        if not isinstance(p, Plan):
            return {"infeasible": p.reason}
        used = {t: sum(r.gpu_type == t for r in p.roles) for t in devices}
        return {
            "step_s": p.predicted_step_s,
            "zero_stage": p.zero_stage,
            "pipelined": p.is_pipelined,
            "used": used,
            "unused": {t: n - used[t] for t, n in devices.items() if n - used[t]},
            "explanation": p.explanation,
        }

    def searched(max_stages: int, zero_stage: int):
        found = plan(
            types,
            catalog,
            fp,
            global_batch=global_batch,
            topology=topology,
            max_stages=max_stages,
            top_k=1,
            zero_stage=zero_stage,
        )
        return found[0] if isinstance(found, list) else found

    def compare(max_stages: int) -> dict:
        placed = {0: searched(max_stages, 0), 1: searched(max_stages, 1) if max_stages > 1 else []}
        without = placed[0]
        ranked = {s: zero_stage_plans(s, placed.get, sharded.get) for s in (1, 2, 3)}
        best = fastest_zero_stage({0: without, **{s: p[0] if isinstance(p, list) else p for s, p in ranked.items()}})
        return {
            "without_zero": summary(without),
            **({"zero1_in_pipelines": summary(placed[1])} if max_stages > 1 else {}),
            "with_zero": summary(best),
            "without_over_with": without.predicted_step_s / best.predicted_step_s
            if isinstance(without, Plan) and isinstance(best, Plan)
            else None,
        }

    return {
        "devices": devices,
        "kind": "modelled (catalog speeds, efficiency 0.4; costs measured on the meta device)",
        "case": f"GPT width {width} ({fp.param_count / 1e9:.2f} G parameters), global batch {global_batch}; "
        f"nodes of 4 GPUs, {gbps:g} Gbit/s between them",
        "zero_steps_s": {s: p.predicted_step_s if isinstance(p, Plan) else None for s, p in sharded.items()},
        "whole_space": compare(8),
        "data_parallel_only": compare(1),
    }


# The confirmation's scale: every card's memory ÷ this (80 GiB → 20 MiB), so the largest GPT the rule admits is
# one this CPU trains. A small GPT family: 12 layers, 16 tokens, 2 heads, width in steps of 8.
MEMORY_SCALE = 4096
SMALL = {"n_layer": 12, "n_head": 2, "block_size": 16, "corpus_bytes": 50_000}


def scaled_catalog(path: str):
    """Write the packaged catalog's ``MIX`` types with memory ÷ ``MEMORY_SCALE`` to ``path``; the catalog."""
    from importlib.resources import files

    import yaml

    from hetero_ray.cluster.catalog import load_catalog

    packaged = yaml.safe_load(files("hetero_ray.cluster").joinpath("gpus.yaml").read_text())["gpus"]
    scaled = {t: {**packaged[t], "memory_gib": packaged[t]["memory_gib"] / MEMORY_SCALE} for t in MIX}
    with open(path, "w") as f:
        yaml.safe_dump({"gpus": scaled}, f)
    return load_catalog(path)


def small_footprint(width: int):
    from hetero_ray.perf.footprint import measure_footprint
    from hetero_ray.workloads import build_workload

    return measure_footprint(lambda: build_workload("gpt", {**SMALL, "n_embd": width}))


def largest_small(stage: int, catalog) -> int:
    """The widest GPT of the small family that trains on all of ``MIX`` at ZeRO ``stage``, in fp32 as the
    emulated cards compute."""
    fits = trains_on_all(stage, MIX, catalog, "fp32")
    return 8 * largest_by(lambda w: fits(small_footprint(8 * w)), 1, 256)


def run_config(name: str, width: int, gpus_file: str, stage: int, steps: int, tmp: str):
    from hetero_ray.config import parse_config

    return parse_config(
        {
            "devices": MIX,
            "gpus_file": gpus_file,
            "emulation": {"mode": "padded"},
            "workload": {"name": "gpt", "options": {**SMALL, "n_embd": width}},
            "optimizer": {"zero_stage": stage},
            "train": {"global_batch": 12, "steps": steps, "precision": "fp32", "report_every": steps},
            "run": {"name": name, "storage_path": f"{tmp}/runs"},
        }
    )


def confirm(steps: int) -> dict:
    """At 1/``MEMORY_SCALE`` of every card's memory: the largest small GPT the rule trains on all six cards
    with ZeRO-3 and without sharding, then a run of the ZeRO-3 one on emulated cards (padded, memory caps
    charging each rank what it holds), and the planner's plan for it without sharding."""
    import tempfile

    from hetero_ray.plan.data_parallel import plan_data_parallel
    from hetero_ray.plan.plan import Plan

    with tempfile.TemporaryDirectory() as tmp:
        catalog = scaled_catalog(f"{tmp}/gpus.yaml")
        widths = {"zero3": largest_small(3, catalog), "unsharded": largest_small(0, catalog)}
        fp = small_footprint(widths["zero3"])
        unsharded = plan_data_parallel(ranks(MIX), catalog, fp, global_batch=12, precision="fp32")
        with pa.connected_cluster(MIX, None):
            from hetero_ray.train.prepare import prepare
            from hetero_ray.train.trainer import run_training

            cfg = run_config("sharding-confirm", widths["zero3"], f"{tmp}/gpus.yaml", 3, steps, tmp)
            prepared = prepare(cfg)
            metrics = run_training(cfg, prepared).metrics
    params = {k: small_footprint(w).param_count for k, w in widths.items()}
    return {
        "kind": "emulated, padded, memory caps; every card's memory ÷ " + str(MEMORY_SCALE),
        "width": widths,
        "params": params,
        "capacity_ratio_at_scale": params["zero3"] / params["unsharded"],
        "zero3_run": {
            "steps": steps,
            "losses": metrics["losses"],
            "devices": [
                {k: d.get(k) for k in ("rank", "gpu_type", "local_batch", "peak_memory_bytes", "memory_cap_bytes")}
                for d in metrics["devices"]
            ],
        },
        "unsharded_plan_at_that_width": {
            "trains_on": sorted(r.gpu_type for r in unsharded.roles),
            "excluded": [f"{e.count} × {e.gpu_type}: {e.reason}" for e in unsharded.excluded],
        }
        if isinstance(unsharded, Plan)
        else {"infeasible": unsharded.reason},
    }


def measured(steps: int, rounds: int) -> list[dict]:
    """``bench/plan_accuracy.py``'s throttled cluster, then ``rounds`` rounds of a fresh profile and one run each
    without ZeRO, at ZeRO-2 and at ZeRO-3, side by side: the planner's predicted step from that round's profile ÷
    the measured one. This machine's speed drifts between minutes by as much as the gap between stages, in the
    profile as in the runs, so each round pairs a profile of its own with the runs after it (one profile for all
    rounds would be one draw of that drift in every figure), and each round starts one stage later (0, 2, 3;
    2, 3, 0; ...), so no stage always runs first or last."""
    records = []
    with pa.profiled_cluster(steps) as profile:
        from hetero_ray.cluster.catalog import load_catalog
        from hetero_ray.train.prepare import prepare, profiled_speeds
        from hetero_ray.train.trainer import run_training

        for round_ in range(rounds):
            profiled = profile()
            # The round's profile prices the slowest of the four alike at every stage.
            straggler = profiled_speeds(profiled, load_catalog(profiled.gpus_file)).straggler - 1
            for i in range(len(STAGES)):
                stage = STAGES[(round_ + i) % len(STAGES)]
                cfg = profiled.model_copy(
                    update={
                        "optimizer": profiled.optimizer.model_copy(update={"zero_stage": stage}),
                        "run": profiled.run.model_copy(update={"name": f"{profiled.run.name}-zero{stage}"}),
                    }
                )
                prepared = prepare(cfg)
                metrics = run_training(cfg, prepared).metrics
                plan = prepared.plan
                devices = [pa.device_record(d) for d in sorted(metrics["devices"], key=lambda d: d["rank"])]
                if [d["gpu_type"] for d in devices] != [r.gpu_type for r in plan.roles]:
                    raise SystemExit(f"ranks {[d['gpu_type'] for d in devices]} are not the plan's roles in order")
                # Each device's compute over what the plan gave it: how far the slowest ran behind the others.
                behind = [d["busy_s"] / r.predicted_compute_s for d, r in zip(devices, plan.roles)]
                records.append(
                    {
                        "round": round_,
                        "zero_stage": stage,
                        "plan": "pipelined" if plan.is_pipelined else "data parallel",
                        "devices_used": [r.gpu_type for r in plan.roles],
                        "shares": [r.local_batch for r in plan.roles],
                        "predicted_step_s": plan.predicted_step_s,
                        "predicted_comm_s": plan.predicted_comm_s,
                        "measured_step_s": metrics["step_s"],
                        "predicted_over_measured": plan.predicted_step_s / metrics["step_s"],
                        "straggler_priced": straggler,
                        "slowest_over_mean": max(behind) / statistics.fmean(behind) - 1,
                        "devices": devices,
                    }
                )
    return records


def by_stage(runs: list[dict]) -> dict:
    """Each stage's ``predicted_over_measured`` over the rounds: every run's, their median, and whether the median
    is within 0.90-1.10."""
    out = {}
    for stage in STAGES:
        ratios = [r["predicted_over_measured"] for r in runs if r["zero_stage"] == stage]
        median = statistics.median(ratios)
        out[f"zero{stage}"] = {"runs": ratios, "median": median, "target_met": 0.90 <= median <= 1.10}
    return out


def stragglers(runs: list[dict]) -> dict:
    """What the plans priced for the slowest of the four devices (from each round's profiled repeats) beside how
    far the slowest ran behind the mean in the runs without ZeRO, which meet once a step (at ZeRO-2 and 3 the
    ranks wait for each other inside the pass, so their compute comes out alike): medians over the rounds."""
    zero0 = [r for r in runs if r["zero_stage"] == 0]
    return {
        "priced": statistics.median(r["straggler_priced"] for r in zero0),
        "measured_zero0": statistics.median(r["slowest_over_mean"] for r in zero0),
        "measured_is": "the slowest device's compute over the four's mean, each over its planned compute, per run "
        "(means over steps, so a device slower all run long shows, one slower now and then less)",
    }


def fresh_process(fn: Callable, *args):
    """``fn(*args)`` in a new process: Ray reads a cluster's authentication token once, at import, so each
    emulated cluster needs a process of its own."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--steps", type=int, default=16, help="steps of each emulated run")
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="throttled rounds: a profile, then a run of each ZeRO stage in rotated order",
    )
    parser.add_argument("--no-measure", action="store_true", help="the modelled figures alone")
    args = parser.parse_args(argv)
    from hetero_ray.cluster.catalog import load_catalog

    catalog = load_catalog()
    out = {"capacity": capacity(catalog)}
    if not args.no_measure:
        out["capacity"]["confirmed"] = fresh_process(confirm, args.steps)
        runs = fresh_process(measured, args.steps, args.rounds)
        out["predicted_over_measured"] = {
            "kind": "emulated, throttled (CPU slices, profiled at the start of every round; a named 1 Gbit/s link)",
            "by_stage": by_stage(runs),
            "stragglers": stragglers(runs),
            "runs": runs,
        }
    # The largest GPT an A100-80GB holds whole, and the largest ZeRO-3 trains on the two-type mix (none whole).
    widths = out["capacity"]["width"]
    out["three_types"] = [
        *(three_types(catalog, widths[k]) for k in ("unsharded_on_some", "zero3_by_memory_on_all")),
        three_types(catalog, widths["zero3_by_memory_on_all"], THREE_X4, 4 * GLOBAL_BATCH),
    ]
    text = json.dumps(out, indent=2)
    print(text)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
