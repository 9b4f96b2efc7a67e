"""Round-to-nearest: each targeted Linear's weight quantized on its own min/max range. Needs no data."""
import torch
from torch import nn

from llmc.calib.layer import LayerWork
from llmc.quant.qtypes import QuantizedWeight, quantize_weight
from llmc.recipe import RTNStage


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
