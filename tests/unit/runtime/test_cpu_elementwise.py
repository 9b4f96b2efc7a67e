"""The CPU norm and rotary kernels (layers/cpu_elementwise.py) against the torch ops of norm.py and rotary.py: rotary
with torch's bits in every dtype and for strided q/k views; RMSNorm within a rounding of torch's in bfloat16 and
float16 (gain in the dtype, or Gemma's float32 offset gain), each row on its own; float32 keeps the torch ops."""
import pytest
import torch

from llmc.runtime.layers import cpu_elementwise
from llmc.runtime.layers.norm import RMSNorm
from llmc.runtime.layers.rotary import rotate_half


@pytest.fixture(autouse=True)
def needs_kernel():
    if cpu_elementwise.KERNEL.get() is None:
        pytest.skip("no C++ toolchain: the torch ops serve")


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed).to(x.dtype) if weight.dtype == torch.float32 else weight * normed.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gain_dtype", ["same", "float32"])
def test_rms_norm_kernel_is_torchs_norm_within_a_rounding_and_rows_are_their_own(dtype, gain_dtype):
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(9, 3, 200, generator=generator) * 3).to(dtype)
    weight = torch.randn(200, generator=generator)
    weight = weight if gain_dtype == "float32" else weight.to(dtype)
    norm = RMSNorm(weight, 1e-6)
    assert cpu_elementwise.serves(x)
    got = norm(x)
    torch.testing.assert_close(got, torch_rms_norm(x, weight, 1e-6), atol=0, rtol=2 * torch.finfo(dtype).eps)
    assert all(torch.equal(got[row], norm(x[row : row + 1])[0]) for row in range(len(x)))


def test_float32_norm_keeps_the_torch_ops():
    x = torch.randn(4, 64)
    assert not cpu_elementwise.serves(x) and cpu_elementwise.serves(x, any_dtype=True)
    norm = RMSNorm(torch.randn(64), 1e-6)
    assert torch.equal(norm(x), torch_rms_norm(x, norm.weight, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotary_kernel_has_torchs_bits_on_strided_query_key_views(dtype):
    generator = torch.Generator().manual_seed(1)
    qkv = torch.randn(6, 15 * 64, generator=generator).to(dtype)
    states = qkv.view(6, 15, 64)[:, :12]  # queries and keys side by side, values left out: strided rows
    cos, sin = torch.randn(2, 100, 64, generator=generator).to(dtype)
    positions = torch.tensor([3, 7, 0, 99, 5, 5])
    expected = states * cos[positions].unsqueeze(1) + rotate_half(states) * sin[positions].unsqueeze(1)
    assert torch.equal(cpu_elementwise.rotary_cpu(states, positions, cos, sin), expected)
