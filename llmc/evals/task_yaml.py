"""A user's lm-eval task YAML, checked before lm-eval reads it: its task name, the files it includes, and whether it
(or a file it includes) has `!function` tags, which make lm-eval import and run a Python file from beside the YAML.
Such a file runs only when the user allows task code; llmc's own bundled tasks are trusted."""
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from llmc.core.errors import LlmcError

ALLOW_CODE_HINT = "pass --allow-task-code to `llmc eval` (in a recipe: eval.tasks.allow_code: true) if you trust it"


@dataclass(frozen=True)
class FunctionTag:
    path: Path
    line: int  # 1-based
    target: str  # module.function, the module a .py file beside the YAML or an importable one


def task_name(path: Path) -> str:
    """The top-level `task: NAME` of a task YAML."""
    value = _top_level(_parse(path), "task")
    if not isinstance(value, yaml.ScalarNode) or not value.value:
        raise LlmcError(f"{path}: a task YAML needs a top-level `task: NAME` line")
    return value.value


def check_task_code(path: Path, allow_code: bool) -> None:
    """Refuses a task YAML whose `!function` tags (its own or an included file's) would run code, unless allowed;
    an included file that is missing is an error here rather than a task lm-eval silently skips."""
    tags = list(function_tags(path))  # reads every include too, so a missing one is named here
    if tags and not allow_code:
        tag = tags[0]
        raise LlmcError(f"{tag.path}, line {tag.line}: `!function {tag.target}` makes lm-eval run Python code from "
                        f"{tag.path.parent}; {ALLOW_CODE_HINT}")


def function_tags(path: Path, seen: frozenset[Path] = frozenset()) -> Iterator[FunctionTag]:
    """Every `!function` tag in the YAML at path and in the files it includes (lm-eval's `include:`), in order."""
    path = path.expanduser().resolve()
    if path in seen:
        raise LlmcError(f"{path}: includes itself (through `include:`)")
    root = _parse(path)
    yield from (FunctionTag(path, node.start_mark.line + 1, str(node.value)) for node in _tagged(root, "!function"))
    for included in _included_files(path, root):
        yield from function_tags(included, seen | {path})


def _parse(path: Path) -> yaml.MappingNode:
    """The YAML's node tree: composed, not constructed, so no tag runs anything here."""
    try:
        root = yaml.compose(path.read_text(), Loader=yaml.SafeLoader)
    except OSError as error:
        raise LlmcError(f"{path}: cannot read the task YAML: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise LlmcError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(root, yaml.MappingNode):
        raise LlmcError(f"{path}: a task YAML is a mapping of settings (task:, dataset_path:, ...)")
    return root


def _top_level(root: yaml.MappingNode, key: str) -> yaml.Node | None:
    return next((value for name, value in root.value if isinstance(name, yaml.ScalarNode) and name.value == key), None)


def _tagged(node: yaml.Node, tag: str) -> Iterator[yaml.Node]:
    if node.tag == tag:
        yield node
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [child for pair in node.value for child in pair]
    else:
        children = []
    for child in children:
        yield from _tagged(child, tag)


def _included_files(path: Path, root: yaml.MappingNode) -> list[Path]:
    """The files `include:` names, resolved as lm-eval resolves them (relative to the including file's folder)."""
    include = _top_level(root, "include")
    if include is None:
        return []
    entries = include.value if isinstance(include, yaml.SequenceNode) else [include]
    files = []
    for entry in entries:
        if not isinstance(entry, yaml.ScalarNode):
            raise LlmcError(f"{path}, line {entry.start_mark.line + 1}: `include:` names a file or a list of files")
        included = path.parent / entry.value  # an absolute path stays as it is
        if not included.is_file():
            raise LlmcError(f"{path}, line {entry.start_mark.line + 1}: `include: {entry.value}`: no such file {included}")
        files.append(included)
    return files
