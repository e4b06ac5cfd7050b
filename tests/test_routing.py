"""Job classes routed by GPU type: the policy and the ledger's queue (pure, fast), and jobs submitted with
`hetero-ray submit` to the session's emulated cluster (2 × A100-80GB + 2 × V100-16GB)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest
import yaml
from cluster_jobs import REPO, ray_cli, run_config, wait_for

from hetero_ray.cluster.catalog import load_catalog
from hetero_ray.routing.ledger import DeviceLedger
from hetero_ray.routing.policy import FIRST_FIT, PolicyError, default_policy, load_policy, place

TYPES = ["A100-80GB", "V100-16GB"]


def test_the_default_policy_sends_training_to_the_fastest_cards_and_finetuning_to_the_older():
    policy = default_policy(["V100-16GB", "A100-80GB"], load_catalog())
    assert policy.order("train", TYPES) == ["A100-80GB"]  # waits for them: no fallback
    assert policy.order("finetune", TYPES) == ["V100-16GB", "A100-80GB"]
    assert policy.order("inference", TYPES) == ["V100-16GB", "A100-80GB"]  # whatever is idle, the older first
    assert [policy.rank(c) for c in ("train", "finetune", "inference")] == [0, 1, 2]
    assert FIRST_FIT.order("finetune", TYPES) == TYPES and FIRST_FIT.rank("inference") == 0


def test_place_takes_types_in_order_and_all_or_nothing():
    assert place(3, TYPES, {"A100-80GB": 2, "V100-16GB": 2}) == {"A100-80GB": 2, "V100-16GB": 1}
    assert place(3, ["A100-80GB"], {"A100-80GB": 2, "V100-16GB": 2}) is None


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("classes: {train: {prefer: [A100]}}", r"classes\.train\.prefer: unknown GPU type 'A100' \(did you mean"),
        ("classes: {trian: {prefer: [A100-80GB]}}", r"classes: unknown job class 'trian' \(did you mean 'train'\?\)"),
        ("priority: [train, finetune]", r"priority: names no place for inference"),
        ("classes: {train: [A100-80GB]}", r"classes\.train: a mapping with keys prefer"),
    ],
)
def test_a_bad_policy_file_is_one_line(tmp_path, text, match):
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    with pytest.raises(PolicyError, match=match) as info:
        load_policy(str(path), load_catalog())
    assert "\n" not in str(info.value)


def test_the_ledger_serves_classes_in_order_and_counts_busy_device_time():
    """2 A100 + 2 V100 under the default policy: a fine-tune job takes the V100s, a second one falls back to the
    A100s; a training job then waits for A100s and, when the A100s free, gets them before a third fine-tune job
    that arrived earlier; a job asking more than its class may ever take is named."""

    async def scenario():
        ledger = DeviceLedger(dict.fromkeys(TYPES, 2), default_policy(TYPES, load_catalog()).to_dict())
        first = (await ledger.acquire("ft-1", "finetune", 2))["devices"]
        second = (await ledger.acquire("ft-2", "finetune", 2))["devices"]
        waiting = [asyncio.create_task(ledger.acquire(j, c, 2)) for j, c in (("ft-3", "finetune"), ("tr-1", "train"))]
        await asyncio.sleep(0.05)
        queued = [w["job"] for w in ledger.status()["queue"]]
        await ledger.release("ft-2")
        train = (await asyncio.wait_for(waiting[1], 1))["devices"]
        assert not waiting[0].done()
        status = ledger.status()
        await ledger.release("ft-1")
        third = (await asyncio.wait_for(waiting[0], 1))["devices"]
        return ledger, first, second, queued, train, status, third

    ledger, first, second, queued, train, status, third = asyncio.run(scenario())
    assert first == {"V100-16GB": 2} and second == {"A100-80GB": 2} and train == {"A100-80GB": 2}
    assert queued == ["tr-1", "ft-3"]  # training first in the queue, though it came later
    assert status["types"]["A100-80GB"]["jobs"] == {"tr-1": 2} and status["queue"][0]["job"] == "ft-3"
    assert third == {"V100-16GB": 2}
    assert 0 < status["types"]["V100-16GB"]["utilisation"] <= 1
    assert "can never be free for a train job" in ledger.problem("train", 3, None)
    assert ledger.problem("finetune", 4, None) is None


def test_a_job_above_inference_takes_a_serve_applications_devices_and_gives_them_back():
    """A Serve application on both V100s; a fine-tune job that may only use V100s gets them, its grant shrinking
    the application to 0; an inference job waits instead of shrinking it; when the fine-tune job ends the queued
    inference job gets a V100 first and the application grows back into the other."""

    async def scenario():
        ledger = DeviceLedger(dict.fromkeys(TYPES, 2), default_policy(TYPES, load_catalog()).to_dict())
        assert ledger.serve("gpt", "V100-16GB", 2) == 2
        grant = await ledger.acquire("ft-1", "finetune", 2, ["V100-16GB"])
        inference = asyncio.create_task(ledger.acquire("inf-1", "inference", 1, ["V100-16GB"]))
        await asyncio.sleep(0.05)
        busy = ledger.status()
        restore = await ledger.release("ft-1")
        return grant, busy, restore, await asyncio.wait_for(inference, 1), ledger.status()

    grant, busy, restore, inference, after = asyncio.run(scenario())
    assert grant == {"devices": {"V100-16GB": 2}, "reclaim": {"gpt": 0}}
    assert busy["types"]["V100-16GB"]["jobs"] == {"ft-1": 2} and busy["queue"][0]["job"] == "inf-1"
    assert restore == {"gpt": 1} and inference == {"devices": {"V100-16GB": 1}, "reclaim": {}}
    assert after["types"]["V100-16GB"]["jobs"] == {"inf-1": 1, "serve:gpt": 1}


def hetero_ray(cluster, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hetero_ray.cli", *args],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def ledger_knows(cluster, ledger: str, job: str, timeout: float = 120) -> dict:
    """`hetero-ray status --json` once the ledger holds ``job`` on some type or in its queue."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        status = hetero_ray(cluster, "status", "--ledger", ledger, "--json")
        if status.returncode == 0:
            busy = json.loads(status.stdout)
            held = [j for t in busy["types"].values() for j in t["jobs"]]
            if job in held or job in [w["job"] for w in busy["queue"]]:
                return busy
        time.sleep(0.5)
    raise AssertionError(f"the ledger {ledger!r} never saw job {job!r} in {timeout:.0f} s")


def test_jobs_of_each_class_land_on_the_types_their_class_prefers(cluster, tmp_path):
    """Through `hetero-ray submit` on the live cluster: a fine-tune job gets the V100s, a training job the A100s
    while the fine-tune job runs, a second fine-tune job waits in the queue (status shows it) and then runs;
    `hetero-ray status` names the jobs on each type. A job no class order can hold is refused in one line."""
    seen = tmp_path / "seen"
    seen.mkdir()
    probe = [
        sys.executable,
        "-c",
        f"import os, time; open('{seen}/' + os.environ['HETERO_RAY_JOB_ID'], 'w').write("
        "os.environ['HETERO_RAY_DEVICES']); t = time.time()\n"
        f"while os.sys.argv[1] == 'hold' and not os.path.exists('{seen}/release-' + os.environ['HETERO_RAY_JOB_ID'])"
        " and time.time() - t < 300: "
        "time.sleep(0.2)",
    ]
    ledger = f"test-{time.time_ns()}"
    jobs = {}
    # The first two hold their devices until the status has been read, then the test releases the fine-tune job
    # first: the queued one then finds the V100s free, not the A100s, whichever job the load lets end first.
    for name, job_class, hold in (("ft-1", "finetune", "hold"), ("tr-1", "train", "hold"), ("ft-2", "finetune", "go")):
        out = hetero_ray(
            cluster,
            "submit",
            "--class",
            job_class,
            "--gpus",
            "2",
            "--ledger",
            ledger,
            "--json",
            "--",
            *probe,
            str(hold),
        )
        assert out.returncode == 0, out.stderr
        jobs[name] = json.loads(out.stdout)["job_id"]
        # A job reaches the ledger only once its driver starts: wait for it, so the drivers ask in this order.
        busy = ledger_knows(cluster, ledger, jobs[name])
    for name in ("ft-1", "tr-1"):
        (seen / f"release-{jobs[name]}").write_text("")
        assert wait_for(cluster, jobs[name], timeout=120) == "SUCCEEDED", ray_cli(cluster, "job", "logs", jobs[name])
    for job in jobs.values():
        assert wait_for(cluster, job, timeout=120) == "SUCCEEDED", ray_cli(cluster, "job", "logs", job)[-2000:]
    got = {name: json.loads((seen / job).read_text()) for name, job in jobs.items()}
    assert got == {"ft-1": {"V100-16GB": 2}, "tr-1": {"A100-80GB": 2}, "ft-2": {"V100-16GB": 2}}
    assert busy["types"]["V100-16GB"]["jobs"] == {jobs["ft-1"]: 2}
    assert busy["types"]["A100-80GB"]["jobs"] == {jobs["tr-1"]: 2}
    assert [w["job"] for w in busy["queue"]] == [jobs["ft-2"]]

    never = hetero_ray(cluster, "submit", "--class", "train", "--gpus", "3", "--ledger", ledger, "--", *probe, "go")
    assert never.returncode == 2
    assert never.stderr.strip().splitlines() == [
        "hetero-ray: error: --gpus: 3 devices can never be free for a train job here: its class may take "
        "2 × A100-80GB (policy default); ask for at most 2"
    ]


def test_a_training_job_plans_for_the_devices_it_got(cluster, tmp_path):
    """The standard config names 2 A100s and 2 V100s; submitted as a 2-device training job it gets the A100s
    and its plan, trained to the end, holds those two and no V100."""
    cfg = run_config(tmp_path / "runs", "routed")
    cfg["train"] = {**cfg["train"], "split": "proportional", "steps": 4}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "result.json"
    train = [
        sys.executable,
        str(REPO / "jobs" / "train.py"),
        "--config",
        str(tmp_path / "run.yaml"),
        "--output",
        str(out),
    ]
    submitted = hetero_ray(
        cluster, "submit", "--class", "train", "--gpus", "2", "--ledger", f"test-{time.time_ns()}", "--", *train
    )
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip()
    assert wait_for(cluster, job, timeout=300) == "SUCCEEDED", ray_cli(cluster, "job", "logs", job)[-3000:]
    plan = json.loads(out.read_text())["metrics"]["plan"]
    assert sorted(r["gpu_type"] for r in plan["roles"]) == ["A100-80GB", "A100-80GB"] and not plan["excluded"]
