"""W8A8 (int8) and FP8 Linears on the CPU in three calls instead of some fifteen small ops, each with the bits of
the torch ops it replaces (llmc.quant.quantized_mm's Kernels). The inputs' symmetric quantization, per token or with
the calibrated per-tensor scale, is one C++ kernel with quantize_activation's arithmetic: absmax / ((qmax - qmin) / 2),
the float32 epsilon when 0, x / scale clamped and rounded half to even (int8) or to float8 E4M3. int8 codes multiply
on torch._int_mm (exact int32 sums; oneDNN's int8 GEMM takes signed inputs on a slow reference path, unsigned ones
slower than _int_mm at these sizes); float8 codes, which bfloat16 holds exactly, on oneDNN's bfloat16 GEMM over the
weight's codes packed once at load (exact products, float32 sums rounded once to bfloat16). A second kernel scales
the sums by token and output channel in float32, adds the bias and rounds to the compute dtype. A row's bits do not
depend on the rows beside it. Compiled on first use like layers/cpu_attention.py; where that fails, the torch ops serve."""
import torch

from llmc.quant.qtypes import QuantArgs
from llmc.runtime.layers.cpp_kernel import COMPILER_FLAGS, WIDEN16, CppKernel
from llmc.runtime.layers.onednn_packed import PackedWeight

SOURCE = WIDEN16 + r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define LLMC_AVX512 1

// the scalar loop's operations 16 at a time, each IEEE-exact (max, division, round half to even, clamp): the same bits
template <typename T>
static int64_t absmax_int8_head(const T* values, int64_t features, float* absmax) {
  __m512 top = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= features; i += 16) top = _mm512_max_ps(top, _mm512_abs_ps(widen16(values + i)));
  *absmax = _mm512_reduce_max_ps(top);
  return i;
}

template <typename T>
static int64_t codes_int8_head(const T* values, int64_t features, float scale, float qmin, float qmax, int8_t* out) {
  const __m512 divisor = _mm512_set1_ps(scale), low = _mm512_set1_ps(qmin), high = _mm512_set1_ps(qmax);
  int64_t i = 0;
  for (; i + 16 <= features; i += 16) {
    const __m512 rounded = _mm512_roundscale_ps(_mm512_div_ps(widen16(values + i), divisor), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 clamped = _mm512_min_ps(_mm512_max_ps(rounded, low), high);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(clamped)));
  }
  return i;
}
#endif

template <typename T, typename Code>
static void quantize_rows_kernel(const T* x, Code* codes, float* scales, int64_t rows, int64_t features,
                                 const float* static_scale, float half_range, float qmin, float qmax) {
  constexpr bool vectorized_int8 = std::is_same_v<Code, int8_t> && !std::is_same_v<T, double>;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* values = x + row * features;
      Code* out = codes + row * features;
      float scale;
      if (static_scale != nullptr) {
        scale = *static_scale;
      } else {
        float absmax = 0.f;
        int64_t i = 0;
#ifdef LLMC_AVX512
        if constexpr (vectorized_int8) i = absmax_int8_head(values, features, &absmax);
#endif
        for (; i < features; ++i) absmax = std::max(absmax, std::fabs(static_cast<float>(values[i])));
        scale = absmax / half_range;
        if (scale == 0.f) scale = FLT_EPSILON;
        scales[row] = scale;
      }
      int64_t i = 0;
#ifdef LLMC_AVX512
      if constexpr (vectorized_int8) i = codes_int8_head(values, features, scale, qmin, qmax, out);
#endif
      for (; i < features; ++i) {
        const float scaled = static_cast<float>(values[i]) / scale;
        if constexpr (std::is_same_v<Code, int8_t>)
          out[i] = static_cast<int8_t>(std::min(std::max(std::nearbyint(scaled), qmin), qmax));
        else  // float8 E4M3: clamped, then rounded to nearest even by c10's conversion, as torch's .to() does
          out[i] = Code(static_cast<float>(c10::Float8_e4m3fn(std::min(std::max(scaled, qmin), qmax))));
      }
    }
  });
}

std::vector<torch::Tensor> quantize_rows(torch::Tensor x, c10::optional<torch::Tensor> static_scale, double half_range,
                                         double qmin, double qmax, at::ScalarType codes_dtype) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "quantize_rows takes a contiguous [rows, features] tensor");
  const int64_t rows = x.size(0), features = x.size(1);
  TORCH_CHECK(codes_dtype == torch::kInt8 || codes_dtype == torch::kFloat8_e4m3fn || codes_dtype == torch::kBFloat16,
              "codes in int8, float8 E4M3 or bfloat16 (holding E4M3 values)");
  auto codes = torch::empty({rows, features}, x.options().dtype(codes_dtype));
  torch::Tensor scales = static_scale.has_value() ? static_scale->to(torch::kFloat32).reshape({1}).contiguous()
                                                  : torch::empty({rows}, x.options().dtype(torch::kFloat32));
  const float* fixed = static_scale.has_value() ? scales.data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_rows", [&] {
    if (codes_dtype == torch::kFloat8_e4m3fn)
      quantize_rows_kernel(x.data_ptr<scalar_t>(), codes.data_ptr<c10::Float8_e4m3fn>(), scales.data_ptr<float>(), rows,
                           features, fixed, half_range, qmin, qmax);
    else if (codes_dtype == torch::kBFloat16)
      quantize_rows_kernel(x.data_ptr<scalar_t>(), codes.data_ptr<c10::BFloat16>(), scales.data_ptr<float>(), rows,
                           features, fixed, half_range, qmin, qmax);
    else
      quantize_rows_kernel(x.data_ptr<scalar_t>(), codes.data_ptr<int8_t>(), scales.data_ptr<float>(), rows, features,
                           fixed, half_range, qmin, qmax);
  });
  return {codes, scales};
}

// out[m, n] = (sums[m, n] * act_scale[m]) * weight_scale[n] (+ bias[n]) in float32, then in Out: torch's order
template <typename In, typename Out>
static void scale_sums_kernel(const In* sums, const float* act_scale, bool per_row, const float* weight_scale,
                              bool per_column, const Out* bias, Out* out, int64_t rows, int64_t columns) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float row_scale = act_scale[per_row ? row : 0];
      const In* in = sums + row * columns;
      Out* result = out + row * columns;
      for (int64_t column = 0; column < columns; ++column) {
        float value = static_cast<float>(in[column]) * row_scale * weight_scale[per_column ? column : 0];
        if (bias != nullptr) value = value + static_cast<float>(bias[column]);
        result[column] = static_cast<Out>(value);
      }
    }
  });
}

template <typename In>
static void scale_sums_as(const torch::Tensor& sums, const torch::Tensor& act_scale, const torch::Tensor& weight_scale,
                          const c10::optional<torch::Tensor>& bias, torch::Tensor& out) {
  const int64_t rows = sums.size(0), columns = sums.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "scale_sums", [&] {
    scale_sums_kernel(sums.data_ptr<In>(), act_scale.data_ptr<float>(), act_scale.numel() > 1, weight_scale.data_ptr<float>(),
                      weight_scale.numel() > 1, bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr,
                      out.data_ptr<scalar_t>(), rows, columns);
  });
}

torch::Tensor scale_sums(torch::Tensor sums, torch::Tensor act_scale, torch::Tensor weight_scale,
                         c10::optional<torch::Tensor> bias, at::ScalarType dtype) {
  TORCH_CHECK(sums.dim() == 2 && sums.is_contiguous(), "scale_sums takes contiguous [rows, columns] sums");
  TORCH_CHECK(act_scale.scalar_type() == torch::kFloat32 && weight_scale.scalar_type() == torch::kFloat32, "float32 scales");
  TORCH_CHECK(act_scale.numel() == 1 || act_scale.numel() == sums.size(0), "one activation scale, or one a row");
  TORCH_CHECK(weight_scale.numel() == 1 || weight_scale.numel() == sums.size(1), "one weight scale, or one a column");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == dtype && bias->numel() == sums.size(1)), "a bias in the output dtype");
  auto out = torch::empty(sums.sizes(), sums.options().dtype(dtype));
  auto act = act_scale.contiguous(), weight = weight_scale.contiguous();
  auto plain_bias = bias.has_value() ? c10::optional<torch::Tensor>(bias->contiguous()) : c10::nullopt;
  switch (sums.scalar_type()) {
    case torch::kInt32: scale_sums_as<int32_t>(sums, act, weight, plain_bias, out); break;
    case torch::kFloat32: scale_sums_as<float>(sums, act, weight, plain_bias, out); break;
    case torch::kBFloat16: scale_sums_as<c10::BFloat16>(sums, act, weight, plain_bias, out); break;
    default: TORCH_CHECK(false, "scale_sums takes int32, float32 or bfloat16 sums");
  }
  return out;
}
"""
# no fast math and no fused multiply-adds: every division, product and rounding must be IEEE's, one at a time, as torch's are
KERNEL = CppKernel("llmc_quantize_rows", SOURCE, ["quantize_rows", "scale_sums"], COMPILER_FLAGS, "quantizing with torch ops")


def compiled_kernel():
    """The compiled extension; None where it cannot be built (the torch ops still quantize and scale)."""
    return KERNEL.get()


def kernel_quantizes(args: QuantArgs) -> bool:
    """Whether quantize_activation_cpu computes these inputs: symmetric 8-bit, per token dynamic or per tensor static."""
    per_token = args.strategy == "token" and args.dynamic
    static_tensor = args.strategy == "tensor" and not args.dynamic
    return args.num_bits == 8 and args.symmetric and (per_token or static_tensor)


def _quantize_rows(x: torch.Tensor, args: QuantArgs, static_scale: torch.Tensor | None, codes_dtype: torch.dtype):
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    return compiled_kernel().quantize_rows(flat, static_scale, (args.qmax - args.qmin) / 2, args.qmin, args.qmax, codes_dtype)


def quantize_activation_cpu(
    x: torch.Tensor, args: QuantArgs, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """qtypes.quantize_activation's contract and bits in one kernel, for the inputs kernel_quantizes takes."""
    codes, scale = _quantize_rows(x, args, static_scale, args.code_dtype)
    return codes, scale


def quantize_fp8_as_bfloat16(
    x: torch.Tensor, args: QuantArgs, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_activation_cpu for float8 inputs with the E4M3 codes given in bfloat16, which holds them exactly, as
    PackedFp8Matmul multiplies them: no conversion between the two kernels."""
    codes, scale = _quantize_rows(x, args, static_scale, torch.bfloat16)
    return codes, scale


def scale_sums_cpu(sums: torch.Tensor, act_scale: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                   dtype: torch.dtype) -> torch.Tensor:
    """quantized_mm.scale_sums' contract and bits in one kernel (weight_scale float32, bias in dtype)."""
    return compiled_kernel().scale_sums(sums.contiguous(), act_scale.float(), weight_scale, bias, dtype)


class PackedFp8Matmul:
    """codes [tokens, in] float8 (or their values in bfloat16) x the weight's codes [out, in] float8 -> their sums
    [tokens, out] in bfloat16, on the weight's codes packed once for oneDNN's bfloat16 GEMM (oneDNN's own float8
    GEMM is a slow reference on CPUs without AMX-FP16)."""

    def __init__(self, weight_codes: torch.Tensor):
        self.packed = PackedWeight(weight_codes.to(torch.bfloat16), None)

    def __call__(self, codes: torch.Tensor, weight_codes: torch.Tensor) -> torch.Tensor:
        return self.packed(codes.to(torch.bfloat16))
