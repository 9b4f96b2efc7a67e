"""Pydantic validation errors as one message: each problem with its field path and where it came from (the YAML
line of a file, or --set)."""
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError

from llmc.core.errors import LlmcError
from llmc.core.overrides import apply_overrides


def validated(model: type[BaseModel], data: dict, source: str, prefix: str = "") -> BaseModel:
    """data as `model`, or one LlmcError listing every problem (`source` says what was being read, `prefix` is the
    path of the section the data fills, e.g. `draft.`)."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        problems = [f"  {prefix}{'.'.join(map(str, _location(item, ()))) or '(top level)'}: {_message(item)}" for item in error.errors()]
        raise LlmcError(f"invalid {source}:\n" + "\n".join(problems)) from None


def loaded_document(model: type[BaseModel], path: Path, overrides: list[str], output: str | None, kind: str, sections: str,
                    union_tags: tuple[str, ...] = ()) -> BaseModel:
    """The YAML file at path (a `kind`, a mapping of `sections`) with its --set overrides and --output applied,
    validated as model; the result keeps where each field came from in `_source` (path, node tree, overridden paths)."""
    try:
        text = path.read_text()
    except OSError as error:
        raise LlmcError(f"cannot read {kind} {path}: {error.strerror}") from None
    try:
        root = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise LlmcError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise LlmcError(f"{path}: a {kind} is a YAML mapping of sections ({sections}, ...)")
    overridden = apply_overrides(data, list(overrides))
    if output is not None:
        data["output"] = output
        overridden.add(("output",))
    document = validated_document(model, data, path, root, overridden, union_tags, kind)
    document._source = (path, root, overridden)
    return document


def validated_document(model: type[BaseModel], data: dict, path: Path, root: yaml.Node | None, overridden: set[tuple],
                       union_tags: tuple[str, ...] = (), kind: str = "recipe") -> BaseModel:
    """data (read from the YAML file at path, its node tree `root`, then overridden) as `model`, or one LlmcError
    naming the field and YAML line (or --set) of each problem. union_tags: the discriminators of the document's
    unions, which pydantic puts into an error's location and a reader does not need."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise LlmcError(_describe(error, path, root, overridden, model, union_tags, kind)) from None


def _location(item: dict, union_tags: tuple[str, ...]) -> list:
    return [part for part in item["loc"] if part not in union_tags and not str(part).startswith("function-")]


def _message(item: dict) -> str:
    if item["type"] in ("extra_forbidden", "unexpected_keyword_argument"):  # a model's key, a dataclass's
        return "unknown key"
    return item["msg"].removeprefix("Value error, ")


def _describe(error: ValidationError, path: Path, root: yaml.Node | None, overridden: set[tuple], model: type[BaseModel],
              union_tags: tuple[str, ...], kind: str) -> str:
    lines = [f"invalid {kind} {path}:"]
    for item in error.errors():
        location = _location(item, union_tags)
        message = _message(item)
        named = [] if location else _path_named_in(message, model)  # a whole-document check names the field it is about
        location = location or named
        lines.append("  " + (f"{path.name} {_where(root, overridden, location)}: {message}" if named
                             else located(path, root, overridden, location, message)))
    return "\n".join(lines)


def located(path: Path, root: yaml.Node | None, overridden: set[tuple], location: list | tuple, message: str) -> str:
    """`recipe.yaml line 12: eval.perplexity.dataset: message` (or `--set` where an override set that field)."""
    field = ".".join(str(part) for part in location) or "(top level)"
    return f"{path.name} {_where(root, overridden, location)}: {field}: {message}"


def _where(root: yaml.Node | None, overridden: set[tuple], location: list | tuple) -> str:
    return "--set" if any(tuple(location[: len(o)]) == o for o in overridden) else f"line {_line_of(root, list(location))}"


def _path_named_in(message: str, model: type[BaseModel]) -> list:
    """`stages.2.weights ...` -> ["stages", 2, "weights"] when the message starts with one of the model's field paths."""
    parts = message.split(" ", 1)[0].rstrip(":").split(".")
    if parts[0] not in model.model_fields:
        return []
    return [int(part) if part.isdigit() else part for part in parts]


def _line_of(node: yaml.Node | None, location: list) -> int:
    """The YAML line of the deepest node on the path that exists (1-based)."""
    line = node.start_mark.line + 1 if node is not None else 1
    for part in location:
        if isinstance(node, yaml.MappingNode):
            match = [(k, v) for k, v in node.value if k.value == str(part)]
            if not match:
                return line
            key_node, node = match[0]
            line = key_node.start_mark.line + 1
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line
