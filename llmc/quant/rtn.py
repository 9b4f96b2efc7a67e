"""Round-to-nearest: each targeted Linear's weight quantized on its own min/max range. Needs no data."""
import torch
from torch import nn

from llmc.quant.qtypes import QuantizedWeight, quantize_weight
from llmc.recipe import RTNStage


class RTNQuantizer:
    needs_calibration = False

    def __init__(self, config: RTNStage, scale_dtype: torch.dtype):
        self.config = config
        self.scale_dtype = scale_dtype

    def quantize_layer(self, linears: dict[str, nn.Linear]) -> dict[str, QuantizedWeight]:
        results = {}
        for name, linear in linears.items():
            quantized = quantize_weight(linear.weight.data, self.config.weights, self.scale_dtype)
            linear.weight.data = quantized.dequantize().to(linear.weight.dtype)
            results[name] = quantized
        return results
