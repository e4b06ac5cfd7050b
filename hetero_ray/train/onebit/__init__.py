"""1-bit Adam on gloo: DeepSpeed's ``OnebitAdam`` / ``ZeroOneAdam`` with a plain-torch compressed backend."""

from hetero_ray.train.onebit.deepspeed_glue import (
    gloo_compressed_backend,
    init_distributed_on_gloo,
    initialize_on_gloo,
    onebit_optimizer_name,
    validate_onebit_config,
)
from hetero_ray.train.onebit.flat import FlatParameters
from hetero_ray.train.onebit.gloo_backend import (
    GlooCompressedBackend,
    SegmentLayout,
    fused_allreduce_bytes,
    padded_numel,
    segment_layout,
)
from hetero_ray.train.onebit.mpu import DataParallelGroup, data_parallel_mpu

__all__ = [
    "DataParallelGroup",
    "FlatParameters",
    "SegmentLayout",
    "segment_layout",
    "GlooCompressedBackend",
    "data_parallel_mpu",
    "fused_allreduce_bytes",
    "gloo_compressed_backend",
    "init_distributed_on_gloo",
    "initialize_on_gloo",
    "onebit_optimizer_name",
    "padded_numel",
    "validate_onebit_config",
]
