"""The recipe: one YAML file that drives the whole pipeline, validated by pydantic with errors that name the
field path and the YAML line."""
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from llmc.errors import LlmcError
from llmc.quant.qtypes import QuantArgs
from llmc.quant.schemes import resolve_activation_args, resolve_weight_args


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
    # precision of the calibration forward passes; weights, statistics and algorithms stay float32
    dtype: Literal["float32", "bfloat16"] = "float32"


class WeightStage(StrictModel):
    """A stage that quantizes the weights of the Linears it targets."""

    scheme: str | None = None
    weights: QuantArgs = QuantArgs()
    input_activations: QuantArgs | None = None  # W8A8 / FP8: the Linears' inputs are quantized too
    targets: list[str] = ["Linear"]
    ignore: list[str] = []

    @model_validator(mode="before")
    @classmethod
    def _apply_scheme(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("scheme") is not None:
            weights = data.get("weights") or {}
            activations = data.get("input_activations")
            if isinstance(weights, dict) and isinstance(activations, dict | None):
                data = {
                    **data,
                    "weights": resolve_weight_args(data["scheme"], weights),
                    "input_activations": resolve_activation_args(data["scheme"], activations),
                }
        return data

    @model_validator(mode="after")
    def _activation_format(self) -> "WeightStage":
        acts = self.input_activations
        if self.weights.dynamic:
            raise ValueError("weights.dynamic: weights are quantized once, only input_activations can be dynamic")
        if self.weights.strategy == "token":
            raise ValueError("weights.strategy: 'token' is for input_activations; use channel")
        if acts is None:
            return self
        if not acts.symmetric or acts.strategy in ("channel", "block") or acts.actorder:
            raise ValueError("input_activations: symmetric, with strategy token, group (dynamic) or tensor")
        if acts.strategy == "group" and not acts.dynamic:
            raise ValueError("input_activations.dynamic: per-token-group scales exist only at run time; set it true")
        if acts.num_bits != 8 or self.weights.num_bits != 8:
            raise ValueError("input_activations: W8A8 and FP8 need 8-bit weights and activations")
        return self

    @property
    def needs_calibration(self) -> bool:
        return self.input_activations is not None and not self.input_activations.dynamic


class RTNStage(WeightStage):
    type: Literal["rtn"]

    @model_validator(mode="after")
    def _no_actorder(self) -> "RTNStage":
        if self.weights.actorder is not None:
            raise ValueError("weights.actorder needs a Hessian; use type: gptq")
        return self


class GPTQStage(WeightStage):
    type: Literal["gptq"]
    block_size: int = Field(128, gt=0)
    dampening_frac: float = Field(0.01, gt=0)

    @model_validator(mode="after")
    def _no_blocks(self) -> "GPTQStage":
        if self.weights.strategy == "block":
            raise ValueError("weights.strategy: GPTQ walks columns and cannot fix 2-D block scales; use type: rtn")
        return self

    @property
    def needs_calibration(self) -> bool:
        return True


class AWQStage(StrictModel):
    """Scales each (norm or Linear) -> Linears pair so that a later stage's quantization loses less; quantizes
    nothing itself."""

    type: Literal["awq"]
    targets: list[str] = ["Linear"]  # pairs whose every balance Linear matches are scaled
    ignore: list[str] = []
    n_grid: int = Field(20, gt=1)
    duo_scaling: bool = True
    clip_search: bool = False
    max_shrink: float = Field(0.5, gt=0, lt=1)  # the clip search tries ranges down to (1 - max_shrink) x max
    needs_calibration: ClassVar[bool] = True


class SmoothQuantStage(StrictModel):
    """Moves activation outliers into the weights: per scaling pair, s_j = max|x_j|^alpha / max|w_j|^(1-alpha)
    divides the preceding norm (or Linear) and multiplies the balance Linears' input columns, so the model in full
    precision is unchanged and a later W8A8 stage quantizes smoother activations; quantizes nothing itself."""

    type: Literal["smoothquant"]
    alpha: float = Field(0.5, ge=0, le=1)  # smoothing strength: 0 leaves activations, 1 moves all range to weights
    targets: list[str] = ["Linear"]  # pairs whose every balance Linear matches are smoothed
    ignore: list[str] = []
    needs_calibration: ClassVar[bool] = True


class KVCacheConfig(StrictModel):
    """Keys and values quantized as the attention stores them, with scales calibrated per layer: one per tensor,
    or one per KV head."""

    dtype: Literal["fp8", "int8"] = "fp8"
    strategy: Literal["tensor", "head"] = "tensor"

    @property
    def args(self) -> QuantArgs:
        strategy = "tensor" if self.strategy == "tensor" else "channel"  # heads lie on dim 0 of [heads, -1]
        return QuantArgs(num_bits=8, type="float" if self.dtype == "fp8" else "int", strategy=strategy)


Stage = Annotated[RTNStage | GPTQStage | AWQStage | SmoothQuantStage, Field(discriminator="type")]
WEIGHT_STAGES = (RTNStage, GPTQStage)
TRANSFORM_STAGES = (AWQStage, SmoothQuantStage)
STAGE_TYPES = ("rtn", "gptq", "awq", "smoothquant")


class PerplexityEval(StrictModel):
    dataset: str
    seq_len: int = Field(1024, gt=0)
    max_windows: int | None = Field(40, gt=0)


class BusinessEval(StrictModel):
    dataset: str
    limit: int | None = Field(None, gt=0)


class LmEvalTasks(StrictModel):
    names: list[str] = Field(min_length=1)
    limit: float | None = Field(None, gt=0)


class GateConfig(StrictModel):
    """Thresholds every quantized target must hold against the baseline."""

    min_recovery: float | None = Field(None, gt=0)
    max_perplexity_increase: float | None = Field(None, ge=0)
    max_kl: float | None = Field(None, ge=0)
    min_agreement: float | None = Field(None, ge=0, le=1)


class EvalConfig(StrictModel):
    perplexity: PerplexityEval | None = None
    business: BusinessEval | None = None
    tasks: LmEvalTasks | None = None
    gate: GateConfig | None = None
    baseline: bool = True

    @model_validator(mode="after")
    def _gate_has_its_metrics(self) -> "EvalConfig":
        gate = self.gate
        if gate is None:
            return self
        if not self.baseline:
            raise ValueError("gate: compares against the baseline, so it needs baseline: true")
        requirements = {
            "min_recovery": (self.business or self.tasks, "eval.business or eval.tasks"),
            "max_perplexity_increase": (self.perplexity, "eval.perplexity"),
            "max_kl": (self.business, "eval.business"),
            "min_agreement": (self.business, "eval.business"),
        }
        for threshold, (measured, source) in requirements.items():
            if getattr(gate, threshold) is not None and not measured:
                raise ValueError(f"gate.{threshold}: needs {source} to be measured")
        return self


class ExportConfig(StrictModel):
    format: Literal["compressed-tensors", "gptq", "awq"] = "compressed-tensors"
    checkpoint_format: Literal["gptq", "gptq_v2"] = "gptq"  # format gptq: v1 stores zero - 1, v2 exact zeros
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"


class DraftConfig(StrictModel):
    """Draft heads trained on the quantized model, by self-distillation on `prompts` (never the evaluation set)."""

    method: Literal["medusa", "eagle"] = "medusa"
    num_heads: int = Field(4, gt=0, le=8)  # Medusa heads
    # JSONL prompt files, each self-distilled and cached on its own: the project's templated requests and the
    # requests the default model itself writes (calib_data/README.md)
    prompts: list[str] = ["calib_data/draft_prompts.jsonl", "calib_data/sampled_prompts.jsonl"]
    num_prompts: int | None = Field(None, gt=0)  # at most this many prompts of each file; None: all of them
    max_tokens: int = Field(128, gt=0)  # answer length generated per prompt
    steps: int | None = Field(None, gt=0)  # default: 300 for Medusa, 6000 for EAGLE (~25 min for SmolLM2 on 2 cores)
    batch_size: int | None = Field(None, gt=0)  # rows (tokens) per step, default 128; EAGLE: windows of 128 tokens, default 512
    lr: float = Field(1e-3, gt=0)
    unroll: int = Field(3, gt=0, le=8)  # EAGLE: drafting steps unrolled in training, each fed the previous one's guess
    seed: int = 0

    @field_validator("prompts", mode="before")
    @classmethod
    def _one_file_or_many(cls, value):
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _method_defaults(self) -> "DraftConfig":
        eagle = self.method == "eagle"
        self.steps = self.steps or (6000 if eagle else 300)
        self.batch_size = self.batch_size or (512 if eagle else 128)
        return self


class Recipe(StrictModel):
    model: str = "smollm2-135m"
    output: str
    calibration: CalibrationConfig | None = None
    stages: list[Stage]  # may be empty when only the KV cache is quantized
    kv_cache: KVCacheConfig | None = None
    eval: EvalConfig = EvalConfig()
    export: ExportConfig = ExportConfig()
    draft: DraftConfig | None = None

    @model_validator(mode="after")
    def _stage_order_and_data(self) -> "Recipe":
        if not self.stages and self.kv_cache is None:
            raise ValueError("stages: list at least one stage (an empty list needs a kv_cache section)")
        for index, stage in enumerate(self.stages):
            if isinstance(stage, TRANSFORM_STAGES):
                before, after = self.stages[:index], self.stages[index + 1 :]
                if any(isinstance(s, WEIGHT_STAGES) for s in before):
                    raise ValueError(f"stages.{index} ({stage.type}) must come before the stages that quantize (rtn, gptq)")
                if not any(isinstance(s, WEIGHT_STAGES) for s in after):
                    raise ValueError(f"stages.{index} ({stage.type}) must be followed by a stage that quantizes (rtn or gptq)")
            if stage.needs_calibration and self.calibration is None:
                reason = "static input_activations need calibrated scales" if isinstance(stage, RTNStage) else "it observes data"
                raise ValueError(f"stages.{index} ({stage.type}) needs a calibration section: {reason}")
        if self.kv_cache is not None and self.calibration is None:
            raise ValueError("kv_cache needs a calibration section: k_scale and v_scale are calibrated")
        self._check_export()
        return self

    @property
    def needs_calibration(self) -> bool:
        return self.kv_cache is not None or any(stage.needs_calibration for stage in self.stages)

    def _check_export(self) -> None:
        formats = {stage.weights for stage in self.stages if isinstance(stage, WEIGHT_STAGES)}
        fmt = self.export.format
        for index, stage in enumerate(self.stages):
            if isinstance(stage, WEIGHT_STAGES) and stage.weights.actorder == "group" and fmt != "gptq":
                raise ValueError(
                    f"stages.{index}.weights.actorder: 'group' needs a g_idx tensor, which only export.format gptq "
                    f"carries (compressed-tensors dropped it); use actorder: static"
                )
        if fmt == "compressed-tensors":
            return
        for index, stage in enumerate(self.stages):
            if isinstance(stage, WEIGHT_STAGES) and (stage.input_activations or stage.weights.type == "float"):
                raise ValueError(f"export.format {fmt}: holds int weight-only formats; stages.{index} needs compressed-tensors")
        if self.kv_cache is not None:
            raise ValueError(f"export.format {fmt}: cannot hold kv_cache scales; use compressed-tensors")
        if len(formats) > 1:
            raise ValueError(f"export.format {fmt}: its config holds one weight format, the stages use {len(formats)}")
        args = next(iter(formats))
        if fmt == "gptq" and args.strategy == "tensor":
            raise ValueError("export.format gptq: needs strategy group or channel")
        if fmt == "gptq" and self.export.checkpoint_format == "gptq" and not args.symmetric:
            raise ValueError(
                "export.checkpoint_format gptq (v1) stores zero - 1 and cannot hold the zero point 0 that asymmetric "
                "groups may need; use checkpoint_format: gptq_v2, or symmetric weights"
            )
        if fmt == "awq" and (args.strategy != "group" or args.num_bits != 4):
            raise ValueError("export.format awq: needs num_bits 4 with strategy group")

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


def eval_config(data: dict, source: str) -> EvalConfig:
    """An eval section built from command-line options, validated like a recipe's."""
    try:
        return EvalConfig.model_validate({key: value for key, value in data.items() if value is not None})
    except ValidationError as error:
        problems = [f"  {'.'.join(str(p) for p in item['loc']) or 'eval'}: {item['msg'].removeprefix('Value error, ')}"
                    for item in error.errors()]
        raise LlmcError(f"invalid {source}:\n" + "\n".join(problems)) from None


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
        location = [part for part in item["loc"] if part not in STAGE_TYPES and not str(part).startswith("function-")]
        message = item["msg"].removeprefix("Value error, ")
        named = [] if location else _path_named_in(message)  # a whole-recipe check names the field it is about
        location = location or named
        field = ".".join(str(part) for part in location) or "(top level)"
        if any(tuple(location[: len(o)]) == o for o in overridden):
            where = "--set"
        else:
            where = f"line {_line_of(root, location)}"
        if item["type"] in ("extra_forbidden", "unexpected_keyword_argument"):  # a model's key, a dataclass's
            message = "unknown key"
        lines.append(f"  {path.name} {where}: {message}" if named else f"  {path.name} {where}: {field}: {message}")
    return "\n".join(lines)


def _path_named_in(message: str) -> list:
    """`stages.2.weights ...` -> ["stages", 2, "weights"] when the message starts with a recipe field path."""
    parts = message.split(" ", 1)[0].rstrip(":").split(".")
    if parts[0] not in Recipe.model_fields:
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
