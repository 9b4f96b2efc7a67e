"""The artifact's weight layout, as the recipe's `export` section chooses: compressed-tensors, or the legacy
AutoGPTQ/GPTQModel and AutoAWQ layouts for older loaders."""
import re
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch

from llmc.artifact.awq_format import awq_config, awq_tensors
from llmc.artifact.compressed_tensors import compressed_tensors_tensors, quantization_config
from llmc.artifact.gptq_format import gptq_config, gptq_tensors
from llmc.quant.qtypes import QuantArgs, QuantizedWeight
from llmc.recipe import GPTQStage, Recipe

LEGACY_SCALE_DTYPE = torch.float16  # both legacy layouts store fp16 scales: quantize against exactly those


@dataclass
class Exporter:
    tensors: Callable[[str, QuantizedWeight], dict[str, torch.Tensor]]
    # (plan, every Linear, input-activation formats) -> quantization_config
    config: Callable[[dict[str, QuantArgs], list[str], dict[str, QuantArgs]], dict]
    scale_dtype: torch.dtype | None = None  # None: the export dtype
    extra_files: list[str] = field(default_factory=list)  # files that repeat the quantization_config


def exporter_for(recipe: Recipe) -> Exporter:
    export = recipe.export
    if export.format == "compressed-tensors":
        kv_cache = recipe.kv_cache.args if recipe.kv_cache else None
        return Exporter(compressed_tensors_tensors, partial(quantization_config, kv_cache=kv_cache))
    if export.format == "awq":
        def config(plan: dict[str, QuantArgs], all_linears: list[str], activations: dict) -> dict:
            return awq_config(next(iter(plan.values()))) | {"modules_to_not_convert": _skipped(plan, all_linears) or None}

        return Exporter(awq_tensors, config, LEGACY_SCALE_DTYPE)
    dampening = next((stage.dampening_frac for stage in recipe.stages if isinstance(stage, GPTQStage)), None)

    def config(plan: dict[str, QuantArgs], all_linears: list[str], activations: dict) -> dict:
        # GPTQModel's per-module override: "-:<regex>" leaves a module unquantized
        skipped = {f"-:^{re.escape(name)}$": {} for name in _skipped(plan, all_linears)}
        return gptq_config(next(iter(plan.values())), export.checkpoint_format, dampening) | {"dynamic": skipped or None}

    tensors = partial(gptq_tensors, checkpoint_format=export.checkpoint_format)
    return Exporter(tensors, config, LEGACY_SCALE_DTYPE, ["quantize_config.json"])


def _skipped(plan: dict[str, QuantArgs], all_linears: list[str]) -> list[str]:
    return sorted(name for name in all_linears if name not in plan and name != "lm_head")
