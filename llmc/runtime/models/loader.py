import json
from pathlib import Path

import torch
from torch import nn

from llmc.artifact.ct_config import kv_cache_args_from_config, schemes_from_config
from llmc.artifact.reader import layout_of, scheme_of
from llmc.checkpoints.checkpoint_reader import CheckpointReader
from llmc.quant.qtypes import kv_scale_names, static_input_name
from llmc.runtime.layers.attention import NVFP4KVRounding
from llmc.runtime.layers.linear import DENSE_COPY_KERNELS, build_linear
from llmc.runtime.layers.linear_weight import LinearWeight, merge


class WeightLoader:
    """Reads a model's tensors from an artifact (compressed-tensors or the legacy GPTQ and AWQ layouts; packed int
    weights stay packed) or a plain HF folder. An artifact with an FP8 kv_cache_scheme gets an FP8 KV cache with its
    k_scale / v_scale; an NVFP4 one a cache in the compute dtype holding NVFP4's rounded values; int8 the compute
    dtype. dense: weight-only quantized layers on dense matmuls (`build_linear`). dense_copy_above: layers on the
    dense_copy_kernels (int4 and float4 CPU kernels) also keep their weights dequantized, for steps of more than this
    many rows (use_dense_copy)."""

    def __init__(self, folder: Path, dtype: torch.dtype, device: str, dense: bool = False, dense_copy_above: int | None = None,
                 dense_copy_kernels: tuple[type, ...] = DENSE_COPY_KERNELS):
        self.reader = CheckpointReader(folder)
        self.dtype, self.device, self.dense, self.dense_copy_above = dtype, device, dense, dense_copy_above
        self.dense_copy_kernels = dense_copy_kernels
        quantization = json.loads((folder / "config.json").read_text()).get("quantization_config")
        self.layout = layout_of(quantization) if quantization else None
        compressed_tensors = quantization is not None and quantization["quant_method"] == "compressed-tensors"
        self.schemes = schemes_from_config(quantization) if compressed_tensors else []  # legacy layouts: weight-only
        kv_cache = kv_cache_args_from_config(quantization) if quantization else None
        self.kv_cache = kv_cache
        fp8 = kv_cache is not None and kv_cache.type == "float" and kv_cache.num_bits == 8
        self.kv_cache_dtype = torch.float8_e4m3fn if fp8 else dtype

    def __contains__(self, name: str) -> bool:
        return name in self.reader

    def tensor(self, name: str) -> torch.Tensor:
        return self.reader.tensor(name).to(self.device, self.dtype)

    def kv_scales(self, prefix: str, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k_scale, v_scale) of one attention module, one float32 per KV head, when the KV cache is FP8."""
        if self.kv_cache_dtype != torch.float8_e4m3fn:
            return None
        return tuple(
            self.reader.tensor(f"{prefix}.{name}").float().reshape(-1).expand(num_kv_heads).contiguous().to(self.device)
            for name in ("k_scale", "v_scale")
        )

    def kv_rounding(self, prefix: str) -> NVFP4KVRounding | None:
        """The rounding of one attention module's keys and values, when the KV cache is NVFP4."""
        if self.kv_cache is None or self.kv_cache.dynamic != "local":
            return None
        scales = (self.reader.tensor(f"{prefix}.{name}").float().reshape(1).to(self.device) for name in kv_scale_names(self.kv_cache))
        return NVFP4KVRounding(self.kv_cache, *scales)

    def linear(self, names: list[str]) -> nn.Module:
        weight = merge([self._linear_weight(name) for name in names])
        module = build_linear([weight], self.dtype, self.device, self.dense)
        if self.dense_copy_above is not None:
            for kernel in module.modules():  # EmulatedInputLinear's weight-only kernel too
                if isinstance(kernel, self.dense_copy_kernels):
                    kernel.use_dense_copy(weight.weight, self.dense_copy_above)
        return module

    def _linear_weight(self, name: str) -> LinearWeight:
        bias = self.reader.tensor(f"{name}.bias") if f"{name}.bias" in self.reader else None
        if self.layout is None or f"{name}{self.layout.marker}" not in self.reader:
            return LinearWeight(self.reader.tensor(f"{name}.weight"), bias)
        weight = self.layout.read(self.reader, name)
        if not self.schemes:
            return LinearWeight(weight, bias)
        input_activations = scheme_of(name, self.schemes)[2]
        weight.input_activations = input_activations
        static = static_input_name(input_activations)
        return LinearWeight(weight, bias, self.reader.tensor(f"{name}.{static}") if static else None)
