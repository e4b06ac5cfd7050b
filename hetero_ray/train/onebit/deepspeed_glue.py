"""Run DeepSpeed's ``OnebitAdam`` / ``ZeroOneAdam`` on gloo with :class:`GlooCompressedBackend`.

How DeepSpeed is hooked: both optimizers build their backend in ``__init__`` with a
function-local ``from deepspeed.runtime.comm.compressed import CompressedBackend`` when
the config says ``"comm_backend_name": "compressed"``, and call it as
``CompressedBackend(engine.mpu)``. The import reads the module attribute at construction
time, so :func:`gloo_compressed_backend` rebinds
``deepspeed.runtime.comm.compressed.CompressedBackend`` to
:meth:`GlooCompressedBackend.from_mpu` while ``deepspeed.initialize`` runs, and restores
it afterwards. Nothing of DeepSpeed is copied or subclassed; the optimizer keeps the
backend as ``optimizer.comm_backend_handle`` (its byte counters live there).

DeepSpeed behaviour worth knowing (0.19.6, ``deepspeed/runtime/fp16/onebit/``):

- **Compression errors are reset on checkpoint load.** ``load_state_dict`` of both
  optimizers pops ``worker_error`` and ``server_error`` from every parameter's state
  (``ZeroOneAdam`` also ``momentum_accumulator``): each rank's errors are its own, only
  rank 0's would be in the checkpoint, and a resume may have a different world size. The
  next step re-allocates them as zeros, so a resumed run differs slightly from an
  uninterrupted one -- the one exception to resume invariance.
- The first ``step()`` only initialises state: it calls ``compressed_allreduce`` on the
  (zero) momentum and updates no parameter. ``OnebitAdam`` then runs plain Adam (the engine
  all-reduces gradients) until ``freeze_step``, after which ``optimizer.adam_freeze_key``
  is True, the engine's ``enable_backward_allreduce`` is False and only compressed
  momentum crosses the wire. ``ZeroOneAdam`` compresses gradients on the steps where it
  does not update the variance, and after ``var_freeze_step`` (``optimizer.freeze_key``)
  compresses accumulated momentum on its local-step schedule.
- ``OnebitAdam`` freezes the variance at ``freeze_step`` and has no bias correction: with a
  very short warm-up and beta2 = 0.999 the frozen variance is ~1e-3 g^2 and the compressed
  steps are ~30x too large (a loss of 0.4 went to 60 here at lr 1e-2); use a real warm-up,
  or a smaller beta2 for toy runs.
- ``ZeroOneAdam`` keeps ranks equal only to rounding, not bit for bit: in its local steps it
  adds its own update to a parameter and subtracts it again before applying the synchronised
  one, and ``(p + u) - u`` rounds differently on each rank.
- Both average over ranks (they divide by the world size), so hetero-ray scales a rank's
  loss by ``W * local_batch / global_batch`` for them, not by ``local_batch / global_batch``.
- The engine only ``assert``s that ZeRO is off; :func:`validate_onebit_config` says it in
  one line before launch.
- On a machine without a GPU DeepSpeed picks its CPU accelerator by itself (a warning,
  "Setting accelerator to CPU"); ``DS_ACCELERATOR=cpu`` makes that explicit. Its
  communication backend is gloo unless ``oneccl_bindings_for_pytorch`` is installed, so
  no Intel extension is needed: ``deepspeed.init_distributed(dist_backend="gloo")``.
- That CPU accelerator JIT-compiles a C++/OpenMP op, ``deepspeed_shm_comm``, when
  ``init_distributed`` creates DeepSpeed's communicator: about 70 s of CPU the first time on
  a machine (then cached in ``~/.cache/torch_extensions``), and it needs a C++ compiler.
  Only inference all-reduce uses it; :func:`init_distributed_on_gloo` skips the build.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from hetero_ray.config import ConfigError
from hetero_ray.train.onebit.gloo_backend import GlooCompressedBackend

# DeepSpeed's optimizer type names (deepspeed/runtime/config.py), compared lower-cased as
# DeepSpeed does; spelled out so validating a config does not import DeepSpeed.
ONEBIT_OPTIMIZERS = {"onebitadam": "OneBitAdam", "zerooneadam": "ZeroOneAdam", "onebitlamb": "OneBitLamb"}
# DeepSpeed's name for the shared-memory all-reduce op its CPU accelerator compiles.
_SHM_OP = "deepspeed_shm_comm"


def onebit_optimizer_name(config: Mapping[str, Any]) -> str | None:
    """The 1-bit optimizer a DeepSpeed config asks for (DeepSpeed's spelling), or None for any other."""
    optimizer = config.get("optimizer") or {}
    return ONEBIT_OPTIMIZERS.get(str(optimizer.get("type", "")).lower())


def _zero_stage(config: Mapping[str, Any]) -> int:
    """ZeRO stage of a DeepSpeed config; the deprecated boolean form means stage 1 when true."""
    zero = config.get("zero_optimization") or {}
    if isinstance(zero, bool):
        return int(zero)
    return int(zero.get("stage", 0))


def validate_onebit_config(config: Mapping[str, Any], where: str = "deepspeed config") -> None:
    """Raise a one-line :class:`ConfigError` (a ValueError) if a 1-bit optimizer is combined with ZeRO > 0.

    ``where`` names the config's place in the user's input, for the message.
    """
    name = onebit_optimizer_name(config)
    stage = _zero_stage(config)
    if name is not None and stage > 0:
        raise ConfigError(
            f"{where}: optimizer.type {name} cannot run with zero_optimization.stage {stage}; "
            f"1-bit optimizers ({', '.join(ONEBIT_OPTIMIZERS.values())}) need zero_optimization.stage 0, "
            f"or choose a non-1-bit optimizer such as Adam for ZeRO"
        )


def init_distributed_on_gloo(**kwargs: Any) -> None:
    """``deepspeed.init_distributed(dist_backend="gloo", **kwargs)`` without compiling DeepSpeed's CPU shm op.

    DeepSpeed builds ``deepspeed_shm_comm`` only when its table of compatible ops says so,
    and without the op its inference all-reduce falls back to ``torch.distributed``; training
    never uses it. The table entry is cleared while the communicator is created, then restored.
    """
    import deepspeed
    import deepspeed.ops

    table = deepspeed.ops.__compatible_ops__
    original = table.get(_SHM_OP, False)
    table[_SHM_OP] = False
    try:
        deepspeed.init_distributed(dist_backend="gloo", **kwargs)
    finally:
        table[_SHM_OP] = original


@contextmanager
def gloo_compressed_backend() -> Iterator[None]:
    """While active, ``comm_backend_name: "compressed"`` builds a :class:`GlooCompressedBackend`.

    Only the optimizer's constructor looks the name up, so the context need only span
    ``deepspeed.initialize``; the optimizer keeps the backend it built.
    """
    import deepspeed.runtime.comm.compressed as compressed

    original = compressed.CompressedBackend
    compressed.CompressedBackend = GlooCompressedBackend.from_mpu
    try:
        yield
    finally:
        compressed.CompressedBackend = original


def initialize_on_gloo(*, config: Mapping[str, Any], where: str = "deepspeed config", **kwargs: Any) -> tuple:
    """``deepspeed.initialize(config=config, **kwargs)`` with 1-bit optimizers on the gloo backend.

    Validates the config first; a 1-bit optimizer must name ``comm_backend_name: "compressed"``
    (DeepSpeed's other names need cupy/NCCL, MPI or Ascend). Returns what
    ``deepspeed.initialize`` returns: ``(engine, optimizer, dataloader, lr_scheduler)``.
    """
    validate_onebit_config(config, where)
    name = onebit_optimizer_name(config)
    backend = (config["optimizer"].get("params") or {}).get("comm_backend_name", "nccl") if name else None
    if name is not None and backend != "compressed":
        raise ConfigError(
            f"{where}: optimizer.params.comm_backend_name is {backend!r} for {name}; "
            f"on gloo it must be 'compressed' (served by hetero-ray's gloo backend)"
        )
    # Imported only now: DeepSpeed takes seconds to import, and bad input should fail before that.
    import deepspeed

    with gloo_compressed_backend():
        return deepspeed.initialize(config=dict(config), **kwargs)
