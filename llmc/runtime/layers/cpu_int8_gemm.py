"""int8 x int8 -> int32 GEMM on the CPU's VNNI dot products (AVX-512 VNNI: vpdpbusd), over a weight packed once at
load. torch._int_mm hands oneDNN a plain weight, which it repacks on every call; at decode's few rows that repacking
costs more than the products. vpdpbusd multiplies unsigned by signed bytes, so the activations go in shifted by
128 (a XOR 0x80) and each output channel's 128 x (sum of its weights), computed once at packing, comes off the sums.
Sums are exact int32, as _int_mm's: the same bits whatever the row count or the rows beside a row. Compiled on first
use like layers/cpu_attention.py; where the compiler or the CPU lacks AVX-512 VNNI, torch._int_mm serves."""
import torch

from llmc.quant.quantized_mm import int8_mm
from llmc.runtime.layers.cpp_kernel import CppKernel

# decode's rows; past them (prefill) the products outweigh the repacking and oneDNN's GEMM in _int_mm is the faster
MAX_PACKED_ROWS = 64

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstring>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define LLMC_VNNI 1
#endif

constexpr int64_t kLanes = 16;  // int32 sums in one 512-bit register: 16 output channels
constexpr int64_t kDepth = 4;   // bytes one int32 lane sums per vpdpbusd: 4 consecutive inputs
constexpr int64_t kMaxRows = 8;     // rows per register tile
constexpr int64_t kMaxColumns = 3;  // 16-channel blocks per register tile: 8 x 3 sums + 3 weights in 32 registers
constexpr int64_t kPrefetchBytes = 512;  // how far ahead in a weight stream the next lines are asked for

bool vnni_available() {
#ifdef LLMC_VNNI
  return true;
#else
  return false;
#endif
}

// weight [N, K] int8 -> packed [ceil(N / 16), ceil(K / 4), 16, 4] (zero padded) and 128 * sum_k weight[n, k]
std::vector<torch::Tensor> pack_int8_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kInt8, "pack_int8_weight takes an int8 [out, in] weight");
  const auto plain = weight.contiguous();
  const int64_t n = plain.size(0), k = plain.size(1);
  const int64_t n_blocks = (n + kLanes - 1) / kLanes, k_steps = (k + kDepth - 1) / kDepth;
  auto packed = torch::zeros({n_blocks, k_steps, kLanes, kDepth}, plain.options());
  auto compensation = torch::zeros({n_blocks * kLanes}, plain.options().dtype(torch::kInt32));
  const int8_t* source = plain.data_ptr<int8_t>();
  int8_t* target = packed.data_ptr<int8_t>();
  int32_t* shift = compensation.data_ptr<int32_t>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t channel = begin; channel < end; ++channel) {
      int32_t sum = 0;
      for (int64_t i = 0; i < k; ++i) {
        const int8_t value = source[channel * k + i];
        sum += value;
        target[(((channel / kLanes) * k_steps + i / kDepth) * kLanes + channel % kLanes) * kDepth + i % kDepth] = value;
      }
      shift[channel] = 128 * sum;
    }
  });
  return {packed, compensation};
}

#ifdef LLMC_VNNI
// out[R rows, C * 16 channels] = shifted rows . packed weights - compensation, channels past `channels_left` unstored
template <int R, int C>
static inline void tile(const uint8_t* rows, int64_t row_stride, const int8_t* weights, int64_t k_steps,
                        const int32_t* shift, int32_t* out, int64_t out_stride, int64_t channels_left) {
  __m512i sums[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) sums[r][c] = _mm512_setzero_si512();
  for (int64_t step = 0; step < k_steps; ++step) {
    __m512i w[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const int8_t* at = weights + (c * k_steps + step) * kLanes * kDepth;
      _mm_prefetch(reinterpret_cast<const char*>(at + kPrefetchBytes), _MM_HINT_T0);
      w[c] = _mm512_loadu_si512(at);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, rows + r * row_stride + step * kDepth, sizeof(four));
      const __m512i x = _mm512_set1_epi32(four);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) sums[r][c] = _mm512_dpbusd_epi32(sums[r][c], x, w[c]);
    }
  }
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) {
    const int64_t valid = channels_left - c * kLanes;
    if (valid <= 0) break;
    const __mmask16 mask = valid >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
    const __m512i correction = _mm512_loadu_si512(shift + c * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_epi32(out + r * out_stride + c * kLanes, mask, _mm512_sub_epi32(sums[r][c], correction));
  }
}

// the first rows in a tile of `rows_here` (at most R) rows
template <int C, int R = kMaxRows>
static inline void row_tile(int64_t rows_here, const uint8_t* rows, int64_t row_stride, const int8_t* weights,
                            int64_t k_steps, const int32_t* shift, int32_t* out, int64_t out_stride, int64_t channels_left) {
  if constexpr (R > 1) {
    if (rows_here < R) return row_tile<C, R - 1>(rows_here, rows, row_stride, weights, k_steps, shift, out, out_stride, channels_left);
  }
  tile<R, C>(rows, row_stride, weights, k_steps, shift, out, out_stride, channels_left);
}

// all rows times `blocks` (at most C) 16-channel blocks
template <int C = kMaxColumns>
static void column_tile(int64_t blocks, const uint8_t* rows, int64_t num_rows, int64_t row_stride, const int8_t* weights,
                        int64_t k_steps, const int32_t* shift, int32_t* out, int64_t out_stride, int64_t channels_left) {
  if constexpr (C > 1) {
    if (blocks < C) return column_tile<C - 1>(blocks, rows, num_rows, row_stride, weights, k_steps, shift, out, out_stride, channels_left);
  }
  for (int64_t first = 0; first < num_rows; first += kMaxRows)
    row_tile<C>(std::min(kMaxRows, num_rows - first), rows + first * row_stride, row_stride, weights, k_steps, shift,
                out + first * out_stride, out_stride, channels_left);
}
#endif

torch::Tensor int8_matmul_packed(torch::Tensor codes, torch::Tensor packed, torch::Tensor compensation, int64_t out_features) {
  TORCH_CHECK(vnni_available(), "int8_matmul_packed needs AVX-512 VNNI");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kInt8, "int8 [rows, in] codes");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kLanes && packed.size(3) == kDepth, "a weight from pack_int8_weight");
  const int64_t m = codes.size(0), k = codes.size(1), n_blocks = packed.size(0), k_steps = packed.size(1);
  TORCH_CHECK(k_steps == (k + kDepth - 1) / kDepth && out_features <= n_blocks * kLanes && out_features > (n_blocks - 1) * kLanes,
              "codes of ", k, " inputs and ", out_features, " outputs do not match the packed weight");
  auto out = torch::empty({m, out_features}, codes.options().dtype(torch::kInt32));
#ifdef LLMC_VNNI
  const int64_t row_stride = k_steps * kDepth;
  auto shifted = torch::zeros({m, row_stride}, codes.options().dtype(torch::kUInt8));
  const auto plain = codes.contiguous();
  const int8_t* source = plain.data_ptr<int8_t>();
  uint8_t* rows = shifted.data_ptr<uint8_t>();
  for (int64_t row = 0; row < m; ++row)
    for (int64_t i = 0; i < k; ++i) rows[row * row_stride + i] = static_cast<uint8_t>(source[row * k + i]) ^ 0x80;
  // enough column tiles for every thread: narrower tiles where the output is narrow
  const int64_t threads = at::get_num_threads();
  const int64_t width = std::max<int64_t>(1, std::min<int64_t>(kMaxColumns, n_blocks / (4 * threads)));
  const int64_t num_tiles = (n_blocks + width - 1) / width;
  const int8_t* weights = packed.data_ptr<int8_t>();
  const int32_t* shift = compensation.data_ptr<int32_t>();
  int32_t* result = out.data_ptr<int32_t>();
  at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = t * width, blocks = std::min(width, n_blocks - block);
      const int8_t* w = weights + block * k_steps * kLanes * kDepth;
      const int64_t channel = block * kLanes, left = out_features - channel;
      column_tile(blocks, rows, m, row_stride, w, k_steps, shift + channel, result + channel, out_features, left);
    }
  });
#endif
  return out;
}
"""
COMPILER_FLAGS = ["-O3", "-march=native", "-fopenmp"]
KERNEL = CppKernel("llmc_int8_gemm", SOURCE, ["vnni_available", "pack_int8_weight", "int8_matmul_packed"], COMPILER_FLAGS,
                   "multiplying int8 codes with torch._int_mm")


def available() -> bool:
    """Whether the kernel built and this CPU (as the compiler saw it, -march=native) has AVX-512 VNNI."""
    kernel = KERNEL.get()
    return kernel is not None and kernel.vnni_available()


class PackedInt8Matmul:
    """codes [tokens, in] int8 x the weight's codes [out, in] int8 -> their exact sums [tokens, out] int32
    (quantized_mm.codes_mm's contract), on the weight packed once for vpdpbusd up to MAX_PACKED_ROWS tokens."""

    def __init__(self, weight_codes: torch.Tensor):
        self.out_features = weight_codes.shape[0]
        self.packed, self.compensation = KERNEL.get().pack_int8_weight(weight_codes)

    def __call__(self, codes: torch.Tensor, weight_codes: torch.Tensor) -> torch.Tensor:
        if codes.shape[0] > MAX_PACKED_ROWS:
            return int8_mm(codes, weight_codes)
        return KERNEL.get().int8_matmul_packed(codes, self.packed, self.compensation, self.out_features)
