"""Workload footprint measured on the meta device: parameters, saved activations, FLOPs."""

from __future__ import annotations

import resource

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from hetero_ray.perf.footprint import measure_footprint
from hetero_ray.workloads import Workload, build_workload


def mse(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def linear_workload(flops_per_sample: float | None = None) -> Workload:
    """y ≈ W x with W of shape (4, 8), no bias."""
    data = TensorDataset(torch.randn(16, 8), torch.randn(16, 4))
    return Workload(model=nn.Linear(8, 4, bias=False), loss_fn=mse, dataset=data, flops_per_sample=flops_per_sample)


def two_layer_workload() -> Workload:
    """8 → 4 → 2, no biases: the second layer's input needs a gradient, the first's does not."""
    model = nn.Sequential(nn.Linear(8, 4, bias=False), nn.Linear(4, 2, bias=False))
    return Workload(model=model, loss_fn=mse, dataset=TensorDataset(torch.randn(16, 8), torch.randn(16, 2)))


def test_linear_mse_footprint() -> None:
    fp = measure_footprint(linear_workload)
    assert fp.param_count == 32
    # Saved for backward, per sample in fp32: the input x (8 floats, for the weight's gradient)
    # and MSE's input and target (4 floats each); the weight is a parameter, not an activation.
    assert fp.activation_bytes_per_sample == (8 + 4 + 4) * 4
    # FlopCounterMode counts matmuls only: forward 2·8·4 and the weight gradient 2·8·4; x needs
    # no gradient, so no grad-input matmul runs.
    assert fp.flops_per_sample == 2 * 8 * 4 + 2 * 8 * 4
    assert fp.static_bytes == 32 * 16


def test_grad_input_is_counted_where_it_is_needed() -> None:
    fp = measure_footprint(two_layer_workload, probe_batch=8)
    assert fp.param_count == 8 * 4 + 4 * 2
    # Forward 2·8·4 + 2·4·2; backward: layer 2 weight and input grads 2·4·2 each, layer 1 weight grad 2·8·4.
    assert fp.flops_per_sample == (64 + 16) + (16 + 16 + 64)
    # x (8 floats), the hidden h (4, saved by layer 2), MSE's input and target (2 each).
    assert fp.activation_bytes_per_sample == (8 + 4 + 2 + 2) * 4


def test_declared_flops_override_the_counter() -> None:
    fp = measure_footprint(lambda: linear_workload(flops_per_sample=1234.0))
    assert fp.flops_per_sample == 1234.0


def test_huge_gpt_is_sized_without_allocating() -> None:
    L, C, T, V = 48, 8192, 2048, 256
    peak_rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fp = measure_footprint(lambda: build_workload("gpt", {"n_layer": L, "n_embd": C, "n_head": 64, "block_size": T}))
    # Its fp32 weights alone are 155 GB; the process's peak memory grew by less than 1 GiB.
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_rss_kib < 2**20
    # Per block: LayerNorms 2·2C, qkv 3C² (no bias), proj C²+C, MLP 4C²+4C + 4C²+C → 12C² + 10C.
    # Plus token and position embeddings V·C and T·C, final LayerNorm 2C, head V·C (no bias).
    assert fp.param_count == L * (12 * C * C + 10 * C) + V * C + T * C + 2 * C + V * C == 38_679_625_728
    # Linear weights: 6 FLOPs per weight per token (forward, grad input, grad weight); attention:
    # QKᵀ and AV at 2·T²·C each forward (the counter does not discount the causal mask), ×3 with backward.
    linear_weights = L * 12 * C * C + V * C
    assert fp.flops_per_sample == 6 * linear_weights * T + L * 3 * 4 * T * T * C
    # Each block saves at least the fp32 inputs of its four Linears: C, C, C and 4C floats per token.
    assert fp.activation_bytes_per_sample >= L * T * 7 * C * 4


def test_what_a_tensor_parallel_split_divides_is_measured_per_block() -> None:
    """A GPT block's split part: every FLOP (all are in its split matrices), every parameter but the layer
    norms and row-parallel biases (6 C), and the activations the member of a 2-way split does not save;
    a member at degree 2 or 4 holds its share of those. Embedding and head cannot be split."""
    C, T = 64, 32
    fp = measure_footprint(lambda: build_workload("gpt", {"n_layer": 2, "n_head": 4, "n_embd": C, "block_size": T}))
    embed, block, _, head = fp.layers
    assert not embed.splittable and not head.splittable
    assert block.tp_params == block.params - 6 * C
    assert block.tp_flops_per_sample == block.flops_per_sample > 0
    # Four (T, C) fp32 tensors stay whole (the residual stream and both layer norms' outputs, once each),
    # a little more for the layer norms' statistics; the rest is split.
    whole = block.activation_bytes_per_sample - block.tp_activation_bytes_per_sample
    assert 4 * T * C * 4 <= whole < 5 * T * C * 4
    for degree in (2, 4):
        member = block.shard(degree)
        assert member.params == 6 * C + block.tp_params / degree
        assert member.flops_per_sample == block.flops_per_sample / degree
        assert member.output_bytes_per_sample == block.output_bytes_per_sample
    assert block.shard(1) == block and embed.shard(4) == embed
    # An uneven member (5 of 8) holds its weight's share of the split part, the rest whole.
    member = block.part(5 / 8)
    assert member.flops_per_sample == block.flops_per_sample * 5 / 8
    assert member.params == round(6 * C + block.tp_params * 5 / 8)
