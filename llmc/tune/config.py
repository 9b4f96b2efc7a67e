"""`llmc tune`'s YAML: the model and calibration as a recipe has them, the candidate formats each Linear may take,
the algorithm that quantizes them, the gate every answer must pass, and what "best" means (the objective)."""
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from llmc.calib.data import CalibrationConfig
from llmc.core.device import DEVICE_PATTERN
from llmc.core.schema import StrictModel
from llmc.core.validation import loaded_document
from llmc.draft.config import DraftConfig
from llmc.evals.config import EvalConfig
from llmc.pipeline.recipe import Recipe
from llmc.quant.qtypes import QuantArgs
from llmc.quant.schemes import PRESET_SCHEMES, resolve_activation_args
from llmc.tune.hardware import GPUS, Gpu

KEEP = "keep"  # the candidate that leaves a Linear unquantized, in the export dtype


class Candidate(StrictModel):
    """One format a Linear may take: a scheme preset, with fields of its own on top (or `keep`)."""

    scheme: str
    weights: dict[str, Any] = {}  # e.g. {group_size: 64}
    name: str | None = None  # the label in the report (default: the scheme, with -g<group_size> when set)

    @field_validator("scheme")
    @classmethod
    def _known(cls, scheme: str) -> str:
        if scheme != KEEP and scheme not in PRESET_SCHEMES:
            raise ValueError(f"unknown scheme {scheme!r}; known: {KEEP}, {', '.join(PRESET_SCHEMES)}")
        return scheme

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        group = self.weights.get("group_size")
        return f"{self.scheme}-g{group}" if group else self.scheme

    @property
    def keep(self) -> bool:
        return self.scheme == KEEP


DEFAULT_CANDIDATES = [KEEP, "W8A16", "W8A8", "FP8_DYNAMIC", {"scheme": "W4A16", "weights": {"group_size": 128}},
                      {"scheme": "W4A16", "weights": {"group_size": 64}}, "NVFP4A16", "MXFP4A16"]


class GpuObjective(StrictModel):
    """Batch-1 decode on a GPU not at hand: time = bytes read / memory bandwidth (docs/tune.md)."""

    gpu: str
    bandwidth_gb_s: float | None = Field(None, gt=0)  # default: the GPU's from the table

    @model_validator(mode="after")
    def _known(self) -> "GpuObjective":
        if self.gpu not in GPUS and self.bandwidth_gb_s is None:
            raise ValueError(f"objective.gpu: {self.gpu!r} is not in the table ({', '.join(GPUS)}); give bandwidth_gb_s")
        return self

    @property
    def target(self) -> Gpu:
        known = GPUS.get(self.gpu)
        bandwidth = self.bandwidth_gb_s or known.bandwidth_gb_s
        return Gpu(self.gpu, bandwidth, known.arch if known else "unknown")


class TuneConfig(StrictModel):
    model: str = "smollm2-135m"
    output: str
    device: str = "auto"
    calibration: CalibrationConfig = CalibrationConfig()
    candidates: list[Candidate] = Field(DEFAULT_CANDIDATES, min_length=2, validate_default=True)
    transforms: list[dict[str, Any]] = []  # stages before the quantizing one, as a recipe writes them (awq, smoothquant, rotate)
    algorithm: dict[str, Any] = {"type": "rtn"}  # the quantizing stage's fields but scheme and targets, e.g. {type: gptq}
    eval: EvalConfig
    # smallest: fewest bytes; this-machine: fastest batch-1 decode, each Linear's kernel timed here; {gpu: H100}
    objective: Literal["smallest", "this-machine"] | GpuObjective = "smallest"
    max_evaluations: int = Field(12, ge=1)  # full quantize-and-evaluate runs, the uniform recipes' included
    uniform: bool = True  # evaluate every candidate alone too (the comparison and the chart need them)
    match_cost_of: list[str] = []  # candidate labels: also evaluate the best mix predicted at each one's cost
    sensitivity_samples: int = Field(8, gt=0)  # calibration samples the per-Linear sensitivity is measured on
    draft: DraftConfig | None = None  # heads trained on the winner; gate.min_accepted_length is checked on them
    _source: tuple = PrivateAttr(default=())

    @field_validator("candidates", mode="before")
    @classmethod
    def _shorthand(cls, candidates: Any) -> Any:
        if isinstance(candidates, list):
            return [{"scheme": item} if isinstance(item, str) else item for item in candidates]
        return candidates

    @field_validator("device")
    @classmethod
    def _device_spelled(cls, device: str) -> str:
        if not DEVICE_PATTERN.fullmatch(device):
            raise ValueError(f"expected auto, cpu, cuda or cuda:N, got {device!r}")
        return device

    @model_validator(mode="after")
    def _consistent(self) -> "TuneConfig":
        if self.eval.gate is None:
            raise ValueError("eval.gate: a tune searches for the cheapest mix that passes a gate; give one")
        if not self.eval.baseline:
            raise ValueError("eval.baseline: the gate compares with the base model; leave it true")
        if self.eval.gate.min_accepted_length is not None and self.draft is None:
            raise ValueError("eval.gate.min_accepted_length: measures the draft, so it needs a draft section")
        labels = [candidate.label for candidate in self.candidates]
        repeated = sorted({label for label in labels if labels.count(label) > 1})
        if repeated:
            raise ValueError(f"candidates: {', '.join(repeated)} listed twice; give one a name")
        if sum(not candidate.keep for candidate in self.candidates) == 0:
            raise ValueError("candidates: list at least one scheme besides keep")
        unknown = [label for label in self.match_cost_of if label not in labels]
        if unknown:
            raise ValueError(f"match_cost_of: {', '.join(unknown)} not among the candidates ({', '.join(labels)})")
        for index, candidate in enumerate(self.candidates):
            if not candidate.keep:
                self._check_candidate(index, candidate)
        return self

    def _check_candidate(self, index: int, candidate: Candidate) -> None:
        try:
            stage = self.weight_stage(candidate, ["Linear"])
            Recipe.model_validate(self.recipe_data("check", [stage]))
        except ValidationError as error:
            problems = "; ".join(f"{'.'.join(map(str, item['loc'][-2:]))}: {item['msg'].removeprefix('Value error, ')}"
                                 for item in error.errors())
            raise ValueError(f"candidates.{index} ({candidate.label}) with algorithm {self.algorithm.get('type')}: {problems}") from None
        activations = resolve_activation_args(stage["scheme"], stage.get("input_activations"))
        if activations is not None and activations.get("dynamic") is not True:
            raise ValueError(f"candidates.{index} ({candidate.label}): its inputs take a calibrated (global) scale, which "
                             "a Linear's sensitivity alone is not measured with; use a dynamic scheme (FP8_DYNAMIC, W8A8)")

    def weight_stage(self, candidate: Candidate, targets: list[str]) -> dict:
        """The quantizing stage of a recipe that puts `targets` in the candidate's format."""
        weights = {**self.algorithm.get("weights", {}), **candidate.weights}
        return {**self.algorithm, "scheme": candidate.scheme, "weights": weights, "targets": targets}

    def recipe_data(self, output: str, weight_stages: list[dict]) -> dict:
        """A plain recipe: the transforms, then one quantizing stage per format; evals, gate and draft as the tune's.
        The calibration section only where a stage needs data (it would only measure each layer's error, at a cost)."""
        data = {
            "model": self.model, "output": output, "device": self.device,
            "calibration": self.calibration.model_dump(mode="json"),
            "stages": [*self.transforms, *weight_stages],
            "eval": self.eval.model_dump(mode="json", exclude_none=True),
            "draft": None if self.draft is None else self.draft.model_dump(mode="json"),
        }
        if weight_stages and not Recipe.model_validate(data).needs_calibration:
            del data["calibration"]
        return data

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def load_tune(path: Path, overrides: list[str] = (), output: str | None = None) -> TuneConfig:
    return loaded_document(TuneConfig, path, overrides, output, "tune file", "model, output, candidates, eval, objective")


def candidate_formats(config: TuneConfig) -> dict[str, tuple[QuantArgs, QuantArgs | None] | None]:
    """Each candidate's weight and input-activation formats as its recipe stage resolves them (None: keep)."""
    formats = {}
    for candidate in config.candidates:
        if candidate.keep:
            formats[candidate.label] = None
            continue
        recipe = Recipe.model_validate(config.recipe_data("check", [config.weight_stage(candidate, ["Linear"])]))
        stage = recipe.stages[-1]
        formats[candidate.label] = (stage.weights, stage.input_activations)
    return formats
