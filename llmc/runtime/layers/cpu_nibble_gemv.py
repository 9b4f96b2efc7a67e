"""4-bit weights (symmetric int4, float4 E2M1) times a few bfloat16 rows on the CPU, read straight from their nibbles:
each 64 codes of a weight row are 32 bytes, the low nibbles the first 32 codes and the high nibbles the next 32
(`interleave_nibbles`, done once at load), so one load, two masks and two 32-way table lookups (vpermw over the
format's 16 values in bfloat16: int4's -8..7, E2M1's 0..6) give 64 bfloat16 weights, which vdpbf16ps multiplies by
the inputs in pairs into float32 sums. Every product is exact; each group's partial sums are scaled by the group's
float32 scale (so a weight is code x scale, as `dequantize` gives it in float32) and accumulated in float32. A row's
bits do not depend on the rows beside it: each row runs the same instructions whatever the batch.

This is the batch-1 decode path: a step reads half a byte a weight plus its group's scale, and spends a few
instructions a 64 weights, so the matmul runs near the memory's speed. It needs AVX-512 with BF16 (Zen 4, Sapphire
Rapids and later); elsewhere `available()` is False and torch's int4 kernel (int4) or the AVX2 float4 kernel serve.
Compiled on first use like layers/cpu_attention.py."""
import torch
from torch import nn

from llmc.runtime.layers.cpp_kernel import COMPILER_FLAGS, CppKernel

# the kernel's arithmetic, shared with the fused decode stack (cpu_decode_stack.py): nibble_rows(x, ..., epilogue)
# calls epilogue(row, output, float32 sum) for every row of x and every output in [begin, end)
CORE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define LLMC_NIBBLE_GEMV 1
// the scales of 32 codes from k, as vdpbf16ps's 16 sums (each of two neighbouring codes) meet them: one group's
// scale in every lane, or with groups of 16 the first group's in the low 8 lanes and the second's in the high 8
static inline __m512 scales_at(const float* scales, int64_t k, int group_shift) {
  if (group_shift == 4)
    return _mm512_insertf32x8(_mm512_set1_ps(scales[k >> 4]), _mm256_set1_ps(scales[(k >> 4) + 1]), 1);
  return _mm512_set1_ps(scales[k >> group_shift]);
}

// rows R of x (bfloat16, row stride `stride`) times one weight row's interleaved nibbles: R float32 sums
// IEEE arithmetic also where the decode stack compiles this beside the attention kernel's fast math
#define LLMC_EXACT __attribute__((optimize("no-fast-math", "fp-contract=off")))
template <int R>
LLMC_EXACT static inline void dot_rows(const c10::BFloat16* x, int64_t stride, int64_t in_features, const uint8_t* codes,
                            const float* scales, int group_shift, __m512i table, float* sums) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m512 low_acc[R], high_acc[R];  // two chains a row: an FMA waits on the one before the last, not the last
  for (int r = 0; r < R; ++r) low_acc[r] = high_acc[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < in_features; k += 64) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + k / 2));
    const __m512i low = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(_mm256_and_si256(bytes, nibble)), table);
    const __m512i high = _mm512_permutexvar_epi16(
        _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble)), table);
    const __m512 low_scale = scales_at(scales, k, group_shift);
    const __m512 high_scale = scales_at(scales, k + 32, group_shift);
    for (int r = 0; r < R; ++r) {
      const c10::BFloat16* row = x + r * stride + k;
      const __m512 low_sums = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)low,
                                               (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(row)));
      const __m512 high_sums = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)high,
                                                (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(row + 32)));
      low_acc[r] = _mm512_fmadd_ps(low_sums, low_scale, low_acc[r]);
      high_acc[r] = _mm512_fmadd_ps(high_sums, high_scale, high_acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) sums[r] = _mm512_reduce_add_ps(_mm512_add_ps(low_acc[r], high_acc[r]));
}

// every row of x times the weight rows [begin, end): four rows at a time, then one
template <typename Epilogue>
static inline void nibble_rows(const c10::BFloat16* x, int64_t stride, int64_t rows, int64_t in_features,
                               const uint8_t* codes, const float* scales, int group_shift, const uint16_t* table16,
                               int64_t begin, int64_t end, Epilogue epilogue) {
  uint16_t entries[32] = {0};
  std::memcpy(entries, table16, 16 * sizeof(uint16_t));
  const __m512i table = _mm512_loadu_si512(entries);
  const int64_t groups = in_features >> group_shift;
  float sums[4];
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* row_codes = codes + o * (in_features / 2);
    const float* row_scales = scales + o * groups;
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
      dot_rows<4>(x + r * stride, stride, in_features, row_codes, row_scales, group_shift, table, sums);
      for (int j = 0; j < 4; ++j) epilogue(r + j, o, sums[j]);
    }
    for (; r < rows; ++r) {
      dot_rows<1>(x + r * stride, stride, in_features, row_codes, row_scales, group_shift, table, sums);
      epilogue(r, o, sums[0]);
    }
  }
}
#endif
"""
SOURCE = CORE + r"""
bool available() {
#ifdef LLMC_NIBBLE_GEMV
  return true;
#else
  return false;
#endif
}

// x [rows, in] bfloat16, codes [out, in / 2] uint8 (interleave_nibbles), scales [out, in / group_size] float32,
// table [16] bfloat16 (each nibble's value) -> [rows, out] bfloat16
torch::Tensor nibble_gemv(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor table, int64_t group_size) {
#ifdef LLMC_NIBBLE_GEMV
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.stride(1) == 1, "nibble_gemv: bfloat16 rows [rows, in]");
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.is_contiguous() && scales.scalar_type() == torch::kFloat32 &&
              scales.is_contiguous() && table.scalar_type() == torch::kBFloat16 && table.numel() == 16 && table.is_contiguous(),
              "nibble_gemv: uint8 codes, float32 scales, a bfloat16 table of 16 values");
  const int64_t rows = x.size(0), in_features = x.size(1), out_features = codes.size(0), stride = x.stride(0);
  TORCH_CHECK(in_features % 64 == 0 && codes.size(1) * 2 == in_features, "nibble_gemv: in_features a multiple of 64");
  TORCH_CHECK(group_size >= 16 && (group_size & (group_size - 1)) == 0 && scales.size(0) == out_features &&
              scales.size(1) * group_size == in_features, "nibble_gemv: groups of a power of two from 16");
  const int group_shift = __builtin_ctzll(group_size);
  auto out = torch::empty({rows, out_features}, x.options());
  const c10::BFloat16* x_data = x.data_ptr<c10::BFloat16>();
  c10::BFloat16* out_data = out.data_ptr<c10::BFloat16>();
  const uint16_t* table16 = reinterpret_cast<const uint16_t*>(table.data_ptr<c10::BFloat16>());
  at::parallel_for(0, out_features, 16, [&](int64_t begin, int64_t end) {
    nibble_rows(x_data, stride, rows, in_features, codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), group_shift, table16,
                begin, end, [&](int64_t r, int64_t o, float sum) { out_data[r * out_features + o] = c10::BFloat16(sum); });
  });
  return out;
#else
  TORCH_CHECK(false, "nibble_gemv needs AVX-512 with BF16");
#endif
}
"""
KERNEL = CppKernel("llmc_nibble_gemv", SOURCE, ["available", "nibble_gemv"], COMPILER_FLAGS,
                   "torch's int4 kernel, or the AVX2 float4 kernel")
CHUNK = 64  # codes a 32-byte load holds


def available() -> bool:
    """Whether the kernel builds and this CPU runs it (AVX-512 BF16)."""
    module = KERNEL.get()
    return module is not None and module.available()


def serves(dtype: torch.dtype, in_features: int, group_size: int) -> bool:
    """Whether a 4-bit layer of this width and group size computing in `dtype` runs on the kernel here (bfloat16 only)."""
    return dtype == torch.bfloat16 and fits(in_features, group_size) and available()


def fits(in_features: int, group_size: int) -> bool:
    """Whether the kernel takes weights of this width and group size."""
    return in_features % CHUNK == 0 and in_features % group_size == 0 and group_size >= 16 and group_size & (group_size - 1) == 0


def interleave_nibbles(indices: torch.Tensor) -> torch.Tensor:
    """[out, in] nibble values (0..15) -> [out, in / 2] uint8: each 64 codes as 32 bytes, code j in byte j's low
    nibble and code j + 32 in its high nibble."""
    out_features, in_features = indices.shape
    chunks = indices.to(torch.uint8).reshape(out_features, in_features // CHUNK, 2, CHUNK // 2)
    return (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(out_features, in_features // 2).contiguous()


def nibble_gemv(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, table: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [rows, in] bfloat16 times the weights [out, in] whose nibbles `codes` (interleave_nibbles) index `table`
    (16 bfloat16 values) and whose groups of group_size scale by `scales` [out, in / group_size] float32."""
    return KERNEL.get().nibble_gemv(x, codes, scales, table, group_size)


def deinterleave_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """interleave_nibbles' inverse: [out, in / 2] uint8 -> [out, in] nibble values (uint8)."""
    out_features = packed.shape[0]
    chunks = packed.reshape(out_features, -1, CHUNK // 2)
    return torch.stack([chunks & 0x0F, chunks >> 4], dim=2).reshape(out_features, -1)


INT4_TABLE = torch.tensor([index if index < 8 else index - 16 for index in range(16)], dtype=torch.bfloat16)


class NibbleMatmul(nn.Module):
    """x [rows, in] bfloat16 times 4-bit weights whose nibbles index `table` and whose groups scale by float32 scales."""

    def __init__(self, nibbles: torch.Tensor, scales: torch.Tensor, table: torch.Tensor, group_size: int):
        super().__init__()
        self.group_size = group_size
        self.register_buffer("codes", interleave_nibbles(nibbles))
        self.register_buffer("scales", scales.float().reshape(nibbles.shape[0], -1).contiguous())
        self.register_buffer("table", table.to(torch.bfloat16))

    @classmethod
    def int4(cls, codes: torch.Tensor, scales: torch.Tensor, group_size: int) -> "NibbleMatmul":
        """Symmetric int4 codes (-8..7) and their group scales."""
        return cls(codes.to(torch.int16) & 0x0F, scales, INT4_TABLE, group_size)

    def int4_codes(self) -> torch.Tensor:
        """The int4 codes back (-8..7), for a kernel of another layout."""
        nibbles = deinterleave_nibbles(self.codes).to(torch.int8)
        return torch.where(nibbles >= 8, nibbles - 16, nibbles)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nibble_gemv(x if x.stride(-1) == 1 else x.contiguous(), self.codes, self.scales, self.table, self.group_size)
