"""Plan JSON files, validated at the edge: a bad file gets one ``PlanError`` line, never a half-built Plan.

``load_plan`` checks each field's type and range (pydantic, strict: ``"4"`` is not
a batch size), then the invariants of ``hetero_ray/plan/plan.py``: pipelines
numbered 0…P−1 with stages 0…S−1, every stage of a pipeline sharing its batch
and micro-batch, stages' layer ranges covering the same layers end to end, and
the pipelines' sample ranges tiling the global batch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hetero_ray.cluster.catalog import Catalog, UnknownGpuType
from hetero_ray.plan.memory import SCHEDULES
from hetero_ray.plan.plan import Plan, PlanError
from hetero_ray.strict_yaml import YamlError, load_yaml
from hetero_ray.suggest import did_you_mean

SCHEMA = 2


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class _Role(_Strict):
    gpu_type: str = Field(min_length=1)
    local_batch: int = Field(gt=0)
    micro_batch: int = Field(gt=0)
    sample_offset: int = Field(ge=0)
    precision: Literal["fp32", "bf16", "fp16"]
    predicted_compute_s: float = Field(ge=0)
    predicted_memory_bytes: float = Field(ge=0)
    memory_cap_bytes: int = Field(gt=0)
    pipeline: int = Field(0, ge=0)
    stage: int = Field(0, ge=0)
    layers: tuple[int, int] | None = None
    activation_checkpointing: bool = False
    tp_weights: tuple[float, ...] | None = Field(None, min_length=2)
    tp_rank: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _ranges(self) -> _Role:
        if self.tp_weights is not None and not all(0 < w < float("inf") for w in self.tp_weights):
            raise ValueError(f"tp_weights {list(self.tp_weights)} must all be positive and finite")
        if self.tp_rank >= len(self.tp_weights or (1,)):
            raise ValueError(f"tp_rank {self.tp_rank} is not one of the {len(self.tp_weights or (1,))} members")
        if self.micro_batch > self.local_batch:
            raise ValueError(f"micro_batch {self.micro_batch} exceeds local_batch {self.local_batch}")
        if self.layers is not None and not 0 <= self.layers[0] < self.layers[1]:
            raise ValueError(f"layers {list(self.layers)} must be [first, last) with 0 <= first < last")
        return self


class _Exclusion(_Strict):
    gpu_type: str = Field(min_length=1)
    count: int = Field(gt=0)
    reason: str


class _Workload(_Strict):
    name: str = Field(min_length=1)
    options: dict[str, Any] = Field(default_factory=dict)


class _Plan(_Strict):
    global_batch: int = Field(gt=0)
    # Descriptive only (the runtime reads the roles); planners name their splits freely.
    split: str = Field(min_length=1)
    emulated: bool
    roles: tuple[_Role, ...] = Field(min_length=1)
    predicted_compute_s: float = Field(ge=0)
    excluded: tuple[_Exclusion, ...] = ()
    predicted_comm_s: float = Field(0.0, ge=0)
    predicted_comm_fp32_s: float = Field(0.0, ge=0)
    schedule: str = "gpipe"
    zero_stage: int = Field(0, ge=0, le=3)
    workload: _Workload | None = None
    explanation: str = ""
    schema_: Literal[2] = Field(SCHEMA, alias="schema")

    @field_validator("schedule")
    @classmethod
    def _known_schedule(cls, v: str) -> str:
        if v not in SCHEDULES:
            raise ValueError(f"unknown schedule {v!r}{did_you_mean(v, SCHEDULES)}; use one of {', '.join(SCHEDULES)}")
        return v


def _one_line(exc: ValidationError, source: str) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "(top level)"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown field"
    elif err["type"] not in ("missing", "value_error") and not isinstance(err.get("input"), dict | list):
        # pydantic's own messages omit the value; ours (value_error) already name it.
        msg += f" (got {err['input']!r})"
    more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{source}: {where}: {msg}{more}"


def _check_pipelines(plan: _Plan, n_layers: int | None) -> str | None:
    """The first broken invariant as ``field: what is wrong, what would be valid``; ``None`` if sound."""
    pipelines: dict[int, list[tuple[int, _Role]]] = {}
    problem = _check_tensor_groups(plan)
    if problem:
        return problem
    if all(r.layers is None and r.tp_weights is None for r in plan.roles):
        # Pure data parallelism: every worker is a one-stage pipeline of its own (the
        # data-parallel planner leaves pipeline and stage at 0).
        staged = [i for i, r in enumerate(plan.roles) if r.stage != 0]
        if staged:
            return f"roles.{staged[0]}.stage: {plan.roles[staged[0]].stage} without layer ranges; stages need layers"
        pipelines = {i: [(i, r)] for i, r in enumerate(plan.roles)}
    else:
        # A tensor-parallel stage stands for its members (checked above) by its first.
        for i, role in enumerate(plan.roles):
            if role.tp_rank == 0:
                pipelines.setdefault(role.pipeline, []).append((i, role))
    if sorted(pipelines) != list(range(len(pipelines))):
        return f"roles.*.pipeline: pipelines are {sorted(pipelines)}; number them 0 to {len(pipelines) - 1}"
    ends: set[int] = set()
    for p, members in sorted(pipelines.items()):
        stages = sorted(r.stage for _, r in members)
        if stages != list(range(len(members))):
            return f"roles.*.stage: pipeline {p} has stages {stages}; each of 0 to {len(members) - 1} exactly once"
        first_i, head = min(members, key=lambda m: m[1].stage)
        for i, role in members:
            for name in ("local_batch", "micro_batch", "sample_offset"):
                if getattr(role, name) != getattr(head, name):
                    return (
                        f"roles.{i}.{name}: {getattr(role, name)}, but stage 0 of pipeline {p} (roles.{first_i}) "
                        f"has {getattr(head, name)}; all stages of a pipeline share it"
                    )
        ranged = [(i, r) for i, r in sorted(members, key=lambda m: m[1].stage) if r.layers is not None]
        if len(members) > 1 and len(ranged) < len(members):
            i = next(i for i, r in members if r.layers is None)
            return f"roles.{i}.layers: missing; every stage of a {len(members)}-stage pipeline needs a layer range"
        expected = 0
        for i, role in ranged:
            if role.layers[0] != expected:
                return (
                    f"roles.{i}.layers: starts at layer {role.layers[0]}; stage {role.stage} of pipeline {p} "
                    f"must start at {expected}, where the previous stage ends"
                )
            expected = role.layers[1]
        if ranged:
            ends.add(expected)
            if n_layers is not None and expected != n_layers:
                return (
                    f"roles.{ranged[-1][0]}.layers: pipeline {p} ends at layer {expected}; the workload has {n_layers}"
                )
    if len(ends) > 1:
        return f"roles.*.layers: pipelines end at layers {sorted(ends)}; every pipeline must hold all the layers"
    heads = sorted((min(m, key=lambda x: x[1].stage) for m in pipelines.values()), key=lambda m: m[1].sample_offset)
    offset = 0
    for i, role in heads:
        if role.sample_offset != offset:
            return (
                f"roles.{i}.sample_offset: {role.sample_offset}; pipelines must cover the global batch in turn, "
                f"so the next one starts at {offset}"
            )
        offset += role.local_batch
    if offset != plan.global_batch:
        batches = [r.local_batch for _, r in heads]
        return f"roles.*.local_batch: pipelines' local batches {batches} sum to {offset}, not global_batch {plan.global_batch}"
    return None


def _check_tensor_groups(plan: _Plan) -> str | None:
    """Each tensor-parallel stage has members 0…d−1 once, sharing weights and samples; stages of different
    pipelines holding one layer split it alike (its gradients are summed per part)."""
    stages: dict[tuple[int, int], list[tuple[int, _Role]]] = {}
    for i, role in enumerate(plan.roles):
        if role.tp_weights is not None or role.layers is not None:
            stages.setdefault((role.pipeline, role.stage), []).append((i, role))
    for (p, s), members in sorted(stages.items()):
        i, head = members[0]
        d = len(head.tp_weights or (1,))
        # Two workers of one unsplit stage are the stage check's to name.
        if any(r.tp_weights is not None for _, r in members):
            ranks = sorted(r.tp_rank for _, r in members)
            if ranks != list(range(d)):
                return f"roles.{i}.tp_rank: stage {s} of pipeline {p} has members {ranks}; each of 0 to {d - 1} exactly once"
            for j, role in members:
                # Precision too: the members' all-reduces add their partial sums, which must share a dtype.
                for name in ("tp_weights", "layers", "local_batch", "micro_batch", "sample_offset", "precision"):
                    if getattr(role, name) != getattr(head, name):
                        return f"roles.{j}.{name}: differs from roles.{i}'s; the members of a tensor-parallel stage share it"
    # Every stage by its member 0, a whole-model worker without tensor parallelism too: an unsplit replica beside
    # a split one holds every layer unsplit.
    heads = [(i, role) for i, role in enumerate(plan.roles) if role.tp_rank == 0]
    for a, (i, x) in enumerate(heads):
        for j, y in heads[a + 1 :]:
            overlap = (
                x.layers is None or y.layers is None or max(x.layers[0], y.layers[0]) < min(x.layers[1], y.layers[1])
            )
            if overlap and x.tp_weights != y.tp_weights:
                return (
                    f"roles.{j}.tp_weights: {_split_name(y)}, but roles.{i} holds some of the same layers "
                    f"{_split_name(x)}; the pipelines holding a layer must split it alike (its gradients are summed "
                    "per part)"
                )
    return None


def _split_name(role: _Role) -> str:
    return f"split {list(role.tp_weights)}" if role.tp_weights else "unsplit"


def parse_plan(data: Any, source: str = "plan", *, catalog: Catalog | None = None, n_layers: int | None = None) -> Plan:
    """Validate a decoded Plan JSON value; ``PlanError`` with one line naming the field on failure.

    ``catalog``: also require every GPU type to be in it. ``n_layers``: also require
    layer ranges to end at the workload's layer count.
    """
    if not isinstance(data, dict):
        raise PlanError(f"{source}: expected a JSON object with global_batch, roles, …; got {type(data).__name__}")
    try:
        model = _Plan.model_validate_json(json.dumps(data))
    except ValidationError as exc:
        raise PlanError(_one_line(exc, source)) from None
    problem = _check_pipelines(model, n_layers)
    if problem:
        raise PlanError(f"{source}: {problem}")
    if catalog is not None:
        for i, role in enumerate(model.roles):
            try:
                problem = catalog.get(role.gpu_type).precision_problem(role.precision)
            except UnknownGpuType as exc:
                raise PlanError(f"{source}: roles.{i}.gpu_type: {exc}") from None
            if problem:
                raise PlanError(f"{source}: roles.{i}.precision: {problem}")
    return Plan.from_dict(model.model_dump(by_alias=True))


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s object hook: a key given twice is refused (json itself keeps the last)."""
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen.add(key)
    return dict(pairs)


def _where_duplicate(text: str, source: str, key: str) -> str:
    """One line naming the repeated ``key``; its line comes from the strict YAML reader, as json gives none
    (JSON is YAML's flow syntax)."""
    try:
        load_yaml(text, source)
    except YamlError as exc:
        if "duplicate key" in str(exc):
            return str(exc)
    return f"{source}: duplicate key {key!r}; give each key once"


def load_plan(path: str | Path, *, catalog: Catalog | None = None, n_layers: int | None = None) -> Plan:
    """Read and validate a Plan JSON file (as written by ``Plan.to_json``)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise PlanError(f"{path}: cannot read plan: {exc.strerror}") from None
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise PlanError(f"{path}: line {exc.lineno}, column {exc.colno}: malformed JSON: {exc.msg}") from None
    except _DuplicateKey as exc:
        raise PlanError(_where_duplicate(text, str(path), exc.key)) from None
    return parse_plan(data, str(path), catalog=catalog, n_layers=n_layers)
