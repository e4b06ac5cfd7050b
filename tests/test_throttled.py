"""Throttled emulated devices: CPU slices (cgroups) whose speeds hetero-ray has to measure.

One throttled cluster for the module: an A100-80GB given 0.95 of a core and a V100-16GB
0.38 of one (2.5 : 1), each its own node and cgroup. Not a whole core for the A100: the
machine's other processes would then take part of it (2.15 : 1 seen in CI). Nothing but the cluster knows
the shares: the profile measures them, the plan follows the profile.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from cluster_jobs import (
    final_params,
    max_abs_diff,
    ray_cli,
    run_config,
    single_process_reference,
    submit,
    wait_for,
)

from hetero_ray.cluster.catalog import load_catalog
from hetero_ray.cluster.cpu_slices import COMM_THREAD_PREFIXES, RESERVED_CORES, check_shares
from hetero_ray.cluster.emulation import GPU_TYPE_LABEL, EmulatedCluster
from hetero_ray.config import ConfigError, parse_config
from hetero_ray.perf import history
from hetero_ray.perf.footprint import measure_footprint
from hetero_ray.perf.remote import device_labels
from hetero_ray.train.prepare import plan_for
from hetero_ray.workloads import build_workload

SHARES = {"A100-80GB": 0.95, "V100-16GB": 0.38}
TRUE_RATIO = SHARES["A100-80GB"] / SHARES["V100-16GB"]
# Small enough to keep its working set in cache: a slice's process loses its caches while it
# waits out its period, which at a low share makes a step cost more CPU time (seen here: +35%
# at 0.2 of a core on a larger GPT), and the measured ratio would then be the workload's, not the shares'.
PROFILE_OPTIONS = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "corpus_bytes": 20_000}


@pytest.fixture(scope="module")
def cluster():
    with EmulatedCluster({"A100-80GB": 1, "V100-16GB": 1}, gpus_per_node=1, cpu_share=SHARES) as c:
        yield c


@pytest.fixture(scope="module")
def profiled(cluster, tmp_path_factory) -> Path:
    """`hetero-ray profile` on the throttled nodes (wall clock), into a fresh history."""
    path = tmp_path_factory.mktemp("profile") / "history.parquet"
    argv = ["--history", str(path), "--options", json.dumps(PROFILE_OPTIONS), "--micro-batches", "2,8"]
    done = subprocess.run(
        [sys.executable, "-m", "hetero_ray.cli", "profile", *argv, "--repeats", "7"],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return path


def test_every_node_registers_on_loopback(cluster):
    nodes = json.loads(ray_cli(cluster, "list", "nodes", "--format", "json"))
    assert len(nodes) == 3 and {n["node_ip"] for n in nodes} == {"127.0.0.1"}


def test_each_device_has_its_own_slice(cluster):
    assert len(cluster.cgroups) == 2 and all(p.is_dir() for p in cluster.cgroups)
    quota = {p.name: p / "cpu.cfs_quota_us" for p in cluster.cgroups}
    if all(q.exists() for q in quota.values()):  # cgroup v1; v2 keeps both figures in cpu.max
        assert sorted(int(q.read_text()) for q in quota.values()) == [3800, 9500]
        v100 = next(q for name, q in quota.items() if "V100" in name)
        cluster.set_cpu_share("V100-16GB", 0, 0.2)  # a device that slows down, as bench/rebalance.py does
        assert int(v100.read_text()) == 2000
        cluster.set_cpu_share("V100-16GB", 0, SHARES["V100-16GB"])
        assert int(v100.read_text()) == 3800
        # The devices' group outweighs every other process, so a busy machine does not slow a device.
        assert int((cluster.cgroups[0].parent / "cpu.shares").read_text()) == 262_144
    with pytest.raises(ValueError, match="no emulated V100-16GB #1"):
        cluster.set_cpu_share("V100-16GB", 1, 0.2)


COMM_THREADS = textwrap.dedent(
    """
    import json, os
    from pathlib import Path
    import ray, torch, torch.distributed as dist
    from hetero_ray.cluster.cpu_slices import free_comm_threads, join_device_slice
    from hetero_ray.cluster.emulation import EMULATED_RESOURCE

    def groups():
        out = {}
        for tid in os.listdir("/proc/self/task"):
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            group = next(line for line in Path(f"/proc/self/task/{tid}/cgroup").read_text().splitlines()
                         if ":cpu," in line or ":cpu:" in line)
            out.setdefault(group.rsplit("/", 1)[-1], []).append([int(tid), name])
        return out

    @ray.remote(num_cpus=1, resources={EMULATED_RESOURCE: 1})
    def threads():
        claim = join_device_slice()
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29_000 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)  # after joining: its threads start in the slice
        dist.all_reduce(torch.ones(8))
        before = groups()
        moved = free_comm_threads(claim)
        dist.all_reduce(torch.ones(8))  # the group still works from outside the slice
        after = groups()
        # A later group's threads start in the slice, and a thread only takes its name once it runs (so a
        # group made just before a call may be missed): the loop calls again after its first step.
        late = dist.new_group([0])
        dist.all_reduce(torch.ones(8), group=late)
        lazy = groups()
        moved_late = free_comm_threads(claim)
        return {"slice": claim[0].name, "base": claim[0].parent.name, "moved": moved, "before": before,
                "after": after, "lazy": lazy, "moved_late": moved_late, "late": groups()}

    ray.init(address="auto")
    print(json.dumps(ray.get(threads.remote())))
    """
)


def test_communication_threads_leave_the_slice(cluster):
    """gloo's threads stand for the device's host, not its compute: once the process groups are made they move
    from the slice to the cluster's unthrottled group, and the rest of the process stays in the slice."""
    if not all((p / "cpu.cfs_quota_us").exists() for p in cluster.cgroups):
        pytest.skip("cgroup v2 keeps a process's threads in one group: communication stays in the slice there")
    done = subprocess.run(
        [sys.executable, "-c", COMM_THREADS], env=cluster.env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[-1])
    where = got["slice"]

    def tids(look: str, cgroup: str, prefixes: tuple[str, ...] = ("",)) -> set[int]:
        return {tid for tid, name in got[look].get(cgroup, []) if name.startswith(prefixes)}

    # By thread id, not name: a thread takes its name only once it runs, so one started just before a call can
    # be named by the next look without having borne the name when it was freed. The loop frees again after its
    # first step for that reason; what a call must do is move every thread named as communication when it runs.
    gloo_names = ("gloo", "pt_gloo")
    gloo = tids("before", where, gloo_names)
    assert gloo and got["moved"] >= len(gloo), got
    assert not tids("before", where, COMM_THREAD_PREFIXES) & tids("after", where), got
    assert tids("after", got["base"], gloo_names) == gloo, got
    assert tids("after", where), got  # the compute (the main thread among them) stays throttled
    started_late = tids("lazy", where, gloo_names)
    assert started_late and got["moved_late"] >= len(started_late), got
    assert not tids("lazy", where, COMM_THREAD_PREFIXES) & tids("late", where), got


# The reference: each device runs plain training steps for two seconds on its slice, both at once, as the
# profile does, timed over the whole window, with the CPU time its process used in it. The CPU time is what a
# quota sets, and it matches the shares to 2 %. The speed does not: a slice computes less per CPU second the
# more of its time it shares the machine with the other (caches, and a virtual machine's cores that may be
# one host core's two threads), so V100 : A100 ran 2.49-2.77 : 1 on one machine and 2.97-4.17 : 1 on another
# against the shares' 2.5. The truth the profile must find is what the devices do, measured here.
REFERENCE = textwrap.dedent(
    """
    import json, sys, time
    import ray, torch
    from torch.utils.data import default_collate
    from hetero_ray.cluster.cpu_slices import join_device_slice
    from hetero_ray.cluster.emulation import EMULATED_RESOURCE, GPU_TYPE_LABEL
    from hetero_ray.workloads import build_workload

    def step(workload, optimizer, batch):
        workload.loss_fn(workload.model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    @ray.remote(num_cpus=1, resources={EMULATED_RESOURCE: 1})
    def seconds_per_step(options, micro_batches, window_s=2.0):
        claim = join_device_slice()
        torch.set_num_threads(1)
        workload = build_workload("gpt", options)
        optimizer = torch.optim.AdamW(workload.model.parameters())
        seconds, cores = {}, {}
        for b in micro_batches:
            batch = default_collate([workload.dataset[i] for i in range(b)])
            for _ in range(3):  # warm-up
                step(workload, optimizer, batch)
            steps, start, cpu = 0, time.perf_counter(), time.process_time()
            while time.perf_counter() - start < window_s:
                step(workload, optimizer, batch)
                steps += 1
            wall = time.perf_counter() - start
            seconds[b], cores[b] = wall / steps, (time.process_time() - cpu) / wall
        return {"seconds": seconds, "cores": cores}

    ray.init(address="auto")
    options, types = json.loads(sys.argv[1]), sys.argv[2].split(",")
    refs = [seconds_per_step.options(label_selector={GPU_TYPE_LABEL: t}).remote(options, [2, 8]) for t in types]
    print(json.dumps(dict(zip(types, ray.get(refs)))))
    """
)


def _measure_reference(cluster) -> dict[str, dict[str, dict[int, float]]]:
    """Per type, seconds per step and cores used at micro-batches 2 and 8, over two-second windows."""
    done = subprocess.run(
        [sys.executable, "-c", REFERENCE, json.dumps(PROFILE_OPTIONS), ",".join(SHARES)],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.splitlines()[-1])
    return {
        t: {k: {int(b): x for b, x in per_b.items()} for k, per_b in figures.items()} for t, figures in measured.items()
    }


@pytest.fixture(scope="module")
def reference(cluster) -> dict[str, dict[str, dict[int, float]]]:
    """The devices' own speeds, measured before the profile."""
    return _measure_reference(cluster)


@pytest.fixture(scope="module")
def references(reference, profiled, cluster) -> list[dict[str, dict[str, dict[int, float]]]]:
    """The devices' own speeds measured just before the profile and again just after it."""
    return [reference, _measure_reference(cluster)]


def _v100_over_a100(reference, b: int) -> float:
    return reference["V100-16GB"]["seconds"][b] / reference["A100-80GB"]["seconds"][b]


# The devices' relative speed drifts with their interference on the machine, more than a profile's error could
# show: two references 40 s apart gave 2.32 and 3.52 at micro-batch 2, and five profiles on one cluster, each
# between two references, ran from 3 % under the lower to 18 % over the higher (2026-12-07); CI runs measured a
# profile 31 % under one reference and 36 % over the higher of two (4.42 against 2.99 and 3.25). So the profile
# is held from below by what the shares fix, not by a reference: V100 : A100 at least 0.8 of the shares' 2.5 : 1
# (a slice never computes more per CPU second than a faster one does; the references are held to the same
# floor), which a profile that did not time the slices misses by far: 1.0 unthrottled, the catalog's 1.24
# modelled. From above it is held to 1.5 times the higher reference around it, the drift seen with room.
SHARES_FLOOR = 0.8 * TRUE_RATIO
DRIFT = 1.5


def _between_shares_and_drift(got: float, measured: list[float]) -> bool:
    return SHARES_FLOOR <= got <= max(measured) * DRIFT


def test_the_slices_get_their_shares(reference):
    """Each device's process uses its share of a core: never more (the quota caps it), and nearly all of it,
    so the two devices' CPU time stands at the shares' 2.5 : 1 within 15 %. Nearly, not all: the A100's 0.95
    of a core leaves the machine's other work (Ray's processes, the kernel's own threads) little room, and it
    takes some of the A100's (CI measured 0.90 of its share, and on 2026-12-07 0.897: 0.8525 of a core over a
    two-second window, a CPU-time ratio of 2.24, while the V100 had 0.380 of its 0.38). Unthrottled, the
    ratio would be about 1. And the devices differ at least as the shares do: a slice never computes more per
    CPU second than a faster one does."""
    for t, share in SHARES.items():
        for b in (2, 8):
            assert 0.85 * share <= reference[t]["cores"][b] <= 1.02 * share, (t, reference)
    for b in (2, 8):
        cores = reference["A100-80GB"]["cores"][b] / reference["V100-16GB"]["cores"][b]
        assert cores == pytest.approx(TRUE_RATIO, rel=0.15), reference
        assert _v100_over_a100(reference, b) > SHARES_FLOOR, reference


def test_profile_measures_what_the_devices_do(profiled, references):
    """The profile's V100 : A100 step times are the devices' own: at least what the shares fix, at most the
    references' around it with their drift."""
    table = history.load(profiled)
    assert table["emulated"].all() and (table["clock"] == "wall").all()
    step = table.set_index(["gpu_type", "micro_batch"])["step_s"]
    for b in (2, 8):
        ratio = step["V100-16GB", b] / step["A100-80GB", b]
        measured = [_v100_over_a100(r, b) for r in references]
        assert min(measured) > SHARES_FLOOR, references
        assert _between_shares_and_drift(ratio, measured), (b, ratio, measured, references, step.to_dict())


def _a100_samples_of_14(speed: float) -> float:
    return 14 * speed / (1 + speed)


def test_plan_from_the_profile_splits_by_the_devices_speeds(profiled, references):
    """From the profile alone (the catalog says A100 : V100 = 1.24 : 1 in fp32), a proportional split of 14
    samples gives the A100 its share by the devices' measured speeds: at least what the shares fix, at most
    what the references around the profile give at the even share (7 samples) with their drift, to within one
    sample more (a sample is 7 % of this batch). The catalog's split is not in that range."""
    cfg = parse_config(
        {
            "devices": {"A100-80GB": 1, "V100-16GB": 1},
            "emulation": {"mode": "throttled"},
            "workload": {"name": "gpt", "options": PROFILE_OPTIONS},
            "train": {"global_batch": 14, "precision": "fp32", "split": "proportional"},
            "profile_history": str(profiled),
        }
    )
    catalog = load_catalog()
    footprint = measure_footprint(lambda: build_workload("gpt", PROFILE_OPTIONS))
    plan = plan_for(cfg, ["A100-80GB", "V100-16GB"], catalog, footprint, 0.4, emulated=True)
    shares = {r.gpu_type: r.local_batch for r in plan.roles}
    speeds = []  # A100 : V100 samples per second at 7 samples each, by each reference
    for reference in references:
        at_7 = {
            t: f["seconds"][2] + (f["seconds"][8] - f["seconds"][2]) * (7 - 2) / (8 - 2) for t, f in reference.items()
        }
        speeds.append(at_7["V100-16GB"] / at_7["A100-80GB"])
    low = _a100_samples_of_14(SHARES_FLOOR)
    high = _a100_samples_of_14(max(speeds) * DRIFT)
    assert low - 1 < shares["A100-80GB"] < high + 1, (shares, speeds, references)
    catalog_plan = plan_for(
        cfg.model_copy(update={"profile_history": None}),
        ["A100-80GB", "V100-16GB"],
        catalog,
        footprint,
        0.4,
        emulated=True,
    )
    assert {r.gpu_type: r.local_batch for r in catalog_plan.roles} != shares


def test_split_invariance_on_throttled_devices(cluster, tmp_path):
    """2 : 1 on the throttled A100 and V100 ends where one process on the full batch does (1e-5, fp32)."""
    cfg = run_config(tmp_path / "runs", "throttled")
    cfg["devices"] = {"A100-80GB": 1, "V100-16GB": 1}
    cfg["emulation"] = {"mode": "throttled", "gpus_per_node": 1}
    job_id, out = submit(cluster, tmp_path, cfg)
    assert wait_for(cluster, job_id) == "SUCCEEDED", ray_cli(cluster, "job", "logs", job_id)[-3000:]
    result = json.loads(out.read_text())
    m = result["metrics"]
    assert {d["gpu_type"]: d["local_batch"] for d in m["devices"]} == {"A100-80GB": 8, "V100-16GB": 4}
    assert all(d["overrun_steps"] == 0 for d in m["devices"])  # nothing is padded on throttled devices
    assert max_abs_diff(final_params(result), single_process_reference()) <= 1e-5


def test_a_padded_run_refuses_a_throttled_node(cluster, tmp_path):
    """The modes of the config and of the cluster must agree: padded times and real ones mean different things."""
    cfg = run_config(tmp_path / "runs", "mismatch")
    cfg["devices"] = {"A100-80GB": 1, "V100-16GB": 1}
    cfg["emulation"]["gpus_per_node"] = 1
    cfg["train"].update(split="equal", max_failures=0)
    job_id, _ = submit(cluster, tmp_path, cfg)
    assert wait_for(cluster, job_id) == "FAILED"
    assert "has throttled device slices" in ray_cli(cluster, "job", "logs", job_id)


CHILD = textwrap.dedent(
    """
    import sys
    from hetero_ray.cluster.emulation import EmulatedCluster
    with EmulatedCluster({"V100-16GB": 1}, gpus_per_node=1, cpu_share={"V100-16GB": 0.3}) as c:
        print(c.cgroups[0].parent, c.workdir, flush=True)
        sys.stdin.readline()  # a line: leave normally; else wait for a signal
    """
)


def _raylets_of(workdir: str) -> list[str]:
    out = subprocess.run(["pgrep", "-f", f"raylet.*{workdir}"], capture_output=True, text=True)
    return out.stdout.split()


@pytest.mark.parametrize("how", ["exit", "sigterm", "sigint-repeated"])
def test_cgroups_and_raylets_are_gone_after_the_cluster_stops(how):
    """On a normal stop, on SIGTERM, and on Ctrl-C pressed again and again while it stops, the cluster leaves
    no cgroup and no raylet behind."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    base, workdir = proc.stdout.readline().split()
    assert Path(base).is_dir() and _raylets_of(workdir)
    if how == "sigterm":
        proc.send_signal(signal.SIGTERM)
    elif how == "sigint-repeated":
        # The first interrupts the `with` body; the next ones land while the cluster stops (a second or more).
        while proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            time.sleep(0.05)
    else:
        proc.stdin.write("\n")
        proc.stdin.flush()
    code = proc.wait(timeout=120)
    assert code == {"exit": 0, "sigterm": 128 + signal.SIGTERM, "sigint-repeated": -signal.SIGINT}[how]
    assert not Path(base).exists()
    assert _raylets_of(workdir) == []


class _NodeStartFails(EmulatedCluster):
    """The first ``failing`` starts of its V100 node exit 1 at once (an invalid label; click keeps an option's last
    value), as a `ray start` that misses Ray's 30 s registration deadline on a loaded host does after those 30 s."""

    failing = 1

    def _ray_start(self, *args, log, env=None):
        if log.startswith("node0-V100-16GB") and self.failing:
            self.failing -= 1
            args = (*args, f"--labels={GPU_TYPE_LABEL}=not a label")
        return super()._ray_start(*args, log=log, env=env)


def test_a_node_whose_ray_start_fails_is_started_again():
    """The node is started again in the same cluster (same address and token), its slice kept, each try logged."""
    with _NodeStartFails({"V100-16GB": 1}, gpus_per_node=1, cpu_share={"V100-16GB": 0.3}) as c:
        assert "not a valid string of key-value pairs" in (c.workdir / "node0-V100-16GB.log").read_text()
        assert (c.workdir / "node0-V100-16GB-try2.log").exists()
        nodes = c.api("/api/v0/nodes?detail=true&limit=100")["data"]["result"]["result"]
        alive = sorted(n["labels"].get(GPU_TYPE_LABEL, "head") for n in nodes if n["state"] == "ALIVE")
        assert alive == ["V100-16GB", "head"], nodes
        assert len(_raylets_of(str(c.workdir))) == 2 and len(c.metrics_ports) == 2 and len(c.cgroups) == 1


def test_a_node_that_fails_every_try_stops_the_cluster_and_names_its_logs():
    cluster = _NodeStartFails({"V100-16GB": 1}, gpus_per_node=1, cpu_share={"V100-16GB": 0.3})
    cluster.failing = 3
    with pytest.raises(RuntimeError, match=rf"a `ray start` exited with code 1 \(logs: {cluster.workdir}\)"):
        with cluster:
            pass
    assert [p.name for p in sorted(cluster.workdir.glob("node0-*.log"))] == [
        "node0-V100-16GB-try2.log",
        "node0-V100-16GB-try3.log",
        "node0-V100-16GB.log",
    ]
    assert _raylets_of(str(cluster.workdir)) == [] and cluster.cgroups == []


def test_shares_must_fit_the_machine():
    cores = os.cpu_count()
    with pytest.raises(ValueError, match="add up to"):
        check_shares({"V100-16GB": 2 * cores}, {"V100-16GB": 1.0})
    with pytest.raises(ValueError, match="no CPU share for A100-80GB"):
        check_shares({"A100-80GB": 1}, {"V100-16GB": 0.2})
    check_shares({"V100-16GB": 1}, {"V100-16GB": min(1.0, cores - RESERVED_CORES)})


@pytest.mark.parametrize(
    ("emulation", "message"),
    [
        ({"mode": "padded", "cpu_share": {"V100-16GB": 0.2}}, "set emulation.mode: throttled"),
        ({"mode": "throttled", "dilation": 10}, "drop emulation.dilation"),
        ({"mode": "throttled", "cpu_share": {"V100-16GB": 50}}, "emulation.cpu_share"),
    ],
)
def test_inconsistent_emulation_is_one_line(emulation, message):
    with pytest.raises(ConfigError, match=message) as err:
        parse_config({"devices": {"V100-16GB": 1}, "emulation": emulation})
    assert "\n" not in str(err.value)


def test_hidden_config_carries_no_shares():
    cfg = parse_config({"devices": {"V100-16GB": 1}, "emulation": {"mode": "throttled", "cpu_share": SHARES}})
    assert cfg.hidden().emulation.cpu_share is None and cfg.hidden().emulation.throttled
    assert "cpu_share" not in json.dumps(cfg.hidden().model_dump(exclude_none=True))


def test_a_run_profiles_every_device_it_will_use():
    """Before a throttled run each of its devices is profiled at once, so each is timed beside the others."""
    labels = device_labels({"A100-80GB": True, "V100-16GB": True}, {"A100-80GB": 1, "V100-16GB": 2})
    assert labels == {
        "A100-80GB (emulated)": "A100-80GB",
        "V100-16GB (emulated) #0": "V100-16GB",
        "V100-16GB (emulated) #1": "V100-16GB",
    }
    assert device_labels({"H100-80GB": False}, None) == {"H100-80GB": "H100-80GB"}
