"""Workloads: the models the runtime trains (built-in GPT, or any ``module:function``)."""

from hetero_ray.workloads.base import Workload, WorkloadError, build_workload

__all__ = ["Workload", "WorkloadError", "build_workload"]
