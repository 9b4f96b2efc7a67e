"""The recipe's `kv_cache` section: keys and values stored in fp8 or int8 with calibrated scales (the algorithm is
`kvcache.py`, kept apart so that reading a recipe does not import transformers' attention)."""
from typing import Literal

from llmc.core.schema import StrictModel
from llmc.quant.qtypes import QuantArgs


class KVCacheConfig(StrictModel):
    """Keys and values quantized as the attention stores them, with scales calibrated per layer: one per tensor,
    or one per KV head."""

    dtype: Literal["fp8", "int8"] = "fp8"
    strategy: Literal["tensor", "head"] = "tensor"

    @property
    def args(self) -> QuantArgs:
        strategy = "tensor" if self.strategy == "tensor" else "channel"  # heads lie on dim 0 of [heads, -1]
        return QuantArgs(num_bits=8, type="float" if self.dtype == "fp8" else "int", strategy=strategy)
