"""An inference job of bench/job_mix.py: a tiny GPT answering next-byte requests on the device the router granted.

Run as a routed job's command (``HETERO_RAY_DEVICES`` = ``{"V100-16GB": 1}``): one Ray actor placed on a node of
the granted type (``emulated_gpu`` and the ``hetero-ray/gpu-type`` label), in that device's CPU slice, answers
``--requests`` requests one after another (each a forward of ``--batch`` windows of ``--block`` bytes, and the
argmax of the next byte) and returns when each began (wall clock) and how long it took; written as JSON to
``--output``.
Usage: python bench/job_mix_infer.py --requests 300 --output /tmp/x.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    devices = json.loads(os.environ["HETERO_RAY_DEVICES"])
    gpu_type = next(iter(devices))

    import ray

    from hetero_ray.cluster.emulation import EMULATED_RESOURCE, GPU_TYPE_LABEL

    @ray.remote
    class Server:
        def __init__(self, block: int):
            import torch

            from hetero_ray.cluster.cpu_slices import join_device_slice
            from hetero_ray.workloads.gpt import GPT

            self.claim = join_device_slice()  # kept: the slice is this device's while the actor lives
            torch.set_num_threads(1)
            torch.manual_seed(0)
            self.model = GPT(n_layer=2, n_head=4, n_embd=64, block_size=block).eval()
            self.torch = torch

        def serve(self, requests: int, batch: int, block: int) -> list[tuple[float, float]]:
            import time

            torch, done = self.torch, []
            gen = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for _ in range(requests):
                    idx = torch.randint(0, 256, (batch, block), generator=gen)
                    began, t0 = time.time(), time.perf_counter()
                    self.model(idx)[:, -1].argmax(-1)
                    done.append((began, (time.perf_counter() - t0) * 1e3))
            return done

    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=False)
    try:
        server = Server.options(
            num_cpus=1, resources={EMULATED_RESOURCE: 1}, label_selector={GPU_TYPE_LABEL: gpu_type}
        ).remote(args.block)
        done = ray.get(server.serve.remote(args.requests, args.batch, args.block))
    finally:
        ray.shutdown()
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump({"gpu_type": gpu_type, "requests": done}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
