"""The recipe: one YAML file that drives the whole pipeline. Each section's fields live beside the code they
configure; this module assembles them, checks what spans sections, and loads YAML."""
from pathlib import Path
from typing import Annotated, Union

import yaml
from pydantic import Field, PrivateAttr, field_validator, model_validator

from llmc.artifact.export_config import ExportConfig
from llmc.calib.data import CalibrationConfig
from llmc.core.device import DEVICE_PATTERN
from llmc.core.errors import LlmcError
from llmc.core.schema import StrictModel
from llmc.core.validation import loaded_document, located
from llmc.draft.config import DraftConfig
from llmc.evals.config import EvalConfig
from llmc.quant import autoround, awq, gptq, rotate, rtn, smoothquant  # noqa: F401  (importing an algorithm's module registers its stage)
from llmc.quant.gptq import GPTQStage
from llmc.quant.kvcache_config import KVCacheConfig
from llmc.quant.lm_head import LMHeadConfig
from llmc.quant.rtn import RTNStage
from llmc.quant.stage import StageRole, stage_types

# the union of every registered stage's section; `X | Y` would need the members spelled out
StageConfig = Annotated[Union[tuple(stage.config for stage in stage_types())], Field(discriminator="type")]  # noqa: UP007
WEIGHT_STAGES = tuple(stage.config for stage in stage_types(StageRole.WEIGHT))
TRANSFORM_STAGES = tuple(stage.config for stage in stage_types(StageRole.TRANSFORM))
WEIGHT_TYPES = tuple(stage.name for stage in stage_types(StageRole.WEIGHT))
STAGE_TYPES = tuple(stage.name for stage in stage_types())


class Recipe(StrictModel):
    model: str = "smollm2-135m"
    output: str
    device: str = "auto"  # where calibration, the stages and the evals compute: auto, cpu, cuda, cuda:N
    calibration: CalibrationConfig | None = None
    stages: list[StageConfig]  # may be empty when only the KV cache is quantized
    kv_cache: KVCacheConfig | None = None
    lm_head: LMHeadConfig | None = None  # None: the LM head stays in the export dtype
    eval: EvalConfig = EvalConfig()
    export: ExportConfig = ExportConfig()
    draft: DraftConfig | None = None
    _source: tuple = PrivateAttr(default=())  # (path, YAML node tree, overridden paths) when loaded from a file

    @field_validator("device")
    @classmethod
    def _device_spelled(cls, device: str) -> str:
        if not DEVICE_PATTERN.fullmatch(device):
            raise ValueError(f"expected auto, cpu, cuda or cuda:N, got {device!r}")
        return device

    @model_validator(mode="after")
    def _stage_order_and_data(self) -> "Recipe":
        if self.lm_head is not None and self.export.format != "compressed-tensors":
            raise ValueError(f"lm_head: a quantized LM head is written in compressed-tensors only ({self.export.format} "
                             "loaders expect the head unquantized)")
        if not self.stages and self.kv_cache is None:
            raise ValueError("stages: list at least one stage (an empty list needs a kv_cache section)")
        for index, stage in enumerate(self.stages):
            if getattr(stage, "rewrites_source", False) and index > 0:
                raise ValueError(f"stages.{index} ({stage.type}) changes the checkpoint as it is read, so it must be the first stage")
            if isinstance(stage, TRANSFORM_STAGES):
                before, after = self.stages[:index], self.stages[index + 1 :]
                if any(isinstance(s, WEIGHT_STAGES) for s in before):
                    raise ValueError(f"stages.{index} ({stage.type}) must come before the stages that quantize "
                                     f"({', '.join(WEIGHT_TYPES)})")
                if not any(isinstance(s, WEIGHT_STAGES) for s in after):
                    raise ValueError(f"stages.{index} ({stage.type}) must be followed by a stage that quantizes "
                                     f"({' or '.join(WEIGHT_TYPES)})")
            if stage.needs_calibration and self.calibration is None:
                reason = "static input_activations need calibrated scales" if isinstance(stage, RTNStage) else "it observes data"
                raise ValueError(f"stages.{index} ({stage.type}) needs a calibration section: {reason}")
        if self.kv_cache is not None and self.calibration is None:
            raise ValueError("kv_cache needs a calibration section: k_scale and v_scale are calibrated")
        gate = self.eval.gate
        if gate is not None and gate.min_accepted_length is not None and self.draft is None:
            raise ValueError("eval.gate.min_accepted_length: measures the draft, so it needs a draft section")
        self._check_export()
        return self

    @property
    def needs_calibration(self) -> bool:
        return self.kv_cache is not None or any(stage.needs_calibration for stage in self.stages)

    @property
    def gptq_dampening_frac(self) -> float | None:
        return next((stage.dampening_frac for stage in self.stages if isinstance(stage, GPTQStage)), None)

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

    def __eq__(self, other: object) -> bool:
        """The same fields make the same recipe, wherever it was read from."""
        return isinstance(other, Recipe) and self.model_dump() == other.model_dump()

    def field_error(self, location: tuple, error: LlmcError) -> LlmcError:
        """error, said of the recipe field at location, with its YAML line (or --set) when the recipe came from a file."""
        message = str(error)
        if self._source:
            return LlmcError(located(*self._source, location, message))
        return LlmcError(f"{'.'.join(map(str, location))}: {message}")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", exclude_none=False), sort_keys=False)


def load_recipe(path: Path, overrides: list[str] = (), output: str | None = None) -> Recipe:
    return loaded_document(Recipe, path, overrides, output, "recipe", "model, output, stages", union_tags=STAGE_TYPES)
