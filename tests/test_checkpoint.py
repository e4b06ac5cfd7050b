"""Atomic checkpoints: a crash mid-write leaves the previous one loadable; corruption is caught on load."""

from __future__ import annotations

import io
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from ray.train.v2._internal.execution.storage import StorageContext

from hetero_ray.train.checkpoint import (
    MANIFEST,
    CheckpointStore,
    CorruptCheckpoint,
    latest_valid,
    restore_dir,
    verify,
    write_checkpoint,
)

REPO = Path(__file__).resolve().parents[1]


def writers(step: int) -> dict:
    torch.manual_seed(step)
    model = {"w": torch.randn(64, 64), "b": torch.randn(64)}
    return {
        "model.pt": lambda p: torch.save(model, p),
        "state.json": lambda p: p.write_text(f'{{"step": {step}}}'),
    }


def load_model(directory: Path) -> dict:
    return torch.load(directory / "model.pt")


def test_round_trip_records_sizes_and_hashes(tmp_path: Path) -> None:
    manifest = write_checkpoint(tmp_path / "ckpt", 7, writers(7))
    assert verify(tmp_path / "ckpt") == manifest
    assert manifest.step == 7 and set(manifest.files) == {"model.pt", "state.json"}
    assert manifest.files["model.pt"].size == (tmp_path / "ckpt" / "model.pt").stat().st_size
    torch.manual_seed(7)
    assert torch.equal(load_model(tmp_path / "ckpt")["w"], torch.randn(64, 64))
    # Nothing but the checkpoint is left next to it.
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_sigkill_during_a_large_write_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    store = CheckpointStore(root=tmp_path, keep=3)
    store.save(1, writers(1))
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from hetero_ray.train.checkpoint import CheckpointStore

        def big(path):
            with path.open("wb") as f:
                for i in range(4096):            # up to 4 GiB: far longer than the test waits
                    f.write(b"x" * (1 << 20))
                    f.flush()
                    if i == 8:
                        print("writing", flush=True)
                    time.sleep(0.01)

        CheckpointStore(root=Path({str(tmp_path)!r}), keep=3).save(2, {{"model.pt": big}})
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        staging = [p for p in tmp_path.iterdir() if p.name.startswith(".staging-")]
        assert len(staging) == 1 and (staging[0] / "model.pt").stat().st_size >= 9 << 20
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not store.path(2).exists()
    directory, manifest = latest_valid(tmp_path)
    assert directory == store.path(1) and manifest.step == 1
    torch.manual_seed(1)
    assert torch.equal(load_model(directory)["w"], torch.randn(64, 64))
    # The next save clears the crashed write's leftovers.
    store.save(2, writers(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == [store.path(1).name, store.path(2).name]


def test_torch_save_failing_halfway_leaves_the_previous_checkpoint(tmp_path: Path, monkeypatch) -> None:
    store = CheckpointStore(root=tmp_path, keep=3)
    store.save(1, writers(1))
    real_save = torch.save

    def half_then_fail(obj, path, *args, **kwargs):
        buf = io.BytesIO()
        real_save(obj, buf)
        Path(path).write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        store.save(2, writers(2))
    monkeypatch.setattr(torch, "save", real_save)
    assert [p.name for p in tmp_path.iterdir()] == [store.path(1).name]
    directory, manifest = store.latest()
    assert manifest.step == 1
    torch.manual_seed(1)
    assert torch.equal(load_model(directory)["w"], torch.randn(64, 64))


def flip_one_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: flip_one_byte(d / "model.pt"), r"model\.pt: sha256 differs from the manifest's"),
        (lambda d: (d / "model.pt").write_bytes((d / "model.pt").read_bytes()[:-1]), r"model\.pt: \d+ bytes, the"),
        (lambda d: (d / "state.json").unlink(), r"state\.json: missing \(listed in manifest\.json\)"),
        (lambda d: (d / MANIFEST).unlink(), r"no manifest\.json"),
        (lambda d: (d / MANIFEST).write_text("{"), r"manifest\.json: unreadable manifest"),
        (lambda d: (d / MANIFEST).write_text('{"schema": 99, "step": 1, "files": {}}'), r"schema 99"),
    ],
    ids=["flipped-byte", "truncated", "missing-file", "missing-manifest", "bad-manifest", "future-schema"],
)
def test_damage_is_detected_with_one_line(tmp_path: Path, damage, message: str) -> None:
    write_checkpoint(tmp_path / "ckpt", 1, writers(1))
    damage(tmp_path / "ckpt")
    with pytest.raises(CorruptCheckpoint, match=message) as err:
        verify(tmp_path / "ckpt")
    assert "\n" not in str(err.value)


def test_latest_valid_walks_back_past_corrupt_ones_and_says_why(tmp_path: Path, caplog) -> None:
    store = CheckpointStore(root=tmp_path, keep=5)
    for step in (10, 20, 30):
        store.save(step, writers(step))
    flip_one_byte(store.path(30) / "model.pt")
    (store.path(20) / MANIFEST).unlink()
    with caplog.at_level(logging.WARNING, logger="hetero_ray.train.checkpoint"):
        directory, manifest = latest_valid(tmp_path)
    assert (directory, manifest.step) == (store.path(10), 10)
    skipped = [r.getMessage() for r in caplog.records]
    assert len(skipped) == 2
    assert "checkpoint_000000030/model.pt: sha256 differs" in skipped[0]
    assert "checkpoint_000000020: no manifest.json" in skipped[1]


def test_latest_valid_of_nothing_is_none(tmp_path: Path) -> None:
    assert latest_valid(tmp_path) is None
    assert latest_valid(tmp_path / "absent") is None


def test_keep_last_k_and_prune_only_after_a_complete_save(tmp_path: Path) -> None:
    store = CheckpointStore(root=tmp_path, keep=2)
    for step in range(1, 6):
        store.save(step, writers(step))
    assert sorted(p.name for p in tmp_path.iterdir()) == [store.path(4).name, store.path(5).name]

    def fail(path: Path) -> None:
        raise RuntimeError("writer failed")

    with pytest.raises(RuntimeError):
        store.save(6, {"model.pt": fail})
    assert sorted(p.name for p in tmp_path.iterdir()) == [store.path(4).name, store.path(5).name]


def test_keep_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep must be >= 1"):
        CheckpointStore(root=tmp_path, keep=0)


def test_a_corrupt_checkpoint_of_the_same_name_is_replaced(tmp_path: Path) -> None:
    store = CheckpointStore(root=tmp_path, keep=3)
    store.save(1, writers(1))
    flip_one_byte(store.path(1) / "model.pt")
    store.save(1, writers(1))
    assert verify(store.path(1)).step == 1
    assert [p.name for p in tmp_path.iterdir()] == [store.path(1).name]


def test_writer_names_are_plain_file_names(tmp_path: Path) -> None:
    for name in (MANIFEST, "../escape.pt", ".hidden"):
        with pytest.raises(ValueError, match="plain names"):
            write_checkpoint(tmp_path / "ckpt", 1, {name: lambda p: p.write_text("x")})
    assert not (tmp_path / "ckpt").exists()


def ray_run_dir(tmp_path: Path, steps: list[int]) -> list[Path]:
    """A run directory laid out as Ray Train leaves it: each report's directory copied to checkpoint_<timestamp>."""
    run_dir, copies = tmp_path / "storage" / "my-run", []
    for step in steps:
        local = tmp_path / "local" / str(step)
        write_checkpoint(local, step, writers(step))
        copy = run_dir / StorageContext.make_default_checkpoint_dir_name()
        shutil.copytree(local, copy)
        copies.append(copy)
        time.sleep(0.002)  # Ray's names have microseconds; keep them distinct
    return copies


def test_restore_falls_back_to_an_older_ray_checkpoint_of_the_run(tmp_path: Path, caplog) -> None:
    copies = ray_run_dir(tmp_path, [10, 20, 30])
    assert restore_dir(copies[-1], copies[-1].parent)[1].step == 30
    # A copy interrupted half-way: one file short.
    os.truncate(copies[-1] / "model.pt", 100)
    with caplog.at_level(logging.WARNING, logger="hetero_ray.train.checkpoint"):
        directory, manifest = restore_dir(copies[-1], copies[-1].parent)
    assert (directory, manifest.step) == (copies[1], 20)
    assert any("resuming from the older checkpoint" in r.getMessage() for r in caplog.records)


def test_restore_takes_a_newer_checkpoint_ray_train_had_not_registered(tmp_path: Path, caplog) -> None:
    """A worker lost after persisting step 30 but before Ray Train registered it: Ray hands back step 20."""
    copies = ray_run_dir(tmp_path, [10, 20, 30])
    with caplog.at_level(logging.WARNING, logger="hetero_ray.train.checkpoint"):
        directory, manifest = restore_dir(copies[1], copies[1].parent)
    assert (directory, manifest.step) == (copies[2], 30)
    assert any("newer, unregistered" in r.getMessage() for r in caplog.records)
    assert restore_dir(None, tmp_path / "no-such-run") is None


def test_restore_refuses_when_nothing_verifies(tmp_path: Path) -> None:
    copies = ray_run_dir(tmp_path, [10, 20])
    for copy in copies:
        flip_one_byte(copy / "model.pt")
    with pytest.raises(CorruptCheckpoint, match=rf"{copies[-1].name}/model\.pt: sha256"):
        restore_dir(copies[-1], copies[-1].parent)
    with pytest.raises(CorruptCheckpoint):
        restore_dir(copies[-1])
