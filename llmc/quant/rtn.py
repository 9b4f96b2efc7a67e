"""Round-to-nearest: each targeted Linear's weight quantized on its own min/max range. Needs no data."""
from typing import Literal

import torch
from pydantic import model_validator
from torch import nn

from llmc.checkpoints.families import Family
from llmc.quant.layer import LayerWork
from llmc.quant.qtypes import QuantizedWeight, quantize_weight
from llmc.quant.weight_stage import WeightStage


class RTNStage(WeightStage):
    type: Literal["rtn"]

    @model_validator(mode="after")
    def _no_actorder(self) -> "RTNStage":
        if self.weights.actorder is not None:
            raise ValueError("weights.actorder needs a Hessian; use type: gptq")
        return self

    def modifier(self, scale_dtype: torch.dtype, family: Family) -> "RTNQuantizer":
        return RTNQuantizer(self, scale_dtype)


class RTNQuantizer:
    quantizes = True

    def __init__(self, config: RTNStage, scale_dtype: torch.dtype):
        self.config = config
        self.scale_dtype = scale_dtype

    def observed_modules(self, work: LayerWork) -> dict[str, nn.Module]:
        return {}

    def record(self, name: str, inputs: torch.Tensor) -> None:
        raise AssertionError("RTN observes nothing")

    def process(self, work: LayerWork) -> dict[str, QuantizedWeight]:
        results = {}
        for name, linear in work.linears.items():
            quantized = quantize_weight(linear.weight.data, self.config.weights, self.scale_dtype)
            linear.weight.data = quantized.dequantize().to(linear.weight.dtype)
            results[name] = quantized
        return results
