"""The placement planner: search time by cluster size, optimality, and gains over pure data parallelism.

Prints one JSON object:
- search_s_8 … search_s_4096: wall seconds of one search (the fastest of ``--repeats`` runs, so that
  other processes on this machine do not count) for 8/64/512/4096 GPUs of 4 types, the slower of a
  48- and a 96-layer GPT (footprints measured on the meta device; measuring is not counted);
- worst_over_optimum: over 20 seeded small instances, the search's predicted step ÷ the exhaustive
  enumerator's optimum (hetero_ray/plan/exhaustive.py walks every plan of the same space);
- gain_memory_bound, gain_comm_bound: the planner's predicted samples/s ÷ the best pure data-parallel
  plan's (the same search restricted to one stage), where the model does not fit the small cards,
  and where the gradient all-reduce crosses a slow network;
- predicted_over_measured: predicted ÷ measured step time of three plans (one data-parallel, two
  pipelines) run on the emulated cluster (``bench/plan_accuracy.py``; skipped with ``--no-measure``,
  which takes minutes less).
Search times are measured on this CPU; every step time and gain is modelled (catalog peak × efficiency,
the topology's links), not measured on GPUs.

Usage: python bench/planner.py [--repeats 3] [--no-measure] [--output docs/measurements/planner.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

from hetero_ray.cluster.catalog import Catalog, load_catalog
from hetero_ray.output import write_json
from hetero_ray.perf.footprint import Footprint, measure_footprint
from hetero_ray.plan.exhaustive import exhaustive_best_step
from hetero_ray.plan.instances import random_instance
from hetero_ray.plan.plan import Infeasible, Plan
from hetero_ray.plan.search import plan
from hetero_ray.plan.topology import uniform_topology
from hetero_ray.workloads.gpt import build

# GPT-2 XL width (1.5 B parameters at 48 layers), 1024-token samples.
GPT = {"n_embd": 1600, "n_head": 25, "block_size": 1024, "corpus_bytes": 2_000_000}
TYPES = ("A100-80GB", "H100-80GB", "V100-16GB", "L4")
SIZES = (8, 64, 512, 4096)
SAMPLES_PER_GPU = 4
INSTANCES = 20


def gpt_footprint(n_layer: int) -> Footprint:
    return measure_footprint(lambda: build(n_layer=n_layer, **GPT))


def cluster(n: int) -> list[str]:
    """n GPUs, a quarter of each type."""
    return [t for t in TYPES for _ in range(n // len(TYPES))]


def best(ranks: list[str], catalog: Catalog, fp: Footprint, **kw) -> Plan:
    result = plan(ranks, catalog, fp, top_k=1, **kw)
    if isinstance(result, Infeasible):
        raise SystemExit(f"bench: {result.reason}")
    return result[0]


def search_seconds(catalog: Catalog, footprints: dict[int, Footprint], repeats: int) -> tuple[dict, dict]:
    """Per cluster size: the slower model's fastest search; and what each search chose."""
    figures, details = {}, {}
    for n in SIZES:
        ranks = cluster(n)
        topo = uniform_topology(catalog, TYPES, gpus_per_node=min(8, n // len(TYPES)), inter_node_gbps=100)
        per_model = {}
        for layers, fp in footprints.items():
            times, cpu = [], []
            for _ in range(repeats):
                start, start_cpu = time.perf_counter(), time.process_time()
                chosen = best(ranks, catalog, fp, global_batch=SAMPLES_PER_GPU * n, topology=topo)
                times.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
            per_model[layers] = {
                "search_s": min(times),
                "runs_s": times,
                # CPU seconds of this process: what the search costs when the machine is shared.
                "cpu_s": min(cpu),
                "predicted_step_s": chosen.predicted_step_s,
                "pipelines": chosen.num_pipelines,
                "stages": sorted(
                    {max(r.stage for r in chosen.roles if r.pipeline == p) + 1 for p in range(chosen.num_pipelines)}
                ),
            }
        figures[f"search_s_{n}"] = max(m["search_s"] for m in per_model.values())
        details[str(n)] = per_model
    return figures, details


def worst_over_optimum(catalog: Catalog) -> tuple[float, list[dict]]:
    rows = []
    for seed in range(INSTANCES):
        inst = random_instance(seed, catalog)
        kw = dict(global_batch=inst.global_batch, topology=inst.topology, max_stages=4, micro_batches=(1, 2))
        result = plan(list(inst.rank_types), catalog, inst.footprint, top_k=1, **kw)
        optimum = exhaustive_best_step(list(inst.rank_types), catalog, inst.footprint, **kw)
        chosen = None if isinstance(result, Infeasible) else result[0].predicted_step_s
        ratio = 1.0 if chosen is None and optimum == float("inf") else chosen / optimum
        rows.append({**inst.describe(), "chosen_step_s": chosen, "optimum_step_s": optimum, "ratio": ratio})
    return max(r["ratio"] for r in rows), rows


def gain(catalog: Catalog, fp: Footprint, ranks: list[str], *, gpus_per_node: int, gbps: float, batch: int) -> dict:
    """The planner's samples/s ÷ the best pure data-parallel plan's, on one scenario."""
    topo = uniform_topology(catalog, set(ranks), gpus_per_node=gpus_per_node, inter_node_gbps=gbps)
    planned = best(ranks, catalog, fp, global_batch=batch, topology=topo)
    dp = best(ranks, catalog, fp, global_batch=batch, topology=topo, max_stages=1)
    return {
        "gain": dp.predicted_step_s / planned.predicted_step_s,
        "devices": {t: ranks.count(t) for t in dict.fromkeys(ranks)},
        "gpus_per_node": gpus_per_node,
        "inter_node_gbps": gbps,
        "global_batch": batch,
        "planned": {"step_s": planned.predicted_step_s, "explanation": planned.explanation},
        "data_parallel": {"step_s": dp.predicted_step_s, "explanation": dp.explanation},
    }


def predicted_over_measured(run: bool) -> dict:
    """Predicted ÷ measured step time of three plans on the emulated cluster (``bench/plan_accuracy.py``)."""
    if not run:
        return {"predicted_over_measured": None, "predicted_over_measured_note": "not measured by this run"}
    from plan_accuracy import measure

    records = measure(mode="padded")
    return {
        "predicted_over_measured": [r["predicted_over_measured"] for r in records],
        "predicted_over_measured_plans": records,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", help="also write the JSON here")
    parser.add_argument(
        "--no-measure", action="store_true", help="skip predicted_over_measured (runs on an emulated cluster)"
    )
    args = parser.parse_args()
    catalog = load_catalog()
    start = time.perf_counter()
    footprints = {48: gpt_footprint(48), 96: gpt_footprint(96)}
    measure_s = time.perf_counter() - start
    search, search_details = search_seconds(catalog, footprints, args.repeats)
    worst, instances = worst_over_optimum(catalog)
    fp = footprints[48]
    # Memory-bound: 1.5 B parameters need ~22 GiB of weights and Adam state, more than a V100-16GB or L4 holds.
    memory_bound = gain(catalog, fp, ["A100-80GB"] * 8 + ["V100-16GB"] * 32, gpus_per_node=8, gbps=100, batch=256)
    # Communication-bound: every GPU in its own node, 10 Gbit/s Ethernet between them.
    comm_bound = gain(catalog, fp, ["A100-80GB"] * 16 + ["H100-80GB"] * 16, gpus_per_node=1, gbps=10, batch=256)
    result = {
        "labels": {
            "search_s_*": "measured: wall seconds of the search on this CPU (fastest of the repeats)",
            "worst_over_optimum, gain_*": "modelled: ratios of the planner's predicted step times",
            "predicted_over_measured": "emulated, padded: modelled step ÷ step measured on the emulated cluster",
        },
        **search,
        "worst_over_optimum": worst,
        "gain_memory_bound": memory_bound["gain"],
        "gain_comm_bound": comm_bound["gain"],
        **predicted_over_measured(not args.no_measure),
        "instances": {
            "search": {
                "types": TYPES,
                "gpt": GPT,
                "layers": {str(k): len(v.layers) for k, v in footprints.items()},
                "params": {str(k): v.param_count for k, v in footprints.items()},
                "global_batch": f"{SAMPLES_PER_GPU} × GPUs",
                "topology": "8 GPUs per node (2 at 8 GPUs), catalog NVLink/PCIe inside, 100 Gbit/s between",
                "footprint_measure_s": measure_s,
                "by_size": search_details,
            },
            "optimality": instances,
            "memory_bound": memory_bound,
            "comm_bound": comm_bound,
        },
        "machine": platform.platform(),
        # Other processes share this machine's cores: its load during the run, 1/5/15 minutes.
        "load_average": os.getloadavg(),
        "cpus": os.cpu_count(),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        write_json(args.output, result, force=True)  # a measurement replaces the last one


if __name__ == "__main__":
    main()
