"""What one sample of a workload costs: FLOPs, activation bytes, parameter bytes.

Measured, not guessed: the workload runs one forward and backward on PyTorch's
``meta`` device, so even a model far larger than this machine's memory is
sized in milliseconds without allocating it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from unittest import mock

import torch
from torch.utils._pytree import tree_map
from torch.utils.data import default_collate
from torch.utils.flop_counter import FlopCounterMode

from hetero_ray.workloads.base import Workload, WorkloadError
from hetero_ray.workloads.gpt import Block
from hetero_ray.workloads.tensor_parallel import TensorParallelBlock

# Adam keeps two fp32 moments per parameter.
OPTIMIZER_STATE_BYTES_PER_PARAM = 8
# Weights and gradients in fp32, plus Adam's moments.
STATIC_BYTES_PER_PARAM = 4 + 4 + OPTIMIZER_STATE_BYTES_PER_PARAM


@dataclass(frozen=True, kw_only=True)
class LayerCost:
    """Per-sample costs of one pipeline layer (``Workload.layered``) at fp32.

    ``flops_per_sample`` is forward + backward (the last layer includes the loss);
    ``output_bytes_per_sample`` is what crosses a stage boundary after this layer,
    forward as activations and backward as their gradient.
    """

    params: int
    flops_per_sample: float
    activation_bytes_per_sample: float
    output_bytes_per_sample: float
    # What a tensor-parallel split divides among its members (0: the layer cannot be split): a GPT block's
    # head and MLP-column parameters, the FLOPs and saved activations of their matrices.
    tp_params: int = 0
    tp_flops_per_sample: float = 0.0
    tp_activation_bytes_per_sample: float = 0.0

    @property
    def splittable(self) -> bool:
        return self.tp_params > 0

    def shard(self, degree: int) -> LayerCost:
        """One member's costs when ``degree`` devices split the layer evenly (the layer itself at degree 1)."""
        return self.part(1 / degree)

    def part(self, held: float) -> LayerCost:
        """One member's costs when it holds ``held`` of the layer's split matrices (an uneven split gives each
        member its weight's share); what the split leaves whole, every member computes and holds whole."""
        if held == 1 or not self.splittable:
            return self
        cut = 1 - held
        return replace(
            self,
            params=round(self.params - self.tp_params * cut),
            flops_per_sample=self.flops_per_sample - self.tp_flops_per_sample * cut,
            activation_bytes_per_sample=self.activation_bytes_per_sample - self.tp_activation_bytes_per_sample * cut,
        )


@dataclass(frozen=True, kw_only=True)
class Footprint:
    """Per-sample costs of a workload at fp32, measured at ``probe_batch`` samples."""

    param_count: int
    dataset_samples: int
    flops_per_sample: float
    activation_bytes_per_sample: float
    # Sizes of the parameter tensors: 1-bit compression works tensor by tensor.
    param_numels: tuple[int, ...] = ()
    # Empty when the workload cannot be cut into pipeline stages.
    layers: tuple[LayerCost, ...] = ()
    # Layers whose forward mixes the samples of a batch, as "name (Class)": BatchNorm's statistics.
    batch_coupled: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, data: dict) -> Footprint:
        """Inverse of ``dataclasses.asdict`` (how a footprint travels to Ray workers)."""
        return cls(
            **{
                **data,
                "param_numels": tuple(data.get("param_numels", ())),
                "layers": tuple(LayerCost(**c) for c in data.get("layers", ())),
                "batch_coupled": tuple(data.get("batch_coupled", ())),
            }
        )

    @property
    def static_bytes(self) -> int:
        """Weights, gradients and Adam moments, all fp32."""
        return self.param_count * STATIC_BYTES_PER_PARAM

    def batch_problem(self, global_batch: int) -> str | None:
        """Why ``global_batch`` cannot be drawn from the dataset (a step would repeat samples), or ``None``."""
        if global_batch > self.dataset_samples:
            return (
                f"{global_batch} is more than the workload's {self.dataset_samples} samples; "
                "use a smaller batch or more data"
            )
        return None

    def memory_bytes(self, micro_batch: int, activation_scale: float = 1.0) -> float:
        """Peak bytes on one device that runs ``micro_batch`` samples per forward pass."""
        return self.static_bytes + micro_batch * self.activation_bytes_per_sample * activation_scale


def saved_activation_bytes(params: set[int]) -> tuple[dict[int, int], Callable]:
    """A ``saved_tensors_hooks`` pack hook that records bytes of tensors saved for backward.

    Storages are counted once (views share them); parameters are not activations.
    Returns the dict it fills (storage key → bytes) and the hook.
    """
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in params:
            seen[key] = storage.nbytes()
        return t

    return seen, pack


def _run_once(workload: Workload, batch, model: torch.nn.Module) -> tuple[float, int]:
    result = _measure(lambda: workload.loss_fn(model, batch), {p.untyped_storage()._cdata for p in model.parameters()})
    model.zero_grad(set_to_none=True)
    return result


def _measure(run: Callable[[], torch.Tensor], params: set[int]) -> tuple[float, int]:
    """FLOPs and saved-activation bytes of ``run()`` and the backward of what it returns."""
    seen, pack = saved_activation_bytes(params)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), FlopCounterMode(display=False) as counter:
        run().backward()
    return float(counter.get_total_flops()), sum(seen.values())


def layer_costs(workload: Workload, batch, probe_batch: int) -> tuple[LayerCost, ...]:
    """Each layer measured alone on the meta device, fed what the previous layer outputs."""
    layered = workload.layered
    x = layered.inputs(batch)
    layers = list(layered.layers(workload.model))
    costs = []
    for i, layer in enumerate(layers):
        params = {p.untyped_storage()._cdata for p in layer.parameters()}
        x_in = x.detach().requires_grad_(x.is_floating_point())
        out: list[torch.Tensor] = []
        last = i == len(layers) - 1

        def run(layer=layer, x_in=x_in, last=last, out=out):
            out.append(layer(x_in))
            return layered.output_loss(out[0], layered.targets(batch)) if last else out[0].sum()

        flops, act = _measure(run, params)
        cost = LayerCost(
            params=sum(p.numel() for p in layer.parameters()),
            flops_per_sample=flops / probe_batch,
            activation_bytes_per_sample=act / probe_batch,
            output_bytes_per_sample=out[0].numel() * out[0].element_size() / probe_batch,
        )
        costs.append(with_split_costs(cost, layer, x_in, probe_batch))
        x = out[0]
    workload.model.zero_grad(set_to_none=True)
    return tuple(costs)


def with_split_costs(cost: LayerCost, layer: torch.nn.Module, x_in: torch.Tensor, probe_batch: int) -> LayerCost:
    """``cost`` with what a tensor-parallel split divides, for a layer the runtime can split (a GPT ``Block`` of
    two heads or more): twice what one member of an even two-way split saves, measured on that member."""
    if not isinstance(layer, Block) or layer.n_head < 2:
        return cost
    with torch.device("meta"):
        member = TensorParallelBlock(layer, None, 0, (1.0, 1.0))
    params = {p.untyped_storage()._cdata for p in member.parameters()}
    # The member alone, its all-reduces left out: on the meta device they would move nothing anyway, and
    # they save no tensors and count no FLOPs.
    with mock.patch.object(torch.distributed, "all_reduce", lambda *args, **kwargs: None):
        flops, act = _measure(lambda: member(x_in).sum(), params)
    own = sum(p.numel() for p in member.parameters())
    return replace(
        cost,
        tp_params=2 * (cost.params - own),
        tp_flops_per_sample=2 * (cost.flops_per_sample - flops / probe_batch),
        tp_activation_bytes_per_sample=2 * (cost.activation_bytes_per_sample - act / probe_batch),
    )


def measure_footprint(factory: Callable[[], Workload], probe_batch: int = 4) -> Footprint:
    """Size a workload on the meta device: the factory is called under ``torch.device("meta")``."""
    with torch.device("meta"):
        workload = factory()
    if len(workload.dataset) < probe_batch:
        raise WorkloadError(
            f"workload: the dataset has {len(workload.dataset)} samples; at least {probe_batch} are needed"
        )
    batch = tree_map(
        lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t,
        default_collate([workload.dataset[i] for i in range(probe_batch)]),
    )
    flops, act_bytes = _run_once(workload, batch, workload.model)
    return Footprint(
        param_count=sum(p.numel() for p in workload.model.parameters()),
        param_numels=tuple(p.numel() for p in workload.model.parameters()),
        dataset_samples=len(workload.dataset),
        flops_per_sample=workload.flops_per_sample or flops / probe_batch,
        activation_bytes_per_sample=act_bytes / probe_batch,
        layers=layer_costs(workload, batch, probe_batch) if workload.layered else (),
        batch_coupled=batch_coupled_layers(workload.model),
    )


def batch_coupled_layers(model: torch.nn.Module) -> tuple[str, ...]:
    """The layers whose training forward normalises over the batch (every kind of BatchNorm), as
    ``"name (Class)"``: under a data-parallel split each device would see only its own samples."""
    return tuple(
        f"{name} ({type(m).__name__})"
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
    )


def cpu_seconds_per_sample(workload: Workload, micro_batch: int, repeats: int = 3) -> float:
    """Median wall time of one forward+backward per sample on this CPU, single-threaded."""
    batch = default_collate([workload.dataset[i] for i in range(micro_batch)])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            workload.loss_fn(workload.model, batch).backward()
            times.append(time.perf_counter() - start)
        workload.model.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(threads)
    return sorted(times[1:])[repeats // 2] / micro_batch
