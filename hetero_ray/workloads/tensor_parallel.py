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
import time
from collections.abc import Callable, Mapping, Sequence

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


# Called after each all-reduce with the reduced tensor and when (``time.perf_counter``) the all-reduce began:
# where an emulated device holds it to its modelled link.
AllReduceHook = Callable[[torch.Tensor, float], None]


def _all_reduce(t: torch.Tensor, group: dist.ProcessGroup | None, hook: AllReduceHook | None) -> torch.Tensor:
    started = time.perf_counter()
    dist.all_reduce(t, group=group)
    if hook is not None:
        hook(t, started)
    return t


class _CopyToParallel(torch.autograd.Function):
    """Megatron's ``f``: the identity forward, the sum of the ranks' gradients backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None, hook: AllReduceHook | None) -> torch.Tensor:
        ctx.group, ctx.hook = group, hook
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_reduce(grad.contiguous().clone(), ctx.group, ctx.hook), None, None


class _ReduceFromParallel(torch.autograd.Function):
    """Megatron's ``g``: the sum of the ranks' partial outputs forward, the identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None, hook: AllReduceHook | None) -> torch.Tensor:
        return _all_reduce(x.contiguous().clone(), group, hook)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


def copy_to_parallel(
    x: torch.Tensor, group: dist.ProcessGroup | None, hook: AllReduceHook | None = None
) -> torch.Tensor:
    return _CopyToParallel.apply(x, group, hook)


def reduce_from_parallel(
    x: torch.Tensor, group: dist.ProcessGroup | None, hook: AllReduceHook | None = None
) -> torch.Tensor:
    return _ReduceFromParallel.apply(x, group, hook)


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach().clone())


class TensorParallelBlock(nn.Module):
    """This rank's shard of a GPT ``Block`` over ``group``, cut from the full block's weights (every rank starts
    from the same full block): heads and MLP hidden columns in proportion to ``weights`` (one per rank of the
    group), the hidden columns in multiples of ``mlp_unit``. Layer norms and row-parallel biases replicated.
    ``hook``: called after each of its all-reduces (``AllReduceHook``)."""

    def __init__(
        self,
        block: Block,
        group: dist.ProcessGroup | None,
        rank_in_group: int,
        weights: Sequence[float],
        mlp_unit: int = 1,
        hook: AllReduceHook | None = None,
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
        self.group, self.rank, self.head_size, self.hook = group, rank_in_group, C // n_head, hook
        self.head_sizes = split_sizes(n_head, weights)
        self.hidden_sizes = split_sizes(hidden, weights, mlp_unit)
        h0, h1 = _ranges(self.head_sizes)[rank_in_group]
        self.n_head = h1 - h0
        self._cols = slice(h0 * self.head_size, h1 * self.head_size)  # this rank's heads' channels in q, k and v
        self._hidden = slice(*_ranges(self.hidden_sizes)[rank_in_group])
        mine = {k: _param(t) for k, t in self.cut(block.state_dict()).items()}
        self.ln1 = nn.LayerNorm(C)
        self.ln1.weight, self.ln1.bias = mine["ln1.weight"], mine["ln1.bias"]
        self.qkv_weight = mine["qkv.weight"]  # (3 · heads · hs, C)
        self.proj_weight = mine["proj.weight"]  # (C, heads · hs)
        self.proj_bias = mine["proj.bias"]
        self.ln2 = nn.LayerNorm(C)
        self.ln2.weight, self.ln2.bias = mine["ln2.weight"], mine["ln2.bias"]
        self.fc_weight = mine["mlp.0.weight"]  # (hidden share, C)
        self.fc_bias = mine["mlp.0.bias"]
        self.out_weight = mine["mlp.2.weight"]  # (C, hidden share)
        self.out_bias = mine["mlp.2.bias"]

    def cut(self, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's part of each tensor of ``full`` (named as the full block's: its weights, or anything laid
        out like them, such as Adam's moments): q, k and v rows of its heads, their columns of ``proj``, its
        hidden rows of ``mlp.0`` and columns of ``mlp.2``; the replicated tensors whole."""
        cols, hidden = self._cols, self._hidden
        pieces = {
            "qkv.weight": lambda w: torch.cat([third[cols] for third in w.unflatten(0, (3, -1))]),
            "proj.weight": lambda w: w[:, cols],
            "mlp.0.weight": lambda w: w[hidden],
            "mlp.0.bias": lambda w: w[hidden],
            "mlp.2.weight": lambda w: w[:, hidden],
        }
        return {k: pieces[k](t) if k in pieces else t for k, t in full.items()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = copy_to_parallel(self.ln1(x), self.group, self.hook)
        q, k, v = F.linear(h, self.qkv_weight).split(self.n_head * self.head_size, dim=2)
        q, k, v = (t.view(B, T, self.n_head, self.head_size).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        x = x + reduce_from_parallel(F.linear(y, self.proj_weight), self.group, self.hook) + self.proj_bias
        h = copy_to_parallel(self.ln2(x), self.group, self.hook)
        m = F.gelu(F.linear(h, self.fc_weight, self.fc_bias))
        return x + reduce_from_parallel(F.linear(m, self.out_weight), self.group, self.hook) + self.out_bias

    def by_full_name(self) -> dict[str, nn.Parameter]:
        """This shard's parameters by the name of the full block's tensor each is cut from, in the order of the
        full block's ``parameters()``."""
        return {
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

    def split_parameters(self) -> list[nn.Parameter]:
        """The parameters cut from the block (the rest, in ``REPLICATED``, every member holds whole)."""
        return [p for k, p in self.by_full_name().items() if k not in REPLICATED]

    def local_state(self, grads: bool = False) -> dict[str, torch.Tensor | None]:
        """This shard's tensors (or their gradients) by the name of the full block's tensor each is cut from."""
        pick = (lambda p: None if p.grad is None else p.grad.detach()) if grads else (lambda p: p.detach())
        return {k: pick(p) for k, p in self.by_full_name().items()}

    def gather(self, grads: bool = False) -> dict[str, torch.Tensor | None]:
        """The full block's state dict (or its gradients, keyed the same) on every rank of the group: each
        rank's shard sent to all (``all_gather_object``, on the CPU), then laid out as the unsplit block's."""
        mine = {k: None if t is None else t.cpu() for k, t in self.local_state(grads).items()}
        shards: list = [None] * len(self.head_sizes)
        # The group orders its ranks by global rank, which need not be the members' order.
        dist.all_gather_object(shards, (self.rank, mine), group=self.group)
        return assemble([shard for _, shard in sorted(shards, key=lambda x: x[0])])


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
