"""Workloads: the models the runtime trains (built-in GPT, or any ``module:function``)."""

from hetero_ray.workloads.base import Layered, Workload, WorkloadError, build_workload

__all__ = ["Layered", "Workload", "WorkloadError", "build_workload"]
