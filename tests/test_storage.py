"""Checkpoints in object storage: a run whose `run.storage_path` is an s3:// URI on a real local S3 server
(moto in server mode), stopped after a checkpoint and resumed from the bucket, through `ray job submit` on the
session's emulated cluster. (A run stopped and resumed on local storage is what a restarted run does:
tests/test_recovery.py.)"""

from __future__ import annotations

import io
import json
import subprocess
import time
import urllib.request

import pyarrow.fs
import pytest
import torch
from cluster_jobs import (
    HELD_OUT,
    STEPS,
    held_out_loss,
    job_status,
    max_abs_diff,
    ray_cli,
    run_config,
    single_process_reference,
    submit,
    wait_for,
)
from ranks import free_port

# moto accepts any credentials; pyarrow and the workers need some.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
BUCKET = "hetero-ray-test"


@pytest.fixture(scope="module")
def s3(monkeypatch_module) -> str:
    """A moto S3 server with an empty bucket; the storage URI prefix that reaches it."""
    port = free_port()
    server = subprocess.Popen(["moto_server", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.3)
        for key, value in CREDENTIALS.items():
            monkeypatch_module.setenv(key, value)
        query = f"endpoint_override=127.0.0.1:{port}&scheme=http"
        fs, _ = pyarrow.fs.FileSystem.from_uri(f"s3://{BUCKET}?{query}&allow_bucket_creation=true")
        fs.create_dir(BUCKET)
        yield f"s3://{BUCKET}/runs?{query}"
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def listing(uri: str, folder: str) -> list[str]:
    fs, path = pyarrow.fs.FileSystem.from_uri(uri)
    found = fs.get_file_info(pyarrow.fs.FileSelector(f"{path}/{folder}", allow_not_found=True))
    return sorted(info.base_name for info in found)


def test_a_run_checkpoints_to_s3_and_resumes_from_the_bucket(cluster, tmp_path, s3):
    """The run writes its checkpoints and result.json under s3://…/runs/<name>/; stopped after its first
    checkpoint and submitted again, it resumes from the bucket (not from step 0) and ends where one process
    ends (1e-5), its last evaluation that model's loss on the held-out samples."""
    cfg = run_config(tmp_path / "unused", "s3-run", evaluate=True)
    cfg["run"]["storage_path"] = s3
    job_id, _ = submit(cluster, tmp_path, cfg, env=CREDENTIALS)
    deadline = time.monotonic() + 240
    # Ray Train registers a checkpoint in its snapshot, which a resumed run reads.
    while "checkpoint_manager_snapshot.json" not in listing(s3, "s3-run") and time.monotonic() < deadline:
        assert job_status(cluster, job_id) in ("PENDING", "RUNNING"), ray_cli(cluster, "job", "logs", job_id)[-3000:]
        time.sleep(0.5)
    ray_cli(cluster, "job", "stop", job_id)
    assert wait_for(cluster, job_id) == "STOPPED", "the run finished before it could be stopped"

    job_id, out = submit(cluster, tmp_path, cfg, env=CREDENTIALS)
    assert wait_for(cluster, job_id) == "SUCCEEDED", ray_cli(cluster, "job", "logs", job_id)[-3000:]
    result = json.loads(out.read_text())
    assert result["metrics"]["resumed_from_step"] > 0 and result["metrics"]["step"] == STEPS - 1
    assert "result.json" in listing(s3, "s3-run")
    fs, _ = pyarrow.fs.FileSystem.from_uri(s3)
    with fs.open_input_file(f"{result['checkpoint_path']}/model.pt") as f:
        params = torch.load(io.BytesIO(f.read()))
    reference = single_process_reference(held_out=HELD_OUT)
    assert max_abs_diff(params, reference) <= 1e-5
    assert result["metrics"]["eval"]["step"] == STEPS - 1
    assert result["metrics"]["eval"]["loss"] == pytest.approx(held_out_loss(reference), abs=1e-5)
