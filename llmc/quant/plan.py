"""The quantization plan: which stage quantizes which Linear, in which weight and input-activation format, worked out
once for the whole model before any weight is read. The layer-by-layer driver follows it and the exporter writes
its formats."""
import math
from dataclasses import dataclass

from torch import nn

from llmc.core.errors import LlmcError
from llmc.quant.qtypes import QuantArgs
from llmc.quant.stage import StageRole, StageRun
from llmc.quant.targets import select

FITTING_GROUP_SIZES = (32, 64, 128, 256)


@dataclass
class QuantizationPlan:
    stage_targets: list[set[str]]  # per stage, the full names of the Linears it works on
    weights: dict[str, QuantArgs]  # every quantized Linear's weight format
    input_activations: dict[str, QuantArgs]  # the Linears whose inputs are quantized (W8A8, FP8)

    def stage_linears(self, index: int, linears: dict[str, nn.Linear]) -> dict[str, nn.Linear]:
        """Stage `index`'s Linears among `linears` (one layer's, by full name)."""
        return {name: linear for name, linear in linears.items() if name in self.stage_targets[index]}

    def layer_weights(self, linears: dict[str, nn.Linear]) -> dict[str, QuantArgs]:
        return {name: self.weights[name] for name in linears if name in self.weights}

    def layer_activations(self, linears: dict[str, nn.Linear]) -> dict[str, QuantArgs]:
        return {name: self.input_activations[name] for name in linears if name in self.input_activations}


def build_plan(stages: list[StageRun], linears: dict[str, nn.Linear], kv_only: bool = False) -> QuantizationPlan:
    """The plan over `linears` (every decoder layer's, by full name); a Linear is quantized by at most one stage."""
    # a stage without targets (rotate) changes the whole model
    per_stage = [select(linears, stage.config.targets, stage.config.ignore) if hasattr(stage.config, "targets") else set(linears)
                 for stage in stages]
    quantizing = [(index, stage, chosen) for index, (stage, chosen) in enumerate(zip(stages, per_stage))
                  if stage.role is StageRole.WEIGHT]
    owner: dict[str, int] = {}
    for index, _, chosen in quantizing:
        for name in chosen:
            if name in owner:
                raise LlmcError(f"stages {owner[name]} and {index} both quantize {name}; narrow their targets")
            owner[name] = index
    check_group_sizes(quantizing)
    weights = {name: stage.config.weights for _, stage, chosen in quantizing for name in chosen}
    if not weights and not kv_only:
        raise LlmcError("the recipe's stages target no Linear layer; check their targets and ignore lists")
    activations = {
        name: stage.config.input_activations
        for _, stage, chosen in quantizing
        if stage.config.input_activations is not None
        for name in chosen
    }
    return QuantizationPlan([set(chosen) for chosen in per_stage], weights, activations)


def check_group_sizes(quantizing: list[tuple[int, StageRun, dict[str, nn.Linear]]]) -> None:
    problems = []
    for index, stage, linears in quantizing:
        args = stage.config.weights
        if not args.grouped:
            continue
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
