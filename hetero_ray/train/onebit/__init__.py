"""1-bit Adam on gloo: DeepSpeed's ``OnebitAdam`` / ``ZeroOneAdam`` with a plain-torch compressed backend."""

from hetero_ray.train.onebit.deepspeed_glue import (
    gloo_compressed_backend,
    init_distributed_on_gloo,
    initialize_on_gloo,
    onebit_optimizer_name,
    validate_onebit_config,
)
from hetero_ray.train.onebit.gloo_backend import GlooCompressedBackend, padded_numel

__all__ = [
    "GlooCompressedBackend",
    "gloo_compressed_backend",
    "init_distributed_on_gloo",
    "initialize_on_gloo",
    "onebit_optimizer_name",
    "padded_numel",
    "validate_onebit_config",
]
