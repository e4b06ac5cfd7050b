"""Training on a mixed cluster, shaped like Ray Train's: ``HeteroTrainer`` runs a loop per device; inside it
``get_context``, ``prepare_model`` and ``prepare_data_loader`` give each worker its device and its share."""

from hetero_ray.train.context import get_context
from hetero_ray.train.own_loop import all_reduce_mean, prepare_data_loader, prepare_model
from hetero_ray.train.trainer import HeteroTrainer

__all__ = ["HeteroTrainer", "all_reduce_mean", "get_context", "prepare_data_loader", "prepare_model"]
