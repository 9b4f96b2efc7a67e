"""Float4 E2M1 weights (NVFP4, MXFP4) in float32 (and in bfloat16 on CPUs without AVX-512 BF16; the others run the
nibble kernel, cpu_nibble_gemv.py) multiplied on the CPU straight from their packed nibbles, as torch's int4 kernel
does with int4 codes: each byte's two codes index a 16-entry table of the E2M1 values times two (integers, so one
byte shuffle looks eight pairs up at once), are widened to float32 and scaled by half their group's scale (float32:
NVFP4's float8 scale over its global scale, MXFP4's power of two), then multiply the inputs in float32. Each weight
is the float32 product `dequantize` gives, bit for bit; only the summation order differs from a dense matmul. A step
reads half a byte a weight where the dense fallback reads two, so decode at few rows is that much cheaper; steps of
many rows go on a dense copy (Fp4CpuLinear.use_dense_copy), as int4's do. Compiled on first use like
layers/cpu_attention.py; where that fails, DenseLinear serves these weights."""
import torch
from torch import nn

from llmc.artifact.pack import e2m1_nibbles, pack_e2m1
from llmc.quant.qtypes import E2M1_MAGNITUDES, QuantizedWeight
from llmc.runtime.layers import cpu_nibble_gemv
from llmc.runtime.layers.cpp_kernel import COMPILER_FLAGS, CppKernel
from llmc.runtime.layers.cpu_nibble_gemv import NibbleMatmul
from llmc.runtime.layers.dense_copy import DenseCopy
from llmc.runtime.layers.linear_weight import LinearWeight

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

// E2M1 codes (sign bit, then an index into 0, 0.5, 1, 1.5, 2, 3, 4, 6) times two
static const int8_t DOUBLED_E2M1[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// rows R of x (float32, stride in_features) times one output row's packed codes: R dot products
template <int R>
static void dot_rows(const float* x, int64_t in_features, const uint8_t* codes, const float* half_scales,
                     int group_shift, float* sums) {
#if defined(__AVX2__) && defined(__FMA__)
  const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(DOUBLED_E2M1));
  const __m128i low_nibble = _mm_set1_epi8(0x0F);
  // two accumulators a row: each FMA chain then waits on every other FMA's latency, not on each one's
  __m256 acc[R], acc_high[R];
  for (int r = 0; r < R; ++r) acc[r] = acc_high[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < in_features; k += 16) {
    const __m256 scale = _mm256_set1_ps(half_scales[k >> group_shift]);
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + k / 2));
    const __m128i nibbles = _mm_unpacklo_epi8(_mm_and_si128(bytes, low_nibble),
                                              _mm_and_si128(_mm_srli_epi16(bytes, 4), low_nibble));
    const __m128i values = _mm_shuffle_epi8(table, nibbles);
    const __m256 w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(values)), scale);
    const __m256 w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(values, 8))), scale);
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * in_features + k), acc[r]);
      acc_high[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * in_features + k + 8), acc_high[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m256 sum = _mm256_add_ps(acc[r], acc_high[r]);
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    const __m128 pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
    sums[r] = _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
  }
#else
  for (int r = 0; r < R; ++r) sums[r] = 0.0f;
  for (int64_t k = 0; k < in_features; ++k) {
    const uint8_t byte = codes[k / 2];
    const float w = DOUBLED_E2M1[(k % 2) ? (byte >> 4) : (byte & 0x0F)] * half_scales[k >> group_shift];
    for (int r = 0; r < R; ++r) sums[r] += w * x[r * in_features + k];
  }
#endif
}

// x [rows, in] (any float dtype), codes [out, in / 2] uint8, half_scales [out, in / group_size] float32
// -> [rows, out] in x's dtype
torch::Tensor fp4_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor half_scales, int64_t group_size) {
  TORCH_CHECK(codes.dtype() == torch::kUInt8 && half_scales.dtype() == torch::kFloat32, "fp4_matmul: uint8 codes, float32 scales");
  TORCH_CHECK(x.size(1) == 2 * codes.size(1) && x.size(1) % 16 == 0 && group_size >= 16 && (group_size & (group_size - 1)) == 0,
              "fp4_matmul: shapes (groups of a power of two from 16)");
  const int group_shift = __builtin_ctzll(group_size);  // k / group_size as a shift: a division per 16 codes costs more than they do
  const torch::Tensor inputs = x.to(torch::kFloat32).contiguous();
  const int64_t rows = inputs.size(0), in_features = inputs.size(1), out_features = codes.size(0);
  torch::Tensor out = torch::empty({rows, out_features}, inputs.options());
  const float* x_data = inputs.data_ptr<float>();
  const uint8_t* code_data = codes.data_ptr<uint8_t>();
  const float* scale_data = half_scales.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const int64_t groups = in_features / group_size;
  at::parallel_for(0, out_features, 16, [&](int64_t begin, int64_t end) {
    float sums[4];
    for (int64_t o = begin; o < end; ++o) {
      const uint8_t* row_codes = code_data + o * (in_features / 2);
      const float* row_scales = scale_data + o * groups;
      int64_t r = 0;
      for (; r + 4 <= rows; r += 4) {
        dot_rows<4>(x_data + r * in_features, in_features, row_codes, row_scales, group_shift, sums);
        for (int j = 0; j < 4; ++j) out_data[(r + j) * out_features + o] = sums[j];
      }
      for (; r < rows; ++r) {
        dot_rows<1>(x_data + r * in_features, in_features, row_codes, row_scales, group_shift, sums);
        out_data[r * out_features + o] = sums[0];
      }
    }
  });
  return out.to(x.scalar_type());
}
"""
# each nibble's E2M1 value: the sign bit, then an index into the magnitudes
E2M1_TABLE = torch.tensor([sign * magnitude for sign in (1, -1) for magnitude in E2M1_MAGNITUDES], dtype=torch.bfloat16)
KERNEL = CppKernel("llmc_fp4_gemm", SOURCE, ["fp4_matmul"], COMPILER_FLAGS, "float4 weights dequantized once, on dense matmuls")


class Fp4CpuLinear(DenseCopy, nn.Module):
    """NVFP4 and MXFP4 weights (weight-only; EmulatedInputLinear puts their inputs' quantization in front): in bfloat16
    on the nibble kernel (cpu_nibble_gemv.py) where the CPU has it, else (and in float32) on the C++ kernel above.
    Steps of more than max_eager_rows rows take the dense copy where one is kept (use_dense_copy)."""

    def __init__(self, weight: LinearWeight, dtype: torch.dtype, device: str):
        super().__init__()
        quantized = weight.weight
        self.out_features, self.in_features = quantized.codes.shape
        self.group_size, self.dtype = quantized.args.group_size, dtype
        self.nibbles: NibbleMatmul | None = None
        if cpu_nibble_gemv.serves(dtype, self.in_features, self.group_size):
            self.nibbles = NibbleMatmul(e2m1_nibbles(quantized.codes), quantized.scale, E2M1_TABLE, self.group_size)
        else:
            self.register_buffer("codes", pack_e2m1(quantized.codes).contiguous())
            self.register_buffer("half_scales", (quantized.scale.float() / 2).reshape(self.out_features, -1).contiguous())
        self.bias = None if weight.bias is None else nn.Parameter(weight.bias.to(dtype), requires_grad=False)
        self.no_dense_copy()

    @staticmethod
    def supports(weight: LinearWeight, dtype: torch.dtype, device: str) -> bool:
        quantized = weight.weight
        return (
            device == "cpu"
            and dtype in (torch.float32, torch.bfloat16)
            and isinstance(quantized, QuantizedWeight)
            and quantized.args.is_fp4
            and quantized.g_idx is None
            and quantized.input_activations is None
            and quantized.codes.shape[1] % quantized.args.group_size == 0  # the kernel's scale rows hold whole groups
            and KERNEL.get() is not None
        )

    def use_dense_copy(self, weight: QuantizedWeight, max_eager_rows: int) -> None:
        """Keep weight (this layer's, as built) dequantized beside the codes for steps of more than max_eager_rows rows."""
        self.keep_dense_copy(weight.dequantize().to(self.dtype), max_eager_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = self.dense_product(flat)
        if out is None and self.nibbles is not None:
            out = self.nibbles(flat)
        elif out is None:
            out = KERNEL.get().fp4_matmul(flat, self.codes, self.half_scales, self.group_size)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias
