"""The decoder's small per-token steps as one C++ kernel each on the CPU, where each torch op of a decode step costs
microseconds of dispatch: RMSNorm (seven ops) and the rotary embedding of q and k (a dozen). Each row is computed on
its own, so its bits do not depend on the rows beside it. The rotary kernel rounds as torch's ops do, one product
and one sum at a time: the same bits, in every dtype. RMSNorm sums its squares in another order than torch's
reduction, within float32 rounding, so it serves bfloat16 and float16 only; in float32, the reference dtype, the
torch ops of norm.py serve it. The CUDA counterparts are triton_elementwise.py. Compiled on first use like
layers/cpu_attention.py; where that fails, the torch ops serve."""
import torch

from llmc.runtime.layers.cpp_kernel import COMPILER_FLAGS, WIDEN16, CppKernel

SOURCE = WIDEN16 + r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <type_traits>

template <typename T>
static inline T rounded(float value) { return static_cast<T>(value); }

// out = weight * (x * rsqrt(mean(x^2) + eps)) in float32, in torch's order of roundings: weight (float32, Gemma's
// offset gain) times the float32 normed value, or the normed value rounded to T first, times a T weight
template <typename T, typename W>
static void rms_norm_kernel(const T* x, const W* weight, T* out, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* values = x + row * hidden;
      float squares = 0.f;
      int64_t i = 0;
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        __m512 sum = _mm512_setzero_ps();
        for (; i + 16 <= hidden; i += 16) {
          const __m512 v = widen16(values + i);
          sum = _mm512_add_ps(sum, _mm512_mul_ps(v, v));
        }
        squares = _mm512_reduce_add_ps(sum);
      }
#endif
      for (; i < hidden; ++i) squares += static_cast<float>(values[i]) * static_cast<float>(values[i]);
      const float inverse = 1.f / std::sqrt(squares / static_cast<float>(hidden) + eps);
      T* result = out + row * hidden;
      for (int64_t j = 0; j < hidden; ++j) {
        const float normed = static_cast<float>(values[j]) * inverse;
        if constexpr (std::is_same_v<W, float>)
          result[j] = rounded<T>(weight[j] * normed);
        else
          result[j] = rounded<T>(static_cast<float>(weight[j]) * static_cast<float>(rounded<T>(normed)));
      }
    }
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && weight.size(0) == x.size(1),
              "rms_norm takes contiguous [rows, hidden] and a [hidden] weight");
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    if (weight.scalar_type() == torch::kFloat32)
      rms_norm_kernel(x.data_ptr<scalar_t>(), weight.data_ptr<float>(), out.data_ptr<scalar_t>(), x.size(0), x.size(1), eps);
    else
      rms_norm_kernel(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0), x.size(1), eps);
  });
  return out;
}

// states [tokens, heads, head_dim] (any token and head strides) rotated by cos/sin [positions, head_dim] rows:
// out = states * cos + rotate_half(states) * sin, each product and the sum rounded to T, as torch's three ops round
template <typename T>
static void rotary_kernel(const T* states, int64_t token_stride, int64_t head_stride, const int64_t* positions,
                          const T* cos, const T* sin, T* out, int64_t tokens, int64_t heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
    for (int64_t token = begin; token < end; ++token) {
      const T* c = cos + positions[token] * head_dim;
      const T* s = sin + positions[token] * head_dim;
      for (int64_t head = 0; head < heads; ++head) {
        const T* in = states + token * token_stride + head * head_stride;
        T* result = out + (token * heads + head) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) {
          const T turned = d < half ? static_cast<T>(-in[d + half]) : in[d - half];
          const T straight = rounded<T>(static_cast<float>(in[d]) * static_cast<float>(c[d]));
          const T crossed = rounded<T>(static_cast<float>(turned) * static_cast<float>(s[d]));
          result[d] = rounded<T>(static_cast<float>(straight) + static_cast<float>(crossed));
        }
      }
    }
  });
}

torch::Tensor rotary(torch::Tensor states, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(states.dim() == 3 && states.stride(2) == 1 && cos.is_contiguous() && sin.is_contiguous() &&
              cos.size(1) == states.size(2) && states.size(2) % 2 == 0, "rotary takes [tokens, heads, head_dim] rotated whole");
  auto out = torch::empty(states.sizes(), states.options());
  auto where = positions.to(torch::kLong).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, states.scalar_type(), "rotary", [&] {
    rotary_kernel(states.data_ptr<scalar_t>(), states.stride(0), states.stride(1), where.data_ptr<int64_t>(),
                  cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), states.size(0),
                  states.size(1), states.size(2));
  });
  return out;
}
"""
# no contractions: the rotary kernel's products and sums must round one at a time, as torch's ops do
KERNEL = CppKernel("llmc_elementwise", SOURCE, ["rms_norm", "rotary"], COMPILER_FLAGS,
                   "the decoder's norms and rotary embedding on torch ops")


def serves(x: torch.Tensor, any_dtype: bool = False) -> bool:
    """Whether these kernels take x: eagerly on the CPU (under torch.compile inductor fuses the torch ops), in bfloat16
    or float16 unless the kernel has torch's bits (any_dtype), where the extension built."""
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        return False
    return (any_dtype or x.dtype in (torch.bfloat16, torch.float16)) and KERNEL.get() is not None


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """norm.RMSNorm's result for x [..., hidden] (weight in x's dtype or float32), each row on its own."""
    return KERNEL.get().rms_norm(x.reshape(-1, x.shape[-1]).contiguous(), weight, eps).view(x.shape)


def rotary_cpu(states: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rotary.RotaryEmbedding's full rotation of states [tokens, heads, head_dim], with its bits, as a new tensor."""
    return KERNEL.get().rotary(states, positions, cos, sin)

