"""Recipe stages turned into quantizers, and the checks that run before any work starts."""
import math

import torch
from torch import nn

from llmc.errors import LlmcError
from llmc.quant.rtn import RTNQuantizer
from llmc.quant.targets import select
from llmc.recipe import Recipe

FITTING_GROUP_SIZES = (32, 64, 128, 256)


def build_quantizers(recipe: Recipe, scale_dtype: torch.dtype) -> list[RTNQuantizer]:
    return [RTNQuantizer(stage, scale_dtype) for stage in recipe.stages]


def assign_linears(quantizers: list, linears: dict[str, nn.Linear]) -> list[dict[str, nn.Linear]]:
    """Which Linears each stage quantizes; a Linear belongs to at most one quantizing stage."""
    assigned: dict[str, int] = {}
    per_stage = []
    for index, quantizer in enumerate(quantizers):
        chosen = select(linears, quantizer.config.targets, quantizer.config.ignore)
        for name in chosen:
            if name in assigned:
                raise LlmcError(f"stages {assigned[name]} and {index} both quantize {name}; narrow their targets")
            assigned[name] = index
        per_stage.append(chosen)
    return per_stage


def check_group_sizes(quantizers: list, per_stage: list[dict[str, nn.Linear]]) -> None:
    problems = []
    for index, (quantizer, linears) in enumerate(zip(quantizers, per_stage)):
        args = quantizer.config.weights
        if args.strategy != "group":
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
