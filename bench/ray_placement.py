"""Where Ray's own placement puts a job that names no GPU type, on the job mix's cluster: the check behind its first-fit baseline.

bench/job_mix.py compares routing with first fit in a fixed order of the types (A100s first, V100s first) and
takes the mean of the two as Ray's default. This measures what Ray itself does instead: on the same emulated
layout (2 × A100-80GB + 4 × V100-16GB, two devices per node, as bench/job_mix.py starts it) it creates the
placement group Ray Train makes for a job of N workers (N bundles of ``{"CPU": 1, "emulated_gpu": 1}``,
strategy PACK, no label selector) in states the job mix passes through, holding other devices with placement
groups pinned to a type by label (one per holding job, packed as its workers would be), and records which types
the bundles got. Ray scores nodes by what they would have left free, so the A100 pair and a free V100 pair often
score alike; node ids, which may break such ties, are random per cluster start, so the cluster is started
``--starts`` times.

Prints JSON (emulated, mode padded: placement only, nothing runs on the devices), also written to
docs/measurements/ray-placement.json. ``a100_while_v100s_free``: the share of placements in states where the
V100s alone could hold the job that took an A100 all the same.

Usage: python bench/ray_placement.py [--starts 3] [--trials 4] [--json PATH]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from hetero_ray.cluster.emulation import EMULATED_RESOURCE, GPU_TYPE_LABEL, start_retrying
from hetero_ray.output import report_json

REPO = Path(__file__).resolve().parent.parent
DEVICES = {"A100-80GB": 2, "V100-16GB": 4}
# (devices held by other jobs, devices the new job asks for), in the order the job mix meets them: its first
# inference job on an idle cluster, a fine-tuning job while that inference holds a V100, a job while one V100 pair
# is busy and the A100s are idle, and an idle cluster again.
STATES = [
    ({}, 1),
    ({"V100-16GB": 1}, 2),
    ({"V100-16GB": 2}, 2),
    ({"V100-16GB": 2}, 1),
    ({}, 2),
]
BUNDLE = {"CPU": 1, EMULATED_RESOURCE: 1}


def place(n: int, types_by_node: dict[str, str], label: str | None = None, timeout_s: float = 20) -> tuple:
    """Create a PACK placement group of ``n`` worker bundles (pinned to type ``label`` if given); return it and
    the types of the nodes its bundles got."""
    from ray.util.placement_group import placement_group, placement_group_table

    selector = {"bundle_label_selector": [{GPU_TYPE_LABEL: label}] * n} if label else {}
    pg = placement_group([BUNDLE] * n, strategy="PACK", **selector)
    if not pg.wait(timeout_s):
        raise RuntimeError(f"a placement group of {n} bundles was not placed in {timeout_s:g} s")
    nodes = placement_group_table(pg)["bundles_to_node_id"].values()
    return pg, tuple(sorted(types_by_node[node] for node in nodes))


def probe(trials: int) -> list[dict]:
    """Each state ``trials`` times on the running cluster: hold, place, record, release."""
    import ray
    from ray.util.placement_group import remove_placement_group

    types_by_node = {n["NodeID"]: n["Labels"].get(GPU_TYPE_LABEL) for n in ray.nodes() if n["Alive"]}
    rows = []
    for held, n in STATES:
        for _ in range(trials):
            # Each holding job as one group, as its own workers would be (a pair packs onto one node).
            holds = [place(k, types_by_node, t)[0] for t, k in held.items()]
            pg, got = place(n, types_by_node)
            rows.append({"held": held, "devices": n, "got": got})
            for group in [pg, *holds]:
                remove_placement_group(group)
            time.sleep(0.5)  # a removed group's resources come back asynchronously
    return rows


def summarise(rows: list[dict]) -> dict:
    """Per state, how often each set of types was taken; and how often an A100 was taken when V100s sufficed."""
    states = []
    for held, n in STATES:
        mine = [r for r in rows if r["held"] == held and r["devices"] == n]
        counts = collections.Counter(" + ".join(r["got"]) for r in mine)
        states.append({"held": held, "devices": n, "placements": dict(counts), "trials": len(mine)})
    choice = [
        r
        for r in rows
        if DEVICES["V100-16GB"] - r["held"].get("V100-16GB", 0) >= r["devices"] and not r["held"].get("A100-80GB")
    ]
    return {
        "states": states,
        "a100_while_v100s_free": sum("A100-80GB" in r["got"] for r in choice) / len(choice),
        "placements_with_a_choice": len(choice),
    }


def one_start(trials: int) -> list[dict]:
    """Start the cluster, probe every state, stop it; in a process of its own (a process that has been connected to
    one emulated cluster fails to connect to the next: ``ConnectionError``)."""
    cluster = start_retrying(DEVICES, on_retry=lambda line: print(line, file=sys.stderr))
    os.environ.update(cluster.env)  # before `import ray`: Ray reads its auth mode at import
    import ray

    with contextlib.redirect_stdout(sys.stderr), contextlib.ExitStack() as stack:
        stack.callback(cluster.stop)
        ray.init(address=cluster.address, log_to_driver=False, logging_level="WARNING")
        stack.callback(ray.shutdown)
        return probe(trials)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=3, help="cluster starts (node ids, and so Ray's ties, differ)")
    parser.add_argument("--trials", type=int, default=4, help="placements per state per cluster start")
    parser.add_argument("--json", default=str(REPO / "docs" / "measurements" / "ray-placement.json"))
    parser.add_argument("--one-start", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for flag, value in (("--starts", args.starts), ("--trials", args.trials)):
        if value < 1:
            parser.error(f"{flag}: {value} is not a count of runs; give 1 or more")
    if args.one_start:
        print(json.dumps(one_start(args.trials)))
        return 0
    started = time.monotonic()
    rows = []
    for start in range(args.starts):
        # Its stderr (the cluster's start, any error) passes through; stdout is its rows.
        done = subprocess.run(
            [sys.executable, __file__, "--one-start", "--trials", str(args.trials)], stdout=subprocess.PIPE, text=True
        )
        if done.returncode:
            print(
                f"ray_placement: cluster start {start + 1} failed (exit {done.returncode}); see above", file=sys.stderr
            )
            return 1
        rows += [{**r, "got": tuple(r["got"]), "start": start} for r in json.loads(done.stdout)]
    import ray

    result = {
        "emulated": True,
        "mode": "padded",
        "what": "Ray's own placement group scheduling (PACK, as Ray Train asks for workers), no hetero-ray routing",
        "ray_version": ray.__version__,
        "cluster": DEVICES,
        "gpus_per_node": 2,
        "bundle": BUNDLE,
        "starts": args.starts,
        "trials": args.trials,
        **summarise(rows),
        "rows": rows,
        "seconds": time.monotonic() - started,
    }
    report_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
