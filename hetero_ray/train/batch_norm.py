"""BatchNorm over the whole global batch, however it is split across devices.

A BatchNorm layer normalises with the mean and variance of the samples in its forward pass. Under a
data-parallel split each device would use only its own share's statistics: the update and the running
statistics would depend on the split (2 : 1 normalises differently from 1 : 1). ``share_batch_norm`` swaps
each BatchNorm for ``SharedBatchNorm``, whose training forward all-reduces the sums it needs (the count,
then the centred squares) over the devices that hold samples, so every device normalises with the exact
full-batch mean and (biased) variance and updates identical running statistics. The all-reduces are
torch's differentiable functional ones, so the backward sums their gradients over the devices too: the gradient is the
full batch's. It is exact only when every device runs its whole share in one forward pass; the planner's
caller refuses micro-batches, pipelines and re-splitting for such models before launch.

``torch.nn.SyncBatchNorm`` does the same on GPUs, but refuses CPU tensors (emulated devices) and needs
CUDA-only kernels (``batch_norm_stats``); this is its arithmetic in plain tensor operations.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_reduce
from torch.nn.modules.batchnorm import _BatchNorm


class SharedBatchNorm(_BatchNorm):
    """A BatchNorm layer (of ``source``'s kind, parameters and buffers) normalising over ``group``'s samples."""

    def __init__(self, source: _BatchNorm, group: dist.ProcessGroup):
        super().__init__(source.num_features, source.eps, source.momentum, source.affine, source.track_running_stats)
        self.load_state_dict(source.state_dict())
        self.to(next(source.buffers(), next(source.parameters(), torch.empty(0))).device)
        self.train(source.training)
        self.kind, self.group = type(source), group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        self.kind._check_input_dim(self, input)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        self._check_input_dim(x)
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        # Statistics in fp32 under autocast too, as torch's batch_norm keeps them.
        xf = x.float()
        local = torch.cat([xf.sum(dims), xf.new_tensor([x.numel() // x.size(1)])])
        total = all_reduce(local, "sum", self.group)
        count = total[-1]
        mean = total[:-1] / count
        centred = xf - mean.view(shape)
        var = all_reduce((centred * centred).sum(dims), "sum", self.group) / count
        y = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats:
            self._track(mean.detach(), var.detach() * count / (count - 1))
        return y.to(x.dtype)

    @torch.no_grad()
    def _track(self, mean: torch.Tensor, unbiased_var: torch.Tensor) -> None:
        """Running statistics as ``F.batch_norm`` keeps them (a cumulative average when momentum is None)."""
        self.num_batches_tracked.add_(1)
        factor = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        self.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased_var, alpha=factor)


def share_batch_norm(model: nn.Module, group: dist.ProcessGroup) -> int:
    """Replace every BatchNorm in ``model`` by a ``SharedBatchNorm`` over ``group``, before an optimizer holds its
    parameters; the state dict keeps its keys. Returns how many were replaced."""
    replaced = 0
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, _BatchNorm) and not isinstance(child, SharedBatchNorm):
                setattr(module, child_name, SharedBatchNorm(child, group))
                replaced += 1
    return replaced
