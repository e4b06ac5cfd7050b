"""Tensor parallelism of a GPT block over devices of different speeds: Megatron's column-then-row scheme with
shards sized in proportion to each device's weight, exact against the unsplit block.

Each sub-block (attention, MLP) is a column-parallel linear layer followed by a row-parallel one:

    attention:  x ─ ln1 ─ f ─ qkv (this rank's heads' q, k, v rows) ─ SDPA ─ proj (their columns) ─ g ─ +bias ─ +x
    MLP:        x ─ ln2 ─ f ─ mlp[0] (its hidden rows, with bias) ─ GELU ─ mlp[2] (their columns) ─ g ─ +bias ─ +x

``f`` is the identity forward and an all-reduce backward; ``g`` an all-reduce forward and the identity
backward: one all-reduce per sub-block forward and one backward. Every all-reduced tensor is full-size
(B, T, C) on every rank whatever its share of heads or columns, so a plain SUM ``all_reduce`` serves uneven
shards as it does even ones.

Gradients are exact on every rank without further communication:
- the input and output of the block are replicated: every rank gets the same full upstream gradient, ``g``
  passes it unchanged to each rank's partial product, and the residual passes it to the input;
- each rank's shard gradients are the slices of the unsplit block's, since its rows/columns see the full
  input (column-parallel) or the full upstream gradient (row-parallel);
- ``f``'s backward sums the ranks' partial input gradients of the column-parallel layer, so the layer norm
  before it sees the full gradient and computes, on every rank, the full (identical) layer-norm gradient;
- the row-parallel biases are added once, after ``g``'s all-reduce, on every rank: replicated parameters
  whose gradient (the sum of the full upstream gradient) is the same full one on every rank.
So the replicated parameters (layer norms, row-parallel biases) need no gradient sum inside the group, and
summing them there would count them ``ranks`` times. Across data-parallel replicas they are summed as usual.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hetero_ray.workloads.gpt import Block

REPLICATED = ("ln1.weight", "ln1.bias", "proj.bias", "ln2.weight", "ln2.bias", "mlp.2.bias")


def split_sizes(total: int, weights: Sequence[float], unit: int = 1) -> list[int]:
    """``total`` cut into integer sizes proportional to ``weights``, each a multiple of ``unit``, summing to
    ``total``, each at least ``unit`` when its weight is positive (largest-remainder rounding, in units)."""
    weights = [float(w) for w in weights]
    if unit < 1 or total < 0 or total % unit:
        raise ValueError(f"total ({total}) must be a non-negative multiple of unit ({unit}, at least 1)")
    if not weights or any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights must be finite, non-negative and not all zero, got {weights}")
    units, live = total // unit, [i for i, w in enumerate(weights) if w > 0]
    if units < len(live):
        raise ValueError(f"{units} units of {unit} cannot give each of {len(live)} positive weights one")
    exact = [units * w / sum(weights) for w in weights]
    counts = [math.floor(e) for e in exact]
    by_remainder = sorted(live, key=lambda i: (counts[i] - exact[i], i))  # largest remainder, then lowest index
    for i in by_remainder[: units - sum(counts)]:
        counts[i] += 1
    for i in live:  # a positive weight rounded to nothing takes a unit from the most over-served size
        if counts[i] == 0:
            j = max((j for j in live if counts[j] > 1), key=lambda j: (counts[j] - exact[j], -j))
            counts[i], counts[j] = 1, counts[j] - 1
    return [c * unit for c in counts]


def _ranges(sizes: Sequence[int]) -> list[tuple[int, int]]:
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(s, s + n) for s, n in zip(starts, sizes)]


class _CopyToParallel(torch.autograd.Function):
    """Megatron's ``f``: the identity forward, the sum of the ranks' gradients backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromParallel(torch.autograd.Function):
    """Megatron's ``g``: the sum of the ranks' partial outputs forward, the identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_parallel(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return _CopyToParallel.apply(x, group)


def reduce_from_parallel(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return _ReduceFromParallel.apply(x, group)


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach().clone())


class TensorParallelBlock(nn.Module):
    """This rank's shard of a GPT ``Block`` over ``group``, cut from the full block's weights (every rank starts
    from the same full block): heads and MLP hidden columns in proportion to ``weights`` (one per rank of the
    group), the hidden columns in multiples of ``mlp_unit``. Layer norms and row-parallel biases replicated."""

    def __init__(
        self,
        block: Block,
        group: dist.ProcessGroup | None,
        rank_in_group: int,
        weights: Sequence[float],
        mlp_unit: int = 1,
    ):
        super().__init__()
        C, n_head = block.qkv.in_features, block.n_head
        hidden = block.mlp[0].out_features
        if not 0 <= rank_in_group < len(weights):
            raise ValueError(f"rank_in_group ({rank_in_group}) is not one of the {len(weights)} weighted ranks")
        if dist.is_initialized() and dist.get_world_size(group) != len(weights):
            raise ValueError(
                f"{len(weights)} weights for a group of {dist.get_world_size(group)} ranks: give one weight per rank"
            )
        self.group, self.rank, self.head_size = group, rank_in_group, C // n_head
        self.head_sizes = split_sizes(n_head, weights)
        self.hidden_sizes = split_sizes(hidden, weights, mlp_unit)
        h0, h1 = _ranges(self.head_sizes)[rank_in_group]
        m0, m1 = _ranges(self.hidden_sizes)[rank_in_group]
        self.n_head = h1 - h0
        cols = slice(h0 * self.head_size, h1 * self.head_size)  # this rank's heads' channels in q, k and v
        w = block.qkv.weight  # (3C, C): q rows, then k rows, then v rows
        self.ln1 = nn.LayerNorm(C)
        self.ln1.load_state_dict(block.ln1.state_dict())
        self.qkv_weight = _param(torch.cat([w[cols], w[C:][cols], w[2 * C :][cols]]))  # (3 · heads · hs, C)
        self.proj_weight = _param(block.proj.weight[:, cols])  # (C, heads · hs)
        self.proj_bias = _param(block.proj.bias)
        self.ln2 = nn.LayerNorm(C)
        self.ln2.load_state_dict(block.ln2.state_dict())
        self.fc_weight = _param(block.mlp[0].weight[m0:m1])  # (hidden share, C)
        self.fc_bias = _param(block.mlp[0].bias[m0:m1])
        self.out_weight = _param(block.mlp[2].weight[:, m0:m1])  # (C, hidden share)
        self.out_bias = _param(block.mlp[2].bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = copy_to_parallel(self.ln1(x), self.group)
        q, k, v = F.linear(h, self.qkv_weight).split(self.n_head * self.head_size, dim=2)
        q, k, v = (t.view(B, T, self.n_head, self.head_size).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        x = x + reduce_from_parallel(F.linear(y, self.proj_weight), self.group) + self.proj_bias
        h = copy_to_parallel(self.ln2(x), self.group)
        m = F.gelu(F.linear(h, self.fc_weight, self.fc_bias))
        return x + reduce_from_parallel(F.linear(m, self.out_weight), self.group) + self.out_bias

    def local_state(self, grads: bool = False) -> dict[str, torch.Tensor | None]:
        """This shard's tensors (or their gradients) by the name of the full block's tensor each is cut from."""
        pick = (lambda p: None if p.grad is None else p.grad.detach()) if grads else (lambda p: p.detach())
        named = {
            "ln1.weight": self.ln1.weight,
            "ln1.bias": self.ln1.bias,
            "qkv.weight": self.qkv_weight,
            "proj.weight": self.proj_weight,
            "proj.bias": self.proj_bias,
            "ln2.weight": self.ln2.weight,
            "ln2.bias": self.ln2.bias,
            "mlp.0.weight": self.fc_weight,
            "mlp.0.bias": self.fc_bias,
            "mlp.2.weight": self.out_weight,
            "mlp.2.bias": self.out_bias,
        }
        return {k: pick(p) for k, p in named.items()}

    def gather(self, grads: bool = False) -> dict[str, torch.Tensor | None]:
        """The full block's state dict (or its gradients, keyed the same) on every rank of the group: each
        rank's shard sent to all (``all_gather_object``, on the CPU), then laid out as the unsplit block's."""
        mine = {k: None if t is None else t.cpu() for k, t in self.local_state(grads).items()}
        shards: list = [None] * len(self.head_sizes)
        dist.all_gather_object(shards, mine, group=self.group)
        return assemble(shards)


def assemble(shards: Sequence[dict[str, torch.Tensor | None]]) -> dict[str, torch.Tensor | None]:
    """The unsplit block's state dict from its shards' ``local_state`` in rank order: replicated tensors from
    the first shard; q, k and v rows of each shard's heads put back in their thirds of ``qkv.weight``."""
    full: dict[str, torch.Tensor | None] = {k: shards[0][k] for k in REPLICATED}
    if any(s["qkv.weight"] is None for s in shards):  # no gradient yet (before a backward)
        return full | dict.fromkeys(("qkv.weight", "proj.weight", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight"))
    thirds = [s["qkv.weight"].unflatten(0, (3, -1)) for s in shards]  # each (3, heads · hs, C): q, k, v
    full["qkv.weight"] = torch.cat(thirds, dim=1).flatten(0, 1)
    full["proj.weight"] = torch.cat([s["proj.weight"] for s in shards], dim=1)
    full["mlp.0.weight"] = torch.cat([s["mlp.0.weight"] for s in shards])
    full["mlp.0.bias"] = torch.cat([s["mlp.0.bias"] for s in shards])
    full["mlp.2.weight"] = torch.cat([s["mlp.2.weight"] for s in shards], dim=1)
    return full
