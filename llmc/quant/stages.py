"""Recipe stages turned into quantizers, and the checks that run before any work starts."""
import math

import torch
from torch import nn

from llmc.errors import LlmcError
from llmc.models.families import Family
from llmc.quant.awq import AWQTransform
from llmc.quant.gptq import GPTQQuantizer
from llmc.quant.qtypes import QuantArgs
from llmc.quant.rtn import RTNQuantizer
from llmc.quant.smoothquant import SmoothQuantTransform
from llmc.quant.targets import select
from llmc.recipe import AWQStage, GPTQStage, Recipe, SmoothQuantStage

FITTING_GROUP_SIZES = (32, 64, 128, 256)


def build_stages(recipe: Recipe, scale_dtype: torch.dtype, family: Family) -> list:
    def build(stage):
        if isinstance(stage, AWQStage):
            return AWQTransform(stage, family)
        if isinstance(stage, SmoothQuantStage):
            return SmoothQuantTransform(stage, family)
        if isinstance(stage, GPTQStage):
            return GPTQQuantizer(stage, scale_dtype)
        return RTNQuantizer(stage, scale_dtype)

    return [build(stage) for stage in recipe.stages]


def assign_linears(stages: list, linears: dict[str, nn.Linear]) -> list[dict[str, nn.Linear]]:
    """The Linears each stage targets; a Linear is quantized by at most one stage."""
    assigned: dict[str, int] = {}
    per_stage = []
    for index, stage in enumerate(stages):
        chosen = select(linears, stage.config.targets, stage.config.ignore)
        if not stage.quantizes:
            per_stage.append(chosen)
            continue
        for name in chosen:
            if name in assigned:
                raise LlmcError(f"stages {assigned[name]} and {index} both quantize {name}; narrow their targets")
            assigned[name] = index
        per_stage.append(chosen)
    return per_stage


def formats_of(stages: list, per_stage: list[dict[str, nn.Linear]]) -> dict[str, QuantArgs]:
    """Each quantized Linear's format, from the stages that quantize."""
    return {name: stage.config.weights for stage, chosen in zip(stages, per_stage) if stage.quantizes for name in chosen}


def activations_of(stages: list, per_stage: list[dict[str, nn.Linear]]) -> dict[str, QuantArgs]:
    """The Linears whose inputs are quantized (W8A8, FP8), with the activations' format."""
    return {
        name: stage.config.input_activations
        for stage, chosen in zip(stages, per_stage)
        if stage.quantizes and stage.config.input_activations is not None
        for name in chosen
    }


def check_group_sizes(stages: list, per_stage: list[dict[str, nn.Linear]]) -> None:
    problems = []
    for index, (stage, linears) in enumerate(zip(stages, per_stage)):
        if not stage.quantizes or stage.config.weights.strategy != "group":
            continue
        args = stage.config.weights
        misfits = {name: linear.in_features for name, linear in linears.items() if linear.in_features % args.group_size}
        if misfits:
            widths = sorted(set(misfits.values()))
            common = math.gcd(*(linear.in_features for linear in linears.values()))
            fitting = [size for size in FITTING_GROUP_SIZES if common % size == 0]
            names = ", ".join(sorted(misfits)[:4]) + (f" and {len(misfits) - 4} more" if len(misfits) > 4 else "")
            advice = f"use group_size {' or '.join(map(str, fitting))}" if fitting else "use strategy: channel"
            problems.append(
                f"stages.{index}.weights.group_size {args.group_size} does not divide the input width "
                f"{'/'.join(map(str, widths))} of {names}; {advice}"
            )
    if problems:
        raise LlmcError("\n".join(problems))
