"""The runtime's GPU kernels against their torch references: natively on CUDA, on CPU under Triton's interpreter.
Shapes are tiny and odd on purpose (masked tails, 3 query heads per KV head). A script rather than a pytest module:
TRITON_INTERPRET must be set before anything imports Triton, so CI runs it in its own process
(test_gpu_kernels.py), and the GPU check machine, which has no pytest, runs `python tests/unit/runtime/kernel_checks.py`."""
import itertools
import os
import subprocess
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaConfig

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated, i.e. imported below


class Skipped(Exception):
    pass


def parametrize(names: str, values: list):
    """Cases as pytest.mark.parametrize spells them, kept on the function for the runner at the bottom."""
    def mark(check):
        keys = [name.strip() for name in names.split(",")]
        rows = [value if len(keys) > 1 else (value,) for value in values]
        check.cases = [{**case, **dict(zip(keys, row))} for case, row in itertools.product(getattr(check, "cases", [{}]), rows)]
        return check
    return mark


from llmc.quant.qtypes import QuantArgs, fake_quantize_activation, quantize_activation, quantize_weight  # noqa: E402
from llmc.quant.schemes import MXFP4_ARGS, NVFP4_ARGS  # noqa: E402
from llmc.runtime.layers.attention import (  # noqa: E402
    decode_attention_reference,
    prefill_attention_reference,
    read_kv,
    store_kv,
)
from llmc.runtime.layers.linear import DenseLinear, build_linear  # noqa: E402
from llmc.runtime.layers.linear_weight import LinearWeight  # noqa: E402
from llmc.runtime.layers.norm import RMSNorm  # noqa: E402
from llmc.runtime.layers.quantized_input_linear import QuantizedInputLinear  # noqa: E402
from llmc.runtime.layers.rotary import RotaryEmbedding  # noqa: E402
from llmc.runtime.layers.triton_act_quant import quantize_activation_triton  # noqa: E402
from llmc.runtime.layers.triton_attention import decode_attention_triton  # noqa: E402
from llmc.runtime.layers.triton_elementwise import rms_norm_triton, rotary_triton  # noqa: E402
from llmc.runtime.layers.triton_w4a16 import w4a16_matmul  # noqa: E402
from llmc.runtime.layers.w4a16_triton_linear import W4A16TritonLinear  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
FP8_GEMM = not CUDA or torch.cuda.get_device_capability() >= (8, 9)  # torch._scaled_mm on CUDA needs sm_89+
TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-3}  # fp32: TF32 dots on GPU; fp16: one rounding of the output
FP8 = QuantArgs(num_bits=8, type="float", strategy="channel")


def generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def paged(num_kv_heads: int, head_dim: int = 16, num_blocks: int = 12, block_size: int = 16):
    g = generator(1)
    return [torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g) for _ in range(2)]


BLOCK_TABLES = torch.tensor([[3, 7, 1], [0, 0, 0], [11, 2, 0]])
CONTEXT_LENS = torch.tensor([40, 5, 17])


@parametrize("dtype", [torch.float32, torch.float16])
@parametrize("num_heads, num_kv_heads", [(4, 2), (6, 2)])
def check_triton_paged_decode_matches_reference(dtype, num_heads, num_kv_heads):
    k_cache, v_cache = paged(num_kv_heads)
    query = torch.randn(3, num_heads, 16, generator=generator(2))
    expected = decode_attention_reference(query, k_cache, v_cache, BLOCK_TABLES, CONTEXT_LENS, 0.25)
    out = decode_attention_triton(*(t.to(DEVICE, dtype) for t in (query, k_cache, v_cache)),
                                  BLOCK_TABLES.to(DEVICE), CONTEXT_LENS.to(DEVICE), 0.25)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float().cpu(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def fp8_cache(num_kv_heads: int = 2):
    """K/V written through store_kv into an FP8 cache with per-KV-head scales, and the same cache dequantized."""
    k_dense, v_dense = paged(num_kv_heads)
    scales = [t.abs().amax(dim=(0, 1, 3)) / 448 for t in (k_dense, v_dense)]  # [kv_heads]
    caches = []
    for dense, scale in zip((k_dense, v_dense), scales):
        cache = torch.zeros(dense.shape, dtype=torch.float8_e4m3fn)
        store_kv(cache, torch.arange(dense.shape[0] * dense.shape[1]), dense.flatten(0, 1), scale)
        caches.append(cache)
    dequantized = [read_kv(cache, scale, torch.float32) for cache, scale in zip(caches, scales)]
    return (k_dense, v_dense), caches, scales, dequantized


def check_fp8_kv_cache_round_trip_and_reference_reads():
    (k_dense, _), (k_cache, v_cache), (k_scale, v_scale), (k_deq, v_deq) = fp8_cache()
    assert k_cache.dtype == torch.float8_e4m3fn
    error = (k_deq - k_dense).abs() / k_dense.abs().amax(dim=(0, 1, 3))[:, None]
    assert 0 < error.max() <= 2**-4  # E4M3 keeps 3 mantissa bits: half a unit in the last place, relative
    query = torch.randn(3, 6, 16, generator=generator(2))
    expected = decode_attention_reference(query, k_deq, v_deq, BLOCK_TABLES, CONTEXT_LENS, 0.25)
    out = decode_attention_reference(query, k_cache, v_cache, BLOCK_TABLES, CONTEXT_LENS, 0.25, k_scale, v_scale)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    table = BLOCK_TABLES[0]
    chunk = torch.randn(6, 6, 16, generator=generator(3))
    torch.testing.assert_close(
        prefill_attention_reference(chunk, k_cache, v_cache, table, 40, 0.25, k_scale, v_scale),
        prefill_attention_reference(chunk, k_deq, v_deq, table, 40, 0.25), atol=1e-6, rtol=1e-6,
    )


@parametrize("dtype", [torch.float32, torch.float16])
def check_triton_decode_reads_fp8_kv_cache(dtype):
    _, (k_cache, v_cache), (k_scale, v_scale), (k_deq, v_deq) = fp8_cache()
    query = torch.randn(3, 6, 16, generator=generator(2))
    expected = decode_attention_reference(query, k_deq, v_deq, BLOCK_TABLES, CONTEXT_LENS, 0.25)
    out = decode_attention_triton(
        query.to(DEVICE, dtype), k_cache.to(DEVICE), v_cache.to(DEVICE), BLOCK_TABLES.to(DEVICE), CONTEXT_LENS.to(DEVICE),
        0.25, k_scale.to(DEVICE), v_scale.to(DEVICE),
    )
    torch.testing.assert_close(out.float().cpu(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def int4_weight(symmetric: bool, out_features: int = 96, in_features: int = 192, group_size: int = 32):
    weight = torch.randn(out_features, in_features, generator=generator(4))
    return quantize_weight(weight, QuantArgs(num_bits=4, symmetric=symmetric, group_size=group_size))


@parametrize("dtype", [torch.float32, torch.float16])
@parametrize("symmetric, group_size, rows, split_k", [(True, 32, 1, 1), (True, 64, 5, 2), (False, 64, 19, 3)])
def check_triton_w4a16_matches_dequantized_weights(dtype, symmetric, group_size, rows, split_k):
    quantized = int4_weight(symmetric, group_size=group_size)
    x = torch.randn(rows, 192, generator=generator(5))
    linear = W4A16TritonLinear(LinearWeight(quantized), dtype, DEVICE)
    expected = x.to(dtype).float() @ quantized.dequantize().to(dtype).float().t()
    out = w4a16_matmul(x.to(DEVICE, dtype), linear.packed, linear.scales, linear.zeros, group_size, split_k=split_k)
    assert out.dtype == dtype
    tolerance = 3e-2 if CUDA and dtype == torch.float32 else TOLERANCE[dtype] * 10  # sums of 192 products; TF32 dots
    torch.testing.assert_close(out.float().cpu(), expected, atol=tolerance, rtol=tolerance)


def check_w4a16_triton_linear_is_chosen_on_cuda_only_and_adds_bias():
    weight = LinearWeight(int4_weight(False), torch.randn(96, generator=generator(6)))
    assert W4A16TritonLinear.supports(weight, torch.float16, "cuda:0") and not W4A16TritonLinear.supports(weight, torch.float16, "cpu")
    x = torch.randn(2, 3, 192, generator=generator(7))
    out = W4A16TritonLinear(weight, torch.float16, DEVICE)(x.to(DEVICE, torch.float16))
    expected = DenseLinear(weight, torch.float32, "cpu")(x)
    torch.testing.assert_close(out.float().cpu(), expected, atol=0.05, rtol=0.01)


@parametrize("dtype", [torch.float32, torch.float16])
@parametrize("layout, rows, split_k", [("NVFP4", 1, 1), ("NVFP4", 5, 3), ("MXFP4", 19, 1), ("MXFP4", 2, 2)])
def check_triton_w4a16_reads_float4_weights(dtype, layout, rows, split_k):
    weight = torch.randn(96, 192, generator=generator(21))
    weight[3, 5] = 40.0  # an outlier: one group's scale is large
    quantized = quantize_weight(weight, QuantArgs(**{"NVFP4": NVFP4_ARGS, "MXFP4": MXFP4_ARGS}[layout]))
    bias = torch.randn(96, generator=generator(22))
    x = torch.randn(rows, 192, generator=generator(23))
    assert W4A16TritonLinear.supports(LinearWeight(quantized, bias), torch.float16, "cuda:0")
    linear = W4A16TritonLinear(LinearWeight(quantized, bias), dtype, DEVICE)
    # the kernel's weights are dequantize's float32 products, rounded to the inputs' dtype for the dot
    expected = x.to(dtype).float() @ quantized.dequantize().to(dtype).float().t()
    out = w4a16_matmul(x.to(DEVICE, dtype), linear.packed, linear.scales, None, quantized.args.group_size, split_k, float4=True)
    tolerance = 3e-2 if CUDA and dtype == torch.float32 else TOLERANCE[dtype] * 10
    torch.testing.assert_close(out.float().cpu(), expected, atol=tolerance * 10, rtol=tolerance)
    torch.testing.assert_close(linear(x.to(DEVICE, dtype)).float().cpu(), expected + bias.to(dtype).float(),
                               atol=tolerance * 10, rtol=tolerance)


ACTIVATIONS = {
    "int8 channel, dynamic per token": (QuantArgs(num_bits=8, strategy="channel"), QuantArgs(num_bits=8, strategy="token", dynamic=True)),
    "int8 channel, static per tensor": (QuantArgs(num_bits=8, strategy="channel"), QuantArgs(num_bits=8, strategy="tensor")),
    "fp8 channel, dynamic per token": (
        QuantArgs(num_bits=8, type="float", strategy="channel"), QuantArgs(num_bits=8, type="float", strategy="token", dynamic=True),
    ),
    "fp8 tensor, static per tensor": (
        QuantArgs(num_bits=8, type="float", strategy="tensor"), QuantArgs(num_bits=8, type="float", strategy="tensor"),
    ),
}


def act_quantized(weights: QuantArgs, activations: QuantArgs, seed: int, out_features: int = 48) -> LinearWeight:
    quantized = quantize_weight(torch.randn(out_features, 64, generator=generator(seed)), weights, torch.float32)
    quantized.input_activations = activations
    return LinearWeight(quantized, torch.randn(out_features, generator=generator(seed + 1)),
                        None if activations.dynamic else torch.tensor([0.03]))


@parametrize("formats", list(ACTIVATIONS))
def check_quantized_input_linear_computes_what_fake_quantization_emulates(formats):
    if ACTIVATIONS[formats][0].type == "float" and not FP8_GEMM:
        raise Skipped("FP8 GEMMs need sm_89+")
    weight = act_quantized(*ACTIVATIONS[formats], seed=8)
    linear = build_linear([weight], torch.float32, DEVICE)
    assert isinstance(linear, QuantizedInputLinear)
    x = torch.randn(2, 5, 64, generator=generator(9))
    expected = F.linear(fake_quantize_activation(x, weight.weight.input_activations, weight.input_scale),
                        weight.weight.dequantize(), weight.bias)
    assert not torch.allclose(expected, F.linear(x, weight.weight.dequantize(), weight.bias), atol=1e-3)
    # CUDA's row-wise FP8 GEMM returns bfloat16
    tolerance = 2e-2 if CUDA and ACTIVATIONS[formats][0].type == "float" else 1e-4
    torch.testing.assert_close(linear(x.to(DEVICE)).cpu(), expected, atol=tolerance, rtol=tolerance)


def check_merged_per_tensor_parts_keep_their_own_scales():
    if not FP8_GEMM:
        raise Skipped("FP8 GEMMs need sm_89+")
    weights, activations = ACTIVATIONS["fp8 tensor, static per tensor"]
    parts = [act_quantized(weights, activations, seed, out_features) for seed, out_features in ((10, 32), (12, 16), (14, 16))]
    merged = build_linear(parts, torch.float32, DEVICE)
    assert isinstance(merged, QuantizedInputLinear)
    x = torch.randn(4, 64, generator=generator(16))
    tolerance = 2e-2 if CUDA else 1e-4
    for out, part in zip(merged(x.to(DEVICE)).cpu().split([32, 16, 16], dim=-1), parts):
        expected = F.linear(fake_quantize_activation(x, activations, part.input_scale), part.weight.dequantize(), part.bias)
        torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)



@parametrize("dtype", [torch.float32, torch.float16])
@parametrize("formats", list(ACTIVATIONS))
def check_triton_activation_quantization_equals_quantize_activation(dtype, formats):
    args = ACTIVATIONS[formats][1]
    x = torch.randn(2, 3, 1500, generator=generator(17)).to(dtype)  # 1500 columns: two blocks, the second masked
    x[1, 0] = 0  # an all-zero token takes the float32 epsilon as its scale
    static = None if args.dynamic else torch.tensor([0.004])
    expected_codes, expected_scale = quantize_activation(x, args, static)
    codes, scale = quantize_activation_triton(x.to(DEVICE), args, None if static is None else static.to(DEVICE))
    assert codes.dtype == expected_codes.dtype and scale.shape == expected_scale.shape
    assert torch.equal(scale.cpu(), expected_scale)
    assert torch.equal(codes.cpu().view(torch.uint8), expected_codes.view(torch.uint8))


@parametrize("dtype", [torch.float32, torch.float16])
def check_triton_rms_norm_matches_the_module(dtype):
    x = torch.randn(2, 3, 576, generator=generator(18)).to(dtype)  # 576: a masked tail in a block of 1024
    weight = (1 + 0.1 * torch.randn(576, generator=generator(19))).to(dtype)
    expected = RMSNorm(weight, 1e-5)(x)
    out = rms_norm_triton(x.to(DEVICE), weight.to(DEVICE), 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.cpu(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@parametrize("dtype", [torch.float32, torch.float16])
def check_triton_rotary_matches_the_module(dtype):
    config = LlamaConfig(hidden_size=192, num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256)
    rotary = RotaryEmbedding(config, 256, dtype)
    qkv = torch.randn(5, 6 * 32 + 2 * 2 * 32, generator=generator(20)).to(dtype).view(5, 10, 32)
    qk = qkv[:, :8]  # a strided view, as the attention hands queries and keys over
    positions = torch.tensor([0, 3, 17, 100, 255])
    expected = rotary(positions, qk)
    out = rotary_triton(qkv.to(DEVICE)[:, :8], positions.to(DEVICE), rotary.cos.to(DEVICE), rotary.sin.to(DEVICE))
    torch.testing.assert_close(out.cpu(), expected, atol=2 * TOLERANCE[dtype], rtol=2 * TOLERANCE[dtype])


HOPPER_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llmc.runtime.layers.triton_attention import _paged_decode_kernel
from llmc.runtime.layers.triton_act_quant import _quantize_rows_kernel
from llmc.runtime.layers.triton_elementwise import _rms_norm_kernel, _rotary_kernel
from llmc.runtime.layers.triton_w4a16 import _w4a16_kernel

def compile(kernel, types, constexprs):
    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in kernel.arg_names}
    triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32))

w4a16 = {"x": "*bf16", "packed": "*i32", "scales": "*bf16", "zeros": "*bf16"}
tiles = {"BLOCK_N": 64, "BLOCK_K": 64}
compile(_w4a16_kernel, w4a16 | {"out": "*fp32"}, {"HAS_ZEROS": True, "FLOAT4": False, "SPLIT_K": 4, "BLOCK_M": 16} | tiles)
compile(_w4a16_kernel, w4a16 | {"out": "*bf16"}, {"HAS_ZEROS": False, "FLOAT4": False, "SPLIT_K": 1, "BLOCK_M": 64} | tiles)
compile(_w4a16_kernel, w4a16 | {"scales": "*fp32", "out": "*bf16"},
        {"HAS_ZEROS": False, "FLOAT4": True, "SPLIT_K": 1, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 16})
for cache in ("*bf16", "*fp8e4nv"):
    types = {"query": "*bf16", "k_cache": cache, "v_cache": cache, "block_tables": "*i64", "context_lens": "*i64",
             "out": "*bf16", "scale": "fp32", "k_scale": "*fp32", "v_scale": "*fp32"}
    constexprs = {"QUERIES_PER_KV": 4, "GROUP": 4, "BLOCK_SIZE": 16, "HEAD_DIM": 128, "FP8_KV": cache == "*fp8e4nv"}
    compile(_paged_decode_kernel, types, constexprs)
for code, is_float, half_range in (("*i8", False, 127.5), ("*fp32", True, 448.0)):
    types = {"x": "*bf16", "codes": code, "scales": "*fp32", "static_scale": "*fp32", "K": "i32", "stride_x": "i32"}
    constexprs = {"HALF_RANGE": half_range, "QMIN": -half_range - 0.5 * (not is_float), "QMAX": half_range - 0.5 * (not is_float),
                  "IS_FLOAT": is_float, "STATIC": not is_float, "EPS": 1.1920928955078125e-07, "BLOCK": 1024}
    compile(_quantize_rows_kernel, types, constexprs)
compile(_rms_norm_kernel, {"x": "*bf16", "weight": "*bf16", "out": "*bf16", "hidden": "i32", "eps": "fp32"}, {"BLOCK": 4096})
compile(_rotary_kernel, {"states": "*bf16", "out": "*bf16", "cos": "*bf16", "sin": "*bf16", "positions": "*i64"}, {"HALF": 64})
print("ok")
"""


def check_kernels_compile_for_hopper():
    """What the interpreter cannot show: the kernels lower to sm_90 machine code (Triton's bundled ptxas, no GPU)."""
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        raise Skipped("this Triton has no bundled ptxas")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[3])
    result = subprocess.run([sys.executable, "-c", HOPPER_COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]

if __name__ == "__main__":
    failures = 0
    for name, check in [(name, value) for name, value in globals().items() if name.startswith("check_")]:
        for case in getattr(check, "cases", [{}]):
            try:
                check(**case)
                print(f"PASS {name} {case or ''}")
            except Skipped as reason:
                print(f"SKIP {name} {case or ''}: {reason}")
            except Exception:
                failures += 1
                print(f"FAIL {name} {case or ''}\n{traceback.format_exc()}")
    print(f"{failures} failed" if failures else "all passed")
    sys.exit(1 if failures else 0)
