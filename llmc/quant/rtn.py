"""Round-to-nearest: each targeted Linear's weight quantized on its own min/max range. Needs no data."""
from typing import Literal

import torch
from pydantic import model_validator

from llmc.quant.layer import LayerWork
from llmc.quant.qtypes import QuantizedWeight, global_scale_of, quantize_weight
from llmc.quant.stage import StageRole, StageRun, register_stage
from llmc.quant.weight_stage import WeightStage


class RTNStage(WeightStage):
    type: Literal["rtn"]

    @model_validator(mode="after")
    def _no_actorder(self) -> "RTNStage":
        if self.weights.actorder is not None:
            raise ValueError("weights.actorder needs a Hessian; use type: gptq")
        return self


class RTNRun(StageRun):
    config: RTNStage

    def process(self, work: LayerWork) -> dict[str, QuantizedWeight]:
        results = {}
        for names in self.family.fused_groups(list(work.linears)):
            global_scale = None
            if self.config.weights.strategy == "tensor_group":  # one global scale for Linears engines stack (NVFP4)
                global_scale = global_scale_of(torch.stack([work.linears[name].weight.abs().amax() for name in names]))
            for name in names:
                linear = work.linears[name]
                quantized = quantize_weight(linear.weight.data, self.config.weights, self.scale_dtype, global_scale)
                linear.weight.data = quantized.dequantize().to(linear.weight.dtype)
                results[name] = quantized
        return results


register_stage(RTNStage, RTNRun, StageRole.WEIGHT)
