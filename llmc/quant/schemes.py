"""Named schemes, as compressed-tensors' presets call them: weight arguments and, for W8A8 and FP8, the input
activations' arguments."""
from llmc.quant.qtypes import QuantArgs

PRESET_SCHEMES: dict[str, dict] = {
    "W4A16": dict(num_bits=4, symmetric=True, strategy="group", group_size=128),
    "W4A16_ASYM": dict(num_bits=4, symmetric=False, strategy="group", group_size=128),
    "W8A16": dict(num_bits=8, symmetric=True, strategy="channel", group_size=None),
    "W8A8": dict(num_bits=8, symmetric=True, strategy="channel", group_size=None),
    "FP8": dict(num_bits=8, type="float", strategy="tensor", group_size=None),
    "FP8_DYNAMIC": dict(num_bits=8, type="float", strategy="channel", group_size=None),
    "FP8_BLOCK": dict(num_bits=8, type="float", strategy="block", group_size=None),
}
ACTIVATION_PRESETS: dict[str, dict] = {
    "W8A8": dict(num_bits=8, strategy="token", dynamic=True),
    "FP8": dict(num_bits=8, type="float", strategy="tensor", dynamic=False),
    "FP8_DYNAMIC": dict(num_bits=8, type="float", strategy="token", dynamic=True),
    "FP8_BLOCK": dict(num_bits=8, type="float", strategy="group", group_size=128, dynamic=True),
}


def _merged(preset: dict, overrides: dict) -> dict:
    merged = {**preset, **overrides}
    if merged.get("strategy") != "group":
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
