"""The fields every quantizing stage shares: the weights' format (or a scheme preset naming it), the input
activations' format for W8A8 and FP8, and which Linears it targets."""
from typing import Any

from pydantic import model_validator

from llmc.core.schema import StrictModel
from llmc.quant.qtypes import QuantArgs, static_input_name
from llmc.quant.schemes import resolve_activation_args, resolve_weight_args


class WeightStage(StrictModel):
    """A stage that quantizes the weights of the Linears it targets."""

    scheme: str | None = None
    weights: QuantArgs = QuantArgs()
    input_activations: QuantArgs | None = None  # W8A8 / FP8: the Linears' inputs are quantized too
    targets: list[str] = ["Linear"]
    ignore: list[str] = []

    @model_validator(mode="before")
    @classmethod
    def _apply_scheme(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("scheme") is not None:
            weights = data.get("weights") or {}
            activations = data.get("input_activations")
            if isinstance(weights, dict) and isinstance(activations, dict | None):
                data = {
                    **data,
                    "weights": resolve_weight_args(data["scheme"], weights),
                    "input_activations": resolve_activation_args(data["scheme"], activations),
                }
        return data

    @model_validator(mode="after")
    def _activation_format(self) -> "WeightStage":
        acts = self.input_activations
        if self.weights.dynamic:
            raise ValueError("weights.dynamic: weights are quantized once, only input_activations can be dynamic")
        if self.weights.strategy == "token":
            raise ValueError("weights.strategy: 'token' is for input_activations; use channel")
        if acts is None:
            return self
        if not acts.symmetric or acts.strategy in ("channel", "block") or acts.actorder:
            raise ValueError("input_activations: symmetric, with strategy token, group (dynamic), tensor_group or tensor")
        if acts.strategy == "group" and acts.dynamic is not True:
            raise ValueError("input_activations.dynamic: per-token-group scales exist only at run time; set it true")
        if acts.strategy == "tensor_group" and acts.dynamic != "local":
            raise ValueError("input_activations.dynamic: NVFP4 inputs take group scales at run time under a calibrated "
                             "global scale; set it 'local'")
        if acts.num_bits == 4 and not (acts.is_fp4 and self.weights.is_fp4):
            raise ValueError("input_activations: 4-bit inputs are float4 (NVFP4, MXFP4), with float4 weights")
        if acts.num_bits != 4 and (acts.num_bits != 8 or self.weights.num_bits not in (4, 8) or self.weights.is_fp4):
            raise ValueError("input_activations: 8-bit inputs take int4 or 8-bit weights (W8A8, FP8, W4A8, W4AFP8, MXFP8)")
        return self

    @property
    def needs_calibration(self) -> bool:
        return static_input_name(self.input_activations) is not None
