"""`--set key.path=value`: one field of a YAML document replaced before validation, lists by index. The paths it
touched are returned, so a validation error there is blamed on --set rather than on a YAML line."""
from typing import Any

import yaml

from llmc.core.errors import LlmcError


def apply_overrides(data: dict, assignments: list[str]) -> set[tuple]:
    return {apply_override(data, assignment) for assignment in assignments}


def apply_override(data: dict, assignment: str) -> tuple:
    key, separator, raw_value = assignment.partition("=")
    if not separator or not key:
        raise LlmcError(f"--set expects key.path=value, got {assignment!r}")
    parts = key.split(".")
    node: Any = data
    for depth, part in enumerate(parts[:-1]):
        node = _child(node, part, parts[: depth + 1], create=True)
    last = parts[-1]
    value = yaml.safe_load(raw_value) if raw_value else None
    if isinstance(node, list):
        node[_index(node, last, parts)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise LlmcError(f"--set {key}: {'.'.join(parts[:-1])} is not a section")
    return tuple(int(p) if p.isdigit() else p for p in parts)


def _child(node: Any, part: str, path: list[str], create: bool) -> Any:
    if isinstance(node, list):
        return node[_index(node, part, path)]
    if isinstance(node, dict):
        if node.get(part) is None and create:
            node[part] = {}
        return node[part]
    raise LlmcError(f"--set: {'.'.join(path[:-1])} is not a section")


def _index(node: list, part: str, path: list[str]) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise LlmcError(f"--set: {'.'.join(path)}: expected a list index below {len(node)}")
    return int(part)
