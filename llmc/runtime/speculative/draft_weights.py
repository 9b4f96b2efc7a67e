"""Draft weights for serving: drafting is bound by reading the draft's weights (a tree of depth 4 reads the EAGLE
layer and its LM head rows four times a step), so they are served as int8 with one scale per output channel, half
the bytes of bfloat16. A draft only proposes tokens the target verifies: rounding its weights can cost acceptance,
never correctness."""
import torch
from torch import nn

from llmc.quant.qtypes import QuantArgs, quantize_weight
from llmc.runtime.layers.linear import build_linear
from llmc.runtime.layers.linear_weight import LinearWeight

DRAFT_WEIGHTS = QuantArgs(num_bits=8, symmetric=True, strategy="channel", group_size=None)


def int8_linear(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, device: str) -> nn.Module:
    """[out, in] weights quantized to DRAFT_WEIGHTS, on the runtime's kernel for them (dense where there is none)."""
    quantized = quantize_weight(weight.detach().float(), DRAFT_WEIGHTS)
    return build_linear([LinearWeight(quantized, None if bias is None else bias.detach().float())], dtype, device)


def with_int8_linears(module: nn.Module, dtype: torch.dtype, device: str) -> nn.Module:
    """module with every nn.Linear inside it served as int8_linear."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, int8_linear(child.weight, child.bias, dtype, device))
        else:
            with_int8_linears(child, dtype, device)
    return module
