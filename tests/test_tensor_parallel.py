"""Uneven tensor parallelism of a GPT block (``workloads/tensor_parallel.py``) on real gloo ranks: outputs and
gradients equal to the unsplit block's, one all-reduce per sub-block each way, shards sized by their share."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks

from hetero_ray.workloads.gpt import Block
from hetero_ray.workloads.tensor_parallel import REPLICATED, TensorParallelBlock, split_sizes

C, HEADS, B, T = 64, 8, 2, 16


def test_split_sizes_is_proportional_and_sums():
    assert split_sizes(8, [5, 3]) == [5, 3]
    assert split_sizes(8, [4, 3, 1]) == [4, 3, 1]
    assert split_sizes(256, [4, 3, 1]) == [128, 96, 32]
    assert split_sizes(10, [1, 1, 1]) == [4, 3, 3]  # the one left over goes to the lowest index of a tie
    assert split_sizes(256, [2, 1], unit=32) == [160, 96]  # 8 units of 32: 5.33 and 2.67 → 5 and 3
    for total, weights, unit in [(256, [0.37, 1.0, 2.2], 8), (7, [1, 1, 1, 1], 1), (96, [9, 1], 16)]:
        sizes = split_sizes(total, weights, unit)
        assert sum(sizes) == total and all(s % unit == 0 for s in sizes)


def test_split_sizes_gives_a_positive_weight_at_least_one_unit_and_a_zero_weight_none():
    assert split_sizes(8, [1, 0, 100]) == [1, 0, 7]
    assert split_sizes(3, [1, 1, 1e-9]) == [1, 1, 1]
    assert split_sizes(64, [100, 1], unit=16) == [48, 16]


@pytest.mark.parametrize(
    "total, weights, unit",
    [
        (8, [], 1),
        (8, [0, 0], 1),
        (8, [1, -1], 1),
        (8, [1, float("nan")], 1),
        (10, [1, 1], 4),
        (8, [1], 0),
        (2, [1] * 3, 1),
    ],
)
def test_split_sizes_rejects_bad_input_in_one_line(total, weights, unit):
    with pytest.raises(ValueError) as err:
        split_sizes(total, weights, unit)
    assert "\n" not in str(err.value)


def full_block() -> tuple[Block, torch.Tensor, torch.Tensor]:
    """The unsplit block, an input and an upstream gradient, the same in every process."""
    torch.manual_seed(0)
    block = Block(C, HEADS)
    return block, torch.randn(B, T, C), torch.randn(B, T, C)


def reference() -> dict:
    block, x, dy = full_block()
    x.requires_grad_(True)
    y = block(x)
    y.backward(dy)
    grads = {k: p.grad for k, p in block.named_parameters()}
    return {"y": y.detach(), "dx": x.grad, "grads": grads, "params": block.state_dict()}


def one_shard(rank: int, world: int, weights: list[float], mlp_unit: int) -> dict:
    """This rank's shard of the full block: a forward and backward of the full input and upstream gradient,
    the all-reduces each issued, the gradients and weights gathered into the full layout."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    block, x, dy = full_block()
    shard = TensorParallelBlock(block, None, rank, weights, mlp_unit=mlp_unit)
    calls = []
    all_reduce = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        calls.append(tuple(tensor.shape))
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        x.requires_grad_(True)
        y = shard(x)
        forward = list(calls)
        y.backward(dy)
        backward = calls[len(forward) :]
    finally:
        dist.all_reduce = all_reduce
    return {
        "y": y.detach(),
        "dx": x.grad,
        "forward": forward,
        "backward": backward,
        "grads": shard.gather(grads=True),
        "params": shard.gather(),
        "numel": sum(p.numel() for p in shard.parameters()),
        "heads": shard.n_head,
        "hidden": shard.fc_weight.shape[0],
    }


SPLITS = {"5:3": ([5, 3], 1, [5, 3], [160, 96]), "4:3:1": ([4, 3, 1], 32, [4, 3, 1], [128, 96, 32])}


@pytest.fixture(scope="module", params=SPLITS, ids=list(SPLITS))
def split(request, tmp_path_factory) -> tuple[str, list[dict]]:
    """A split's name and its ranks' results, run once for the tests of this module."""
    weights, mlp_unit, _, _ = SPLITS[request.param]
    return request.param, run_ranks(one_shard, len(weights), tmp_path_factory.mktemp("ranks"), weights, mlp_unit)


def test_uneven_split_equals_the_unsplit_block(split):
    """Heads and hidden columns split by the weights (MLP in units of 32 for 4 : 3 : 1); each rank's output
    and input gradient are the unsplit block's; every gradient gathered back into the full layout is the
    unsplit block's (1e-5, fp32); the gathered weights are the block's exactly."""
    name, out = split
    _, _, heads, hidden = SPLITS[name]
    want = reference()
    assert [r["heads"] for r in out] == heads and [r["hidden"] for r in out] == hidden
    for r in out:
        assert (r["y"] - want["y"]).abs().max() <= 1e-5
        assert (r["dx"] - want["dx"]).abs().max() <= 1e-5
        assert r["grads"].keys() == want["grads"].keys()
        for name, g in want["grads"].items():
            assert r["grads"][name].shape == g.shape, name
            assert (r["grads"][name] - g).abs().max() <= 1e-5, name
        for name, p in want["params"].items():
            assert torch.equal(r["params"][name], p), name


def test_one_all_reduce_per_sub_block_each_way_and_shards_sized_by_share(split):
    """Two full-size all-reduces forward (attention, MLP) and two backward, whatever the shard's size; each
    shard holds its share of the sharded weights plus the replicated layer norms and row-parallel biases."""
    name, out = split
    weights = SPLITS[name][0]
    block = full_block()[0]
    params = dict(block.named_parameters())
    replicated = sum(params[k].numel() for k in REPLICATED)
    sharded = sum(p.numel() for p in block.parameters()) - replicated
    for r, w in zip(out, weights):
        assert r["forward"] == [(B, T, C)] * 2 and r["backward"] == [(B, T, C)] * 2
        assert r["numel"] == sharded * w / sum(weights) + replicated
