"""A stage: one quantization algorithm as the recipe's `stages:` lists it (`type: gptq`). Its module in llmc/quant
holds its recipe section (a pydantic class with a `type: Literal[...]` field), its run (a StageRun: what the
layer-by-layer driver calls for each decoder layer) and one `register_stage` call; the recipe builds its union of
sections and its order check from this registry, and the pipeline starts each stage's run through it."""
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from typing import get_args

import torch
from pydantic import BaseModel
from torch import nn

from llmc.checkpoints.checkpoint_reader import CheckpointReader
from llmc.checkpoints.families import Family
from llmc.quant.layer import LayerWork
from llmc.quant.qtypes import QuantizedWeight


class StageRole(Enum):
    WEIGHT = "weight"  # quantizes the weights of the Linears it targets: the plan and the exporters take its formats
    TRANSFORM = "transform"  # changes the layer in full precision for a later weight stage, so it comes before one


class StageRun(ABC):
    """A stage as the layer-by-layer driver runs it, built once for the whole model. For each decoder layer the
    driver asks for the modules whose inputs it observes, hands it every calibration batch that reaches them, then
    lets it process the layer; what it recorded lasts that one layer."""

    def __init__(self, config: BaseModel, scale_dtype: torch.dtype, family: Family):
        self.config = config  # the stage's section of the recipe
        self.scale_dtype = scale_dtype  # what the artifact stores quantization scales in
        self.family = family

    @property
    def role(self) -> StageRole:
        return stage_type_of(self.config).role

    def observed_modules(self, work: LayerWork) -> dict[str, nn.Module]:
        """The modules of the layer whose inputs the stage needs to see, by name; none for a data-free stage."""
        return {}

    def record(self, name: str, inputs: torch.Tensor) -> None:
        """One calibration batch reaching the observed module `name`, as float32."""
        raise AssertionError(f"{type(self).__name__} observes nothing")

    def source(self, reader: CheckpointReader, skeleton: nn.Module, config) -> CheckpointReader:
        """The checkpoint as the driver, the later stages and the artifact read it. A stage that changes tensors
        outside the decoder layers (the rotations' embeddings and LM head) returns a reader that rewrites them; it is
        asked before any work, so it refuses a model it cannot change here. The others leave the reader as it is."""
        return reader

    def config_changes(self, config) -> dict:
        """Keys of the artifact's config.json that differ from the checkpoint's once this stage ran."""
        return {}

    @abstractmethod
    def process(self, work: LayerWork) -> dict[str, QuantizedWeight]:
        """Changes the layer in place; returns the weight of each Linear it quantized (none for a transform stage)."""


@dataclass(frozen=True)
class StageType:
    """One registered algorithm: the recipe's `type:` value, its section, its run and its role."""

    name: str
    config: type[BaseModel]
    run: type[StageRun]
    role: StageRole


_registered: dict[str, StageType] = {}


def register_stage(config: type[BaseModel], run: type[StageRun], role: StageRole) -> None:
    """Makes `type: <config's type literal>` a recipe stage, run by `run`."""
    name = get_args(config.model_fields["type"].annotation)[0]
    if name in _registered and _registered[name].config is not config:
        raise ValueError(f"stage type {name!r} is registered by {_registered[name].config.__name__} already")
    _registered[name] = StageType(name, config, run, role)


def stage_types(role: StageRole | None = None) -> list[StageType]:
    """The registered stages (of `role`, when given), by name: the same order whichever module was imported first."""
    chosen = [stage for stage in _registered.values() if role is None or stage.role is role]
    return sorted(chosen, key=lambda stage: stage.name)


def stage_type_of(config: BaseModel) -> StageType:
    return _registered[config.type]


def start_stage(config: BaseModel, scale_dtype: torch.dtype, family: Family) -> StageRun:
    """The run of the stage `config` describes."""
    return stage_type_of(config).run(config, scale_dtype, family)


def source_of(stages: list[StageRun], reader: CheckpointReader, skeleton: nn.Module, config) -> CheckpointReader:
    """The checkpoint as every stage's `source` rewrites it, in the recipe's order."""
    for stage in stages:
        reader = stage.source(reader, skeleton, config)
    return reader
