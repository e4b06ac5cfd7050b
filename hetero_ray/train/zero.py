"""ZeRO stage 1 with uneven shards: each rank keeps AdamW's state for a contiguous range of the flattened
parameters whose length is proportional to its weight (the memory it has to spare), not to its share of the
batch, which stays proportional to its speed.

The flattened order is that of the gradient chunks (``buckets.GradBuckets``). Each chunk's parameters become
views into one flat tensor beside the chunk's flat gradient, so a rank's piece of a chunk is one slice of
each: an ``nn.Parameter`` sharing the parameters' storage, whose ``.grad`` is the slice of the summed
gradient. AdamW is elementwise, so AdamW over the slices is AdamW over the parameters. After the update each
owner broadcasts its slices; every rank then holds the whole updated model.

Why not ZeRO as DeepSpeed and FSDP2 ship it: both cut the state into equal parts (DeepSpeed: ``numel /
world`` per rank; FSDP2: dim-0 chunks of every parameter), so the smallest card sets the limit for all.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hetero_ray.cluster.catalog import Catalog
from hetero_ray.perf.footprint import Footprint
from hetero_ray.plan.data_parallel import zero_bytes
from hetero_ray.plan.plan import WorkerRole


def spare_memory(
    roles: Sequence[WorkerRole | None], rank_types: Sequence[str], catalog: Catalog, footprint: Footprint
) -> list[float]:
    """Each rank's weight for its shard of Adam's state: its memory beyond weights and gradients, the planner's
    rule (``plan/data_parallel.py::sharded_state``); a rank with no room beyond them still gets a token weight."""
    held = zero_bytes(footprint, 1)[0]
    memory = [r.memory_cap_bytes if r else catalog.get(t).memory_bytes for r, t in zip(roles, rank_types)]
    return [max(1.0, float(m - held)) for m in memory]


@dataclass(frozen=True)
class Shards:
    """Rank ``r`` owns ``[bounds[r], bounds[r + 1])`` of the flattened parameters."""

    bounds: tuple[int, ...]

    @classmethod
    def by_weight(cls, numel: int, weights: Sequence[float]) -> Shards:
        """Contiguous ranges of ``numel`` elements in proportion to ``weights`` (rounded at the cumulative sums,
        so they tile exactly), at least one element each."""
        if not weights or min(weights) <= 0 or numel < len(weights):
            raise ValueError(
                f"shard weights: {list(weights)} over {numel} elements; need positive weights, one element each"
            )
        total, world = sum(weights), len(weights)
        bounds = [0, *(round(numel * c / total) for c in itertools.accumulate(weights))]
        for r in range(1, world):
            bounds[r] = min(max(bounds[r], bounds[r - 1] + 1), numel - (world - r))
        return cls(tuple(bounds))

    def piece(self, rank: int, start: int, length: int) -> tuple[int, int] | None:
        """The part of ``[start, start + length)`` rank ``rank`` owns, as offsets from ``start``; ``None`` if none."""
        lo, hi = max(self.bounds[rank], start), min(self.bounds[rank + 1], start + length)
        return (lo - start, hi - start) if lo < hi else None

    @property
    def world(self) -> int:
        return len(self.bounds) - 1


@dataclass(eq=False)
class _Slice:
    """One rank's piece of one chunk: ``(lo, hi)`` within the chunk's flat parameters and gradient."""

    chunk: int
    rank: int
    lo: int
    hi: int


class ShardedParameters:
    """This rank's slices of every chunk (``params`` for its optimizer) and the broadcasts that share updates.

    ``chunks``: ``(params, flat gradient)`` pairs in the flattened order; the parameters are moved into one
    flat tensor per chunk (their ``.data`` become views), so the slices share their storage.
    """

    def __init__(self, chunks: Sequence[tuple[Sequence[nn.Parameter], torch.Tensor]], shards: Shards, rank: int):
        self.shards, self.rank = shards, rank
        self.flats: list[torch.Tensor] = []
        self.layout: list[list[nn.Parameter]] = []
        self.slices: list[_Slice] = []
        self.params: list[nn.Parameter] = []
        start = 0
        for c, (params, grad) in enumerate(chunks):
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            offset = 0
            for p in params:
                p.data = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
            self.flats.append(flat)
            self.layout.append(list(params))
            for r in range(shards.world):
                piece = shards.piece(r, start, flat.numel())
                if piece is None:
                    continue
                self.slices.append(_Slice(c, r, *piece))
                if r == rank:
                    mine = nn.Parameter(flat[piece[0] : piece[1]])
                    mine.grad = grad[piece[0] : piece[1]]
                    self.params.append(mine)
            start += flat.numel()

    def share_updates(self, group: dist.ProcessGroup | None = None) -> None:
        """Every owner's updated slices to every rank (one broadcast per slice, all in flight together)."""
        works = [
            dist.broadcast(self.flats[s.chunk][s.lo : s.hi], src=s.rank, group=group, async_op=True)
            for s in self.slices
        ]
        for work in works:
            work.wait()

    def whole_state(self, state: Sequence[dict], positions: Sequence[int]) -> list[tuple[int, dict]] | None:
        """AdamW's state of every parameter, keyed by position (``positions``: of each chunk parameter in the
        model, flattened order), assembled on rank 0 from every rank's slices (``state``: this rank's, per
        slice); ``None`` elsewhere. Every rank must call it: it is one ``gather_object``."""
        parts: list | None = [None] * self.shards.world if self.rank == 0 else None
        dist.gather_object(list(state), parts, dst=0)
        if self.rank != 0:
            return None
        ordered = sorted(self.slices, key=lambda s: (s.rank, s.chunk))  # how each rank listed its own
        got = dict(zip(map(id, ordered), (x for part in parts for x in part)))
        out, position = [], iter(positions)
        for c, params in enumerate(self.layout):
            # A chunk's slices, by rank, are in order of their offsets.
            mine = [got[id(s)] for s in self.slices if s.chunk == c]
            joined = (
                {k: torch.cat([x[k] for x in mine]) for k in ("exp_avg", "exp_avg_sq")} if mine and all(mine) else {}
            )
            offset = 0
            for p in params:
                entry = {k: v[offset : offset + p.numel()].view_as(p).clone() for k, v in joined.items()}
                if joined:
                    entry["step"] = mine[0]["step"].clone()  # AdamW counts each parameter's own step in place
                out.append((next(position), entry))
                offset += p.numel()
        return out

    def slice_state(self, state: dict[int, dict], positions: Sequence[int]) -> list[dict]:
        """This rank's slices of a whole-model state keyed by position (the inverse of ``whole_state``)."""
        position = iter(positions)
        chunk_positions = [[next(position) for _ in params] for params in self.layout]
        out = []
        for s in (s for s in self.slices if s.rank == self.rank):
            entries = [state.get(i) for i in chunk_positions[s.chunk]]
            if not all(entries):
                out.append({})
                continue
            flat = {k: torch.cat([e[k].reshape(-1) for e in entries])[s.lo : s.hi] for k in ("exp_avg", "exp_avg_sq")}
            out.append({**flat, "step": entries[0]["step"].clone()})
        return out
