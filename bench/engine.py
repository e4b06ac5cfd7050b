"""hetero-ray's gradient engine against torch's DistributedDataParallel, side by side on throttled devices.

One emulated cluster of 2 × A100-80GB + 4 × V100-16GB, CPU slices of 0.40 and 0.16 of a core
(2.5 : 1). Each device is a Ray actor in its slice (gloo's threads out of it, as in training); the same
GPT, the same bucket size and the same emulated link for both engines: every bucket's all-reduce is
held until bytes ÷ bandwidth + latency after its start, one bucket after another (DDP through a comm
hook that waits as hetero-ray's link emulation does). Runs alternate between the engines. Prints JSON:

- ``step_over_ddp``: hetero-ray's step ÷ DDP's on the two A100 slices, equal split, over a link chosen
  so that communication is about half of an unoverlapped step (target ≤ 1.02);
- ``overlap_fraction`` (both): the share of the link's time hidden behind the backward,
  1 − (step − the step without any synchronisation) ÷ the link's time (target ≥ 0.5 where DDP reaches it);
- ``grad_memory_over_ddp``: bytes held for gradients and buckets during a step ÷ DDP's, both in fp32 on
  the wire (each bucket reduced in place, no copies): hetero-ray's bucket storage; DDP's bucket storage,
  which its gradients are views of (``gradient_as_bucket_view``; target ≤ 1.05);
- ``hetero_over_ddp``: samples/s on all six devices over a fast link, hetero-ray with the split by the
  speeds each device measured alone in this run ÷ DDP with an equal split (target ≥ 1.35, bound 1.5);
- ``bf16_wire_bytes_ratio``: gradient bytes sent with ``reduce_dtype: bf16`` ÷ fp32 (0.5).

Usage: python bench/engine.py [--steps 8] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from pathlib import Path

DEVICES = {"A100-80GB": 2, "V100-16GB": 4}
CPU_SHARE = {"A100-80GB": 0.40, "V100-16GB": 0.16}
WORKLOAD = {"name": "gpt", "options": {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 128}}
# Small enough that a 3.4 MB model makes several buckets (DDP's 25 MiB would make one, and nothing to overlap).
BUCKET_MB = 0.5
HOMOGENEOUS_BATCH = 16  # per A100 slice
HETERO_BATCH = 48  # over all six
FAST_LINK = (10e9 / 8, 5e-6)  # compute dominates
MEASUREMENTS = Path(__file__).resolve().parent.parent / "docs" / "measurements"


def actor_class():
    import ray

    @ray.remote
    class Device:
        """One throttled device: its slice, a gloo rank, and timed steps of either engine."""

        def setup(self) -> str:
            """Join this node's free slice; the device's GPU type."""
            import torch

            from hetero_ray.cluster.catalog import load_catalog
            from hetero_ray.cluster.cpu_slices import join_device_slice
            from hetero_ray.train.device import worker_gpu_type

            self.claim = join_device_slice()  # kept: the slice is ours while the actor lives
            torch.set_num_threads(1)
            return worker_gpu_type(load_catalog())[0]

        def join(self, rank: int, world: int, port: int) -> None:
            """A fresh gloo world of ``world`` ranks (the last one left); its threads leave the slice once they run."""
            import torch
            import torch.distributed as dist

            from hetero_ray.cluster.cpu_slices import free_comm_threads

            if dist.is_initialized():
                dist.destroy_process_group()
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            dist.init_process_group("gloo", rank=rank, world_size=world)
            dist.all_reduce(torch.zeros(1))
            free_comm_threads(self.claim)

        def run(self, engine: str, batches: list[int], steps: int, link, wire: str) -> dict:
            """``steps`` timed steps (after two untimed) of ``engine`` on this world, ``batches[rank]`` samples here."""
            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel

            from hetero_ray.config import parse_config
            from hetero_ray.train.buckets import EmulatedLink
            from hetero_ray.train.data import collate
            from hetero_ray.train.sync import TorchAdam
            from hetero_ray.workloads import build_workload

            me, world = dist.get_rank(), dist.get_world_size()
            torch.manual_seed(0)
            workload = build_workload(WORKLOAD["name"], WORKLOAD["options"])
            model = workload.model
            total = sum(batches)
            start = sum(batches[:me])
            batch = collate(workload.dataset, torch.arange(start, start + batches[me]))
            emulated_link = EmulatedLink(*link) if link else None
            if engine == "ddp":
                ddp = DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB, gradient_as_bucket_view=True)
                ddp.register_comm_hook(padded_hook_state(emulated_link, world), padded_allreduce)
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
                run_model = ddp
            elif engine == "hetero_ray":
                cfg = parse_config(
                    {
                        "devices": DEVICES,
                        "train": {"global_batch": total, "bucket_mb": BUCKET_MB, "reduce_dtype": wire},
                    }
                )
                sync = TorchAdam(model, cfg, torch.device("cpu"), "fp32", link=emulated_link)
            else:  # "local": no synchronisation at all, the step the others are measured against
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
                run_model = model
            times, sent = [], 0.0
            for step in range(steps + 2):
                t0 = time.perf_counter()
                if engine == "hetero_ray":
                    sync.arm()
                    sync.backward(workload.loss_fn(model, batch) * (batches[me] / total))
                    synced = sync.step(0.0, False)
                    sent = sum(x.bytes_sent for x in synced.launches)
                else:
                    # DDP averages over the ranks: equal local batches make that the full-batch mean.
                    workload.loss_fn(run_model, batch).backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=False)
                if step >= 2:
                    times.append(time.perf_counter() - t0)
            held = 0
            if engine == "hetero_ray":
                held = sum(c.flat.nbytes for c in sync.grads.chunks)
            elif engine == "ddp":
                held = sum(
                    {
                        p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
                        for p in model.parameters()
                    }.values()
                )
            dist.barrier()
            return {
                "step_s": statistics.median(times),
                "grad_bytes_held": held,
                "bytes_sent": sent,
                "grad_bytes": sum(p.numel() * 4 for p in model.parameters()),
            }

    return Device


def padded_hook_state(link, world: int) -> dict:
    return {"link": link, "world": world}


def padded_allreduce(state: dict, bucket):
    """DDP's allreduce hook (average), each bucket held until the emulated link would have delivered it: the
    same ``EmulatedLink`` that holds hetero-ray's buckets."""
    import torch.distributed as dist

    from hetero_ray.plan.cost import ring_allreduce_bytes

    started = time.perf_counter()
    tensor = bucket.buffer().div_(state["world"])
    future = dist.all_reduce(tensor, async_op=True).get_future()
    link, world = state["link"], state["world"]

    def delivered(fut):
        if link is not None:
            link.hold(link.send(started, ring_allreduce_bytes(tensor.nbytes, world), 2 * (world - 1)), started)
        return fut.value()[0]

    return future.then(delivered)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=str(MEASUREMENTS / "engine-throttled.json"))
    args = parser.parse_args()

    from hetero_ray.cluster.emulation import EMULATED_RESOURCE, GPU_TYPE_LABEL, EmulatedCluster
    from hetero_ray.output import write_json
    from hetero_ray.plan.data_parallel import split_batch

    started = time.monotonic()
    cluster = EmulatedCluster(DEVICES, cpu_share=CPU_SHARE)
    cluster.start()
    os.environ.update(cluster.env)  # before `import ray`: Ray reads its auth mode at import
    import ray

    try:
        ray.init(address=cluster.address, log_to_driver=False)
        Device = actor_class()
        types = [t for t, n in DEVICES.items() for _ in range(n)]
        actors = [
            Device.options(num_cpus=1, resources={EMULATED_RESOURCE: 1}, label_selector={GPU_TYPE_LABEL: t}).remote()
            for t in types
        ]
        got = ray.get([a.setup.remote() for a in actors])
        assert got == types, got
        fast = [a for a, t in zip(actors, types) if t == "A100-80GB"]

        def join(members) -> None:
            port = free_port()
            ray.get([a.join.remote(r, len(members), port) for r, a in enumerate(members)])

        def run(members, engine, batches, link, wire="fp32"):
            out = ray.get([a.run.remote(engine, batches, args.steps, link, wire) for a in members])
            return {
                "step_s": max(o["step_s"] for o in out),
                "grad_bytes_held": out[0]["grad_bytes_held"],
                "bytes_sent": out[0]["bytes_sent"],
                "grad_bytes": out[0]["grad_bytes"],
            }

        join(fast)
        even = [HOMOGENEOUS_BATCH] * len(fast)
        local = run(fast, "local", even, None)
        # The link: the ring all-reduce of the gradients takes as long as the step without it.
        ring_bytes = local["grad_bytes"]  # 2 (W-1)/W of the payload, W = 2
        link = (ring_bytes / local["step_s"], 50e-6)
        homogeneous = {"ddp": [], "hetero_ray": []}
        for _ in range(args.repeats):
            for engine in homogeneous:
                homogeneous[engine].append(run(fast, engine, even, link))
        bf16 = run(fast, "hetero_ray", even, link, wire="bf16")
        step = {e: statistics.median(r["step_s"] for r in rs) for e, rs in homogeneous.items()}
        from hetero_ray.plan.cost import link_seconds

        link_s = link_seconds(ring_bytes, 2, *link)

        # Mixed: each device's speed alone (the profile's role), then hetero-ray's split against DDP's equal one.
        alone = []
        for a in actors:
            join([a])
            alone.append(run([a], "local", [HETERO_BATCH // len(types)], None))
        speeds = [(HETERO_BATCH // len(types)) / o["step_s"] for o in alone]
        split = split_batch(HETERO_BATCH, speeds)
        equal = [HETERO_BATCH // len(types)] * len(types)
        join(actors)
        mixed = {"ddp": [], "hetero_ray": []}
        for _ in range(args.repeats):
            mixed["ddp"].append(run(actors, "ddp", equal, FAST_LINK))
            mixed["hetero_ray"].append(run(actors, "hetero_ray", split, FAST_LINK))
        mixed_step = {e: statistics.median(r["step_s"] for r in rs) for e, rs in mixed.items()}
    finally:
        ray.shutdown()
        cluster.stop()

    def overlap(step_s: float) -> float:
        return 1 - (step_s - local["step_s"]) / link_s

    result = {
        "emulated": True,
        "mode": "throttled",
        "cluster": DEVICES,
        "cpu_share": CPU_SHARE,
        "workload": WORKLOAD,
        "bucket_mb": BUCKET_MB,
        "homogeneous": {
            "devices": "2 × A100-80GB",
            "local_batch": HOMOGENEOUS_BATCH,
            "link_bytes_s": link[0],
            "link_latency_s": link[1],
            "link_s": link_s,
            "step_without_sync_s": local["step_s"],
            "step_s": step,
        },
        "step_over_ddp": step["hetero_ray"] / step["ddp"],
        "overlap_fraction": {e: overlap(s) for e, s in step.items()},
        "grad_memory_over_ddp": homogeneous["hetero_ray"][0]["grad_bytes_held"]
        / homogeneous["ddp"][0]["grad_bytes_held"],
        "grad_bytes_held": {e: rs[0]["grad_bytes_held"] for e, rs in homogeneous.items()},
        "bf16_wire_bytes_ratio": bf16["bytes_sent"] / homogeneous["hetero_ray"][0]["bytes_sent"],
        "mixed": {
            "devices": types,
            "global_batch": HETERO_BATCH,
            "speeds_alone": speeds,
            "split": split,
            "equal": equal,
            "step_s": mixed_step,
        },
        "hetero_over_ddp": mixed_step["ddp"] / mixed_step["hetero_ray"],
        "seconds": time.monotonic() - started,
        "command": "python bench/engine.py",
    }
    print(json.dumps(result, indent=2))
    write_json(args.json, result, force=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
