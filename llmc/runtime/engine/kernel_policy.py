"""Which kernels serve a model, decided once as the engine starts: the C++ extensions a CPU build needs, the attention
backend every layer's decode rows run on, and where int4 layers run steps of many rows (AMX or a dense copy)."""
import logging
import time

import torch

from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.layers import (
    cpu_attention,
    cpu_decode_stack,
    cpu_elementwise,
    cpu_fp4_gemm,
    cpu_int8_gemm,
    cpu_int8_gemv,
    cpu_nibble_gemv,
    cpu_quantized_mm,
)
from llmc.runtime.layers.attention import REFERENCE_ATTENTION, AttentionBackend
from llmc.runtime.layers.cpp_kernel import CppKernel, build_concurrently
from llmc.runtime.layers.cpu_attention import CPP_ATTENTION
from llmc.runtime.layers.int4_amx import amx_available
from llmc.runtime.layers.linear import DENSE_COPY_KERNELS, Int4CpuLinear
from llmc.runtime.models.architecture import Architecture
from llmc.runtime.models.loader import WeightLoader

logger = logging.getLogger(__name__)


def cpu_kernels(weights: WeightLoader, config: EngineConfig) -> list[CppKernel]:
    """The C++ extensions serving this checkpoint on the CPU: norms and rotary, decode attention unless turned off,
    input quantization where Linears quantize their inputs, the packed int8 GEMM where those are int8, the float4 GEMM
    where weights are float4, the int8 GEMV where weights are int8 and inputs not, the nibble GEMV where weights have 4
    bits."""
    kernels = [cpu_elementwise.KERNEL] + ([cpu_attention.KERNEL] if config.cpu_decode_kernel else [])
    quantized_inputs = [weight_args for _, weight_args, input_args in weights.schemes if input_args is not None]
    if quantized_inputs:
        kernels.append(cpu_quantized_mm.KERNEL)
    if any(weight_args.type == "int" for weight_args in quantized_inputs):
        kernels.append(cpu_int8_gemm.KERNEL)
    if any(weight_args.is_fp4 for _, weight_args, _ in weights.schemes):
        kernels.append(cpu_fp4_gemm.KERNEL)
    if any(weight_args.num_bits == 8 and input_args is None for _, weight_args, input_args in weights.schemes):
        kernels.append(cpu_int8_gemv.KERNEL)
    if any(weight_args.num_bits == 4 for _, weight_args, _ in weights.schemes):
        kernels.append(cpu_nibble_gemv.KERNEL)
        if config.cpu_decode_stack:
            kernels.append(cpu_decode_stack.KERNEL)
    return kernels


def build_cpu_kernels(weights: WeightLoader, config: EngineConfig) -> None:
    """On the CPU, the checkpoint's C++ extensions built side by side before the layers ask for them one by one."""
    if config.device == "cpu":
        build_concurrently(cpu_kernels(weights, config))


def attention_backend(arch: Architecture, kv_dtype: torch.dtype, config: EngineConfig) -> AttentionBackend:
    """CUDA decodes on the Triton kernel, which reads the block tables itself, unless a layer is windowed or
    soft-capped; the CPU on the C++ kernel (layers/cpu_attention.py) unless it is turned off, the cache is FP8 or the
    kernel does not build; everything else on the torch reference, whose buckets of decode rows are worked out once a
    step."""
    if config.device.startswith("cuda") and arch.plain_attention:
        from llmc.runtime.layers.triton_attention import TRITON_ATTENTION  # imports Triton: GPU machines only

        return TRITON_ATTENTION
    if config.cpu_decode_kernel and config.device == "cpu" and kv_dtype == config.dtype and cpu_attention.compiled_kernel() is not None:
        return CPP_ATTENTION
    return REFERENCE_ATTENTION


def uses_amx(config: EngineConfig) -> bool:
    return config.amx_int4 and not config.compile and amx_available()


def dense_copy_rows(config: EngineConfig) -> int | None:
    """Int4 and float4 layers keep a dense copy for steps of more than this many rows (WeightLoader's
    dense_copy_above); None where the copy is off."""
    return config.max_eager_int4_rows if config.int4_dense_copy else None


def dense_copy_kernels(config: EngineConfig) -> tuple[type, ...]:
    """The kernels that keep the copy: not int4's where AMX takes their steps of many rows (float4 layers still do)."""
    return tuple(kernel for kernel in DENSE_COPY_KERNELS if kernel is not Int4CpuLinear) if uses_amx(config) else DENSE_COPY_KERNELS


def amx_int4(model: torch.nn.Module, max_eager_rows: int) -> float | None:
    """The model's int4 layers compiled onto AMX (Int4CpuLinear.use_amx); the seconds that took, None without any."""
    linears = [module for module in model.modules() if isinstance(module, Int4CpuLinear)]
    if not linears:
        return None
    started = time.perf_counter()
    logger.info("compiling %d int4 matmuls for AMX (cached on disk for later starts)", len(linears))
    served = sum(linear.use_amx(max_eager_rows) for linear in linears)
    seconds = time.perf_counter() - started
    logger.info("%d of %d int4 matmuls on AMX, compiled in %.1f s", served, len(linears), seconds)
    return seconds
