"""The recipe: one YAML file that drives the whole pipeline, validated by pydantic with errors that name the
field path and the YAML line."""
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from llmc.errors import LlmcError
from llmc.quant.qtypes import QuantArgs
from llmc.quant.schemes import resolve_weight_args


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CalibrationConfig(StrictModel):
    dataset: str = "calib_data/smollm2_self_generated.jsonl"
    split: str = "train"
    text_field: str = "text"
    messages_field: str = "messages"
    chat_template: bool = False
    num_samples: int = Field(64, gt=0)
    seq_len: int = Field(512, gt=0)
    seed: int = 0


class RTNStage(StrictModel):
    type: Literal["rtn"]
    scheme: str | None = None
    weights: QuantArgs = QuantArgs()
    targets: list[str] = ["Linear"]
    ignore: list[str] = []

    @model_validator(mode="before")
    @classmethod
    def _apply_scheme(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("scheme") is not None:
            weights = data.get("weights") or {}
            if isinstance(weights, dict):
                data = {**data, "weights": resolve_weight_args(data["scheme"], weights)}
        return data


Stage = Annotated[RTNStage, Field(discriminator="type")]


class PerplexityEval(StrictModel):
    dataset: str
    seq_len: int = Field(1024, gt=0)
    max_windows: int | None = Field(40, gt=0)


class EvalConfig(StrictModel):
    perplexity: PerplexityEval | None = None
    baseline: bool = True


class ExportConfig(StrictModel):
    format: Literal["compressed-tensors"] = "compressed-tensors"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"


class DraftConfig(StrictModel):
    """Draft heads trained on the quantized model, by self-distillation on `prompts` (never the evaluation set)."""

    method: Literal["medusa"] = "medusa"
    num_heads: int = Field(4, gt=0, le=8)
    prompts: str = "calib_data/smollm2_self_generated.jsonl"
    num_prompts: int = Field(128, gt=0)
    max_tokens: int = Field(256, gt=0)  # answer length generated per prompt
    steps: int = Field(300, gt=0)
    batch_size: int = Field(128, gt=0)
    lr: float = Field(1e-3, gt=0)
    seed: int = 0


class Recipe(StrictModel):
    model: str = "smollm2-135m"
    output: str
    calibration: CalibrationConfig | None = None
    stages: list[Stage] = Field(min_length=1)
    eval: EvalConfig = EvalConfig()
    export: ExportConfig = ExportConfig()
    draft: DraftConfig | None = None

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", exclude_none=False), sort_keys=False)


def load_recipe(path: Path, overrides: list[str] = (), output: str | None = None) -> Recipe:
    try:
        text = path.read_text()
    except OSError as error:
        raise LlmcError(f"cannot read recipe {path}: {error.strerror}") from None
    try:
        root = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise LlmcError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise LlmcError(f"{path}: a recipe is a YAML mapping of sections (model, output, stages, ...)")
    overridden = set()
    for assignment in overrides:
        overridden.add(_apply_override(data, assignment))
    if output is not None:
        data["output"] = output
        overridden.add(("output",))
    try:
        return Recipe.model_validate(data)
    except ValidationError as error:
        raise LlmcError(_describe(error, path, root, overridden)) from None


def _apply_override(data: dict, assignment: str) -> tuple:
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


def _describe(error: ValidationError, path: Path, root: yaml.Node | None, overridden: set[tuple]) -> str:
    lines = [f"invalid recipe {path}:"]
    for item in error.errors():
        location = [part for part in item["loc"] if part not in ("rtn",) and not str(part).startswith("function-")]
        field = ".".join(str(part) for part in location) or "(top level)"
        if any(tuple(location[: len(o)]) == o for o in overridden):
            where = "--set"
        else:
            where = f"line {_line_of(root, location)}"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown key"
        lines.append(f"  {path.name} {where}: {field}: {message}")
    return "\n".join(lines)


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
