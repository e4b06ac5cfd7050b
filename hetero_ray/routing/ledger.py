"""Which job holds which devices of a shared cluster, and who waits: one named, detached Ray actor per cluster.

Ray places a job's workers wherever its resources are free; it has no notion of a job class or of a GPU type
a class should prefer. Jobs submitted through ``hetero-ray submit`` therefore ask this ledger for devices
first (``acquire``, in their driver), run on exactly those (their training plans for them), and give them
back when they end (``release``). Waiting jobs are served in the policy's class order, then in arrival order,
each on the first free devices its class's order allows (a job that does not fit lets the next one try).

Ray Serve applications registered here (``serve``; ``hetero-ray serve --ledger``) hold idle devices as
inference: a training or fine-tuning job that needs them takes them back (its grant names the replica count
each application must shrink to, which its driver applies), and once devices are free again the application
gets them back (``release`` returns the counts to grow to, which the releasing driver applies).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hetero_ray.routing.policy import Policy, PolicyError, place

NAMESPACE = "hetero-ray"
SERVE_PREFIX = "serve:"  # the holding of a Serve application is named so


def ledger_name(name: str) -> str:
    """The Ray actor name of the ledger called ``name`` (one per cluster unless a bench wants two)."""
    return f"hetero-ray-ledger-{name}"


@dataclass
class _Waiting:
    job: str
    job_class: str
    gpus: int
    order: list[str]
    since: float
    seq: int
    granted: dict[str, int] | None = None
    reclaim: dict[str, int] = field(default_factory=dict)  # Serve application -> replicas to shrink to


@dataclass
class _Serving:
    gpu_type: str
    wanted: int


@dataclass
class _Holding:
    job: str
    job_class: str
    devices: dict[str, int]
    since: float


@dataclass
class DeviceLedger:
    """The ledger's state and rules; Ray runs it as an async actor (``get_ledger``)."""

    devices: dict[str, int]
    policy: dict
    started: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        self._policy = Policy.from_dict(self.policy)
        self._holdings: dict[str, _Holding] = {}
        self._queue: list[_Waiting] = []
        self._seq = itertools.count()
        self._busy_seconds = dict.fromkeys(self.devices, 0.0)
        self._last = self.started
        self._log: list[dict] = []
        self._serving: dict[str, _Serving] = {}
        self._restore: dict[str, int] = {}  # Serve application -> replicas to grow to, for the next release
        self._changed = asyncio.Condition()

    def policy_name(self) -> str:
        return self._policy.name

    def problem(self, job_class: str, gpus: int, only: Sequence[str] | None) -> str | None:
        """Why a job could never be placed here (more devices than its class may ever take), else ``None``."""
        order = self._order(job_class, only)
        most = sum(self.devices[t] for t in order)
        if gpus > most:
            allowed = ", ".join(f"{self.devices[t]} × {t}" for t in order) or "no device"
            return (
                f"--gpus: {gpus} devices can never be free for a {job_class} job here: its class may take "
                f"{allowed} (policy {self._policy.name}{', --only ' + ','.join(only) if only else ''}); ask for at "
                f"most {most}"
            )
        return None

    async def acquire(self, job: str, job_class: str, gpus: int, only: Sequence[str] | None = None) -> dict:
        """Wait until ``gpus`` devices are this job's: ``{"devices": {type: n}, "reclaim": {application: replicas}}``,
        the Serve applications to shrink first (their replicas hold some of those devices)."""
        waiting = _Waiting(job, job_class, gpus, self._order(job_class, only), time.time(), next(self._seq))
        async with self._changed:
            self._queue.append(waiting)
            self._schedule()
            await self._changed.wait_for(lambda: waiting.granted is not None)
        return {"devices": waiting.granted, "reclaim": waiting.reclaim}

    async def release(self, job: str) -> dict[str, int]:
        """Give back what ``job`` holds (or drop it from the queue); the waiting jobs then try again, and the Serve
        applications get what is still free. Returns the replica counts those applications must grow to."""
        async with self._changed:
            self._account()
            held = self._holdings.pop(job, None)
            if held is not None:
                self._log.append({"time": time.time(), "job": job, "event": "release", "devices": held.devices})
            self._queue = [w for w in self._queue if w.job != job]
            self._schedule()
            restore, self._restore = self._restore, {}
            return restore

    def serve(self, app: str, gpu_type: str, wanted: int) -> int:
        """Register Serve application ``app`` wanting ``wanted`` replicas on ``gpu_type``; how many it may run now
        (the idle devices of that type; more as they free)."""
        if gpu_type not in self.devices:
            raise PolicyError(f"--types: the cluster has no {gpu_type}; it has {', '.join(self.devices)}")
        self._account()
        self._serving[app] = _Serving(gpu_type, wanted)
        now = min(wanted, self._free()[gpu_type])
        if now:
            self._hold(SERVE_PREFIX + app, "inference", {gpu_type: now})
        return now

    def status(self) -> dict:
        """Per type: devices, busy, the jobs holding them, utilisation since the ledger started; the queue."""
        self._account()
        elapsed = max(time.time() - self.started, 1e-9)
        types = {}
        for t, n in self.devices.items():
            holders = {h.job: h.devices[t] for h in self._holdings.values() if h.devices.get(t)}
            types[t] = {
                "devices": n,
                "busy": sum(holders.values()),
                "jobs": holders,
                "utilisation": self._busy_seconds[t] / (n * elapsed),
            }
        queue = [
            {"job": w.job, "class": w.job_class, "gpus": w.gpus, "waiting_s": time.time() - w.since}
            for w in sorted(self._queue, key=self._rank)
        ]
        return {"policy": self._policy.name, "since": self.started, "types": types, "queue": queue, "log": self._log}

    def _order(self, job_class: str, only: Sequence[str] | None) -> list[str]:
        types = [t for t in self.devices if only is None or t in only]
        return self._policy.order(job_class, types)

    def _rank(self, w: _Waiting) -> tuple[int, int]:
        return self._policy.rank(w.job_class), w.seq

    def _free(self) -> dict[str, int]:
        free = dict(self.devices)
        for h in self._holdings.values():
            for t, n in h.devices.items():
                free[t] -= n
        return free

    def _schedule(self) -> None:
        """Grant devices to the waiting jobs that fit, in class then arrival order, taking Serve applications'
        devices for jobs above inference; then grow the applications into what is left."""
        self._account()
        for w in sorted(self._queue, key=self._rank):
            free = self._free()
            got = place(w.gpus, w.order, free)
            if got is None and w.job_class != "inference":
                got = place(w.gpus, w.order, {t: free[t] + self._served(t) for t in free})
                if got is not None:
                    w.reclaim = self._shrink({t: n - free[t] for t, n in got.items() if n > free[t]})
            if got is None:
                continue
            w.granted = got
            self._queue.remove(w)
            self._hold(w.job, w.job_class, got)
        for app, serving in self._serving.items():
            held = self._holdings.get(SERVE_PREFIX + app)
            have = held.devices[serving.gpu_type] if held else 0
            more = min(serving.wanted - have, self._free()[serving.gpu_type])
            if more > 0:
                self._hold(SERVE_PREFIX + app, "inference", {serving.gpu_type: have + more})
                self._restore[app] = have + more
        self._changed.notify_all()

    def _hold(self, job: str, job_class: str, devices: dict[str, int]) -> None:
        self._holdings[job] = _Holding(job, job_class, devices, time.time())
        self._log.append({"time": time.time(), "job": job, "event": "acquire", "devices": devices})

    def _served(self, gpu_type: str) -> int:
        """Devices of ``gpu_type`` Serve applications hold."""
        return sum(h.devices.get(gpu_type, 0) for j, h in self._holdings.items() if j.startswith(SERVE_PREFIX))

    def _shrink(self, needed: dict[str, int]) -> dict[str, int]:
        """Take ``needed`` devices per type from the Serve applications holding them; their new replica counts."""
        counts = {}
        for app, serving in self._serving.items():
            held = self._holdings.get(SERVE_PREFIX + app)
            take = min(needed.get(serving.gpu_type, 0), held.devices[serving.gpu_type] if held else 0)
            if take:
                needed[serving.gpu_type] -= take
                left = held.devices[serving.gpu_type] - take
                self._holdings[SERVE_PREFIX + app].devices = {serving.gpu_type: left}
                self._log.append(
                    {
                        "time": time.time(),
                        "job": SERVE_PREFIX + app,
                        "event": "shrink",
                        "devices": {serving.gpu_type: left},
                    }
                )
                counts[app] = left
                self._restore.pop(app, None)
        return counts

    def _account(self) -> None:
        """Add the busy device-seconds since the last change (holdings are constant in between)."""
        now = time.time()
        busy = {t: n - f for (t, n), f in zip(self.devices.items(), self._free().values())}
        for t, n in busy.items():
            self._busy_seconds[t] += n * (now - self._last)
        self._last = now


def get_ledger(name: str, devices: Mapping[str, int] | None = None, policy: Policy | None = None):
    """The ledger ``name`` of the connected cluster; created with ``devices`` and ``policy`` if it does not exist
    (``None`` then: ``PolicyError``)."""
    import ray

    actor_name = ledger_name(name)
    try:
        return ray.get_actor(actor_name, namespace=NAMESPACE)
    except ValueError:
        if devices is None or policy is None:
            raise PolicyError(
                f"--ledger: no job ledger {name!r} on this cluster; submit a job with `hetero-ray submit` first"
            ) from None
    return (
        ray.remote(DeviceLedger)
        .options(name=actor_name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0)
        .remote(dict(devices), policy.to_dict())
    )
