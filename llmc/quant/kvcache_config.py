"""The recipe's `kv_cache` section: keys and values stored in fp8, int8 or nvfp4 with calibrated scales (the algorithm
is `kvcache.py`, kept apart so that reading a recipe does not import transformers' attention)."""
from typing import Literal

from pydantic import model_validator

from llmc.core.schema import StrictModel
from llmc.quant.qtypes import QuantArgs
from llmc.quant.schemes import ACTIVATION_PRESETS


class KVCacheConfig(StrictModel):
    """Keys and values quantized as the attention stores them, with scales calibrated per layer: one per tensor,
    or one per KV head. nvfp4: NVFP4's activation format along each head's features (groups of 16, their float8
    scales computed as the values are stored) under one calibrated global scale per tensor."""

    dtype: Literal["fp8", "int8", "nvfp4"] = "fp8"
    strategy: Literal["tensor", "head"] = "tensor"

    @model_validator(mode="after")
    def _one_global_scale(self):
        if self.dtype == "nvfp4" and self.strategy == "head":
            raise ValueError("kv_cache.strategy head: nvfp4 has one global scale per tensor (its group scales are per 16 "
                             "features); use strategy tensor, or fp8 / int8 for a scale per KV head")
        return self

    @property
    def args(self) -> QuantArgs:
        if self.dtype == "nvfp4":
            return QuantArgs(**ACTIVATION_PRESETS["NVFP4"])
        strategy = "tensor" if self.strategy == "tensor" else "channel"  # heads lie on dim 0 of [heads, -1]
        return QuantArgs(num_bits=8, type="float" if self.dtype == "fp8" else "int", strategy=strategy)
