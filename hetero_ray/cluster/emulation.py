"""An emulated heterogeneous cluster: real Ray raylets on this machine, labelled with GPU types.

Each emulated node is started with ``ray start`` (as on a real cluster), carries
the label ``hetero-ray/gpu-type=<catalog name>`` and ``hetero-ray/emulated=true``,
and offers ``emulated_gpu`` resources, never ``GPU``: nothing emulated can be
mistaken for a real GPU. Token authentication stays on: the cluster writes its
own token and every process it starts, and every client, uses it.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

GPU_TYPE_LABEL = "hetero-ray/gpu-type"
EMULATED_LABEL = "hetero-ray/emulated"
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


@dataclass
class EmulatedCluster:
    """Start with ``with EmulatedCluster({...}) as cluster:``; ``cluster.env`` is what clients need."""

    devices: Mapping[str, int]
    gpus_per_node: int = 2
    object_store_bytes: int = 100 * 2**20
    head_cpus: int = 2
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="hetero-ray-emulated-")))
    port: int = field(init=False)
    dashboard_port: int = field(init=False)
    # Each raylet's Prometheus endpoint (http://127.0.0.1:<port>/metrics), head first.
    metrics_ports: list[int] = field(default_factory=list, init=False)
    _procs: list[subprocess.Popen] = field(default_factory=list, init=False, repr=False)
    _nodes: list[tuple[str, subprocess.Popen]] = field(default_factory=list, init=False, repr=False)
    _ports_taken: set[int] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        self.port, self.dashboard_port = _free_ports(2, self._ports_taken)

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
        }

    def _ray_start(self, *args: str, log: str) -> subprocess.Popen:
        # Every raylet on one machine needs its own agent ports; Ray's defaults would collide.
        flags = (
            "dashboard-agent-listen-port",
            "dashboard-agent-grpc-port",
            "metrics-export-port",
            "runtime-env-agent-port",
        )
        chosen = dict(zip(flags, _free_ports(len(flags), self._ports_taken), strict=True))
        self.metrics_ports.append(chosen["metrics-export-port"])
        ports = [f"--{flag}={port}" for flag, port in chosen.items()]
        out = open(self.workdir / f"{log}.log", "wb")
        proc = subprocess.Popen(
            ["ray", "start", "--block", "--disable-usage-stats", *ports, *args],
            env=self.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._procs.append(proc)
        return proc

    def start(self, timeout_s: float = 120) -> EmulatedCluster:
        """Start the head and one raylet per emulated node; return when all have joined."""
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

    def add_node(self, gpu_type: str, count: int, timeout_s: float = 120) -> None:
        """Start one more emulated node of ``count`` × ``gpu_type`` and wait until it has joined."""
        proc = self._ray_start(
            f"--address={self.address}",
            f"--num-cpus={count}",
            f"--object-store-memory={self.object_store_bytes}",
            f'--resources={{"{EMULATED_RESOURCE}": {count}}}',
            f"--labels={GPU_TYPE_LABEL}={gpu_type},{EMULATED_LABEL}=true",
            log=f"node{len(self._nodes)}-{gpu_type}",
        )
        self._nodes.append((gpu_type, proc))
        self._wait_for_nodes(1 + len(self._nodes), timeout_s)

    def kill_node(self, gpu_type: str) -> None:
        """Kill the first live node of ``gpu_type`` at once (raylet and its workers), as a lost machine."""
        for i, (t, proc) in enumerate(self._nodes):
            if t == gpu_type and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                self._procs.remove(proc)
                del self._nodes[i]
                return
        raise ValueError(f"no live emulated node of type {gpu_type!r}")

    def _wait_for_job_agent(self, timeout_s: float) -> None:
        """`ray job submit` fails until the head's dashboard agent has registered: submit a no-op until it works."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive()
            out = subprocess.run(
                ["ray", "job", "submit", "--no-wait", "--", "true"], env=self.env, capture_output=True, text=True
            )
            if out.returncode == 0:
                return
            time.sleep(2)
        raise TimeoutError(
            f"the emulated head's job server did not come up in {timeout_s:.0f} s (logs: {self.workdir})"
        )

    def _wait_for_port(self, port: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive()
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.5)
        raise TimeoutError(f"emulated Ray head did not open port {port} in {timeout_s:.0f} s (logs: {self.workdir})")

    def _wait_for_nodes(self, n: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive()
            out = subprocess.run(
                ["ray", "list", "nodes", "--filter", "state=ALIVE", "--format", "json", "--limit", "1000"],
                env=self.env,
                capture_output=True,
                text=True,
            )
            if out.returncode == 0 and out.stdout.count('"node_id"') >= n:
                return
            time.sleep(1)
        raise TimeoutError(f"only some of {n} emulated nodes joined in {timeout_s:.0f} s (logs: {self.workdir})")

    def _check_alive(self) -> None:
        for proc in self._procs:
            if proc.poll() is not None:
                raise RuntimeError(f"a `ray start` exited with code {proc.returncode} (logs: {self.workdir})")

    def stop(self) -> None:
        """Stop every process this cluster started (and only those)."""
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self._procs):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._procs.clear()

    def __enter__(self) -> EmulatedCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
