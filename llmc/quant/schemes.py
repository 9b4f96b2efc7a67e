"""Named weight schemes, as compressed-tensors' presets call them."""
from llmc.quant.qtypes import QuantArgs

PRESET_SCHEMES: dict[str, dict] = {
    "W4A16": dict(num_bits=4, symmetric=True, strategy="group", group_size=128),
    "W4A16_ASYM": dict(num_bits=4, symmetric=False, strategy="group", group_size=128),
    "W8A16": dict(num_bits=8, symmetric=True, strategy="channel", group_size=None),
}


def resolve_weight_args(scheme: str | None, overrides: dict) -> dict:
    """A preset's weight arguments with the recipe's own fields on top."""
    if scheme is None:
        return overrides
    if scheme not in PRESET_SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; known: {', '.join(PRESET_SCHEMES)}")
    merged = {**PRESET_SCHEMES[scheme], **overrides}
    if merged.get("strategy") != "group":
        merged["group_size"] = None
    return merged


__all__ = ["PRESET_SCHEMES", "QuantArgs", "resolve_weight_args"]
