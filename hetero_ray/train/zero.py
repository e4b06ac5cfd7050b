"""ZeRO stages 1 to 3 with uneven shards: each rank owns a contiguous range of the flattened parameters whose
length is proportional to its weight (the memory it has to spare), not to its share of the batch, which stays
proportional to its speed. What a rank holds whole and what it holds for its range alone is
``plan/data_parallel.py::zero_bytes``, the rule the planner sizes shards by.

The flattened order is that of the gradient chunks (``buckets.GradBuckets``). Each chunk's parameters become
views into one flat tensor, so a rank's piece of a chunk is one slice of it: an ``nn.Parameter`` whose
``.grad`` is the piece of the summed gradient. AdamW is elementwise, so AdamW over the slices is AdamW over
the parameters.

- Stage 1: AdamW's state for the rank's slices alone. The whole gradient is all-reduced; the slices share the
  parameters' storage and their ``.grad`` is the summed chunk's slice.
- Stage 2: also the gradient. Each backward pass reduces every chunk to the owners of its slices as it fills
  (``GradBuckets.reduce_to_owners``); the owner adds its piece into a gradient of its own that outlives the
  passes, the chunk's ``.grad`` of the slice.
- Stage 3: also the parameters. Chunks are cut at the workload's layers; a rank keeps its slices apart and
  the flat parameters of a layer exist only while it is gathered: for its forward, and again from the moment
  the gradient of its output arrives until its gradients have left (``gather_per_layer``). The next layer's
  gather is sent as a layer starts (forward and backward), so it travels while the layer computes: at most
  two layers are whole at once, as the planner budgets (FSDP's forward and backward prefetch). Freeing shrinks
  the flat tensor's storage to nothing and gathering regrows the same storage, so the parameters' views and
  autograd's saved references to them stay valid (FSDP1's trick).

After the update each owner broadcasts its slices (stages 1 and 2) and every rank holds the whole updated
model; under stage 3 the next gather takes the updated slices.

Why not ZeRO as DeepSpeed and FSDP2 ship it: both cut the state into equal parts (DeepSpeed: ``numel /
world`` per rank; FSDP2: dim-0 chunks of every parameter), so the smallest card sets the limit for all.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hetero_ray.cluster.catalog import Catalog
from hetero_ray.config import ConfigError
from hetero_ray.perf.footprint import Footprint
from hetero_ray.plan.cost import ring_allreduce_bytes
from hetero_ray.plan.data_parallel import zero_bytes
from hetero_ray.plan.plan import WorkerRole
from hetero_ray.train.buckets import Launch, free_storage


def spare_memory(
    roles: Sequence[WorkerRole | None],
    rank_types: Sequence[str],
    catalog: Catalog,
    footprint: Footprint,
    zero_stage: int,
) -> list[float]:
    """Each rank's weight for its shard: its memory beyond what every rank holds whole at ``zero_stage``, the
    planner's rule (``plan/data_parallel.py::sharded_state``); a rank with no room beyond it still gets a token
    weight."""
    held = zero_bytes(footprint, zero_stage)[0]
    memory = [r.memory_cap_bytes if r else catalog.get(t).memory_bytes for r, t in zip(roles, rank_types)]
    return [max(1.0, float(m - held)) for m in memory]


def layer_units(
    model: nn.Module, layers: Sequence[nn.Module] | None, zero_stage: int
) -> list[list[nn.Parameter]] | None:
    """The parameters of each layer, last layer first (the order the backward reaches them), for ZeRO-2 and 3
    to cut gradient chunks at; ``None`` below stage 2 or, at stage 2, without layers (the model is one layer).
    Parameters outside every layer form a last unit at stage 2; stage 3 refuses them, a model without layers
    and a parameter in two layers (tied weights) with a one-line ``ConfigError``."""
    if zero_stage < 2 or (not layers and zero_stage == 2):
        return None
    if not layers:
        raise ConfigError(
            "optimizer.zero_stage: 3 gathers parameters layer by layer and this workload has no layers "
            "(Workload.layered); use optimizer.zero_stage: 2 or lower"
        )
    names: dict[nn.Parameter, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(p, name)
    owner: dict[nn.Parameter, int] = {}
    units: list[list[nn.Parameter]] = []
    for i, layer in enumerate(layers):
        unit = []
        for p in layer.parameters():
            if p in owner and zero_stage == 3:
                raise ConfigError(
                    f"optimizer.zero_stage: 3 gathers one layer at a time, but parameter {names.get(p)} sits in "
                    f"layers {owner[p]} and {i} (tied weights); untie them or use optimizer.zero_stage: 2 or lower"
                )
            if p not in owner:
                owner[p] = i
                unit.append(p)
        units.append(unit)
    rest = [p for p in model.parameters() if p not in owner]
    if rest and zero_stage == 3:
        raise ConfigError(
            f"optimizer.zero_stage: 3 gathers one layer at a time, but parameter {names.get(rest[0])} is in none "
            "of the workload's layers; use optimizer.zero_stage: 2 or lower"
        )
    return [u for u in [*reversed(units), rest] if u]


@dataclass(frozen=True)
class Shards:
    """Owner ``i`` (global rank ``ranks[i]``; ``ranks`` empty: rank ``i``) owns ``[bounds[i], bounds[i + 1])`` of
    the flattened parameters."""

    bounds: tuple[int, ...]
    ranks: tuple[int, ...] = ()

    @classmethod
    def by_weight(cls, numel: int, weights: Sequence[float], ranks: Sequence[int] = ()) -> Shards:
        """Contiguous ranges of ``numel`` elements in proportion to ``weights`` (rounded at the cumulative sums,
        so they tile exactly), at least one element each; ``ranks``: the owners' global ranks, one per weight
        (default: 0, 1, …)."""
        if not weights or min(weights) <= 0 or numel < len(weights) or (ranks and len(ranks) != len(weights)):
            raise ValueError(
                f"shard weights: {list(weights)} over {numel} elements for ranks {list(ranks) or 'all'}; need "
                "positive weights, one element each, one weight per rank"
            )
        total, world = sum(weights), len(weights)
        bounds = [0, *(round(numel * c / total) for c in itertools.accumulate(weights))]
        for r in range(1, world):
            bounds[r] = min(max(bounds[r], bounds[r - 1] + 1), numel - (world - r))
        return cls(tuple(bounds), tuple(ranks))

    def pieces(self, start: int, length: int) -> list[tuple[int, int, int]]:
        """``(global rank, lo, hi)`` of every owner of part of ``[start, start + length)``, as offsets from
        ``start``, in order of offsets."""
        out = []
        for i, owner in enumerate(self.owners):
            lo, hi = max(self.bounds[i], start), min(self.bounds[i + 1], start + length)
            if lo < hi:
                out.append((owner, lo - start, hi - start))
        return out

    @property
    def owners(self) -> tuple[int, ...]:
        """The owners' global ranks, in order of their ranges."""
        return self.ranks or tuple(range(self.world))

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


def _resident(flat: torch.Tensor) -> bool:
    return flat.untyped_storage().nbytes() > 0


class ShardedParameters:
    """This rank's slices of every chunk (``params`` for its optimizer), the broadcasts that share updates and,
    under stage 3, the gathers of whole layers.

    ``chunks``: ``(params, gradient)`` pairs in the flattened order; ``shards`` name their owners, whose
    process group is ``group`` (``None``: the world; a pipeline stage's data-parallel replicas otherwise). The
    gradient is the chunk's flat summed one at stage 1, this rank's piece of it at stages 2 and 3 (``None``
    where it owns none). The parameters are
    moved into one flat tensor per chunk (their ``.data`` become views), so the slices share their storage
    (stages 1 and 2). ``launches``: where stage 3's gathers are recorded, as the gradient buckets' reduces are.
    """

    def __init__(
        self,
        chunks: Sequence[tuple[Sequence[nn.Parameter], torch.Tensor | None]],
        shards: Shards,
        rank: int,
        zero_stage: int = 1,
        launches: list[Launch] | None = None,
        group: dist.ProcessGroup | None = None,
    ):
        self.shards, self.rank, self.group = shards, rank, group
        self.launches = launches if launches is not None else []
        self.flats: list[torch.Tensor] = []
        self.layout: list[list[nn.Parameter]] = []
        self.slices: list[_Slice] = []
        self.params: list[nn.Parameter] = []
        self.mine: dict[int, tuple[_Slice, nn.Parameter]] = {}  # chunk → this rank's slice of it
        self.in_flight: dict[int, list[dist.Work]] = {}  # stage 3: chunk → its gather's broadcasts, not yet awaited
        start = 0
        for c, (params, grad) in enumerate(chunks):
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            offset = 0
            for p in params:
                p.data = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
            self.flats.append(flat)
            self.layout.append(list(params))
            for r, lo, hi in shards.pieces(start, flat.numel()):
                piece = _Slice(c, r, lo, hi)
                self.slices.append(piece)
                if r == rank:
                    # Stage 3 keeps its slice apart: the flat tensor lives only while its layer is gathered.
                    mine = nn.Parameter(flat[lo:hi].clone() if zero_stage == 3 else flat[lo:hi])
                    mine.grad = grad[lo:hi] if zero_stage == 1 else grad
                    self.params.append(mine)
                    self.mine[c] = (piece, mine)
            start += flat.numel()
        if zero_stage == 3:
            self.release(range(len(self.flats)))

    def share_updates(self) -> None:
        """Every owner's updated slices to every rank of the group (one broadcast per slice, all in flight
        together)."""
        self._broadcast(self.slices)

    def _send(self, slices: Iterable[_Slice]) -> dict[int, list[dist.Work]]:
        """One async broadcast per slice; its work, by chunk."""
        works: dict[int, list[dist.Work]] = {}
        for s in slices:
            view = self.flats[s.chunk][s.lo : s.hi]
            works.setdefault(s.chunk, []).append(dist.broadcast(view, src=s.rank, group=self.group, async_op=True))
        return works

    def _broadcast(self, slices: Iterable[_Slice]) -> None:
        for works in self._send(slices).values():
            for work in works:
                work.wait()

    def gather(self, chunks: Iterable[int], *, wait: bool = True) -> None:
        """Stage 3: the whole parameters of ``chunks`` from their owners' slices (one broadcast per slice, all in
        flight together), recorded in ``launches`` as the ring all-gather it equals; chunks already whole or on
        their way are not sent again. ``wait``: return once they have arrived (else they travel on, and the
        next gather that asks for them waits). Every rank must call it alike."""
        chunks = tuple(chunks)
        start, missing = time.perf_counter(), {c for c in chunks if not _resident(self.flats[c])}
        for c in missing:
            flat = self.flats[c]
            flat.untyped_storage().resize_(flat.numel() * flat.element_size())
            if c in self.mine:
                piece, mine = self.mine[c]
                flat[piece.lo : piece.hi].copy_(mine.detach())
        if missing:
            self.in_flight.update(self._send(s for s in self.slices if s.chunk in missing))
            world = self.shards.world
            nbytes = sum(self.flats[c].numel() * self.flats[c].element_size() for c in missing)
            self.launches.append(Launch(start, ring_allreduce_bytes(nbytes, world) / 2, world - 1))
        if wait:
            for c in chunks:
                self._land(c)

    def release(self, chunks: Iterable[int]) -> None:
        """Stage 3: free the whole parameters of ``chunks`` (this rank's slices stay); a gather still on its way
        into one (sent ahead for a layer that did not run) lands first."""
        for c in chunks:
            self._land(c)
            free_storage(self.flats[c])

    def _land(self, chunk: int) -> None:
        """Wait for a gather of ``chunk`` still on its way, if any."""
        for work in self.in_flight.pop(chunk, ()):
            work.wait()

    def gather_per_layer(self, layers: Sequence[nn.Module], chunks_of: Sequence[Sequence[int]]) -> None:
        """Stage 3: gather each layer's chunks (``chunks_of``, by layer, in forward order) before its forward and
        release them after it; gather them again when the gradient of its output arrives, i.e. before its
        backward. Each of these gathers sends the next layer's (the one after in the forward, the one before in
        the backward) without waiting for it. The backward's release is chunk by chunk, once a chunk's
        gradients have all arrived (``GradBuckets.on_launch``): its parameters are needed by nothing after
        that."""
        chunks_of = [tuple(c) for c in chunks_of]
        for k, (layer, chunks) in enumerate(zip(layers, chunks_of)):
            after = chunks_of[k + 1] if k + 1 < len(chunks_of) else ()
            before = chunks_of[k - 1] if k > 0 else ()
            layer.register_forward_pre_hook(functools.partial(self._before_forward, chunks, after))
            layer.register_forward_hook(functools.partial(self._after_forward, chunks, before))

    def _gather_and_send_next(self, chunks: tuple[int, ...], following: tuple[int, ...]) -> None:
        self.gather(chunks)
        self.gather(following, wait=False)

    def _before_forward(self, chunks: tuple[int, ...], after: tuple[int, ...], _module: nn.Module, _args) -> None:
        self._gather_and_send_next(chunks, after)

    def _after_forward(
        self, chunks: tuple[int, ...], before: tuple[int, ...], _module: nn.Module, _args, output
    ) -> None:
        self.release(chunks)
        if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda _grad: self._gather_and_send_next(chunks, before))

    def host_copies(self, keep: bool = True) -> dict[int, torch.Tensor]:
        """Stage 3: a copy on the host of every parameter (by ``id``; none unless ``keep``), gathered a chunk at a
        time and released again, so no more than one chunk beyond those already whole is whole at once. Every
        rank must call it alike."""
        copies: dict[int, torch.Tensor] = {}
        for c, params in enumerate(self.layout):
            whole = _resident(self.flats[c]) and c not in self.in_flight
            self.gather([c])
            if keep:
                copies.update((id(p), p.detach().to("cpu", copy=True)) for p in params)
            if not whole:
                self.release([c])
        return copies

    def whole_state(self, state: Sequence[dict], positions: Sequence[int]) -> list[tuple[int, dict]] | None:
        """AdamW's state of every parameter, keyed by position (``positions``: of each chunk parameter in the
        model, flattened order), assembled on the shards' first owner (rank 0 over the world) from the group's
        slices (``state``: this rank's, per slice); ``None`` elsewhere. Every rank of the group must call it: it
        is one ``gather_object``."""
        gatherer = self.shards.owners[0]
        parts: list | None = [None] * self.shards.world if self.rank == gatherer else None
        dist.gather_object(list(state), parts, dst=gatherer, group=self.group)
        if self.rank != gatherer:
            return None
        # By rank, as gather_object lists a group's ranks, then as each rank listed its own.
        ordered = sorted(self.slices, key=lambda s: (s.rank, s.chunk))
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
