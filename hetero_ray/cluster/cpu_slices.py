"""Throttled emulated devices: one Linux cgroup per device, each a CFS quota of CPU time.

The emulated cluster creates the cgroups (it alone knows each type's share); a worker
process that drives a device claims one of its node's slices and moves itself into
it, so only training and profiling processes are throttled, never raylets, agents or
the driver. A worker learns nothing about its speed here: it gets a directory to join,
and measures how fast it is like a process on a real GPU does.

cgroup v1 (``cpu`` controller: ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``) and v2
(``cpu.max``) are both supported.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

# What the machine keeps for Ray itself (raylets, GCS, agents, the driver) beyond the devices' slices.
RESERVED_CORES = 0.5
# A short period keeps throttling smooth: a device runs 10 ms windows, not 100 ms bursts.
PERIOD_US = 10_000
# The node's slices, ':'-separated, in the environment of its raylet (and so of its workers), and the
# folder of their claim files (a cgroup folder holds no files of ours).
SLICES_ENV = "HETERO_RAY_DEVICE_SLICES"
CLAIMS_ENV = "HETERO_RAY_SLICE_CLAIMS"
V1_ROOT = Path("/sys/fs/cgroup/cpu")
MAX_SHARES_V1, MAX_WEIGHT_V2 = 262_144, 10_000
V2_ROOT = Path("/sys/fs/cgroup/unified")
# The threads that stand for a GPU's host and network card rather than for the GPU, as torch and gloo name
# them: gloo's transport loop, the threads that run its collectives, the c10d store's. A slice throttles a
# device's compute; a real GPU's slowness does not slow its host's network threads, and inside the slice
# every hop of a ring all-reduce waited out the rest of a quota period (0.41 s of a 2.4 s step at 0.14 of
# a core).
COMM_THREAD_PREFIXES = ("gloo", "pt_gloo", "pt_tcpstore")


class CgroupError(RuntimeError):
    """No cgroup with a writable cpu controller; the message says what was tried."""


def _is_v2(root: Path) -> bool:
    return (root / "cgroup.controllers").exists()


def find_cpu_root(candidates: tuple[Path, ...] = (V1_ROOT, V2_ROOT)) -> Path:
    """The first cgroup hierarchy whose cpu controller this process may create groups in."""
    tried = []
    for root in candidates:
        usable = (root / "cpu.cfs_quota_us").exists() or (
            _is_v2(root) and "cpu" in (root / "cgroup.controllers").read_text().split()
        )
        if usable and os.access(root, os.W_OK):
            return root
        tried.append(str(root))
    raise CgroupError(
        f"throttled devices need a writable cgroup cpu controller; none at {', '.join(tried)} "
        "(run as root, or use emulation.mode: padded)"
    )


@dataclass
class CpuSlices:
    """The cgroups of one emulated cluster: ``add`` one per device, ``set_share`` to change one, ``remove`` them all
    (also with processes inside)."""

    name: str
    root: Path = field(default_factory=find_cpu_root)
    paths: dict[str, Path] = field(default_factory=dict, init=False)

    @property
    def base(self) -> Path:
        return self.root / self.name

    def add(self, slice_name: str, share: float) -> Path:
        """A cgroup ``slice_name`` limited to ``share`` of one core; the cluster's own group is made on first use."""
        if not self.base.exists():
            self.base.mkdir()
            # The highest weight: when the machine is busy, the devices still get their whole quota first, as a
            # GPU's speed does not depend on its host's load; the quotas alone keep Ray's processes their cores.
            if _is_v2(self.root):
                (self.base / "cgroup.subtree_control").write_text("+cpu")
                (self.base / "cpu.weight").write_text(str(MAX_WEIGHT_V2))
            else:
                (self.base / "cpu.shares").write_text(str(MAX_SHARES_V1))
        path = self.base / slice_name
        path.mkdir()
        self.paths[slice_name] = path
        self.set_share(slice_name, share)
        return path

    def set_share(self, slice_name: str, share: float) -> None:
        """Give slice ``slice_name`` ``share`` of one core from now on (a device that slows down or recovers)."""
        path = self.paths[slice_name]
        quota = max(1000, round(share * PERIOD_US))
        if _is_v2(self.root):
            (path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (path / "cpu.cfs_quota_us").write_text(str(quota))

    def remove(self, timeout_s: float = 10.0) -> None:
        """Move any process still inside to the root group, then delete every cgroup of this cluster."""
        if not self.base.exists():
            return
        deadline = time.monotonic() + timeout_s
        for path in [*self.base.iterdir(), self.base]:  # the slices, then the group their comm threads are in
            if not path.is_dir():
                continue
            while True:
                for pid in (path / "cgroup.procs").read_text().split():
                    try:
                        (self.root / "cgroup.procs").write_text(pid)
                    except OSError:
                        pass  # it exited meanwhile
                try:
                    path.rmdir()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
        self.paths.clear()


def check_shares(devices: Mapping[str, int], shares: Mapping[str, float], cores: int | None = None) -> None:
    """Raise ``ValueError`` (one line) unless every device type has a share and all slices fit the machine."""
    missing = [t for t in devices if t not in shares]
    if missing:
        raise ValueError(
            f"no CPU share for {', '.join(missing)}; give each device type one, e.g. {{{missing[0]}: 0.2}}"
        )
    bad = {t: s for t, s in shares.items() if not 0 < s <= 1}
    if bad:
        raise ValueError(f"shares are fractions of one core in (0, 1] (got {bad})")
    cores = cores or os.cpu_count() or 1
    total = sum(n * shares[t] for t, n in devices.items())
    if total > cores - RESERVED_CORES:
        raise ValueError(
            f"the devices' shares add up to {total:.2f} cores; this machine has {cores}, and Ray needs "
            f"{RESERVED_CORES} of them: at most {cores - RESERVED_CORES:g} in all"
        )


def join_device_slice(env: Mapping[str, str] = os.environ) -> tuple[Path, int] | None:
    """Claim a free slice of this node and move this whole process into it; ``None`` on an unthrottled node.

    The claim is an exclusive lock on the slice's file in the claims folder, held by the returned
    descriptor for the life of the process: a dead worker's slice is free again for the
    one Ray starts after it. Keep the descriptor open.
    """
    listed = env.get(SLICES_ENV)
    if not listed:
        return None
    slices = [Path(p) for p in listed.split(":")]
    claims = Path(env[CLAIMS_ENV])
    for path in slices:
        fd = os.open(claims / f"{path.name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        (path / "cgroup.procs").write_text(str(os.getpid()))
        return path, fd
    raise CgroupError(f"every device slice of this node is taken ({', '.join(map(str, slices))})")


def free_comm_threads(claim: tuple[Path, int] | None) -> int:
    """Move this process's communication threads (``COMM_THREAD_PREFIXES``) out of its device slice into the
    cluster's group, which has no quota; its compute stays in the slice. Call it once every process group is
    made: a new thread starts in its creator's group. Returns how many threads moved: none on an unthrottled
    node, and none under cgroup v2, which keeps a process's threads together (its threaded mode aside), so
    there communication stays throttled with the device."""
    tasks = claim[0].parent / "tasks" if claim else None
    if tasks is None or not tasks.exists():
        return 0
    moved = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:
            continue  # it exited meanwhile
        if name.startswith(COMM_THREAD_PREFIXES):
            tasks.write_text(tid)
            moved += 1
    return moved
