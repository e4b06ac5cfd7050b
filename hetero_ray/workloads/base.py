"""The contract between a user's model and the runtime, and how a name resolves to one."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from hetero_ray.suggest import did_you_mean

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class Layered:
    """How to cut a workload's model into pipeline stages.

    ``layers(model)`` returns modules whose composition is the model:
    ``x = inputs(batch)``, then ``x = layer(x)`` for each layer, then
    ``output_loss(x, batch)`` is the mean loss. Each layer takes and returns one
    tensor, which is what crosses a stage boundary.
    """

    layers: Callable[[torch.nn.Module], Sequence[torch.nn.Module]]
    inputs: Callable[[Any], torch.Tensor]
    targets: Callable[[Any], torch.Tensor]
    output_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(kw_only=True)
class Workload:
    """What the runtime needs from a model: the module, its loss and its data.

    ``loss_fn(model, batch)`` returns the *mean* loss over the batch; the runtime
    weights it by the batch's share of the global batch. ``dataset[i]`` returns
    one sample; batches are built with ``torch.utils.data.default_collate``.
    ``flops_per_sample`` (forward + backward) drives emulated timing and the
    planner; when ``None`` the runtime counts it with torch's FLOP counter.
    ``layered`` is present when the model can be cut into pipeline stages.
    """

    model: torch.nn.Module
    loss_fn: LossFn
    dataset: Dataset
    flops_per_sample: float | None = None
    layered: Layered | None = None


class WorkloadError(ValueError):
    """A workload name that does not resolve, or a factory that returns the wrong thing."""


BUILTIN = {"gpt": "hetero_ray.workloads.gpt:build"}


def build_workload(name: str, options: Mapping[str, Any]) -> Workload:
    """Build the workload ``name`` (a built-in name or ``module:function``) with ``options``.

    The factory is called as ``function(**options)`` and must return a ``Workload``.
    """
    target = BUILTIN.get(name, name)
    if ":" not in target:
        raise WorkloadError(
            f"workload.name: unknown workload '{name}'{did_you_mean(name, BUILTIN)}; use one of {sorted(BUILTIN)} "
            "or 'module:function' returning a hetero_ray Workload"
        )
    module_name, _, attr = target.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise WorkloadError(f"workload.name: cannot load '{target}': {exc}") from exc
    try:
        workload = factory(**options)
    except (TypeError, ValueError) as exc:
        raise WorkloadError(f"workload.options: {target} rejected the options: {exc}") from exc
    if not isinstance(workload, Workload):
        raise WorkloadError(
            f"workload.name: '{target}' returned {type(workload).__name__}, expected hetero_ray.workloads.Workload"
        )
    return workload
