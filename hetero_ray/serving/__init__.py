"""Inference on idle GPUs with Ray Serve: a trained checkpoint's model as a Serve application.

``serving.model`` (torch only) loads a checkpoint and answers next-token requests; ``serving.deployment`` is the
Serve deployment; ``serving.app`` deploys, scales and removes it (``deploy``, ``scale``, ``replicas``,
``free_devices``, ``shutdown``). The last two import Ray: import them once the cluster's environment is set.
"""

from hetero_ray.serving.model import ServeError, load_checkpoint_model, load_predictor

__all__ = ["ServeError", "load_checkpoint_model", "load_predictor"]
