"""KV-cache quantization: keys and values, as attention stores them (after the rotary embedding), pass through a
per-module hook before scaled-dot-product attention: an observer during calibration, a quantize-dequantize with
the calibrated k_scale / v_scale during evaluation. Scales are one per tensor ([1]) or one per KV head
([heads, 1, 1]), compressed-tensors' `tensor` and `attn_head` strategies; NVFP4 calibrates one global scale per tensor
and computes its group scales as the values are quantized."""

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from llmc.quant.qtypes import QuantArgs, compute_qparams, dequantize, fake_quantize_activation, global_scale_of, quantize

KV_ATTENTION = "llmc_kv_attention"  # no "sdpa" in the name: transformers would refuse it for Gemma 2


def kv_attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    hook = getattr(module, "kv_hook", None)
    if hook is not None:
        key, value = hook(key, value)
    if kwargs.get("softcap") is not None:
        return softcapped_attention(query, key, value, attention_mask, kwargs["scaling"], kwargs["softcap"])
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def visible_keys(query_len: int, key_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[query_len, key_len] True where a query (the last query_len of key_len positions) sees a key: causally, and
    within its last `window` keys (itself included) when the layer attends in a sliding window."""
    query_positions = torch.arange(key_len - query_len, key_len, device=device)[:, None]
    key_positions = torch.arange(key_len, device=device)[None, :]
    visible = key_positions <= query_positions
    return visible if window is None else visible & (key_positions > query_positions - window)


def softcapped_attention(query, key, value, attention_mask: torch.Tensor | None, scaling: float, softcap: float):
    """Gemma 2's attention (scores -> softcap * tanh(scores / softcap)), which SDPA cannot compute: [batch, heads,
    seq, dim] queries over grouped keys and values, causal or under a boolean (visible) or additive mask."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.tanh(query @ key.transpose(2, 3) * scaling / softcap) * softcap
    if attention_mask is None:
        attention_mask = visible_keys(*scores.shape[-2:], None, query.device)
    if attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    else:
        scores = scores + attention_mask
    probabilities = scores.float().softmax(-1).to(query.dtype)
    return (probabilities @ value).transpose(1, 2).contiguous(), None


AttentionInterface.register(KV_ATTENTION, kv_attention)
AttentionMaskInterface.register(KV_ATTENTION, sdpa_mask)


def _by_head(states: torch.Tensor) -> torch.Tensor:
    """[batch, heads, seq, head_dim] -> [heads, batch * seq * head_dim]."""
    return states.transpose(0, 1).reshape(states.shape[1], -1)


def _flat(states: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    return _by_head(states) if args.strategy == "channel" else states.reshape(1, -1)


def kv_scale(absmax: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    if args.dynamic == "local":  # NVFP4: the global scale its group scales are computed under
        return global_scale_of(absmax)
    scale, _ = compute_qparams(-absmax, absmax, args, torch.float32)
    return scale.reshape(-1, 1, 1) if args.strategy == "channel" else scale


def fake_quantize_kv(states: torch.Tensor, scale: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    if args.dynamic == "local":  # NVFP4: groups of 16 along each head's features
        return fake_quantize_activation(states, args, scale)
    flat = _flat(states, args)
    scale = scale.float().reshape(-1, 1) if args.strategy == "channel" else scale.float().reshape(1)
    zero_point = torch.zeros_like(scale, dtype=torch.int8)
    restored = dequantize(quantize(flat, scale, zero_point, args), scale, zero_point, args)
    if args.strategy == "channel":
        return restored.reshape(states.shape[1], states.shape[0], *states.shape[2:]).transpose(0, 1).to(states.dtype)
    return restored.reshape(states.shape).to(states.dtype)


class KVObserver:
    """Running |K| and |V| maxima, per tensor or per KV head."""

    def __init__(self, args: QuantArgs):
        self.args = args
        self.absmax: list[torch.Tensor | None] = [None, None]

    def __call__(self, key: torch.Tensor, value: torch.Tensor):
        for index, states in enumerate((key, value)):
            batch_max = _flat(states, self.args).abs().amax(dim=-1)
            current = self.absmax[index]
            self.absmax[index] = batch_max if current is None else torch.maximum(current, batch_max)
        return key, value

    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        return kv_scale(self.absmax[0], self.args), kv_scale(self.absmax[1], self.args)


class KVFakeQuantizer:
    def __init__(self, args: QuantArgs, k_scale: torch.Tensor, v_scale: torch.Tensor):
        self.args, self.k_scale, self.v_scale = args, k_scale, v_scale

    def __call__(self, key: torch.Tensor, value: torch.Tensor):
        return fake_quantize_kv(key, self.k_scale, self.args), fake_quantize_kv(value, self.v_scale, self.args)
