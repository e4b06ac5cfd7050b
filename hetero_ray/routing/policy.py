"""Job classes and where each goes: training to the fastest cards, fine-tuning to the older ones, inference to
whatever is idle, and what a class may fall back to.

A policy file (YAML)::

    classes:
      train:     {prefer: [H100-80GB, A100-80GB], fallback: false}
      finetune:  {prefer: [V100-16GB], fallback: true}
      inference: {prefer: [], fallback: true}       # no preference: any idle device (the default: slowest first)
    priority: [train, finetune, inference]           # who gets freed devices first

``default_policy`` derives one from the cluster's types by their catalog speed. ``FIRST_FIT`` is what Ray
does without hetero-ray: no preference, devices in the cluster's order, jobs in arrival order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hetero_ray.cluster.catalog import Catalog
from hetero_ray.strict_yaml import YamlError, load_yaml
from hetero_ray.suggest import did_you_mean
from hetero_ray.train.precision import choose_precision

CLASSES = ("train", "finetune", "inference")
# What a routed job's command gets (hetero_ray/routing/run.py): the devices granted, {"A100-80GB": 2}, its class
# and its submission id.
DEVICES_ENV, CLASS_ENV, JOB_ENV = "HETERO_RAY_DEVICES", "HETERO_RAY_JOB_CLASS", "HETERO_RAY_JOB_ID"


class PolicyError(ValueError):
    """A bad class, policy or request: one line saying what, where and what would be valid."""


@dataclass(frozen=True)
class ClassRule:
    """Where one class of job goes: its preferred types in order; ``fallback``: other types when those are busy."""

    prefer: tuple[str, ...] = ()
    fallback: bool = True


@dataclass(frozen=True)
class Policy:
    """A rule per class and the order in which queued classes get freed devices (``None``: arrival order)."""

    rules: Mapping[str, ClassRule] = field(default_factory=dict)
    priority: tuple[str, ...] | None = CLASSES
    name: str = "policy"

    def order(self, job_class: str, types: Sequence[str]) -> list[str]:
        """The types a job of ``job_class`` may take, in the order it takes them, among the cluster's ``types``."""
        rule = self.rules.get(job_class, ClassRule())
        preferred = [t for t in rule.prefer if t in types]
        if not rule.prefer or rule.fallback:
            return preferred + [t for t in types if t not in preferred]
        return preferred

    def rank(self, job_class: str) -> int:
        """Where a queued job of ``job_class`` stands (lower first); 0 for every class in arrival order."""
        return self.priority.index(job_class) if self.priority else 0

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "classes": {c: {"prefer": list(r.prefer), "fallback": r.fallback} for c, r in self.rules.items()},
            "priority": list(self.priority) if self.priority else None,
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> Policy:
        rules = {c: ClassRule(tuple(r["prefer"]), r["fallback"]) for c, r in data["classes"].items()}
        return cls(rules, tuple(data["priority"]) if data["priority"] else None, data.get("name", "policy"))


# Ray's own placement: no preference, the cluster's order, arrival order.
FIRST_FIT = Policy({}, None, "first-fit")


def check_class(job_class: str, where: str = "--class") -> str:
    """``job_class`` if it is a known class, else ``PolicyError``."""
    if job_class not in CLASSES:
        raise PolicyError(
            f"{where}: unknown job class {job_class!r}{did_you_mean(job_class, CLASSES)}; use one of {', '.join(CLASSES)}"
        )
    return job_class


def speed_order(types: Sequence[str], catalog: Catalog) -> list[str]:
    """``types`` fastest first, by the catalog's peak FLOP/s in each card's own training precision."""

    def peak(t: str) -> float:
        spec = catalog.get(t)
        return spec.peak_flops(choose_precision(spec, "auto"))

    return sorted(types, key=lambda t: (-peak(t), t))


def default_policy(types: Sequence[str], catalog: Catalog) -> Policy:
    """Training on the faster half of the cluster's types (waiting for them: a large model's memory and speed
    are there), fine-tuning on the slower half (falling back to any), inference on whatever is idle, the slowest
    types first (an idle fast card taken by inference would keep a training job waiting)."""
    fastest = speed_order(types, catalog)
    half = math.ceil(len(fastest) / 2) if len(fastest) > 1 else 1
    fast, slow = fastest[:half], fastest[half:] or fastest
    return Policy(
        {
            "train": ClassRule(tuple(fast), fallback=len(fastest) == 1),
            "finetune": ClassRule(tuple(reversed(slow)), fallback=True),
            "inference": ClassRule(tuple(reversed(fastest)), fallback=True),
        },
        CLASSES,
        "default",
    )


def load_policy(path: str, catalog: Catalog) -> Policy:
    """A policy file (the module docstring's form), every type checked against ``catalog``; ``PolicyError``."""
    try:
        with open(path, encoding="utf-8") as f:
            data = load_yaml(f.read(), path)
    except OSError as exc:
        raise PolicyError(f"{path}: cannot read the policy: {exc.strerror}") from None
    except YamlError as exc:
        raise PolicyError(str(exc)) from None
    if not isinstance(data, dict) or set(data) - {"classes", "priority"}:
        raise PolicyError(f"{path}: a policy is a mapping with keys classes and priority")
    rules = {}
    for job_class, rule in (data.get("classes") or {}).items():
        check_class(job_class, f"{path}: classes")
        if not isinstance(rule, dict) or set(rule) - {"prefer", "fallback"}:
            raise PolicyError(f"{path}: classes.{job_class}: a mapping with keys prefer (GPU types) and fallback")
        prefer = tuple(rule.get("prefer") or ())
        for t in prefer:
            if t not in catalog:
                raise PolicyError(
                    f"{path}: classes.{job_class}.prefer: unknown GPU type {t!r}{catalog.did_you_mean(t)}"
                )
        rules[job_class] = ClassRule(prefer, bool(rule.get("fallback", True)))
    priority = tuple(data.get("priority") or CLASSES)
    for job_class in priority:
        check_class(job_class, f"{path}: priority")
    missing = [c for c in CLASSES if c not in priority]
    if missing:
        raise PolicyError(
            f"{path}: priority: names no place for {', '.join(missing)}; list all of {', '.join(CLASSES)}"
        )
    return Policy(rules, priority, path)


def place(gpus: int, order: Sequence[str], free: Mapping[str, int]) -> dict[str, int] | None:
    """``gpus`` devices taken from ``free`` type by type in ``order``, or ``None`` when they are not there."""
    taken: dict[str, int] = {}
    for t in order:
        n = min(free.get(t, 0), gpus - sum(taken.values()))
        if n:
            taken[t] = n
    return taken if sum(taken.values()) == gpus else None
