"""GPU catalog: peak FLOP/s, memory and links per GPU type, from vendor datasheets.

The packaged ``gpus.yaml`` holds the data; a user YAML of the same schema adds
types or replaces packaged ones. ``Catalog.normalise`` maps the device names NVML
reports to catalog names.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import types
from collections.abc import Iterable, Iterator, Mapping
from importlib import resources
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import ConfigDict, Field, NonNegativeInt, PositiveFloat, ValidationError, field_validator
from pydantic.dataclasses import dataclass

from hetero_ray.strict_yaml import YamlError, load_yaml
from hetero_ray.suggest import did_you_mean

Precision = Literal["fp32", "tf32", "fp16", "bf16"]
PRECISIONS: tuple[Precision, ...] = get_args(Precision)

GPUS_ENV_VAR = "HETERO_RAY_GPUS"

# A catalog name becomes a Ray node label value (hetero-ray/gpu-type=<name>), so
# it must obey Ray's label syntax.
_LABEL_VALUE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?")

# Older drivers and consumer boards add or drop these words in NVML names.
_VENDOR_WORDS = ("nvidia", "tesla", "geforce", "quadro")


class CatalogError(ValueError):
    """A GPU types file is unreadable or invalid; the message is one line naming file, entry and field."""


# A MIG instance type is named ``<card>-MIG-<profile>`` (``cluster/mig.py``).
MIG_MARK = "-MIG-"


class UnknownGpuType(ValueError):
    """A GPU type name that the catalog does not hold."""


@dataclass(frozen=True, kw_only=True, config=ConfigDict(extra="forbid"))
class GpuSpec:
    """One GPU type: the figures the planner prices work with (see gpus.yaml for conventions)."""

    name: str
    """Catalog name, e.g. ``A100-80GB``; also a Ray node label value."""
    architecture: str = Field(min_length=1)
    """``volta`` | ``turing`` | ``ampere`` | ``ada`` | ``hopper``; free for user types."""
    compute_capability: tuple[NonNegativeInt, NonNegativeInt]
    memory_gib: PositiveFloat
    memory_bandwidth_gbs: PositiveFloat
    peak_tflops: Mapping[Precision, PositiveFloat] = dataclasses.field(hash=False)
    """Dense peak TFLOP/s per precision the card has; must include fp32."""
    interconnect: str = Field(min_length=1)
    """Human text, e.g. ``NVLink 3, 600 GB/s (SXM4)``."""
    interconnect_gbs: PositiveFloat
    """GPU-to-GPU GB/s per GPU, both directions added, as datasheets quote it."""
    nvml_names: tuple[str, ...]
    source: str = Field(min_length=1)
    """Where the figures come from (document title, year, URL)."""
    price_per_hour_usd: PositiveFloat | None = None
    lambda_benchmark_names: tuple[str, ...] = ()
    """1-GPU ``name_gpu`` rows of Lambda's pytorch-train-throughput CSV measured on this type."""

    @field_validator("name")
    @classmethod
    def _name_is_label_value(cls, name: str) -> str:
        if not _LABEL_VALUE.fullmatch(name):
            raise ValueError(
                "must be usable as a Ray label value: 1-63 letters, digits, '-', '_' or '.', "
                "starting and ending with a letter or digit"
            )
        return name

    @field_validator("peak_tflops")
    @classmethod
    def _has_fp32(cls, peak: Mapping[str, float]) -> Mapping[str, float]:
        # fp32 is every planner's fallback precision, so every type must price it.
        if "fp32" not in peak:
            raise ValueError(f"must include fp32 (has {', '.join(peak) or 'none'})")
        return peak

    def __post_init__(self) -> None:
        # Frozen means frozen all the way down: the cached default catalog is shared.
        object.__setattr__(self, "peak_tflops", types.MappingProxyType(dict(self.peak_tflops)))

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        # A mappingproxy does not pickle; rebuild through the constructor instead.
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return functools.partial(GpuSpec, **{**fields, "peak_tflops": dict(self.peak_tflops)}), ()

    @property
    def memory_bytes(self) -> int:
        """Memory capacity in bytes (``memory_gib`` × 2³⁰)."""
        return int(self.memory_gib * 2**30)

    def precision_problem(self, precision: str) -> str | None:
        """Why this card cannot train in ``precision`` (the catalog has no FLOP/s for it), else ``None``."""
        if precision in self.peak_tflops:
            return None
        usable = ", ".join(p for p in ("bf16", "fp16", "fp32") if p in self.peak_tflops)
        return f"{self.name} has no {precision}; use one of {usable}"

    @property
    def supports_bf16(self) -> bool:
        """Whether the card has bf16 tensor cores (Ampere and newer)."""
        return "bf16" in self.peak_tflops

    @property
    def supports_tf32(self) -> bool:
        """Whether the card has TF32 tensor cores (Ampere and newer)."""
        return "tf32" in self.peak_tflops

    def peak_flops(self, precision: str) -> float:
        """Dense peak FLOP/s at ``precision``; ``ValueError`` if the card lacks it."""
        try:
            return self.peak_tflops[precision] * 1e12  # type: ignore[index]
        except KeyError:
            raise ValueError(
                f"GPU type {self.name} has no {precision} peak; it has {', '.join(self.peak_tflops)}"
            ) from None


_SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(GpuSpec))


def _key(name: str) -> str:
    """Case-, space-, '-' and '_'-insensitive form of a device or type name."""
    return " ".join(re.split(r"[\s_-]+", name.strip().casefold()))


def _strip_vendor(key: str) -> str:
    words = key.split()
    while words and words[0] in _VENDOR_WORDS:
        words.pop(0)
    return " ".join(words)


class Catalog:
    """An immutable set of GPU types by name; build it with ``load_catalog``."""

    def __init__(self, specs: Iterable[GpuSpec]) -> None:
        """Index ``specs``; when two claim the same name or NVML name, the later one wins."""
        self._specs: dict[str, GpuSpec] = {}
        for spec in specs:
            # Re-inserting moves a replacement to the end, so its NVML names win below.
            self._specs.pop(spec.name, None)
            self._specs[spec.name] = spec
        self._by_nvml = {_key(n): spec.name for spec in self._specs.values() for n in spec.nvml_names}
        self._by_stripped = self._fallback_index()

    def _fallback_index(self) -> dict[str, str]:
        """Vendor-word-stripped NVML and catalog names → catalog name, ambiguous keys dropped."""
        claims: dict[str, set[str]] = {}
        for name, spec in self._specs.items():
            for alias in (name, *spec.nvml_names):
                claims.setdefault(_strip_vendor(_key(alias)), set()).add(name)
        return {key: names.pop() for key, names in claims.items() if len(names) == 1}

    def get(self, name: str) -> GpuSpec:
        """The spec of GPU type ``name``; ``UnknownGpuType`` listing the known names if absent."""
        try:
            return self._specs[name]
        except KeyError:
            # MIG types are listed by their cards.
            cards = [n for n in self.names() if MIG_MARK not in n]
            instances = [n for n in self.names() if MIG_MARK in n]
            mig = f" (and the MIG instances of some, e.g. {instances[0]})" if instances else ""
            raise UnknownGpuType(
                f"unknown GPU type {name!r}{self.did_you_mean(name)}; known: {', '.join(cards)}{mig}; declare it in a gpus file "
                f"(--gpus FILE or {GPUS_ENV_VAR}, same schema as hetero_ray/cluster/gpus.yaml)"
            ) from None

    def did_you_mean(self, name: str) -> str:
        """`` (did you mean …?)`` for a type name close to ``name`` (a MIG type only when ``name`` asks for one), or
        ``""``."""
        return did_you_mean(name, [n for n in self.names() if (MIG_MARK in n) == (MIG_MARK in name)])

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._specs)

    def __repr__(self) -> str:
        return f"Catalog({', '.join(self.names())})"

    def names(self) -> list[str]:
        """Catalog names, sorted."""
        return sorted(self._specs)

    def normalise(self, nvml_name: str) -> str | None:
        """Catalog name of an NVML device name, or ``None`` if no type claims it.

        Exact match (ignoring case, spaces, '-' and '_') on the types' ``nvml_names``
        first; then the same with leading vendor words (NVIDIA, Tesla, GeForce,
        Quadro) dropped from both sides, also against catalog names, so
        ``GeForce RTX 3090`` (old drivers) and ``NVIDIA L4`` resolve. Never a
        substring match: ``NVIDIA H200 NVL`` is not an ``H200``.
        """
        key = _key(nvml_name)
        return self._by_nvml.get(key) or self._by_stripped.get(_strip_vendor(key))

    def with_types(self, specs: Iterable[GpuSpec]) -> Catalog:
        """A new catalog with ``specs`` added, each replacing a type of the same name."""
        return Catalog([*self._specs.values(), *specs])


_UNKNOWN_FIELD = ("unexpected_keyword_argument", "extra_forbidden")


def _one_line(error: ValidationError) -> str:
    """The first pydantic error as 'field: what is wrong (got X)'."""
    errors = error.errors()
    # A misspelt field also shows up as a missing one; the misspelling is the cause.
    first = next((e for e in errors if e["type"] in _UNKNOWN_FIELD), errors[0])
    field = ".".join(str(part) for part in first["loc"] if part != "[key]") or "entry"
    if first["type"] in _UNKNOWN_FIELD:
        what = f"unknown field; valid fields: {', '.join(f for f in _SPEC_FIELDS if f != 'name')}"
    elif first["type"].startswith("missing"):
        what = "required field is missing"
    elif first["type"] == "value_error":
        what = str(first["ctx"]["error"])
    else:
        what = first["msg"][0].lower() + first["msg"][1:]
    got = "" if first["type"].startswith("missing") else f" (got {first['input']!r})"
    more = error.error_count() - 1
    return f"{field}: {what}{got}" + (f" (and {more} more error{'s' * (more > 1)})" if more else "")


def _parse_gpus_yaml(text: str, origin: str) -> list[GpuSpec]:
    """GPU specs from the YAML ``text`` of a gpus file; ``origin`` names it in errors."""
    try:
        data = load_yaml(text, origin)
    except YamlError as exc:
        raise CatalogError(str(exc)) from None
    if not isinstance(data, dict) or set(data) != {"gpus"} or not isinstance(data["gpus"], dict):
        raise CatalogError(f"{origin}: must be a mapping with the single key 'gpus: {{<type name>: {{fields}}}}'")
    specs: list[GpuSpec] = []
    claimed: dict[str, str] = {}
    for name, fields in data["gpus"].items():
        entry = f"{origin}: entry {name!r}"
        if not isinstance(fields, dict):
            raise CatalogError(f"{entry}: must be a mapping of fields (got {fields!r})")
        if "name" in fields:
            raise CatalogError(f"{entry}: name: the entry's key is its name; remove the field")
        try:
            spec = GpuSpec(name=str(name), **{str(k): v for k, v in fields.items()})
        except ValidationError as exc:
            raise CatalogError(f"{entry}: {_one_line(exc)}") from None
        for nvml_name in spec.nvml_names:
            other = claimed.setdefault(_key(nvml_name), spec.name)
            if other != spec.name:
                raise CatalogError(f"{entry}: nvml_names: {nvml_name!r} is already claimed by {other!r}")
        specs.append(spec)
    return specs


def _read_gpus_file(path: Path, origin: str) -> list[GpuSpec]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CatalogError(f"{origin}: cannot read GPU types file ({exc.strerror or exc})") from None
    return _parse_gpus_yaml(text, origin)


@functools.cache
def _packaged_catalog() -> Catalog:
    """The catalog shipped with hetero-ray (``hetero_ray/cluster/gpus.yaml``), read once."""
    text = resources.files("hetero_ray.cluster").joinpath("gpus.yaml").read_text(encoding="utf-8")
    return Catalog(_parse_gpus_yaml(text, "gpus.yaml (packaged)"))


def load_catalog(extra: str | os.PathLike[str] | None = None) -> Catalog:
    """The packaged catalog plus the user types in ``extra``, and the MIG instance types of every card that has
    them (``cluster/mig.py``: derived from the card's figures, so a user's card gives its own).

    ``extra`` is a YAML file with gpus.yaml's schema; when ``None``, the file named
    by the ``HETERO_RAY_GPUS`` environment variable is used, if set. User entries
    add types or replace packaged ones of the same name. Raises ``CatalogError``
    with a one-line message on a missing or invalid file.
    """
    from hetero_ray.cluster.mig import with_mig_types  # mig.py builds on this module's types

    if extra is not None:
        path, origin = Path(extra), str(extra)
    elif os.environ.get(GPUS_ENV_VAR):
        path = Path(os.environ[GPUS_ENV_VAR])
        origin = f"{path} (from {GPUS_ENV_VAR})"
    else:
        return with_mig_types(_packaged_catalog())
    return with_mig_types(_packaged_catalog().with_types(_read_gpus_file(path, origin)))
