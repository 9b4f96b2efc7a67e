"""The recipe's `export` section: the artifact's weight layout and dtype (the exporters are `export.py`, kept apart
so that reading a recipe does not import compressed-tensors)."""
from typing import Literal

from llmc.core.schema import StrictModel


class ExportConfig(StrictModel):
    format: Literal["compressed-tensors", "gptq", "awq"] = "compressed-tensors"
    checkpoint_format: Literal["gptq", "gptq_v2"] = "gptq"  # format gptq: v1 stores zero - 1, v2 exact zeros
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
