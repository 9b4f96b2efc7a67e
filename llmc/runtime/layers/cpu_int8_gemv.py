"""Symmetric per-channel int8 weights (W8A16; an int8 LM head) times bfloat16 rows on the CPU: 32 codes a load,
widened to float32 and narrowed to bfloat16 (every int8 value is exact in both), multiplied with the inputs by
vdpbf16ps into float32 sums (each pair of products exact), each sum times its channel's float32 scale, rounded to
bfloat16: torch's int8 kernel's arithmetic (`_weight_int8pack_mm`: the sum of code x input, times the scale) up to
summation order, at one row about twice its speed (near this machine's read bandwidth), at 16 rows three times. A
row's bits do not depend on the rows beside it. AVX-512 BF16 only (`available()`); elsewhere torch's kernel serves.
Compiled on first use like layers/cpu_attention.py."""
import torch

from llmc.runtime.layers.cpp_kernel import COMPILER_FLAGS, CppKernel

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define LLMC_INT8_GEMV 1
// rows R of x (bfloat16, row stride `stride`) times one weight row's int8 codes: R float32 sums
template <int R>
static inline void dot_rows(const c10::BFloat16* x, int64_t stride, int64_t in_features, const int8_t* codes, float* sums) {
  __m512 even[R], odd[R];  // two chains a row, alternate blocks of 32 codes
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < in_features; k += 64) {
    for (int half = 0; half < 2; ++half) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + k + 32 * half));
      const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
      const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
      const __m512bh weights = _mm512_cvtne2ps_pbh(high, low);
      for (int r = 0; r < R; ++r) {
        const __m512bh inputs = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(x + r * stride + k + 32 * half));
        if (half == 0) even[r] = _mm512_dpbf16_ps(even[r], weights, inputs);
        else odd[r] = _mm512_dpbf16_ps(odd[r], weights, inputs);
      }
    }
  }
  for (int r = 0; r < R; ++r) sums[r] = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r]));
}
#endif

bool available() {
#ifdef LLMC_INT8_GEMV
  return true;
#else
  return false;
#endif
}

// x [rows, in] bfloat16, codes [out, in] int8, scales [out] float32 -> [rows, out] bfloat16
torch::Tensor int8_gemv(torch::Tensor x, torch::Tensor codes, torch::Tensor scales) {
#ifdef LLMC_INT8_GEMV
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.stride(1) == 1, "int8_gemv: bfloat16 rows [rows, in]");
  TORCH_CHECK(codes.scalar_type() == torch::kInt8 && codes.is_contiguous() && scales.scalar_type() == torch::kFloat32 &&
              scales.is_contiguous() && scales.numel() == codes.size(0) && codes.size(1) == x.size(1) && x.size(1) % 64 == 0,
              "int8_gemv: int8 codes [out, in] (in a multiple of 64), float32 scales [out]");
  const int64_t rows = x.size(0), in_features = x.size(1), out_features = codes.size(0), stride = x.stride(0);
  auto out = torch::empty({rows, out_features}, x.options());
  const c10::BFloat16* x_data = x.data_ptr<c10::BFloat16>();
  const int8_t* code_data = codes.data_ptr<int8_t>();
  const float* scale_data = scales.data_ptr<float>();
  c10::BFloat16* out_data = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, out_features, 16, [&](int64_t begin, int64_t end) {
    float sums[4];
    for (int64_t o = begin; o < end; ++o) {
      const int8_t* row = code_data + o * in_features;
      int64_t r = 0;
      for (; r + 4 <= rows; r += 4) {
        dot_rows<4>(x_data + r * stride, stride, in_features, row, sums);
        for (int j = 0; j < 4; ++j) out_data[(r + j) * out_features + o] = c10::BFloat16(sums[j] * scale_data[o]);
      }
      for (; r < rows; ++r) {
        dot_rows<1>(x_data + r * stride, stride, in_features, row, sums);
        out_data[r * out_features + o] = c10::BFloat16(sums[0] * scale_data[o]);
      }
    }
  });
  return out;
#else
  TORCH_CHECK(false, "int8_gemv needs AVX-512 with BF16");
#endif
}
"""
KERNEL = CppKernel("llmc_int8_gemv", SOURCE, ["available", "int8_gemv"], COMPILER_FLAGS, "torch's int8 kernel")
CHUNK = 64


def available() -> bool:
    """Whether the kernel builds and this CPU runs it (AVX-512 BF16)."""
    module = KERNEL.get()
    return module is not None and module.available()


def int8_gemv(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [rows, in] bfloat16 times int8 codes [out, in] scaled per output channel by scales [out] float32."""
    return KERNEL.get().int8_gemv(x if x.stride(-1) == 1 else x.contiguous(), codes, scales)
