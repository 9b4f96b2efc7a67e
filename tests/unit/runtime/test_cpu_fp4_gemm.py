"""The float4 GEMM (layers/cpu_fp4_gemm.py) against llmc's dequantization: NVFP4 and MXFP4 weights read back bit for
bit, products within float32 summation order of a dense matmul for every row count, each row's bits independent of
the rows beside it, and the kernel chosen for float4 weights (behind the emulated input quantization too)."""
import pytest
import torch
import torch.nn.functional as F

from llmc.quant.qtypes import QuantArgs, quantize_weight
from llmc.quant.schemes import MXFP4_ARGS, NVFP4_ARGS
from llmc.runtime.layers import cpu_fp4_gemm
from llmc.runtime.layers.linear import DenseLinear, EmulatedInputLinear, build_linear
from llmc.runtime.layers.linear_weight import LinearWeight

LAYOUTS = {"NVFP4": NVFP4_ARGS, "MXFP4": MXFP4_ARGS}


@pytest.fixture(autouse=True)
def needs_the_kernel():
    if cpu_fp4_gemm.KERNEL.get() is None:
        pytest.skip("no C++ toolchain here: DenseLinear serves float4 weights")


def float4(layout: str, out_features: int = 96, in_features: int = 192, seed: int = 0):
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    weight[3, 5] = 40.0  # an outlier: its group's scale is large, the rest of the row's small
    weight[7, :32] = 0.0  # an all-zero group
    return quantize_weight(weight, QuantArgs(**LAYOUTS[layout]))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernel_weights_equal_dequantize_bit_for_bit(layout):
    weight = float4(layout)
    linear = cpu_fp4_gemm.Fp4CpuLinear(LinearWeight(weight), torch.float32, "cpu")
    # multiplying by the identity reads the kernel's weights back without any summation
    assert torch.equal(linear(torch.eye(192)), weight.dequantize().t())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_equal_a_dense_matmul_for_every_row_count(layout, dtype):
    weight, bias = float4(layout), torch.randn(96)
    linear = cpu_fp4_gemm.Fp4CpuLinear(LinearWeight(weight, bias), dtype, "cpu")
    for rows in (1, 2, 3, 4, 5, 8, 9, 16):
        x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows)).to(dtype)
        out = linear(x)
        assert out.dtype == dtype
        exact = F.linear(x.float(), weight.dequantize(), bias)
        tolerance = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.01}
        torch.testing.assert_close(out.float(), exact, **tolerance)


def test_each_row_gets_the_bits_it_gets_alone():
    linear = cpu_fp4_gemm.Fp4CpuLinear(LinearWeight(float4("NVFP4")), torch.bfloat16, "cpu")
    x = torch.randn(11, 192).bfloat16()
    together = linear(x)
    assert all(torch.equal(together[row], linear(x[row : row + 1])[0]) for row in range(len(x)))


def test_dense_copy_takes_steps_of_many_rows():
    weight = float4("MXFP4")
    linear = cpu_fp4_gemm.Fp4CpuLinear(LinearWeight(weight), torch.bfloat16, "cpu")
    few, many = torch.randn(4, 192).bfloat16(), torch.randn(5, 192).bfloat16()
    eager = linear(many)
    linear.use_dense_copy(weight, max_eager_rows=4)
    kernel = linear.nibbles or (lambda x: cpu_fp4_gemm.KERNEL.get().fp4_matmul(x, linear.codes, linear.half_scales, 32))
    assert torch.equal(linear(few), kernel(few))
    assert torch.equal(linear(many), F.linear(many, weight.dequantize().bfloat16()))
    torch.testing.assert_close(linear(many).float(), eager.float(), atol=0.1, rtol=0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float4_weights_get_the_kernel_behind_their_inputs_quantization(dtype):
    assert isinstance(build_linear([LinearWeight(float4("NVFP4"))], dtype, "cpu"), cpu_fp4_gemm.Fp4CpuLinear)
    assert isinstance(build_linear([LinearWeight(float4("MXFP4"))], dtype, "cpu", dense=True), DenseLinear)
    weight = float4("MXFP4")
    weight.input_activations = QuantArgs(type="float", num_bits=4, strategy="group", group_size=32, dynamic=True,
                                         scale_dtype="uint8")
    emulated = build_linear([LinearWeight(weight)], dtype, "cpu")
    assert isinstance(emulated, EmulatedInputLinear) and isinstance(emulated.weights, cpu_fp4_gemm.Fp4CpuLinear)


def test_float4_layers_keep_their_dense_copy_where_amx_takes_int4_layers_steps(monkeypatch):
    """On a CPU with AMX, int4 layers run their steps of many rows on AMX; float4 layers have no AMX path and keep the copy."""
    from llmc.runtime.engine import kernel_policy
    from llmc.runtime.engine.config import EngineConfig
    from llmc.runtime.layers.linear import Int4CpuLinear

    config = EngineConfig(dtype=torch.bfloat16)
    for amx in (False, True):
        monkeypatch.setattr(kernel_policy, "amx_available", lambda amx=amx: amx)
        kernels = kernel_policy.dense_copy_kernels(config)
        assert cpu_fp4_gemm.Fp4CpuLinear in kernels and (Int4CpuLinear in kernels) == (not amx)
        assert kernel_policy.dense_copy_rows(config) == config.max_eager_int4_rows
    assert kernel_policy.dense_copy_rows(EngineConfig(dtype=torch.bfloat16, int4_dense_copy=False)) is None
