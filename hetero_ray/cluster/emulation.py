"""An emulated heterogeneous cluster: real Ray raylets on this machine, labelled with GPU types.

Each emulated node is started with ``ray start`` (as on a real cluster), carries
the label ``hetero-ray/gpu-type=<catalog name>`` and ``hetero-ray/emulated=true``,
and offers ``emulated_gpu`` resources, never ``GPU``: nothing emulated can be
mistaken for a real GPU. Token authentication stays on: the cluster writes its
own token and every process it starts, and every client, uses it. Every process
registers as 127.0.0.1, so Ray's own traffic stays on the loopback interface.

With ``cpu_share`` the devices are *throttled*: each is a cgroup holding that share of
one core (``cluster/cpu_slices.py``), which the worker driving it joins, so devices
differ in real speed that hetero-ray must measure. The cgroups go when the cluster
stops, also on an error, SIGINT or SIGTERM.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from hetero_ray.cluster.cpu_slices import CLAIMS_ENV, SLICES_ENV, CpuSlices, check_shares

GPU_TYPE_LABEL = "hetero-ray/gpu-type"
EMULATED_LABEL = "hetero-ray/emulated"
LOOPBACK = "127.0.0.1"
STOP_GRACE_S = 5.0
EMULATED_RESOURCE = "emulated_gpu"


def _free_ports(count: int, taken: set[int]) -> list[int]:
    """``count`` ports free now, distinct from each other and from ``taken``, which they join.

    The sockets stay bound until all are picked: a port closed at once may be handed out
    again by the next bind, and two Ray components given one port make ``ray start`` fail.
    """
    sockets: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            s = socket.socket()
            sockets.append(s)
            s.bind(("127.0.0.1", 0))
            if (port := s.getsockname()[1]) not in taken:
                ports.append(port)
    finally:
        for s in sockets:
            s.close()
    taken.update(ports)
    return ports


def node_layout(devices: Mapping[str, int], gpus_per_node: int) -> list[tuple[str, int]]:
    """(GPU type, count) per emulated node: each type packed ``gpus_per_node`` to a node."""
    nodes = []
    for gpu_type, count in devices.items():
        full, rest = divmod(count, gpus_per_node)
        nodes += [(gpu_type, gpus_per_node)] * full + ([(gpu_type, rest)] if rest else [])
    return nodes


def _wait_until_dead(processes: list[psutil.Process], timeout_s: float = 10) -> None:
    """Return once every one of ``processes`` has exited (a killed process takes a moment to), or after
    ``timeout_s``. One whose parent died first stays a zombie until something reaps it: that counts as exited.
    Not ``psutil.wait_procs``: for a process that is not this one's child it waits until the pid is gone,
    so an unreaped zombie would hold every kill for the whole timeout."""
    deadline = time.monotonic() + timeout_s
    for p in processes:
        while time.monotonic() < deadline:
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)


@dataclass
class EmulatedCluster:
    """Start with ``with EmulatedCluster({...}) as cluster:``; ``cluster.env`` is what clients need."""

    devices: Mapping[str, int]
    gpus_per_node: int = 2
    object_store_bytes: int = 100 * 2**20
    head_cpus: int = 2
    # Share of one core per device, by GPU type: throttled devices. None: padded ones (compute unthrottled).
    cpu_share: Mapping[str, float] | None = None
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="hetero-ray-emulated-")))
    port: int = field(init=False)
    dashboard_port: int = field(init=False)
    _procs: list[subprocess.Popen] = field(default_factory=list, init=False, repr=False)
    _metrics_port: dict[subprocess.Popen, int] = field(default_factory=dict, init=False, repr=False)
    _nodes: list[tuple[str, subprocess.Popen]] = field(default_factory=list, init=False, repr=False)
    _ports_taken: set[int] = field(default_factory=set, init=False, repr=False)
    _slices: CpuSlices | None = field(default=None, init=False, repr=False)
    _slice_types: list[tuple[str, str]] = field(default_factory=list, init=False, repr=False)  # (GPU type, slice)
    _sigterm: list = field(default_factory=list, init=False, repr=False)  # the handler to restore, once set

    def __post_init__(self) -> None:
        if self.cpu_share is not None:
            check_shares(self.devices, self.cpu_share)
        self.port, self.dashboard_port = _free_ports(2, self._ports_taken)

    @property
    def throttled(self) -> bool:
        return self.cpu_share is not None

    @property
    def cgroups(self) -> list[Path]:
        """The device cgroups this cluster made and has not removed yet."""
        return list(self._slices.paths.values()) if self._slices else []

    @property
    def metrics_ports(self) -> list[int]:
        """Each live raylet's Prometheus endpoint (http://127.0.0.1:<port>/metrics), head first: a killed node's
        or a failed try's is gone with it."""
        return [self._metrics_port[proc] for proc in self._procs]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    @property
    def env(self) -> dict[str, str]:
        """Environment for any process that talks to this cluster (driver, `ray job submit`, nodes)."""
        return {
            **os.environ,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(self.workdir / "auth_token"),
            "RAY_ADDRESS": self.address,
            "RAY_API_SERVER_ADDRESS": self.dashboard_url,
            "RAY_USAGE_STATS_ENABLED": "0",
            # Ray's own loopback-only mode: every driver and worker registers as 127.0.0.1.
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        }

    def _ray_start(self, *args: str, log: str, env: Mapping[str, str] | None = None) -> subprocess.Popen:
        # Every raylet on one machine needs its own agent ports; Ray's defaults would collide.
        flags = (
            "dashboard-agent-listen-port",
            "dashboard-agent-grpc-port",
            "metrics-export-port",
            "runtime-env-agent-port",
        )
        chosen = dict(zip(flags, _free_ports(len(flags), self._ports_taken), strict=True))
        ports = [f"--{flag}={port}" for flag, port in chosen.items()]
        out = open(self.workdir / f"{log}.log", "wb")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hetero_ray.cluster.ray_start_loopback",
                "start",
                "--block",
                "--disable-usage-stats",
                f"--node-ip-address={LOOPBACK}",
                *ports,
                *args,
            ],
            env={**self.env, **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._procs.append(proc)
        self._metrics_port[proc] = chosen["metrics-export-port"]
        return proc

    def start(self, timeout_s: float = 120) -> EmulatedCluster:
        """Start the head and one raylet per emulated node; return when all have joined."""
        if self.throttled:
            self._slices = CpuSlices(name=f"hetero-ray-{self.workdir.name}")
            (self.workdir / "claims").mkdir()
        (self.workdir / "auth_token").write_text(secrets.token_hex(32))
        self._ray_start(
            "--head",
            f"--port={self.port}",
            f"--num-cpus={self.head_cpus}",
            f"--object-store-memory={self.object_store_bytes}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={self.dashboard_port}",
            "--include-dashboard=true",
            # Its own temp dir: Ray resolves "auto" (as job drivers do) through the temp dir's
            # record of the current cluster, which clusters sharing /tmp/ray overwrite.
            f"--temp-dir={self.workdir / 'r'}",
            "--labels=hetero-ray/role=head",
            # A lost emulated node is declared dead after ~3 s rather than Ray's default ~15 s,
            # so recovery tests and benchmarks do not spend their time waiting on heartbeats.
            '--system-config={"health_check_period_ms": 1000, "health_check_failure_threshold": 3}',
            log="head",
        )
        self._wait_for_port(self.port, timeout_s)
        # A joining node asks the GCS for the head's node record, and gives up after ~20 s: on a
        # loaded machine the head's raylet registers later than its GCS port opens.
        self._wait_for_nodes(1, timeout_s)
        # One raylet at a time: started together on two cores, some miss Ray's
        # fixed 30 s registration deadline.
        for gpu_type, count in node_layout(self.devices, self.gpus_per_node):
            self.add_node(gpu_type, count, timeout_s)
        self._wait_for_job_agent(timeout_s)
        return self

    def add_node(self, gpu_type: str, count: int, timeout_s: float = 120, attempts: int = 3) -> None:
        """Start one more emulated node of ``count`` × ``gpu_type`` and wait until it has joined.

        On a loaded two-core host a raylet can miss Ray's fixed 30 s registration deadline, and its `ray start`
        exits 1 ("The current node timed out during startup"); that node is started again, up to ``attempts``
        times, each try with its own log. The cluster's address, token and other nodes stay as they are, so
        clients already given ``env`` keep working, which a whole fresh cluster (``start_retrying``) cannot do."""
        name = f"node{len(self._nodes)}-{gpu_type}"
        env = {}
        if self._slices is not None:
            self._slice_types += [(gpu_type, f"{name}-{i}") for i in range(count)]
            slices = [self._slices.add(f"{name}-{i}", self.cpu_share[gpu_type]) for i in range(count)]
            env = {SLICES_ENV: ":".join(map(str, slices)), CLAIMS_ENV: str(self.workdir / "claims")}
        joined = 2 + len(self._nodes)  # the head, the nodes so far and this one
        for attempt in range(1, attempts + 1):
            proc = self._ray_start(
                f"--address={self.address}",
                f"--num-cpus={count}",
                f"--object-store-memory={self.object_store_bytes}",
                f'--resources={{"{EMULATED_RESOURCE}": {count}}}',
                f"--labels={GPU_TYPE_LABEL}={gpu_type},{EMULATED_LABEL}=true",
                log=name if attempt == 1 else f"{name}-try{attempt}",
                env=env,
            )
            try:
                self._wait_for_nodes(joined, timeout_s)
            except RuntimeError:
                if proc.poll() is None or attempt == attempts:
                    raise  # another process died, or this node failed every try
                self._drop_failed_start(proc)
                # A raylet that registered late stays alive in the GCS until its health checks fail: wait for
                # that, or it would count as the next try's node.
                self._wait_for_nodes(joined - 1, timeout_s, exactly=True)
                continue
            self._nodes.append((gpu_type, proc))
            return

    def _drop_failed_start(self, proc: subprocess.Popen) -> None:
        """Forget ``proc``, a `ray start` that exited, after killing what it left in its process group (a
        raylet); its metrics port goes with it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        self._procs.remove(proc)

    def set_cpu_share(self, gpu_type: str, index: int, share: float) -> None:
        """Throttled devices: give the ``index``-th device of ``gpu_type`` (in node order) ``share`` of a core."""
        if self._slices is None:
            raise ValueError("only a throttled cluster (cpu_share) has CPU shares to change")
        names = [n for t, n in self._slice_types if t == gpu_type]
        if not 0 <= index < len(names):
            raise ValueError(f"no emulated {gpu_type} #{index}; this cluster has {len(names)} of that type")
        self._slices.set_share(names[index], share)

    def kill_node(self, gpu_type: str) -> None:
        """Kill the first live node of ``gpu_type`` at once (raylet and its workers), as a lost machine."""
        for i, (t, proc) in enumerate(self._nodes):
            if t == gpu_type and proc.poll() is None:
                # The raylet starts each worker in a process group of its own, so killing the node's group
                # alone leaves its workers training until they notice their raylet is gone.
                workers = psutil.Process(proc.pid).children(recursive=True)
                os.killpg(proc.pid, signal.SIGKILL)
                for worker in workers:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        worker.kill()
                _wait_until_dead(workers)
                proc.wait()
                self._procs.remove(proc)
                del self._nodes[i]
                return
        raise ValueError(f"no live emulated node of type {gpu_type!r}")

    def api(self, path: str, body: Mapping[str, Any] | None = None, timeout_s: float = 30) -> Any:
        """GET ``path`` of the head's dashboard, or POST ``body`` to it, with the cluster's token: the JSON answer.
        It is what `ray list` and `ray job` ask for, without a `ray` process per call (about 2 s of CPU, which a
        two-core machine takes from the cluster being waited on)."""
        token = (self.workdir / "auth_token").read_text().strip()
        request = urllib.request.Request(
            self.dashboard_url + path,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.load(response)

    def _poll(self, ready: Callable[[], Any], timeout_s: float, failure: str) -> Any:
        """Call ``ready()`` every half second until it answers something true, and return that; the dashboard not
        answering yet counts as not ready."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                if answer := ready():
                    return answer
            except (OSError, ValueError, KeyError):  # not listening yet, an error page, an answer without data
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{failure} in {timeout_s:.0f} s (logs: {self.workdir})")

    def _wait_for_job_agent(self, timeout_s: float) -> None:
        """Job submission fails until the head's dashboard agent has registered: submit a no-op until it works,
        then wait for it to end, so that the agents' start-up work is done too before anything is measured."""
        job_id = self._poll(
            lambda: self.api("/api/jobs/", {"entrypoint": "true"})["job_id"],
            timeout_s,
            "the emulated head's job server did not take a no-op job",
        )

        def ended() -> str | None:
            status = self.api(f"/api/jobs/{job_id}")["status"]
            return status if status in ("SUCCEEDED", "FAILED", "STOPPED") else None

        status = self._poll(ended, timeout_s, "the emulated head's job server did not run a no-op job")
        if status != "SUCCEEDED":
            raise RuntimeError(f"the emulated head's no-op job (`true`) ended {status} (logs: {self.workdir})")

    def _wait_for_port(self, port: int, timeout_s: float) -> None:
        def listening() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0

        self._poll(listening, timeout_s, f"emulated Ray head did not open port {port}")

    def _wait_for_nodes(self, n: int, timeout_s: float, exactly: bool = False) -> None:
        """Until at least ``n`` nodes (``exactly`` ``n``) are alive."""
        alive = "/api/v0/nodes?filter_keys=state&filter_predicates=%3D&filter_values=ALIVE&limit=1000&detail=false"

        def ready() -> bool:
            total = self.api(alive)["data"]["result"]["total"]
            return total == n if exactly else total >= n

        failure = (
            f"the emulated nodes alive did not come back to {n}"
            if exactly
            else f"only some of {n} emulated nodes joined"
        )
        self._poll(ready, timeout_s, failure)

    def _check_alive(self) -> None:
        for proc in self._procs:
            if proc.poll() is not None:
                raise RuntimeError(f"a `ray start` exited with code {proc.returncode} (logs: {self.workdir})")

    def stop(self) -> None:
        """Stop every process this cluster started (and only those), then remove its cgroups.

        SIGINT and SIGTERM are held until that is done and delivered after: a second Ctrl-C (or a CI
        runner's repeated TERM) while stopping would otherwise abort the cleanup half-way and orphan
        the raylets."""
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            self._stop_processes()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)

    def _stop_processes(self) -> None:
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        # A head that ran Ray Train jobs can take 20 s and more to wind down on SIGTERM; an emulated
        # cluster keeps nothing worth that wait (its temp dir is its own), so the rest is SIGKILLed.
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in reversed(self._procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._procs.clear()
        if self._slices is not None:
            self._slices.remove()

    def __enter__(self) -> EmulatedCluster:
        # SIGTERM (a job stopped, a CI timeout) unwinds the stack, as Ctrl-C does, so the raylets and
        # cgroups go with the process instead of outliving it; the exit status is a shell's (143). Only the main thread may set handlers.
        if threading.current_thread() is threading.main_thread():
            self._sigterm.append(signal.signal(signal.SIGTERM, _exit_on_signal))
        try:
            return self.start()
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            while self._sigterm:
                # None: a handler not set from Python; the default is what it did.
                signal.signal(signal.SIGTERM, self._sigterm.pop() or signal.SIG_DFL)


def start_retrying(devices: Mapping[str, int], *, attempts: int = 3, on_retry=print, **options) -> EmulatedCluster:
    """A started ``EmulatedCluster(devices, **options)``; a failed start (the head's, or a node's on every one of
    ``add_node``'s tries) is retried with a fresh cluster (fresh ports, token and processes) up to ``attempts``
    times, ``on_retry`` getting each failure's line. Only for a process that has not yet set its environment
    from a cluster's ``env``: the retry's differs."""
    if attempts < 1:
        raise ValueError(f"attempts: {attempts}; use at least 1")
    for attempt in range(attempts):
        cluster = EmulatedCluster(devices, **options)
        try:
            return cluster.start()
        except (RuntimeError, TimeoutError) as exc:
            cluster.stop()
            if attempt + 1 == attempts:
                raise
            on_retry(f"the emulated cluster did not start ({exc}); retrying")
    raise AssertionError("unreachable: the last attempt returns or raises")


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(128 + signum)
