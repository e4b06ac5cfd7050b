"""1-bit compressed all-reduce on gloo: exact against a reference, bytes, weighting, DeepSpeed end to end.

Multi-rank parts run in processes started with ``torch.multiprocessing.spawn`` on gloo
over loopback; each rank saves what it saw to a file that the test reads back. To keep
the file fast on two cores, each world size is spawned once per module (every scenario
runs in that one spawn) and DeepSpeed once for both optimizers.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import run_ranks

from hetero_ray.config import ConfigError
from hetero_ray.train.onebit import (
    GlooCompressedBackend,
    fused_allreduce_bytes,
    init_distributed_on_gloo,
    initialize_on_gloo,
    padded_numel,
    validate_onebit_config,
)

# Not divisible by 8 x world, divisible, and 3-d with padding: shapes as an optimizer passes them.
SHAPES = [(37,), (8, 16), (3, 5, 7)]
STEPS = 4
# Numels for the byte count: large (the ratio that matters) and tiny (scales dominate).
BYTES_NUMELS = [2**20, 37]
# Local batch per rank, uneven on purpose.
SHARES = {2: [2, 1], 4: [3, 1, 1, 2]}
HETERO_NUMEL = 256  # a multiple of 8 x W x lcm(W, 8) for W = 2 and 4: no padding, so no padding zeros
# Tensors fused into one buffer (190 elements, padded to 192): sizes not divisible by 8 x W,
# segments crossing server chunks, a 1-element tensor, and an empty one (it holds no segment).
SEGMENTS = (37, 5, 0, 128, 19, 1)
HETERO_SEGMENTS = (100, 56, 100)
LOSSY_STEPS = 30


def error_buffers(numel: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker and server error buffers sized as DeepSpeed's 1-bit optimizers size them."""
    padded = padded_numel(numel, world)
    return torch.zeros(padded), torch.zeros(padded // world)


# ---------------------------------------------------------------- reference, single process


def one_bit(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, float signs) of 1-bit compression; zero counts as +1."""
    return torch.linalg.norm(v) / math.sqrt(v.numel()), torch.where(v >= 0, 1.0, -1.0)


def reference_allreduce(
    inputs: list[torch.Tensor], worker_errors: list[torch.Tensor], server_errors: list[torch.Tensor]
) -> torch.Tensor:
    """One compressed all-reduce over every rank's input, without packing; updates the error lists.

    Rank r compresses its zero-padded input plus its worker error; the decompressed messages
    are averaged; rank r's server compresses chunk r of the average plus its server error;
    the result is the concatenation of the server messages, the same on every rank.
    """
    world, numel, padded = len(inputs), inputs[0].numel(), worker_errors[0].numel()
    chunk = padded // world
    messages = []
    for r, x in enumerate(inputs):
        v = torch.cat([x.reshape(-1), torch.zeros(padded - numel)]) + worker_errors[r]
        scale, sign = one_bit(v)
        worker_errors[r] = v - scale * sign
        messages.append(scale * sign)
    average = sum(messages) / world
    result = []
    for r in range(world):
        m = average[r * chunk : (r + 1) * chunk] + server_errors[r]
        scale, sign = one_bit(m)
        server_errors[r] = m - scale * sign
        result.append(scale * sign)
    return torch.cat(result)[:numel].reshape(inputs[0].shape)


def segmented_reference(
    inputs: list[torch.Tensor],
    worker_errors: list[torch.Tensor],
    server_errors: list[torch.Tensor],
    segments: tuple[int, ...],
) -> torch.Tensor:
    """:func:`reference_allreduce` with one scale per segment (the padding its own), on workers and servers.

    A server's chunk compresses each piece of a segment that falls in it with its own scale.
    """
    world, numel, padded = len(inputs), inputs[0].numel(), worker_errors[0].numel()
    chunk = padded // world
    cuts = sorted({0, padded, *torch.tensor(segments).cumsum(0).tolist()})
    messages = []
    for r, x in enumerate(inputs):
        v = torch.cat([x.reshape(-1), torch.zeros(padded - numel)]) + worker_errors[r]
        message = torch.empty(padded)
        for a, b in zip(cuts, cuts[1:]):
            scale, sign = one_bit(v[a:b])
            message[a:b] = scale * sign
        worker_errors[r] = v - message
        messages.append(message)
    average = sum(messages) / world
    result = []
    for r in range(world):
        lo, hi = r * chunk, (r + 1) * chunk
        m = average[lo:hi] + server_errors[r]
        out = torch.empty(chunk)
        pieces = sorted({lo, hi, *(c for c in cuts if lo < c < hi)})
        for a, b in zip(pieces, pieces[1:]):
            scale, sign = one_bit(m[a - lo : b - lo])
            out[a - lo : b - lo] = scale * sign
        server_errors[r] = m - out
        result.append(out)
    return torch.cat(result)[:numel]


def fused_inputs(world: int) -> list[list[torch.Tensor]]:
    """inputs[step][rank]: one buffer of SEGMENTS' tensors, segment k of magnitude ~10^(k-2), with exact zeros."""
    g = torch.Generator().manual_seed(50 + world)
    magnitude = torch.cat([torch.full((n,), 10.0 ** (k - 2)) for k, n in enumerate(SEGMENTS)])
    inputs = []
    for _ in range(STEPS):
        per_rank = [torch.randn(sum(SEGMENTS), generator=g) * magnitude for _ in range(world)]
        for x in per_rank:
            x[x.abs() < 0.1 * magnitude] = 0.0
        inputs.append(per_rank)
    return inputs


def exactness_inputs(world: int) -> list[list[list[torch.Tensor]]]:
    """inputs[step][rank][tensor]: random, with exact zeros (1-bit compression maps them to +1)."""
    g = torch.Generator().manual_seed(world)
    inputs = []
    for _ in range(STEPS):
        per_rank = []
        for _ in range(world):
            tensors = [torch.randn(shape, generator=g) for shape in SHAPES]
            for t in tensors:
                t[t.abs() < 0.1] = 0.0
            per_rank.append(tensors)
        inputs.append(per_rank)
    return inputs


def lossless_samples(shares: list[int], seed: int) -> torch.Tensor:
    """Per-sample gradients (rows) that are random, yet whose per-rank sums are c_r * s for one sign vector s.

    Every rank's contribution and their average then have entries of one magnitude, which
    1-bit compression represents exactly: any difference from the weighted average is a
    weighting error, not a compression error.
    """
    g = torch.Generator().manual_seed(seed)
    s = torch.where(torch.rand(HETERO_NUMEL, generator=g) < 0.5, -1.0, 1.0)
    rows = []
    for r, share in enumerate(shares):
        free = torch.randn(share - 1, HETERO_NUMEL, generator=g)
        c_r = 0.5 + r  # a different total per rank, so that weighting matters
        rows += [free, (c_r * s - free.sum(dim=0)).unsqueeze(0)]
    return torch.cat(rows)


def average_backend_gradient(samples: torch.Tensor, world: int, global_batch: int) -> torch.Tensor:
    """A rank's contribution to an AVERAGING all-reduce: its mean gradient with the loss scaled by W * b / B."""
    return world * len(samples) / global_batch * samples.mean(dim=0)


# ---------------------------------------------------------------- one spawned run per world size


def backend_rank(
    rank: int, world: int, inputs: list, fused: list, lossless: torch.Tensor, lossy: list[torch.Tensor]
) -> dict:
    """Every backend scenario on one rank: exactness (per tensor and fused), bytes, weighting, a group, size errors."""
    dist.init_process_group("gloo")
    backend = GlooCompressedBackend()
    result = {"size": backend.size, "rank": backend.rank}

    # Exactness: called as OnebitAdam calls it, one persistent buffer and error pair per tensor.
    buffers = [torch.zeros(shape) for shape in SHAPES]
    errors = [error_buffers(b.numel(), world) for b in buffers]
    outputs, in_place = [], True
    for step in inputs:
        for buffer, (worker_error, server_error), x in zip(buffers, errors, step[rank]):
            buffer.copy_(x)
            out = backend.compressed_allreduce(buffer, worker_error, server_error, rank)
            in_place &= out is buffer
            outputs.append(out.clone())
    result |= {"outputs": outputs, "in_place": in_place, "worker_errors": [w for w, _ in errors]}
    result["server_errors"] = [s for _, s in errors]

    # Fused: one buffer, every segment with its own scale; errors persist across steps as the optimizer's do.
    segmented = GlooCompressedBackend()
    segmented.set_segments(SEGMENTS)
    buffer = torch.zeros(sum(SEGMENTS))
    worker_error, server_error = error_buffers(buffer.numel(), world)
    fused_out = []
    for step in fused:
        buffer.copy_(step[rank])
        fused_out.append(segmented.compressed_allreduce(buffer, worker_error, server_error, rank).clone())
    result |= {"fused": fused_out, "fused_worker_error": worker_error, "fused_server_error": server_error}
    result |= {"fused_bytes": segmented.last_bytes_sent, "fused_rounds": segmented.last_rounds}
    try:
        segmented.compressed_allreduce(torch.ones(37), *error_buffers(37, world), rank)
    except ValueError as e:
        result["segments_error"] = str(e)

    # Bytes: a fresh backend, so its counters hold these calls only.
    counted = GlooCompressedBackend()
    per_call = []
    for numel in BYTES_NUMELS:
        counted.compressed_allreduce(torch.randn(numel), *error_buffers(numel, world), rank)
        per_call.append(counted.last_bytes_sent)
    result |= {"bytes_per_call": per_call, "bytes_sent": counted.bytes_sent, "calls": counted.calls}

    # Heterogeneous weighting: rank r owns the next SHARES[world][r] samples of the global batch;
    # once with one scale per call, once fused into segments with a scale each.
    shares = SHARES[world]
    start, global_batch = sum(shares[:rank]), sum(shares)
    mine = slice(start, start + shares[rank])
    weighted_by = GlooCompressedBackend()
    weighted_by.set_segments(HETERO_SEGMENTS)
    result["weighting"] = {}
    for name, weighting in (("plain", backend), ("fused", weighted_by)):
        exact = average_backend_gradient(lossless[mine], world, global_batch)
        weighting.compressed_allreduce(exact, *error_buffers(HETERO_NUMEL, world), rank)
        worker_error, server_error = error_buffers(HETERO_NUMEL, world)
        lossy_out = []
        for samples in lossy:
            local = average_backend_gradient(samples[mine], world, global_batch)
            lossy_out.append(weighting.compressed_allreduce(local, worker_error, server_error, rank).clone())
        result["weighting"][name] = {
            "lossless": exact,
            "lossy": lossy_out,
            "lossy_worker_error": worker_error,
            "lossy_server_error": server_error,
        }

    # An explicit group, as a pipeline plan's data-parallel groups: pairs of consecutive ranks.
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]  # every rank creates every group
    paired = GlooCompressedBackend(pairs[rank // 2])
    result["pair_rank_size"] = (paired.rank, paired.size)
    x = inputs[0][rank][0].clone()
    result["pair_output"] = paired.compressed_allreduce(x, *error_buffers(x.numel(), 2), rank)

    try:
        backend.compressed_allreduce(torch.ones(37), torch.zeros(48 * world), torch.zeros(5), rank)
    except ValueError as e:
        result["size_error"] = str(e)
    return result


@pytest.fixture(scope="module")
def backend_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], dict]:
    """``runs(world)``: the scenario inputs and every rank's results, spawned once per world size."""
    cache: dict[int, dict] = {}

    def runs(world: int) -> dict:
        if world not in cache:
            g = torch.Generator().manual_seed(10 + world)
            scenario = {
                "inputs": exactness_inputs(world),
                "fused": fused_inputs(world),
                "lossless": lossless_samples(SHARES[world], seed=world),
                "lossy": [torch.randn(sum(SHARES[world]), HETERO_NUMEL, generator=g) for _ in range(LOSSY_STEPS)],
            }
            out = tmp_path_factory.mktemp(f"world{world}")
            ranks = run_ranks(
                backend_rank, world, out, scenario["inputs"], scenario["fused"], scenario["lossless"], scenario["lossy"]
            )
            cache[world] = scenario | {"ranks": ranks}
        return cache[world]

    return runs


# ---------------------------------------------------------------- tests: the backend


def test_padded_numel_matches_deepspeeds_corrected_size() -> None:
    # OnebitAdam pads to a multiple of W * lcm(W, 8): 16 for W=2, 32 for W=4, 72 for W=3.
    assert [padded_numel(37, 2), padded_numel(37, 4), padded_numel(37, 3), padded_numel(128, 4)] == [48, 64, 72, 128]


@pytest.mark.parametrize("world", [2, 4])
def test_compressed_allreduce_equals_reference(world: int, backend_runs: Callable[[int], dict]) -> None:
    """Bit for bit: the same float operations in the same order. The backend multiplies each
    scale by 1/W before summing, the reference divides the sum by W; for W = 2 and 4 both are
    exact power-of-two scalings, so the order cannot change a bit (for W = 3 it could, by 1 ulp)."""
    run = backend_runs(world)
    # errors[tensor][rank], carried from step to step as the optimizer's state carries them.
    worker_errors = [[error_buffers(math.prod(s), world)[0] for _ in range(world)] for s in SHAPES]
    server_errors = [[error_buffers(math.prod(s), world)[1] for _ in range(world)] for s in SHAPES]
    expected = [
        reference_allreduce([step[r][i] for r in range(world)], worker_errors[i], server_errors[i])
        for step in run["inputs"]
        for i in range(len(SHAPES))
    ]

    for r, got in enumerate(run["ranks"]):
        assert (got["size"], got["rank"]) == (world, r)
        assert got["in_place"], "compressed_allreduce must write into buffer_m and return it"
        for call, (out, ref) in enumerate(zip(got["outputs"], expected)):
            assert torch.equal(out, ref), f"rank {r}, call {call}: max diff {(out - ref).abs().max()}"
        for i in range(len(SHAPES)):
            assert torch.equal(got["worker_errors"][i], worker_errors[i][r])
            assert torch.equal(got["server_errors"][i], server_errors[i][r])
    # The error feedback was exercised: every worker error is non-zero, and some server error of
    # every tensor (a chunk made only of padding compresses losslessly, so its error may stay 0).
    assert all(e.abs().max() > 0 for errors in worker_errors for e in errors)
    assert all(max(e.abs().max() for e in errors) > 0 for errors in server_errors)


@pytest.mark.parametrize("world", [2, 4])
def test_fused_allreduce_equals_segmented_reference(world: int, backend_runs: Callable[[int], dict]) -> None:
    """Fused tensors, one scale per segment on workers and per piece on servers: bit for bit the reference."""
    run = backend_runs(world)
    numel = sum(SEGMENTS)
    worker_errors = [error_buffers(numel, world)[0] for _ in range(world)]
    server_errors = [error_buffers(numel, world)[1] for _ in range(world)]
    one_scale = ([e.clone() for e in worker_errors], [e.clone() for e in server_errors])
    expected, unsegmented = [], []
    for step in run["fused"]:
        expected.append(segmented_reference(step, worker_errors, server_errors, SEGMENTS))
        unsegmented.append(reference_allreduce(step, *one_scale))
    for r, got in enumerate(run["ranks"]):
        for call, (out, ref) in enumerate(zip(got["fused"], expected)):
            assert torch.equal(out, ref), f"rank {r}, call {call}: max diff {(out - ref).abs().max()}"
        assert torch.equal(got["fused_worker_error"], worker_errors[r])
        assert torch.equal(got["fused_server_error"], server_errors[r])
    # Segments matter: one scale for the buffer gives another result, and the 0.01-sized first
    # tensor keeps its size only with its own scale.
    assert not torch.equal(expected[-1], unsegmented[-1])
    first = slice(0, SEGMENTS[0])
    assert expected[-1][first].abs().max() < 0.1 < unsegmented[-1][first].abs().max()
    # The padding is a segment of its own: zero in, zero error out.
    assert all(float(e[numel:].abs().max()) == 0.0 for e in worker_errors)


@pytest.mark.parametrize("world", [2, 4])
def test_fused_call_is_two_collectives_and_counts_its_bytes(world: int, backend_runs: Callable[[int], dict]) -> None:
    # 190 elements padded to 192, chunks of 96 (W=2) or 48 (W=4). Segments (37, 5, 128, 19, 1, pad 2):
    #   W=2: chunk 0 meets 37, 5, 128 (3 pieces), chunk 1 meets 128, 19, 1, pad (4): 4 slots
    #        -> 2 phases x 1 peer x (96/8 + 4*4) = 56
    #   W=4: chunk 0 meets 37, 5, 128; chunks 1, 2 only 128; chunk 3 128, 19, 1, pad: 4 slots
    #        -> 2 phases x 3 peers x (48/8 + 4*4) = 132
    expected = {2: 56, 4: 132}[world]
    assert fused_allreduce_bytes(SEGMENTS, world) == expected
    for got in backend_runs(world)["ranks"]:
        assert (got["fused_bytes"], got["fused_rounds"]) == (expected, 2 * (world - 1))
        assert "declared segments sum to 190" in got["segments_error"] and "\n" not in got["segments_error"]


def test_explicit_group_reduces_within_the_group(backend_runs: Callable[[int], dict]) -> None:
    run = backend_runs(4)
    for first in (0, 2):
        pair = [first, first + 1]
        worker_errors, server_errors = zip(*(error_buffers(SHAPES[0][0], 2) for _ in pair))
        expected = reference_allreduce([run["inputs"][0][r][0] for r in pair], list(worker_errors), list(server_errors))
        for local, r in enumerate(pair):
            assert run["ranks"][r]["pair_rank_size"] == (local, 2)
            assert torch.equal(run["ranks"][r]["pair_output"], expected)


def test_wrongly_sized_error_buffers_get_a_one_line_error(backend_runs: Callable[[int], dict]) -> None:
    message = backend_runs(2)["ranks"][0]["size_error"]
    assert "\n" not in message
    assert "worker_error of 96 and server_error of 5" in message and "must be 48 and 24" in message


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_sent_are_counted_and_about_a_32nd_of_fp32(world: int, backend_runs: Callable[[int], dict]) -> None:
    # Per call: 2 phases x (W-1) peers x (one packed chunk of padded/(8W) bytes + one fp32 scale).
    #   W=2: 2^20 -> 2*1*(65536+4) = 131080;  37 -> padded 48, chunk 3 B -> 2*1*(3+4) = 14
    #   W=4: 2^20 -> 2*3*(32768+4) = 196632;  37 -> padded 64, chunk 2 B -> 2*3*(2+4) = 36
    expected = {2: [131080, 14], 4: [196632, 36]}[world]
    for got in backend_runs(world)["ranks"]:
        assert got["bytes_per_call"] == expected
        assert (got["bytes_sent"], got["calls"]) == (sum(expected), 2)
    # fp32 ring all-reduce of the same tensor: 2 (W-1)/W x numel x 4 bytes per rank.
    ring = 2 * (world - 1) / world * 2**20 * 4
    assert expected[0] / ring <= 0.06
    assert expected[0] / ring == pytest.approx(1 / 32, rel=1e-3)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("backend", ["plain", "fused"])
def test_share_weighted_average_survives_compression(
    world: int, backend: str, backend_runs: Callable[[int], dict]
) -> None:
    """hetero-ray scales losses by W * b_r / B for an averaging backend; the result is the full-batch gradient,
    with one scale per call and with one per fused segment."""
    run = backend_runs(world)
    shares, lossless = SHARES[world], run["lossless"]
    full_batch = lossless.mean(dim=0)
    bounds = torch.tensor([0, *shares]).cumsum(0).tolist()
    local_means = [lossless[a:b].mean(dim=0) for a, b in zip(bounds, bounds[1:])]
    # The weighting matters here: an unweighted average of local means is far off.
    assert (sum(local_means) / world - full_batch).abs().max() > 0.1
    ranks = [got["weighting"][backend] for got in run["ranks"]]
    for got in ranks:
        # Lossless compression (one magnitude everywhere): equal up to float rounding of the scales.
        torch.testing.assert_close(got["lossless"], full_batch, rtol=1e-6, atol=1e-6)

    # Lossy compression over many steps: error feedback delays, never loses. With zero initial
    # errors, sum_t out_t + server_error + mean_r worker_error_r = sum_t full_batch_t in exact arithmetic,
    # so the compressed average equals the share-weighted one up to a bounded, non-growing error.
    delivered = sum(ranks[0]["lossy"])
    pending = torch.cat([r["lossy_server_error"] for r in ranks]) + sum(r["lossy_worker_error"] for r in ranks) / world
    wanted = sum(samples.mean(dim=0) for samples in run["lossy"])
    torch.testing.assert_close(delivered + pending, wanted, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(r["lossy"][-1], ranks[0]["lossy"][-1]) for r in ranks)
    assert (ranks[0]["lossy"][-1] - run["lossy"][-1].mean(dim=0)).abs().max() > 0.1, "compression should be lossy"


# ---------------------------------------------------------------- tests: DeepSpeed on gloo

ONEBIT_ADAM = {
    "type": "OneBitAdam",
    # freeze_step 2: the first step only initialises state, the second is plain Adam, then 1-bit.
    # A small beta2 gives a usable variance after one step (1-bit Adam freezes it at freeze_step).
    "params": {
        "lr": 1e-3,
        "betas": [0.9, 0.99],
        "freeze_step": 2,
        "comm_backend_name": "compressed",
        "cuda_aware": False,
    },
}
ZERO_ONE_ADAM = {
    "type": "ZeroOneAdam",
    # var_update_scaler 1: the variance interval doubles at once, so gradients are 1-bit
    # compressed on alternate steps; after var_freeze_step, accumulated momentum is.
    "params": {
        "lr": 1e-3,
        "betas": [0.9, 0.99],
        "var_freeze_step": 4,
        "var_update_scaler": 1,
        "comm_backend_name": "compressed",
        "cuda_aware": False,
    },
}
# The attribute that says an optimizer is in its compressed stage.
COMPRESSED_FLAG = {"OneBitAdam": "adam_freeze_key", "ZeroOneAdam": "freeze_key"}
DS_STEPS = 8


def deepspeed_rank(rank: int, world: int, optimizers: list[dict]) -> dict:
    """Train a Linear(16, 4) with each 1-bit optimizer through deepspeed.initialize on gloo."""
    # Explicit CPU accelerator (auto-detection lands there too, with a warning); its
    # communication backend is gloo when oneccl is not installed.
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed.comm
    import deepspeed.runtime.comm.compressed as compressed

    # deepspeed.init_distributed(dist_backend="gloo"), minus a 70 s compile of an op training never uses.
    init_distributed_on_gloo()
    assert deepspeed.comm.get_world_size() == world and deepspeed.comm.comm.cdb.shm_comm_op is None
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(8, 16, generator=g)
    y = x @ torch.full((16, 4), 0.1)
    results = {}
    for optimizer in optimizers:
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 4)
        config = {"train_batch_size": 8 * world, "optimizer": optimizer, "zero_optimization": {"stage": 0}}
        engine, opt, _, _ = initialize_on_gloo(config=config, model=model, model_parameters=model.parameters())
        backend = opt.comm_backend_handle
        losses, flags, bytes_sent = [], [], []
        for _ in range(DS_STEPS):
            loss = F.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / world)
            flags.append(getattr(opt, COMPRESSED_FLAG[optimizer["type"]]))
            bytes_sent.append(backend.bytes_sent)
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.empty_like(params) for _ in range(world)]
        dist.all_gather(gathered, params)
        results[optimizer["type"]] = {
            "backend": type(backend).__name__,
            "binding_restored": compressed.CompressedBackend.__name__ == "CompressedBackend",
            "losses": losses,
            "flags": flags,
            "bytes_sent": bytes_sent,
            "backward_allreduce": engine.enable_backward_allreduce,
            "error_sizes": [
                (p.numel(), s["worker_error"].numel(), s["server_error"].numel()) for p, s in opt.state.items()
            ],
            "params": gathered,
        }
    return results


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Rank 0's view of both optimizers' runs (parameters of every rank are in it, all-gathered)."""
    return run_ranks(deepspeed_rank, 2, tmp_path_factory.mktemp("deepspeed"), [ONEBIT_ADAM, ZERO_ONE_ADAM])[0]


def check_deepspeed_run(run: dict) -> None:
    """What both optimizers must show: our backend, DeepSpeed's error sizing, learning, bytes moved."""
    assert run["backend"] == "GlooCompressedBackend" and run["binding_restored"]
    # Linear(16, 4) on 2 ranks: weight 64 elements -> 64 (a multiple of 16), bias 4 -> 16.
    assert sorted(run["error_sizes"]) == [(4, 16, 8), (64, 64, 32)]
    assert all(padded_numel(n, 2) == w for n, w, _ in run["error_sizes"])
    losses = run["losses"]
    assert losses[-1] < losses[2] < losses[0], losses
    assert run["bytes_sent"][-1] > run["bytes_sent"][2]


def test_deepspeed_onebit_adam_on_gloo(deepspeed_runs: dict) -> None:
    run = deepspeed_runs["OneBitAdam"]
    check_deepspeed_run(run)
    # Step 1 initialises, step 2 is plain Adam and reaches freeze_step: compressed from then on.
    assert run["flags"] == [False] + [True] * (DS_STEPS - 1)
    assert run["backward_allreduce"] is False, "the engine must stop all-reducing gradients"
    # Each compressed step moves both parameters: weight 2*(4+4) = 16 B, bias 2*(1+4) = 10 B.
    assert [b - a for a, b in zip(run["bytes_sent"][1:], run["bytes_sent"][2:])] == [26] * (DS_STEPS - 2)
    first, second = run["params"]
    assert torch.equal(first, second), "ranks must hold identical parameters"


def test_deepspeed_zero_one_adam_on_gloo(deepspeed_runs: dict) -> None:
    run = deepspeed_runs["ZeroOneAdam"]
    check_deepspeed_run(run)
    # freeze_key turns on after step var_freeze_step + 1 = 5.
    assert run["flags"] == [False] * 4 + [True] * (DS_STEPS - 4)
    # Not bit-identical: in its local steps ZeroOneAdam adds its own update to the parameter
    # and subtracts it again before applying the synchronised one, and (p + u) - u rounds
    # differently on each rank. The difference stays at rounding level.
    first, second = run["params"]
    torch.testing.assert_close(first, second, rtol=0, atol=1e-6)


# ---------------------------------------------------------------- tests: config validation


@pytest.mark.parametrize(
    ("optimizer", "zero", "stage"),
    [("OneBitAdam", {"stage": 2}, 2), ("zerooneadam", True, 1), ("OneBitLamb", {"stage": 3}, 3)],
)
def test_onebit_with_zero_is_rejected_in_one_line(optimizer: str, zero: Any, stage: int) -> None:
    config = {"optimizer": {"type": optimizer, "params": {}}, "zero_optimization": zero}
    with pytest.raises(ValueError) as info:
        validate_onebit_config(config, where="train.deepspeed")
    message = str(info.value)
    assert isinstance(info.value, ConfigError) and "\n" not in message
    assert message.startswith("train.deepspeed: optimizer.type ")
    assert f"zero_optimization.stage {stage}" in message and "need zero_optimization.stage 0" in message


@pytest.mark.parametrize(
    "config",
    [
        {"optimizer": {"type": "OneBitAdam"}, "zero_optimization": {"stage": 0}},
        {"optimizer": {"type": "ZeroOneAdam"}},
        {"optimizer": {"type": "Adam"}, "zero_optimization": {"stage": 2}},
        {"train_batch_size": 8},
    ],
)
def test_valid_configs_pass(config: dict) -> None:
    validate_onebit_config(config)


def test_initialize_on_gloo_needs_the_compressed_backend_name() -> None:
    config = {"optimizer": {"type": "OneBitAdam", "params": {"comm_backend_name": "nccl"}}}
    with pytest.raises(ConfigError, match=r"^deepspeed config: optimizer.params.comm_backend_name is 'nccl'"):
        initialize_on_gloo(config=config)


def test_a_user_deepspeed_config_merges_into_the_one_hetero_ray_writes() -> None:
    """Keys hetero-ray does not set pass through, nested ones too; its own keep their values."""
    from hetero_ray.config import parse_config
    from hetero_ray.train.sync import deepspeed_config

    user = {"optimizer": {"params": {"eps": 1e-6}}, "wall_clock_breakdown": True, "train_batch_size": 4}
    cfg = parse_config(
        {
            "devices": {"A100-80GB": 2, "V100-16GB": 2},
            "optimizer": {"name": "onebit_adam", "freeze_step": 3, "deepspeed": user},
            "train": {"steps": 10},
        }
    )
    merged = deepspeed_config(cfg, 4, on_gpu=False)
    assert merged["optimizer"]["params"]["eps"] == 1e-6 and merged["wall_clock_breakdown"] is True
    assert merged["optimizer"]["params"]["freeze_step"] == 3 and merged["optimizer"]["type"] == "OneBitAdam"
    with pytest.raises(ConfigError, match=r"optimizer\.deepspeed\.train_batch_size: 4 conflicts with hetero-ray's 2"):
        deepspeed_config(cfg, 2, on_gpu=False)
