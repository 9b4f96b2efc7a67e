"""int8 x int8 -> int32 GEMM on the CPU's VNNI dot products (AVX-512 VNNI: vpdpbusd), over a weight packed once at
load. torch._int_mm hands oneDNN a plain weight, which it repacks on every call; at decode's few rows that repacking
costs more than the products. vpdpbusd multiplies unsigned by signed bytes, so the activations go in shifted by
128 (a XOR 0x80) and each output channel's 128 x (sum of its weights), computed once at packing, comes off the sums.
Sums are exact int32, as _int_mm's: the same bits whatever the row count or the rows beside a row. Compiled on first
use like layers/cpu_attention.py; where the compiler or the CPU lacks AVX-512 VNNI, torch._int_mm serves."""
from collections.abc import Callable

import torch

from llmc.quant.qtypes import QuantizedWeight
from llmc.quant.quantized_mm import int8_mm
from llmc.runtime.layers.cpp_kernel import COMPILER_FLAGS, CppKernel

# decode's rows; past them (prefill) the products outweigh the repacking and oneDNN's GEMM in _int_mm is the faster
MAX_PACKED_ROWS = 64

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstring>
#include <type_traits>
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
// what becomes of a tile's int32 sums: stored as they are (Out int32), or scaled in float32 by the row's activation
// scale, then by the channel's weight scale, plus the bias, and rounded to Out: quantized_mm.scale_sums' order and bits
template <typename Out>
struct Epilogue {
  const float* act_scale;     // the tile's first row's, or the one scale
  bool per_row;
  const float* weight_scale;  // the tile's first channel's, or the one scale
  bool per_channel;
  const Out* bias;            // the tile's first channel's, or nullptr
};

static inline __m512 widen_masked(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
static inline __m512 widen_masked(const c10::BFloat16* p, __mmask16 mask) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}
static inline __m512 widen_masked(const c10::Half* p, __mmask16 mask) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p)); }

static inline void store_masked(float* p, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(p, mask, v); }
// c10::BFloat16's rounding: to nearest even on the bits (denormals kept), NaN to the quiet NaN
static inline void store_masked(c10::BFloat16* p, __m512 v, __mmask16 mask) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  _mm256_mask_storeu_epi16(p, mask, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}
static inline void store_masked(c10::Half* p, __m512 v, __mmask16 mask) {
  _mm256_mask_storeu_epi16(p, mask, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// out[R rows, C * 16 channels] = shifted rows . packed weights - compensation, then the epilogue; channels past
// `channels_left` unstored
template <int R, int C, typename Out>
static inline void tile(const uint8_t* rows, int64_t row_stride, const int8_t* weights, int64_t k_steps,
                        const int32_t* shift, Out* out, int64_t out_stride, int64_t channels_left, const Epilogue<Out>& epilogue) {
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
    if constexpr (std::is_same_v<Out, int32_t>) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        _mm512_mask_storeu_epi32(out + r * out_stride + c * kLanes, mask, _mm512_sub_epi32(sums[r][c], correction));
    } else {
      const __m512 channel_scale = epilogue.per_channel ? widen_masked(epilogue.weight_scale + c * kLanes, mask)
                                                        : _mm512_set1_ps(epilogue.weight_scale[0]);
      const __m512 bias = epilogue.bias != nullptr ? widen_masked(epilogue.bias + c * kLanes, mask) : _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 row_scale = _mm512_set1_ps(epilogue.act_scale[epilogue.per_row ? r : 0]);
        __m512 value = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sums[r][c], correction)), row_scale), channel_scale);
        if (epilogue.bias != nullptr) value = _mm512_add_ps(value, bias);
        store_masked(out + r * out_stride + c * kLanes, value, mask);
      }
    }
  }
}

// the first rows in a tile of `rows_here` (at most R) rows
template <int C, typename Out, int R = kMaxRows>
static inline void row_tile(int64_t rows_here, const uint8_t* rows, int64_t row_stride, const int8_t* weights,
                            int64_t k_steps, const int32_t* shift, Out* out, int64_t out_stride, int64_t channels_left,
                            const Epilogue<Out>& epilogue) {
  if constexpr (R > 1) {
    if (rows_here < R)
      return row_tile<C, Out, R - 1>(rows_here, rows, row_stride, weights, k_steps, shift, out, out_stride, channels_left, epilogue);
  }
  tile<R, C, Out>(rows, row_stride, weights, k_steps, shift, out, out_stride, channels_left, epilogue);
}

// all rows times `blocks` (at most C) 16-channel blocks
template <typename Out, int C = kMaxColumns>
static void column_tile(int64_t blocks, const uint8_t* rows, int64_t num_rows, int64_t row_stride, const int8_t* weights,
                        int64_t k_steps, const int32_t* shift, Out* out, int64_t out_stride, int64_t channels_left,
                        Epilogue<Out> epilogue) {
  if constexpr (C > 1) {
    if (blocks < C)
      return column_tile<Out, C - 1>(blocks, rows, num_rows, row_stride, weights, k_steps, shift, out, out_stride, channels_left, epilogue);
  }
  const float* act_scale = epilogue.act_scale;
  for (int64_t first = 0; first < num_rows; first += kMaxRows) {
    if (epilogue.per_row) epilogue.act_scale = act_scale + first;
    row_tile<C, Out>(std::min(kMaxRows, num_rows - first), rows + first * row_stride, row_stride, weights, k_steps, shift,
                     out + first * out_stride, out_stride, channels_left, epilogue);
  }
}

template <typename Out>
static void matmul(const torch::Tensor& codes, const torch::Tensor& packed, const torch::Tensor& compensation, Out* result,
                   int64_t out_features, const Epilogue<Out>& epilogue) {
  const int64_t m = codes.size(0), k = codes.size(1), n_blocks = packed.size(0), k_steps = packed.size(1);
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
  at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = t * width, blocks = std::min(width, n_blocks - block);
      const int8_t* w = weights + block * k_steps * kLanes * kDepth;
      const int64_t channel = block * kLanes;
      Epilogue<Out> here = epilogue;
      if (here.per_channel) here.weight_scale += channel;
      if (here.bias != nullptr) here.bias += channel;
      column_tile<Out>(blocks, rows, m, row_stride, w, k_steps, shift + channel, result + channel, out_features,
                       out_features - channel, here);
    }
  });
}
#endif

static void check_packed(const torch::Tensor& codes, const torch::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(vnni_available(), "the packed int8 GEMM needs AVX-512 VNNI");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kInt8, "int8 [rows, in] codes");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kLanes && packed.size(3) == kDepth, "a weight from pack_int8_weight");
  const int64_t k = codes.size(1), n_blocks = packed.size(0);
  TORCH_CHECK(packed.size(1) == (k + kDepth - 1) / kDepth && out_features <= n_blocks * kLanes && out_features > (n_blocks - 1) * kLanes,
              "codes of ", k, " inputs and ", out_features, " outputs do not match the packed weight");
}

// codes [M, K] int8 x packed weight -> [M, N] exact int32 sums
torch::Tensor int8_matmul_packed(torch::Tensor codes, torch::Tensor packed, torch::Tensor compensation, int64_t out_features) {
  check_packed(codes, packed, out_features);
  auto out = torch::empty({codes.size(0), out_features}, codes.options().dtype(torch::kInt32));
#ifdef LLMC_VNNI
  const Epilogue<int32_t> unscaled{nullptr, false, nullptr, false, nullptr};
  matmul<int32_t>(codes, packed, compensation, out.data_ptr<int32_t>(), out_features, unscaled);
#endif
  return out;
}

// the same sums scaled by act_scale (one a row, or one) and weight_scale (one a channel, or one), plus the bias, in dtype
torch::Tensor int8_linear_packed(torch::Tensor codes, torch::Tensor act_scale, torch::Tensor packed, torch::Tensor compensation,
                                 torch::Tensor weight_scale, c10::optional<torch::Tensor> bias, int64_t out_features,
                                 at::ScalarType dtype) {
  check_packed(codes, packed, out_features);
  TORCH_CHECK(act_scale.scalar_type() == torch::kFloat32 && weight_scale.scalar_type() == torch::kFloat32, "float32 scales");
  TORCH_CHECK(act_scale.numel() == 1 || act_scale.numel() == codes.size(0), "one activation scale, or one a row");
  TORCH_CHECK(weight_scale.numel() == 1 || weight_scale.numel() == out_features, "one weight scale, or one a channel");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == dtype && bias->numel() == out_features), "a bias in the output dtype");
  auto out = torch::empty({codes.size(0), out_features}, codes.options().dtype(dtype));
#ifdef LLMC_VNNI
  const auto act = act_scale.contiguous(), weight = weight_scale.contiguous();
  const auto plain_bias = bias.has_value() ? c10::optional<torch::Tensor>(bias->contiguous()) : c10::nullopt;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "int8_linear_packed", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      const Epilogue<scalar_t> epilogue{act.data_ptr<float>(), act.numel() > 1, weight.data_ptr<float>(), weight.numel() > 1,
                                        plain_bias.has_value() ? plain_bias->data_ptr<scalar_t>() : nullptr};
      matmul<scalar_t>(codes, packed, compensation, out.data_ptr<scalar_t>(), out_features, epilogue);
    } else {
      TORCH_CHECK(false, "int8_linear_packed writes float32, bfloat16 or float16");
    }
  });
#endif
  return out;
}
"""
# no contractions: the epilogue's two products and sum round one at a time, as scale_sums' do
FUNCTIONS = ["vnni_available", "pack_int8_weight", "int8_matmul_packed", "int8_linear_packed"]
KERNEL = CppKernel("llmc_int8_gemm", SOURCE, FUNCTIONS, COMPILER_FLAGS, "multiplying int8 codes with torch._int_mm")


def available() -> bool:
    """Whether the kernel built and this CPU (as the compiler saw it, -march=native) has AVX-512 VNNI."""
    kernel = KERNEL.get()
    return kernel is not None and kernel.vnni_available()


class PackedInt8Matmul:
    """codes [tokens, in] int8 x the weight's codes [out, in] int8 -> their exact sums [tokens, out] int32
    (quantized_mm.codes_mm's contract), on the weight packed once for vpdpbusd up to MAX_PACKED_ROWS tokens; `scaled`
    also applies scale_sums (quantized_mm.Kernels.scaled_matmul's contract) in the same kernel, with its bits."""

    def __init__(self, weight_codes: torch.Tensor, scale_sums: Callable):
        self.out_features = weight_codes.shape[0]
        self.packed, self.compensation = KERNEL.get().pack_int8_weight(weight_codes)
        self.scale_sums = scale_sums  # for the rows past MAX_PACKED_ROWS

    def __call__(self, codes: torch.Tensor, weight_codes: torch.Tensor) -> torch.Tensor:
        if codes.shape[0] > MAX_PACKED_ROWS:
            return int8_mm(codes, weight_codes)
        return KERNEL.get().int8_matmul_packed(codes, self.packed, self.compensation, self.out_features)

    def scaled(self, codes: torch.Tensor, act_scale: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None,
               dtype: torch.dtype) -> torch.Tensor:
        if codes.shape[0] > MAX_PACKED_ROWS:
            return self.scale_sums(int8_mm(codes, weight.codes), act_scale, weight.scale, bias, dtype)
        return KERNEL.get().int8_linear_packed(codes, act_scale.float(), self.packed, self.compensation, weight.scale.float(),
                                               bias, self.out_features, dtype)
