"""Checkpoints that are whole or absent: written aside, fsynced, manifest last, renamed into place.

A checkpoint is a directory of files plus ``manifest.json`` (each file's size and
sha256, the schema version, the step). The manifest is written after every file
is on disk, and the directory appears under its final name by one ``os.replace``
of a temporary sibling, so a crash at any moment leaves either the previous
checkpoints alone or the new one complete. Loading verifies the manifest; a
checkpoint that fails is skipped for the newest one that passes.

With Ray Train the loop writes into a local directory with ``write_checkpoint`` and
hands it to ``ray.train.report``; Ray copies it, manifest included, to
``storage_path/run_name/checkpoint_<timestamp>`` (keeping ``num_to_keep`` of them).
That copy is not atomic, which is why restore verifies (``restore_dir``) and can
fall back to an older ``checkpoint_*`` sibling of the same run, or take a newer one
Ray Train had not registered yet.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
# What a training checkpoint holds (train/loop.py writes them; serving reads the model and the state).
MODEL_FILE, OPTIMIZER_FILE, STATE_FILE = "model.pt", "optimizer.pt", "state.json"
SCHEMA = 1
# Ray Train's directory names (checkpoint_<timestamp>) and ours (checkpoint_<step>) share this prefix.
PREFIX = "checkpoint_"
_STAGING = ".staging-"
_CHUNK = 1 << 20

# Writes one file of a checkpoint at the path it is given, e.g. ``lambda p: torch.save(obj, p)``.
FileWriter = Callable[[Path], object]


class CorruptCheckpoint(ValueError):
    """A checkpoint failed verification; the message is one line naming the directory and file."""


@dataclass(frozen=True, kw_only=True)
class FileEntry:
    """One file of a checkpoint as written."""

    size: int
    sha256: str


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What a complete checkpoint holds; written last."""

    step: int
    files: Mapping[str, FileEntry]
    schema: int = SCHEMA

    def to_json(self) -> str:
        files = {name: {"size": e.size, "sha256": e.sha256} for name, e in sorted(self.files.items())}
        return json.dumps({"schema": self.schema, "step": self.step, "files": files}, indent=2)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    """Flush a file or a directory entry to disk (a rename is durable only once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(directory: Path, step: int, writers: Mapping[str, FileWriter]) -> Manifest:
    """Create ``directory`` holding one file per ``writers`` entry and a manifest, atomically.

    Each writer is called with the path its file must be written to (inside a hidden
    temporary sibling of ``directory``). Any exception from a writer removes the
    temporary directory and propagates; ``directory`` is then untouched. If
    ``directory`` already exists (a checkpoint of the same name that was found
    corrupt, say) it is replaced only once the new one is complete.
    """
    directory = Path(directory)
    bad = [n for n in writers if n == MANIFEST or Path(n).name != n or n.startswith(".")]
    if bad:
        raise ValueError(f"checkpoint file names must be plain names other than {MANIFEST}; got {bad[0]!r}")
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f"{_STAGING}{directory.name}-"))
    try:
        entries = {}
        for name, write in writers.items():
            path = staging / name
            write(path)
            if not path.is_file():
                raise CorruptCheckpoint(f"{directory}: the writer of {name} did not create it")
            _fsync(path)
            entries[name] = FileEntry(size=path.stat().st_size, sha256=_sha256(path))
        manifest = Manifest(step=step, files=entries)
        (staging / MANIFEST).write_text(manifest.to_json())
        _fsync(staging / MANIFEST)
        _fsync(staging)
        _swap_into_place(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _fsync(directory.parent)
    return manifest


def _swap_into_place(staging: Path, directory: Path) -> None:
    if not directory.exists():
        os.replace(staging, directory)
        return
    # rename() cannot replace a non-empty directory: move the old one aside first.
    # Between the two renames neither name exists; older checkpoints stay loadable.
    old = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f"{_STAGING}{directory.name}-old-"))
    os.replace(directory, old / directory.name)
    os.replace(staging, directory)
    shutil.rmtree(old, ignore_errors=True)


def verify(directory: Path) -> Manifest:
    """The manifest of a complete, intact checkpoint; ``CorruptCheckpoint`` (one line) otherwise."""
    directory = Path(directory)
    path = directory / MANIFEST
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{directory}: no {MANIFEST} (an interrupted write or copy)") from None
    except OSError as exc:
        raise CorruptCheckpoint(f"{path}: cannot read ({exc.strerror})") from None
    try:
        data = json.loads(text)
        manifest = Manifest(
            schema=data["schema"],
            step=int(data["step"]),
            files={n: FileEntry(size=int(e["size"]), sha256=str(e["sha256"])) for n, e in data["files"].items()},
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptCheckpoint(f"{path}: unreadable manifest ({type(exc).__name__}: {exc})") from None
    if manifest.schema != SCHEMA:
        raise CorruptCheckpoint(f"{path}: schema {manifest.schema!r}, this version reads {SCHEMA}")
    for name, entry in manifest.files.items():
        file = directory / name
        if not file.is_file():
            raise CorruptCheckpoint(f"{file}: missing (listed in {MANIFEST})")
        size = file.stat().st_size
        if size != entry.size:
            raise CorruptCheckpoint(f"{file}: {size} bytes, the manifest says {entry.size}")
        if _sha256(file) != entry.sha256:
            raise CorruptCheckpoint(f"{file}: sha256 differs from the manifest's")
    return manifest


def checkpoint_dirs(root: Path) -> list[Path]:
    """The ``checkpoint_*`` directories under ``root``, oldest first.

    Names sort in write order for both namings in use: Ray Train's
    ``checkpoint_<YYYY-mm-dd_HH-MM-SS.ffffff>`` and this module's zero-padded steps.
    Hidden staging directories of interrupted writes are not candidates.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX))


def latest_valid(root: Path) -> tuple[Path, Manifest] | None:
    """The newest checkpoint under ``root`` that verifies, or ``None``; each one skipped is logged with why."""
    for directory in reversed(checkpoint_dirs(root)):
        try:
            return directory, verify(directory)
        except CorruptCheckpoint as exc:
            logger.warning("skipping checkpoint: %s", exc)
    return None


def restore_dir(latest: Path | None, run_dir: Path | None = None) -> tuple[Path, Manifest] | None:
    """The checkpoint to resume from: the newest in ``run_dir`` that verifies, else ``latest``.

    ``latest`` is the directory Ray Train hands back (``ray.train.get_checkpoint()``, None
    when it has none); ``run_dir`` holds the run's ``checkpoint_*`` directories where the
    storage is a directory this process can read. Ray Train registers a checkpoint only
    after a worker has persisted it, so a worker lost in between leaves ``run_dir`` a
    complete checkpoint newer than ``latest``; a damaged copy falls back to an older one.
    None when there is no checkpoint at all. Raises ``CorruptCheckpoint`` naming
    ``latest``'s problem when nothing verifies: silently starting again from step 0 would
    throw the run's progress away.
    """
    found = latest_valid(run_dir) if run_dir is not None else None
    if found is None:
        return None if latest is None else (Path(latest), verify(latest))
    # By name: Ray Train may spell the storage path otherwise (resolved, without ~).
    if latest is not None and found[0].name != Path(latest).name:
        age = "older" if found[0].name < Path(latest).name else "newer, unregistered"
        logger.warning("resuming from the %s checkpoint %s (step %d)", age, found[0], found[1].step)
    return found


@dataclass(frozen=True, kw_only=True)
class CheckpointStore:
    """Checkpoints under ``root`` named by step, the last ``keep`` of them kept.

    For writers that manage their own directory (Ray Train manages its own and
    keeps ``CheckpointConfig.num_to_keep``; use ``write_checkpoint`` there).
    """

    root: Path
    keep: int = 3

    def __post_init__(self) -> None:
        if self.keep < 1:
            raise ValueError(f"CheckpointStore.keep must be >= 1, got {self.keep}")

    def path(self, step: int) -> Path:
        return Path(self.root) / f"{PREFIX}{step:09d}"

    def save(self, step: int, writers: Mapping[str, FileWriter]) -> Path:
        """Write step ``step``'s checkpoint atomically, then delete all but the newest ``keep``."""
        self._remove_stale_staging()
        directory = self.path(step)
        write_checkpoint(directory, step, writers)
        # Only now, with the new one complete, may older ones go.
        for old in checkpoint_dirs(self.root)[: -self.keep]:
            shutil.rmtree(old)
        return directory

    def latest(self) -> tuple[Path, Manifest] | None:
        """The newest checkpoint that verifies (see ``latest_valid``)."""
        return latest_valid(self.root)

    def _remove_stale_staging(self) -> None:
        # One writer per store (rank 0): staging left behind was a crashed write.
        root = Path(self.root)
        for stale in root.glob(f"{_STAGING}*") if root.is_dir() else ():
            shutil.rmtree(stale, ignore_errors=True)
