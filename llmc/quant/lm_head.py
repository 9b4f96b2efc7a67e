"""The LM head quantized into the artifact (the recipe's `lm_head` section): round to nearest on the format's observer
(minmax or mse), weight-only, after the decoder layers. At batch 1 the head is a small model's largest matmul
(SmolLM2-135M: 49,152 x 576, 57 MB in bfloat16, more than the rest of its int4 layers), read in full every token. A
tied head is untied first: the embedding table stays in the export dtype (a step reads one row of it) and the head is
written as a quantized Linear of its own, which compressed-tensors' config covers like any other."""
from typing import Any

import torch
from pydantic import model_validator

from llmc.checkpoints.checkpoint_reader import CheckpointReader
from llmc.checkpoints.families import Family
from llmc.core.schema import StrictModel
from llmc.quant.qtypes import QuantArgs, QuantizedWeight, quantize_weight
from llmc.quant.schemes import resolve_activation_args, resolve_weight_args


class LMHeadConfig(StrictModel):
    """scheme: a weight-only preset (W4A16, W8A16, NVFP4A16, ...), or weights: the format itself."""

    scheme: str | None = None
    weights: QuantArgs = QuantArgs()

    @model_validator(mode="before")
    @classmethod
    def _apply_scheme(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("scheme") is not None:
            if resolve_activation_args(data["scheme"], None) is not None:
                raise ValueError(f"scheme {data['scheme']!r} quantizes inputs; the LM head takes weight-only schemes "
                                 "(W4A16, W8A16, NVFP4A16, MXFP4A16, ...)")
            weights = data.get("weights") or {}
            if isinstance(weights, dict):
                data = {**data, "weights": resolve_weight_args(data["scheme"], weights)}
        return data

    @model_validator(mode="after")
    def _round_to_nearest(self) -> "LMHeadConfig":
        if self.weights.actorder is not None:
            raise ValueError("weights.actorder: the LM head is rounded to nearest (no Hessian); leave actorder unset")
        if self.weights.dynamic or self.weights.strategy == "token":
            raise ValueError("weights: a static weight format (strategy channel, group, tensor_group or tensor)")
        return self


def head_weight(reader: CheckpointReader, family: Family) -> torch.Tensor:
    """The head's weight as the (possibly rotated) checkpoint gives it: its own tensor, or the tied embedding table."""
    name = f"{family.lm_head}.weight"
    return reader.tensor(name if name in reader else f"{family.embed_tokens}.weight")


def quantize_lm_head(reader: CheckpointReader, family: Family, config: LMHeadConfig, scale_dtype: torch.dtype) -> QuantizedWeight:
    return quantize_weight(head_weight(reader, family).float(), config.weights, scale_dtype)
