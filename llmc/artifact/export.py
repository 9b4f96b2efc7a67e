"""The artifact's weight layout, as the recipe's `export` section chooses: compressed-tensors, or the legacy
AutoGPTQ/GPTQModel and AutoAWQ layouts for older loaders."""
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from llmc.artifact.awq_format import awq_config, awq_tensors
from llmc.artifact.compressed_tensors import compressed_tensors_tensors, quantization_config
from llmc.artifact.export_config import ExportConfig
from llmc.artifact.gptq_format import gptq_config, gptq_tensors
from llmc.quant.plan import QuantizationPlan
from llmc.quant.qtypes import QuantArgs, QuantizedWeight

LEGACY_SCALE_DTYPE = torch.float16  # both legacy layouts store fp16 scales: quantize against exactly those


@dataclass
class Exporter:
    tensors: Callable[[str, QuantizedWeight], dict[str, torch.Tensor]]
    config: Callable[[QuantizationPlan, list[str]], dict]  # (plan, every Linear's name) -> quantization_config
    scale_dtype: torch.dtype | None = None  # None: the export dtype
    extra_files: list[str] = field(default_factory=list)  # files that repeat the quantization_config


def exporter_for(export: ExportConfig, kv_cache: QuantArgs | None, dampening_frac: float | None) -> Exporter:
    """dampening_frac: the GPTQ stage's, recorded in the legacy GPTQ config (None without one)."""
    if export.format == "compressed-tensors":
        def config(plan: QuantizationPlan, all_linears: list[str]) -> dict:
            return quantization_config(plan.weights, all_linears, plan.input_activations, kv_cache=kv_cache)

        return Exporter(compressed_tensors_tensors, config)
    if export.format == "awq":
        def config(plan: QuantizationPlan, all_linears: list[str]) -> dict:
            skipped = _skipped(plan.weights, all_linears)
            return awq_config(next(iter(plan.weights.values()))) | {"modules_to_not_convert": skipped or None}

        return Exporter(awq_tensors, config, LEGACY_SCALE_DTYPE)

    def config(plan: QuantizationPlan, all_linears: list[str]) -> dict:
        # GPTQModel's per-module override: "-:<regex>" leaves a module unquantized
        skipped = {f"-:^{re.escape(name)}$": {} for name in _skipped(plan.weights, all_linears)}
        return gptq_config(next(iter(plan.weights.values())), export.checkpoint_format, dampening_frac) | {"dynamic": skipped or None}

    tensors = partial(gptq_tensors, checkpoint_format=export.checkpoint_format)
    return Exporter(tensors, config, LEGACY_SCALE_DTYPE, ["quantize_config.json"])


def _skipped(plan: dict[str, QuantArgs], all_linears: list[str]) -> list[str]:
    return sorted(name for name in all_linears if name not in plan and name != "lm_head")
