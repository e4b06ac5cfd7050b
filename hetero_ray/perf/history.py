"""The profile history: one row per measurement, a pandas table kept as parquet on disk.

Schema (``COLUMNS``, in this order; every row one (device, workload, micro-batch,
precision) measurement):

==================  ==============  =====================================================
column              dtype           meaning
==================  ==============  =====================================================
timestamp           datetime (UTC)  when the measurement finished
host                string          hostname of the node that ran it
gpu_type            string          catalog name of the device, or ``cpu`` for a host CPU
emulated            bool            True when ``gpu_type`` is an emulated device: ``step_s``
                                    is then the type's modelled time, not a GPU measurement
workload            string          workload name (built-in name or ``module:function``)
workload_hash       string          ``options_hash`` of the workload's options
workload_options    string          the options themselves, as sorted JSON
micro_batch         int64           samples per forward+backward
precision           string          fp32 | tf32 | fp16 | bf16
step_s              float64         median seconds of one forward+backward+optimizer step
step_s_spread       float64         interquartile range of the timed repeats, seconds
repeats             int64           timed repeats behind the median (warm-up excluded)
clock               string          what ``step_s`` counts: ``wall`` (CUDA synchronised);
                                    ``thread_cpu``: the CPU time of the one thread that ran
                                    the step (a single-threaded CPU profile on a shared
                                    host, where wall time also counts other processes'
                                    time slices); ``modelled``: an emulated device's model
threads             int64           torch intra-op threads (CPU); 0 on CUDA
peak_memory_bytes   int64           peak bytes of one step (see ``memory_source``)
memory_source       string          ``cuda_max_allocated``: torch.cuda.max_memory_allocated;
                                    ``static+saved_activations``: weights, gradients and
                                    optimizer state plus the bytes autograd saved for
                                    backward (CPU and emulated devices, which have no
                                    allocator statistics)
torch_version       string          software that produced the row
ray_version         string
deepspeed_version   string          empty when DeepSpeed is not installed
python_version      string
==================  ==============  =====================================================

Appends never lose rows: the old table and the new rows are written to a temporary
file beside the history, which then replaces it (``os.replace``), under a lock file
so two appenders do not race.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import socket
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import pandas as pd

from hetero_ray.output import write_atomically

CPU = "cpu"
CUDA_MEMORY = "cuda_max_allocated"
HOST_MEMORY = "static+saved_activations"


class HistoryError(ValueError):
    """A history file or table that does not follow the schema; the message names file and column."""


def options_hash(options: Mapping[str, Any]) -> str:
    """Short stable hash of a workload's options (sorted JSON): rows of one model share it."""
    return hashlib.sha256(options_json(options).encode()).hexdigest()[:12]


def options_json(options: Mapping[str, Any]) -> str:
    """The options as sorted, compact JSON (what ``workload_options`` stores)."""
    return json.dumps(dict(options), sort_keys=True, separators=(",", ":"), default=str)


def _version(package: str) -> str:
    # Read from the installed metadata: importing DeepSpeed just for its version takes seconds.
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return ""


@dataclass(frozen=True, kw_only=True)
class Software:
    """Versions of the software a measurement ran under."""

    torch_version: str
    ray_version: str
    deepspeed_version: str
    python_version: str

    @classmethod
    def installed(cls) -> Software:
        """The versions installed in this Python environment."""
        return cls(
            torch_version=_version("torch"),
            ray_version=_version("ray"),
            deepspeed_version=_version("deepspeed"),
            python_version=platform.python_version(),
        )


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """One row of the history (see the module docstring for each field)."""

    gpu_type: str
    emulated: bool
    workload: str
    workload_hash: str
    workload_options: str
    micro_batch: int
    precision: str
    step_s: float
    step_s_spread: float
    repeats: int
    clock: str
    threads: int
    peak_memory_bytes: int
    memory_source: str
    host: str = field(default_factory=socket.gethostname)
    timestamp: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    software: Software = field(default_factory=Software.installed)

    def to_row(self) -> dict[str, Any]:
        """The row as a flat dict in the schema's column names."""
        row = asdict(self)
        return {**row.pop("software"), **row}


DTYPES: dict[str, str] = {
    "timestamp": "datetime64[ns, UTC]",
    "host": "string",
    "gpu_type": "string",
    "emulated": "bool",
    "workload": "string",
    "workload_hash": "string",
    "workload_options": "string",
    "micro_batch": "int64",
    "precision": "string",
    "step_s": "float64",
    "step_s_spread": "float64",
    "repeats": "int64",
    "clock": "string",
    "threads": "int64",
    "peak_memory_bytes": "int64",
    "memory_source": "string",
    "torch_version": "string",
    "ray_version": "string",
    "deepspeed_version": "string",
    "python_version": "string",
}
COLUMNS = tuple(DTYPES)


def empty() -> pd.DataFrame:
    """A history with no rows and the schema's columns and dtypes."""
    return pd.DataFrame({c: pd.Series(dtype=t) for c, t in DTYPES.items()})


def to_frame(measurements: Iterable[Measurement]) -> pd.DataFrame:
    """Measurements as a history table (schema columns and dtypes)."""
    rows = [m.to_row() for m in measurements]
    if not rows:
        return empty()
    return conform(pd.DataFrame(rows), "measurements")


def conform(table: pd.DataFrame, origin: str) -> pd.DataFrame:
    """``table`` with the schema's columns in order and dtypes; ``HistoryError`` naming ``origin`` if it cannot be."""
    missing = [c for c in COLUMNS if c not in table.columns]
    extra = [c for c in table.columns if c not in DTYPES]
    if missing or extra:
        what = f"missing columns {missing}" if missing else f"unknown columns {extra}"
        raise HistoryError(f"{origin}: {what}; a history has exactly {', '.join(COLUMNS)}")
    try:
        return table[list(COLUMNS)].astype(DTYPES).reset_index(drop=True)
    except (ValueError, TypeError) as exc:
        raise HistoryError(f"{origin}: a column does not convert to the schema's dtype ({exc})") from None


def load(path: str | os.PathLike[str]) -> pd.DataFrame:
    """The history at ``path``; an empty table when the file does not exist yet."""
    path = Path(path)
    if not path.exists():
        return empty()
    try:
        table = pd.read_parquet(path)
    except (OSError, ValueError) as exc:
        raise HistoryError(f"{path}: not a readable parquet history ({exc})") from None
    return conform(table, str(path))


@contextmanager
def _locked(path: Path):
    lock = path.with_name(f".{path.name}.lock")
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def append(path: str | os.PathLike[str], new: pd.DataFrame | Iterable[Measurement]) -> pd.DataFrame:
    """Add rows to the history at ``path`` (created if absent) and return the whole table.

    The old rows stay: readers see the old file or the complete new one, never half.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    added = conform(new, "new rows") if isinstance(new, pd.DataFrame) else to_frame(new)
    with _locked(path):
        old = load(path)
        table = added if old.empty else old if added.empty else pd.concat([old, added], ignore_index=True)
        write_atomically(path, lambda tmp: table.to_parquet(tmp, index=False))
    return table
