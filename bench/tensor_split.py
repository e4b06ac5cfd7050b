"""Tensor parallelism across GPU types: how exact the uneven split is, and what the planner gains from it.

- ``split_max_abs``: a GPT block split 5 : 3 over two gloo ranks and 4 : 3 : 1 over three (real
  processes, fp32), against the unsplit block: the largest absolute difference of any output, input
  gradient or parameter gradient (the computation of ``tests/test_tensor_parallel.py``, run here).
- ``modelled_gain``: the planner's best step without tensor parallelism ÷ with it (degrees 1-8 tried),
  on a named case where it pays: a GPT whose blocks (1.26 G parameters, 20 GB of weights, gradients
  and Adam state each) fit no V100-16GB, on 2 × A100-80GB (a p4d node, NVLink) + 8 × V100-16GB (a
  p3.16xlarge, NVLink). Modelled: catalog speeds at the default efficiency, the block's costs measured
  on the meta device. Not a measurement of a run.
- ``modelled_gain_across_types``: the same model's best step without groups across GPU types ÷ with them
  (degrees 1-8 per type tried in both), on a named case where nodes mix types: 4 nodes, each an
  A100-80GB beside a V100-16GB over PCIe 3.0 x16, 100 Gbit/s between nodes. Modelled, as above.
- ``predicted_over_measured``: the planner's predicted step ÷ the step measured on throttled devices
  (``bench/plan_accuracy.py``'s cluster: 2 × A100-80GB + 2 × V100-16GB as CPU slices of 0.40 and 0.22
  of a core, a named 1 Gbit/s link, profiled first) for its best plan of tensor-parallel degree 2;
  ``predicted_over_measured_unequal`` the same for its best plan whose types have unequal degrees (stages
  of different degrees in one pipeline, on hetero-ray's own schedule); beside them its best plan without
  tensor parallelism; ``predicted_over_measured_across_types`` the same for its best plan with a stage split
  across an A100 and a V100 (``train.tensor_parallel_across``, the split by the profile's speeds). Emulated,
  throttled: compute takes the time it takes; the members' all-reduces and every other message are held to
  the named link.
- ``speed_split_speedup``: on the same cluster, a layer split across GPU types: two replicas, each one
  tensor-parallel stage over an A100 and a V100 holding the whole model, its heads and MLP columns split
  in proportion to the two types' speeds as the profile measured them, against the same pairs split in
  halves: the step measured with halves ÷ the step measured by speed. Both are plans made by hand, so no
  prediction is compared.

Usage: python bench/tensor_split.py [--steps 16] [--no-measure] [--json-out docs/measurements/tensor-split.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
GPT = {"n_layer": 8, "n_head": 80, "n_embd": 10240, "block_size": 2048}
DEVICES = {"A100-80GB": 2, "V100-16GB": 8}
# (GPUs per node, NIC Gbit/s): AWS p4d.24xlarge and p3.16xlarge, as in cluster.yaml.
NODES = {"A100-80GB": (8, 400.0), "V100-16GB": (8, 25.0)}
GLOBAL_BATCH = 64


def split_max_abs() -> dict:
    """Run the test's uneven splits on gloo ranks; the worst difference from the unsplit block per split."""
    sys.path.insert(0, str(TESTS))
    import torch
    from ranks import run_ranks
    from test_tensor_parallel import SPLITS, one_shard, reference

    want = reference()
    out = {}
    for name, (weights, mlp_unit, _, _) in SPLITS.items():
        with tempfile.TemporaryDirectory() as tmp:
            ranks = run_ranks(one_shard, len(weights), Path(tmp), weights, mlp_unit)
        worst = 0.0
        for r in ranks:
            worst = max(worst, float((r["y"] - want["y"]).abs().max()), float((r["dx"] - want["dx"]).abs().max()))
            worst = max(worst, *(float((r["grads"][k] - g).abs().max()) for k, g in want["grads"].items()))
            assert all(torch.equal(r["params"][k], p) for k, p in want["params"].items())
        out[name] = {"weights": weights, "heads": [r["heads"] for r in ranks], "max_abs": worst}
    return out


def tp_degrees(p) -> dict[str, int]:
    """The tensor-parallel degree of each GPU type's stages in plan ``p``."""
    return {r.gpu_type: r.tp_degree for r in p.roles}


# The plans measured: (name, degrees tried, what the plan must hold: "" the best plan, "unequal" types of
# different degrees, "across" a stage split across GPU types).
MEASURED = (
    ("degree 2", (2,), ""),
    ("unequal degrees per type", (1, 2), "unequal"),
    ("across types", (1, 2), "across"),
    ("degree 1", (1,), ""),
)
ACROSS = [["A100-80GB", "V100-16GB"]]
# The named case where nodes mix types: nodes of one A100-80GB and one V100-16GB, 100 Gbit/s between them.
MIXED_NODES, MIXED_NIC_GBPS = 4, 100.0


def holds(kind: str, p) -> bool:
    """Whether plan ``p`` is of the kind a ``MEASURED`` entry asks for."""
    if kind == "unequal":
        return len(set(tp_degrees(p).values())) > 1
    return p.splits_across_types if kind == "across" else True


def modelled_gain() -> dict:
    """The planner's best plan on the named case, without and with tensor parallelism."""
    from hetero_ray.cluster.catalog import load_catalog
    from hetero_ray.perf.footprint import measure_footprint
    from hetero_ray.plan.search import plan
    from hetero_ray.plan.topology import MixedNodeKind, NodeKind, Topology
    from hetero_ray.workloads import build_workload

    catalog = load_catalog()
    footprint = measure_footprint(lambda: build_workload("gpt", GPT))
    topology = Topology(
        nodes={
            t: NodeKind(
                gpu_type=t,
                gpus_per_node=gpus,
                intra_bandwidth_bytes_s=catalog.get(t).interconnect_gbs * 1e9 / 2,
                nic_bandwidth_bytes_s=gbps * 1e9 / 8,
            )
            for t, (gpus, gbps) in NODES.items()
        }
    )
    ranks = [t for t, n in DEVICES.items() for _ in range(n)]
    kw = dict(global_batch=GLOBAL_BATCH, topology=topology, top_k=1)
    without = plan(ranks, catalog, footprint, **kw)[0]
    best = plan(ranks, catalog, footprint, tensor_parallel=(1, 2, 4, 8), **kw)[0]

    def summary(p) -> dict:
        return {
            "step_s": p.predicted_step_s,
            "tensor_parallel": p.tensor_parallel,
            "tp_degrees": tp_degrees(p),
            "used": {t: sum(r.gpu_type == t for r in p.roles) for t in DEVICES},
            "unused": {e.gpu_type: e.count for e in p.excluded},
            "explanation": p.explanation,
        }

    block = footprint.layers[1]
    node = {
        t: replace(topology.nodes[t], gpus_per_node=1, nic_bandwidth_bytes_s=MIXED_NIC_GBPS * 1e9 / 8) for t in NODES
    }
    apart = Topology(nodes=node)
    mixed = replace(
        apart,
        mixed=(
            MixedNodeKind(gpu_types=tuple(DEVICES), nodes=MIXED_NODES, nic_bandwidth_bytes_s=MIXED_NIC_GBPS * 1e9 / 8),
        ),
    )
    pairs = [t for t in DEVICES for _ in range(MIXED_NODES)]
    kw["tensor_parallel"] = (1, 2, 4, 8)
    one_type = plan(pairs, catalog, footprint, **(kw | {"topology": apart}))[0]
    across = plan(pairs, catalog, footprint, **(kw | {"topology": mixed}))[0]
    across_types = {
        "case": f"the same GPT on {MIXED_NODES} nodes, each an A100-80GB beside a V100-16GB over PCIe 3.0 x16 "
        f"(16 GB/s), {MIXED_NIC_GBPS:g} Gbit/s between nodes, global batch {GLOBAL_BATCH}; tensor-parallel degrees "
        "1-8 per type tried in both",
        "kind": "modelled (catalog speeds, efficiency 0.4; costs measured on the meta device)",
        "without": summary(one_type),
        "with": summary(across),
        "gain": one_type.predicted_step_s / across.predicted_step_s,
    }
    return {
        "case": "GPT 8 × 10240 (80 heads, 2048 tokens) on 2 × A100-80GB (p4d, NVLink) + 8 × V100-16GB "
        "(p3.16xlarge, NVLink), global batch 64; one block holds 1.26 G parameters, whose 20 GB of "
        "weights, gradients and Adam state fit no V100-16GB",
        "kind": "modelled (catalog speeds, efficiency 0.4; costs measured on the meta device)",
        "block_params": block.params,
        "block_split_params": block.tp_params,
        "without": summary(without),
        "with": summary(best),
        "gain": without.predicted_step_s / best.predicted_step_s,
        "across_types": across_types,
    }


def measured(steps: int) -> dict:
    """Profile the throttled cluster, then run the planner's best plan at degree 2 and at degree 1 on it."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import plan_accuracy as pa  # the throttled cluster, workload, batch and link that bench measures plans on

    records = []
    with pa.profiled_cluster(steps) as cfg:
        from hetero_ray.plan.search import plan
        from hetero_ray.train.prepare import prepare, profiled_speeds, rank_types, topology_for
        from hetero_ray.train.trainer import run_training

        prepared = prepare(cfg)
        types = rank_types(cfg)
        speeds = profiled_speeds(cfg, prepared.catalog)

        made: list[str] = []

        def run(name: str, p) -> dict:
            # A run name of its own: one already used would resume that run's last checkpoint.
            made.append(name)
            update = {"run": cfg.run.model_copy(update={"name": f"{cfg.run.name}-{len(made)}"})}
            metrics = run_training(cfg.model_copy(update=update), replace(prepared, plan=p)).metrics
            return {
                "name": name,
                "shape": pa.describe(replace(p, roles=tuple(r for r in p.roles if r.tp_rank == 0))),
                "measured_step_s": metrics["step_s"],
                "devices": [pa.device_record(d) for d in metrics["devices"]],
                "roles": [pa.role_record(r) | {"tp_rank": r.tp_rank, "tp_weights": r.tp_weights} for r in p.roles],
            }

        # The config's route to groups across types; the plans run under ``cfg`` itself, which only executes them.
        train_across = cfg.train.model_copy(update={"tensor_parallel_across": ACROSS, "max_tensor_parallel": 2})
        across_cfg = cfg.model_copy(update={"train": train_across})
        for name, degrees, kind in MEASURED:
            plans = plan(
                types,
                prepared.catalog,
                prepared.footprint,
                global_batch=cfg.train.global_batch,
                topology=topology_for(across_cfg if kind == "across" else cfg, prepared.catalog, types),
                precision=cfg.train.precision,
                efficiency=prepared.efficiency,
                emulated=True,
                seconds_per_sample=speeds,
                tensor_parallel=degrees,
                # The best plan of unequal degrees (or across types) is among the top ones, after those of degree 1.
                top_k=100 if kind else 1,
            )
            best = next(p for p in plans if holds(kind, p))
            if name == "degree 2":
                degree_two = best
            record = run(name, best)
            records.append(
                record
                | {
                    "tensor_parallel": best.tensor_parallel,
                    "tp_degrees": tp_degrees(best),
                    "predicted_step_s": best.predicted_step_s,
                    "predicted_over_measured": best.predicted_step_s / record["measured_step_s"],
                    "explanation": best.explanation,
                }
            )
        by_speed = speed_weights(speeds, degree_two)
        across = [
            run(f"across types, {name}", across_types(degree_two, w))
            for name, w in (("by speed", by_speed), ("halves", (1.0, 1.0)))
        ]
    return {
        "kind": "emulated, throttled: CPU slices whose speeds the profile measured; messages held to the link",
        "cluster": pa.DEVICES,
        "cpu_share": pa.CPU_SHARE,
        "workload": pa.THROTTLED_WORKLOAD,
        "global_batch": pa.THROTTLED_BATCH,
        "link": pa.LINK,
        "steps": steps,
        "plans": records,
        "across_types": across,
    }


def speed_weights(speeds, plan) -> tuple[float, float]:
    """(A100, V100) in proportion to the profile's samples per second of each, in the precision ``plan`` gives
    it, at the micro-batch the pairs run."""
    micro = plan.global_batch // 2
    precision = {r.gpu_type: r.precision for r in plan.roles}
    per_sample = [speeds(t, precision[t], micro) for t in ("A100-80GB", "V100-16GB")]
    return tuple(min(per_sample) / s for s in per_sample)


def across_types(plan, weights: tuple[float, float]):
    """Two replicas, each one tensor-parallel stage over an A100 (member 0) and a V100 (member 1) split by
    ``weights``, the batch halved between them: ``plan``'s degree-2 roles of each type, regrouped, without their
    predictions (the planner prices no such stage)."""
    from hetero_ray.plan.plan import Plan

    first = {t: next(r for r in plan.roles if r.gpu_type == t) for t in ("A100-80GB", "V100-16GB")}
    half = plan.global_batch // 2
    roles = tuple(
        replace(
            first[t],
            pipeline=p,
            tp_rank=k,
            tp_weights=weights,
            local_batch=half,
            micro_batch=half,
            sample_offset=p * half,
            predicted_compute_s=0.0,
        )
        for p in range(2)
        for k, t in enumerate(first)
    )
    return Plan(global_batch=plan.global_batch, split="by hand", emulated=True, roles=roles, predicted_compute_s=0.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16, help="steps of each measured run (default 16)")
    parser.add_argument("--no-measure", action="store_true", help="skip the runs on throttled devices")
    parser.add_argument("--json-out", help="also write the JSON here")
    args = parser.parse_args()
    splits = split_max_abs()
    result = {
        "split_max_abs": max(s["max_abs"] for s in splits.values()),
        "splits": splits,
        "split_kind": "real: gloo ranks on this CPU, fp32",
        "modelled_gain": (gain := modelled_gain()),
        "modelled_gain_across_types": gain["across_types"]["gain"],
    }
    if not args.no_measure:
        runs = measured(args.steps)
        ratio = {p["name"]: p["predicted_over_measured"] for p in runs["plans"]}
        result |= {
            "predicted_over_measured": ratio["degree 2"],
            "predicted_over_measured_unequal": ratio["unequal degrees per type"],
            "predicted_over_measured_across_types": ratio["across types"],
            "speed_split_speedup": runs["across_types"][1]["measured_step_s"]
            / runs["across_types"][0]["measured_step_s"],
            "speed_split_weights": runs["across_types"][0]["roles"][0]["tp_weights"],
            "measured": runs,
        }
    result["command"] = " ".join(["python bench/tensor_split.py", *sys.argv[1:]])
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
