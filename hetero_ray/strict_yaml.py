"""YAML as hetero-ray reads every file: safe types, and a key given twice in one mapping is an error.

PyYAML keeps the last of two equal keys without a word, so a cluster file with two
node types of one name, or a run config listing a device twice, would plan without
one of them. This module sits below every other (it imports nothing of hetero-ray),
so the run config, the cluster file, the GPU catalog and the sweeps all read through it.
"""

from __future__ import annotations

from typing import Any

import yaml

_MERGE_TAG = "tag:yaml.org,2002:merge"


class YamlError(ValueError):
    """A file is not valid YAML or repeats a key; the message is one line: source, line, column, problem."""


class _DuplicateKey(yaml.constructor.ConstructorError):
    """A key given twice in one mapping."""


class _StrictLoader(yaml.SafeLoader):
    """``SafeLoader`` that refuses a key given twice in one mapping (``<<`` merges may still override)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:  # an unhashable key: SafeLoader's own check below says so
                continue
            if first is not key_node:
                raise _DuplicateKey(
                    None,
                    None,
                    f"duplicate key {key!r} (first at line {first.start_mark.line + 1}); give each key once",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str, source: str) -> Any:
    """The value of the YAML ``text``; ``YamlError`` naming ``source``, line and column when it is not valid."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}:" if mark else ""
        problem = getattr(exc, "problem", None) or exc
        what = problem if isinstance(exc, _DuplicateKey) else f"malformed YAML: {problem}"
        raise YamlError(f"{source}:{where} {what}") from None
