"""A model's parameters as views into one flat fp32 parameter, so DeepSpeed's 1-bit optimizers see one tensor.

DeepSpeed's ``OnebitAdam`` / ``ZeroOneAdam`` call the backend once per parameter tensor;
on a small model those calls are latency-bound (27 tensors x 4 collectives per step on
the bench GPT). Handing DeepSpeed one flat parameter instead makes it one call per step;
the backend is told the tensors' sizes (``GlooCompressedBackend.set_segments``) so each
keeps its own scale.

The model's parameters stay leaf ``nn.Parameter``s (the model, its forward, its
``state_dict`` and ``load_state_dict`` are untouched); only their storage moves into the
flat tensor. Autograd still writes per-parameter ``.grad``; :meth:`FlatParameters.collect_grads`
copies them into the flat gradient before the optimizer steps, and the optimizer's
in-place updates of the flat tensor are the parameters' updates.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class FlatParameters(nn.Module):
    """One module, one parameter (``flat``): the concatenation of ``params``, which become views into it."""

    def __init__(self, params: Sequence[nn.Parameter]):
        super().__init__()
        self.params = list(params)
        self.numels = [p.numel() for p in self.params]
        device = self.params[0].device if self.params else torch.device("cpu")
        self.flat = nn.Parameter(torch.cat([p.detach().reshape(-1).float() for p in self.params]).to(device))
        offset = 0
        for p, n in zip(self.params, self.numels):
            # Re-pointing .data keeps p the same leaf Parameter (hooks, optimizer keys, module attribute).
            p.data = self.flat.data[offset : offset + n].view_as(p)
            offset += n

    def collect_grads(self, scale: float) -> None:
        """``flat.grad = scale *`` the concatenated parameter gradients (zero where none); clears theirs."""
        grads = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(n) for p, n in zip(self.params, self.numels)]
        self.flat.grad = torch.cat(grads).mul_(scale)
        for p in self.params:
            p.grad = None

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """A flat tensor of ``flat``'s size as per-parameter tensors of their shapes (copies)."""
        return [t.view_as(p).clone() for t, p in zip(flat.split(self.numels), self.params)]

    def join(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`split`."""
        return torch.cat([t.reshape(-1).float() for t in tensors])
