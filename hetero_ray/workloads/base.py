"""The contract between a user's model and the runtime, and how a name resolves to one."""

from __future__ import annotations

import importlib
import inspect
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


BUILTIN = {
    "gpt": "hetero_ray.workloads.gpt:build",
    "cnn": "hetero_ray.workloads.cnn:build",
    "hf-gpt2": "hetero_ray.workloads.ecosystem:gpt2",
    "hf-llama": "hetero_ray.workloads.ecosystem:llama",
    "hf-bert": "hetero_ray.workloads.ecosystem:bert",
    "resnet": "hetero_ray.workloads.ecosystem:resnet",
}


def _keywords(factory: Callable[..., Any]) -> list[str]:
    """The keyword arguments ``factory`` names, or ``[]`` when its signature cannot be read or takes ``**kwargs``."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # builtins and some C extensions have no signature
        return []
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _unknown_option(factory: Callable[..., Any], options: Mapping[str, Any]) -> str | None:
    """``"key: unknown option (did you mean …?)"`` for the first option ``factory`` does not take, else ``None``."""
    known = _keywords(factory)
    unknown = [k for k in options if known and k not in known]
    return f"{unknown[0]}: unknown option{did_you_mean(unknown[0], known)}" if unknown else None


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
    problem = _unknown_option(factory, options)
    if problem:
        raise WorkloadError(f"workload.options.{problem}; {target} takes {', '.join(_keywords(factory))}")
    try:
        workload = factory(**options)
    except (TypeError, ValueError) as exc:
        raise WorkloadError(f"workload.options: {target} rejected the options: {exc}") from exc
    if not isinstance(workload, Workload):
        raise WorkloadError(
            f"workload.name: '{target}' returned {type(workload).__name__}, expected hetero_ray.workloads.Workload"
        )
    return workload
