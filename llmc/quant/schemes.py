"""Named schemes, as compressed-tensors' presets define them (its quant_scheme.py): weight arguments and, where the
inputs are quantized too, the input activations' arguments. W8A16 differs on purpose: per channel, which torch's
int8 CPU kernel runs, where compressed-tensors' generic WnA16 template groups by 128."""
from llmc.quant.qtypes import MX_GROUP_SIZE, QuantArgs

INT4_G128 = dict(num_bits=4, symmetric=True, strategy="group", group_size=128)
NVFP4_ARGS = dict(num_bits=4, type="float", strategy="tensor_group", group_size=16, scale_dtype="float8_e4m3fn")
MXFP4_ARGS = dict(num_bits=4, type="float", strategy="group", group_size=MX_GROUP_SIZE, scale_dtype="uint8")
MXFP8_ARGS = dict(num_bits=8, type="float", strategy="group", group_size=MX_GROUP_SIZE, scale_dtype="uint8")

PRESET_SCHEMES: dict[str, dict] = {
    "W4A16": INT4_G128,
    "W4A16_ASYM": dict(num_bits=4, symmetric=False, strategy="group", group_size=128),
    "W3A16": dict(INT4_G128, num_bits=3),
    "W2A16": dict(INT4_G128, num_bits=2),
    "W8A16": dict(num_bits=8, symmetric=True, strategy="channel", group_size=None),
    "W8A8": dict(num_bits=8, symmetric=True, strategy="channel", group_size=None),
    "W4A8": INT4_G128,
    "W4AFP8": INT4_G128,
    "FP8": dict(num_bits=8, type="float", strategy="tensor", group_size=None),
    "FP8_DYNAMIC": dict(num_bits=8, type="float", strategy="channel", group_size=None),
    "FP8_BLOCK": dict(num_bits=8, type="float", strategy="block", group_size=None),
    "NVFP4A16": NVFP4_ARGS,
    "NVFP4": NVFP4_ARGS,
    "MXFP4A16": MXFP4_ARGS,
    "MXFP4": MXFP4_ARGS,
    "MXFP8A16": MXFP8_ARGS,
    "MXFP8": MXFP8_ARGS,
}
ACTIVATION_PRESETS: dict[str, dict] = {
    "W8A8": dict(num_bits=8, strategy="token", dynamic=True),
    "W4A8": dict(num_bits=8, strategy="token", dynamic=True),
    "W4AFP8": dict(num_bits=8, type="float", strategy="token", dynamic=True),
    "FP8": dict(num_bits=8, type="float", strategy="tensor", dynamic=False),
    "FP8_DYNAMIC": dict(num_bits=8, type="float", strategy="token", dynamic=True),
    "FP8_BLOCK": dict(num_bits=8, type="float", strategy="group", group_size=128, dynamic=True),
    "NVFP4": dict(NVFP4_ARGS, dynamic="local"),
    "MXFP4": dict(MXFP4_ARGS, dynamic=True),
    "MXFP8": dict(MXFP8_ARGS, dynamic=True),
}


def _merged(preset: dict, overrides: dict) -> dict:
    merged = {**preset, **overrides}
    if merged.get("strategy") not in ("group", "tensor_group"):
        merged["group_size"] = None
    return merged


def resolve_weight_args(scheme: str | None, overrides: dict) -> dict:
    """A preset's weight arguments with the recipe's own fields on top."""
    if scheme is None:
        return overrides
    if scheme not in PRESET_SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; known: {', '.join(PRESET_SCHEMES)}")
    return _merged(PRESET_SCHEMES[scheme], overrides)


def resolve_activation_args(scheme: str | None, overrides: dict | None) -> dict | None:
    """A preset's input-activation arguments (None for weight-only schemes) with the recipe's fields on top."""
    if scheme not in ACTIVATION_PRESETS:
        return overrides
    return _merged(ACTIVATION_PRESETS[scheme], overrides or {})


__all__ = ["ACTIVATION_PRESETS", "PRESET_SCHEMES", "QuantArgs", "resolve_activation_args", "resolve_weight_args"]
