"""Result files as every command writes them: whole or not at all, with the user's normal permissions,
and an existing file replaced only when asked (``--force``).

Below every other module (it imports nothing of hetero-ray): the CLI, the planner's
commands, the profile history and the sweeps all write through it.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


class OutputError(ValueError):
    """An output path that cannot be written as asked; the message is one line naming the path and the fix."""


def check_output(path: str | os.PathLike[str], *, force: bool, option: str = "--output") -> Path:
    """``path`` if a result may be written there; checked before the work, so a long run never ends unwritable."""
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"{option}: {path} is a directory; name a file in it, e.g. {path / 'result.json'}")
    if path.exists() and not force:
        raise OutputError(f"{option}: {path} exists; pass --force to replace it, or name another path")
    for parent in (path.parent, *path.parent.parents):
        if parent.exists():
            if not parent.is_dir():
                raise OutputError(f"{option}: {parent} is a file, so {path} cannot be created; name another path")
            break
    return path


def _umask() -> int:
    # os.umask can only be read by setting it; set it straight back.
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` into a temporary file beside ``path``, then rename it over ``path``: readers see the old
    file or the whole new one. The file gets the mode a plain ``open`` would give (0666 less the umask), not
    mkstemp's 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # The file's own suffix, for writers that infer a format from it (pandas, matplotlib).
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: str | os.PathLike[str], data: Any, *, force: bool = False) -> None:
    """``data`` as indented JSON at ``path`` (see ``check_output`` and ``write_atomically``)."""
    path = check_output(path, force=force)
    write_atomically(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2)))


def report_json(path: str | os.PathLike[str], data: Any) -> None:
    """A benchmark's figures: printed as JSON on stdout and written to ``path``, replacing the last measurement."""
    print(json.dumps(data, indent=2))
    write_json(path, data, force=True)


def write_json_uri(uri: str, name: str, data: Any) -> str:
    """Write ``data`` as JSON to ``name`` in the folder ``uri`` (a URI pyarrow's filesystems read, query
    included, e.g. ``s3://bucket/runs/run?endpoint_override=…``); the path written."""
    import pyarrow.fs

    fs, folder = pyarrow.fs.FileSystem.from_uri(uri)
    path = f"{folder.rstrip('/')}/{name}"
    with fs.open_output_stream(path) as out:
        out.write(json.dumps(data, indent=2).encode() + b"\n")
    return path
