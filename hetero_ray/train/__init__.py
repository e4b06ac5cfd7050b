"""Training on a mixed cluster, shaped like Ray Train's: ``HeteroTrainer`` runs a loop per device; inside it
``get_context``, ``prepare_model`` and ``prepare_data_loader`` give each worker its device and its share.

The names load on first use: the planner imports modules of this package (``train.precision``), and importing
the trainer with them would import the planner back.
"""

from importlib import import_module

_WHERE = {
    "HeteroTrainer": "hetero_ray.train.trainer",
    "get_context": "hetero_ray.train.context",
    "all_reduce_mean": "hetero_ray.train.own_loop",
    "prepare_data_loader": "hetero_ray.train.own_loop",
    "prepare_model": "hetero_ray.train.own_loop",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'hetero_ray.train' has no attribute {name!r}")
    return getattr(import_module(_WHERE[name]), name)
