"""`hetero-ray serve`: a checkpoint's model on emulated V100s with Ray Serve, real HTTP requests, batched answers
equal to the model's own, replicas that hold their devices and give them back when scaled down.

Every process that talks to the cluster is a subprocess with the cluster's environment (Ray reads its
authentication mode at import): the CLI, and this file run as a script, a driver that executes ``serving.app``
calls sent to it as JSON lines.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from hetero_ray.cluster.emulation import EmulatedCluster

OPTIONS = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16, "corpus_bytes": 20_000}
TEXTS = [
    "def ",
    "import os\n",
    "x",
    "    return self.",
    "class Foo(object):\n    def __init__(self",  # longer than the block: left-truncated
    "for i in range(",
    "if __name__ == ",
    "ab",
]
RESULT = "RESULT "


def _write_checkpoint(directory: Path, workload: dict, *, steps: int = 40) -> None:
    """A checkpoint as `train/loop.py::_report` writes one, of a model trained here for a few steps (peaked
    predictions, so answers are not ties)."""
    from hetero_ray.train.checkpoint import write_checkpoint
    from hetero_ray.workloads.base import build_workload

    torch.manual_seed(0)
    built = build_workload(workload["name"], workload["options"])
    optimizer = torch.optim.Adam(built.model.parameters(), lr=3e-3)
    loader = torch.utils.data.DataLoader(built.dataset, batch_size=16, shuffle=True)
    batches = iter(loader)
    for _ in range(steps):
        try:
            batch = next(batches)
        except StopIteration:
            batches = iter(loader)
            batch = next(batches)
        optimizer.zero_grad()
        built.loss_fn(built.model, batch).backward()
        optimizer.step()
    state = {"step": steps - 1, "history": [], "plan": {"workload": workload}}
    write_checkpoint(
        directory,
        steps - 1,
        {
            "model.pt": lambda p: torch.save(built.model.state_dict(), p),
            "optimizer.pt": lambda p: torch.save(optimizer.state_dict(), p),
            "state.json": lambda p: p.write_text(json.dumps(state)),
        },
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("serve") / "run" / "checkpoint_000000039"
    _write_checkpoint(directory, {"name": "gpt", "options": OPTIONS})
    return directory


@pytest.fixture(scope="module")
def serve_cluster():
    with EmulatedCluster({"A100-80GB": 1, "V100-16GB": 2}, gpus_per_node=2) as c:
        yield c


def _cli(argv: list[str], env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hetero_ray.cli", "serve", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class Driver:
    """This file as a script with the cluster's environment: one Ray connection for every call."""

    def __init__(self, env: dict):
        self.proc = subprocess.Popen(
            [sys.executable, __file__], env={**env, "PYTHONUNBUFFERED": "1"}, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip

    def __call__(self, op: str, *args, **kwargs):
        self.proc.stdin.write(json.dumps({"op": op, "args": args, "kwargs": kwargs}) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(RESULT):
                out = json.loads(line[len(RESULT) :])
                if "error" in out:
                    raise AssertionError(f"{op}{args}: {out['error']}")
                return out["ok"]
        raise AssertionError(f"the driver exited ({self.proc.wait()}) during {op}{args}")

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _burst(url: str, texts: list[str]) -> list[dict]:
    """All requests at once, from threads: concurrent requests reach a replica together and are batched."""
    with ThreadPoolExecutor(len(texts)) as pool:
        replies = list(pool.map(lambda t: _post(url, {"text": t}), texts))
    assert all(status == 200 for status, _ in replies), replies
    return [answer for _, answer in replies]


def _check_answers(answers: list[dict], texts: list[str], predictor) -> None:
    for text, answer in zip(texts, answers, strict=True):
        expected = predictor.predict([predictor.tokens({"text": text})])[0]
        assert answer["token"] == expected.token, (text, answer, expected)
        assert answer["probability"] == pytest.approx(expected.probability, rel=1e-4), (text, answer, expected)
        assert answer["gpu_type"] == "V100-16GB", answer


def _free_soon(driver: Driver, gpu_type: str, count: int, timeout_s: float = 20) -> None:
    """Ray's resource view (the GCS's, which `ray status` shows) follows a released actor within a second or so."""
    deadline = time.monotonic() + timeout_s
    while (free := driver("free_devices").get(gpu_type)) != count:
        assert time.monotonic() < deadline, f"{gpu_type}: {free} devices free after {timeout_s:.0f} s, expected {count}"
        time.sleep(0.5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_batched_answers_equal_single_ones(checkpoint):
    """Requests of different lengths in one batch: each answer is the one its request gets alone."""
    from hetero_ray.serving.model import load_predictor

    predictor = load_predictor(checkpoint)
    requests = [predictor.tokens({"text": t}) for t in TEXTS]
    assert predictor.predict(requests) == [predictor.predict([r])[0] for r in requests]
    assert predictor.context == OPTIONS["block_size"] and predictor.vocab == 256


def test_bad_input_is_one_line(checkpoint, tmp_path):
    """A missing checkpoint, a model that is not a next-token model and an unknown GPU type: one line, exit 2,
    before any cluster is reached."""
    cnn = tmp_path / "cnn" / "checkpoint_000000001"
    _write_checkpoint(cnn, {"name": "cnn", "options": {"samples": 64}}, steps=1)
    cases = [
        (["--checkpoint", str(tmp_path / "nowhere")], "is not a checkpoint directory"),
        (["--checkpoint", str(cnn)], "serving answers next-token requests"),
        (["--checkpoint", str(checkpoint), "--types", "V100-16G"], "unknown GPU type 'V100-16G'"),
    ]
    for argv, message in cases:
        out = _cli(argv, env={**os.environ, "RAY_ADDRESS": "127.0.0.1:1"}, timeout=120)  # nothing listens there
        assert out.returncode == 2, (argv, out.stdout, out.stderr[-3000:])
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("hetero-ray: error:") and message in lines[0], out.stderr


def test_serve_on_v100s_scale_down_and_up(serve_cluster, checkpoint):
    """Deploy 2 replicas on the V100s with the CLI; concurrent HTTP requests are batched and answered as the model
    answers them; the replicas hold both V100s; scaled to 1 a V100 is free and requests still work, a job holding
    it keeps the second replica waiting, and once it is free again the deployment is back at 2."""
    from hetero_ray.serving.model import load_predictor

    predictor = load_predictor(checkpoint)
    env = serve_cluster.env
    missing = _cli(["--checkpoint", str(checkpoint), "--types", "H100-80GB"], env=env)
    assert missing.returncode == 2 and "no node of GPU type 'H100-80GB'" in missing.stderr, missing.stderr[-3000:]

    port = _free_port()
    out = _cli(["--checkpoint", str(checkpoint), "--types", "V100-16GB", "--replicas", "2", "--port", str(port),
                "--name", "gpt", "--json"], env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr[-5000:]
    url = json.loads(out.stdout)["url"]
    assert url == f"http://127.0.0.1:{port}/gpt"

    driver = Driver(env)
    try:
        assert driver("replicas", "gpt") == 2
        assert driver("free_devices") == {"A100-80GB": 1, "V100-16GB": 0}  # both V100s held by replicas

        texts = TEXTS * 3
        answers = _burst(url, texts)
        _check_answers(answers, texts, predictor)
        assert max(a["batch_size"] for a in answers) > 1, answers  # some requests shared a forward
        status, error = _post(url, {"text": ""})
        assert status == 400 and "empty request" in error["error"], error

        assert driver("scale", "gpt", 1) == 1
        _free_soon(driver, "V100-16GB", 1)
        answers = _burst(url, TEXTS)
        _check_answers(answers, TEXTS, predictor)
        assert len({a["replica"] for a in answers}) == 1

        # A training job takes the freed V100: the second replica waits for it; freed, it comes back.
        driver("hold_device", "V100-16GB")
        with pytest.raises(AssertionError, match="1 of 2 replicas running"):
            driver("scale", "gpt", 2, wait_s=3)
        driver("release_device")
        assert driver("scale", "gpt", 2, wait_s=90) == 2
        _free_soon(driver, "V100-16GB", 0)
        _check_answers(_burst(url, TEXTS), TEXTS, predictor)
    finally:
        try:
            driver("shutdown", "gpt")
        finally:
            driver.close()


def test_a_finetune_job_takes_the_served_v100s_and_they_grow_back(serve_cluster, checkpoint):
    """Served through the job ledger on both V100s, the application shrinks to 0 replicas when a fine-tune job
    that may only use V100s is submitted (the job runs on them), and grows back to 2 when the job ends."""
    from cluster_jobs import ray_cli, wait_for

    env = serve_cluster.env
    ledger = f"serve-{time.time_ns()}"
    out = _cli(["--checkpoint", str(checkpoint), "--types", "V100-16GB", "--replicas", "2", "--port", str(_free_port()),
                "--name", "lm", "--ledger", ledger, "--json"], env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr[-5000:]
    url = json.loads(out.stdout)["url"]
    driver = Driver(env)
    try:
        assert driver("replicas", "lm") == 2
        probe = [sys.executable, "-c", "import os; print('ran on', os.environ['HETERO_RAY_DEVICES'])"]
        job = subprocess.run(
            [sys.executable, "-m", "hetero_ray.cli", "submit", "--class", "finetune", "--gpus", "2", "--only",
             "V100-16GB", "--ledger", ledger, "--", *probe],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert job.returncode == 0, job.stderr[-3000:]
        job_id = job.stdout.strip()
        assert wait_for(serve_cluster, job_id, timeout=180) == "SUCCEEDED"
        logs = ray_cli(serve_cluster, "job", "logs", job_id)
        assert "Serve application lm to 0 replicas (devices for this job)" in logs, logs[-3000:]
        assert 'ran on {"V100-16GB": 2}' in logs, logs[-3000:]
        assert "Serve application lm to 2 replicas (devices free again)" in logs, logs[-3000:]
        assert driver("replicas", "lm") == 2
        assert all(a["gpu_type"] == "V100-16GB" for a in _burst(url, TEXTS))
    finally:
        try:
            driver("shutdown", "lm")
        finally:
            driver.close()


def _drive() -> None:
    """The driver: ``serving.app`` calls (and holding a device, as a training job would) from JSON lines on stdin."""
    import ray

    from hetero_ray.cluster.emulation import EMULATED_RESOURCE, GPU_TYPE_LABEL
    from hetero_ray.serving import app

    @ray.remote(num_cpus=0)
    class Holder:
        def ready(self) -> bool:
            return True

    held = []

    def hold_device(gpu_type: str) -> None:
        holder = Holder.options(resources={EMULATED_RESOURCE: 1}, label_selector={GPU_TYPE_LABEL: gpu_type}).remote()
        ray.get(holder.ready.remote(), timeout=60)
        held.append(holder)

    def release_device() -> None:
        ray.kill(held.pop())

    ops = {"hold_device": hold_device, "release_device": release_device}
    app._connect()
    for line in sys.stdin:
        command = json.loads(line)
        try:
            result = ops.get(command["op"]) or getattr(app, command["op"])
            out = {"ok": result(*command["args"], **command["kwargs"])}
        except Exception as exc:  # reported to the test, which fails with it
            out = {"error": f"{type(exc).__name__}: {exc}"}
        print(RESULT + json.dumps(out), flush=True)


if __name__ == "__main__":
    _drive()
