"""Paged decode attention on the CPU as one C++ kernel: for each (sequence, KV head) it reads the sequence's K/V
blocks through its block table where they lie in the cache (no gather, no float32 copy of the cache), computes the
scores of the query heads that share the KV head in float32, soft-caps them, masks the keys out of the sliding
window, and sums the softmax-weighted values, keys in position order. Head sizes 64 and 128 are written out in
AVX-512 where the compiler has it: each key and value row widened to float32 once for the whole query group, the
group's value sums held in registers, rows fetched ahead (the compiler left the bfloat16 loops scalar). A row's
arithmetic depends on its own length only, so its result is the same whatever rows share the step. Compiled with
the machine's compiler on first use (torch.utils.cpp_extension, about 25 s on 2 cores, cached for later runs in
torch's extension folder, TORCH_EXTENSIONS_DIR); where that fails, decoding keeps the torch reference
(attention.decode_attention_reference)."""
import torch

from llmc.runtime.layers.attention import PLAIN, AttentionBackend, DecodeRows, ScoreShape
from llmc.runtime.layers.cpp_kernel import WIDEN16, CppKernel

SOURCE = WIDEN16 + r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

// element i of a cache row as float; bfloat16 widened by a shift the compiler vectorizes
template <typename T>
static inline float load(const T* row, int64_t i) { return static_cast<float>(row[i]); }
template <>
inline float load<c10::BFloat16>(const c10::BFloat16* row, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(row)[i]) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

#if defined(__AVX512F__)
// a cache row's lines asked for ahead of use: rows lie a block apart, where the hardware's stride prefetch stops
constexpr int64_t kAhead = 8;  // positions
template <typename T, int J, int Hint>
static inline void prefetch_row(const T* row) {
#pragma GCC unroll 8
  for (int line = 0; line < int(16 * J * sizeof(T) / 64); ++line)
    _mm_prefetch(reinterpret_cast<const char*>(row) + 64 * line, static_cast<_mm_hint>(Hint));
}

// scores[g * count + i] = q[g] . key i, for head_dim = 16 * J: a key row is widened once into registers for the group;
// the value rows are fetched meanwhile, for weighted_values
template <typename T, int J>
static void key_scores(const float* q, const T* const* keys, const T* const* values, int64_t count, int64_t group, float* scores) {
  for (int64_t i = 0; i < count; ++i) {
    if (i + kAhead < count) prefetch_row<T, J, _MM_HINT_T0>(keys[i + kAhead]);
    prefetch_row<T, J, _MM_HINT_T1>(values[i]);
    __m512 key[J];
#pragma GCC unroll 8
    for (int j = 0; j < J; ++j) key[j] = widen16(keys[i] + 16 * j);
    for (int64_t g = 0; g < group; ++g) {
      __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(q + g * 16 * J), key[0]);
#pragma GCC unroll 8
      for (int j = 1; j < J; ++j) dot = _mm512_fmadd_ps(_mm512_loadu_ps(q + (g * J + j) * 16), key[j], dot);
      scores[g * count + i] = _mm512_reduce_add_ps(dot);
    }
  }
}

// acc[g] = sum_i weights[g * count + i] * value i for G query heads from `first_head`, the sums held in registers
template <typename T, int J, int G>
static void weighted_values(const float* weights, const T* const* values, int64_t count, int64_t first_head, float* acc) {
  __m512 sums[G][J];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int j = 0; j < J; ++j) sums[g][j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < count; ++i) {
    if (i + kAhead < count) prefetch_row<T, J, _MM_HINT_T0>(values[i + kAhead]);
    __m512 value[J];
#pragma GCC unroll 8
    for (int j = 0; j < J; ++j) value[j] = widen16(values[i] + 16 * j);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const __m512 weight = _mm512_set1_ps(weights[(first_head + g) * count + i]);
#pragma GCC unroll 8
      for (int j = 0; j < J; ++j) sums[g][j] = _mm512_fmadd_ps(weight, value[j], sums[g][j]);
    }
  }
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int j = 0; j < J; ++j) _mm512_storeu_ps(acc + ((first_head + g) * J + j) * 16, sums[g][j]);
}

// the group's heads in tiles of at most G (24 / J sums in registers), the last tile narrower
template <typename T, int J, int G = 24 / J>
static void all_weighted_values(const float* weights, const T* const* values, int64_t count, int64_t group, int64_t first_head,
                                float* acc) {
  const int64_t left = group - first_head;
  if constexpr (G > 1) {
    if (left < G) return all_weighted_values<T, J, G - 1>(weights, values, count, group, first_head, acc);
  }
  weighted_values<T, J, G>(weights, values, count, first_head, acc);
  if (left > G) all_weighted_values<T, J>(weights, values, count, group, first_head + G, acc);
}
#endif

// scores[g * count + i] = q[g] . key i, and acc[g] = sum_i weights[g * count + i] * value i; head_dim 64 and 128
// explicitly vectorized where the CPU has AVX-512, any head_dim by the compiler's vectorization
template <typename T>
static void item_scores(const float* q, const T* const* keys, const T* const* values, int64_t count, int64_t group,
                        int64_t head_dim, float* scores) {
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, double>) {
    if (head_dim == 64) return key_scores<T, 4>(q, keys, values, count, group, scores);
    if (head_dim == 128) return key_scores<T, 8>(q, keys, values, count, group, scores);
  }
#endif
  for (int64_t i = 0; i < count; ++i)
    for (int64_t g = 0; g < group; ++g) {
      float dot = 0.f;
      for (int64_t d = 0; d < head_dim; ++d) dot += q[g * head_dim + d] * load(keys[i], d);
      scores[g * count + i] = dot;
    }
}

template <typename T>
static void item_values(const float* weights, const T* const* values, int64_t count, int64_t group, int64_t head_dim, float* acc) {
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, double>) {
    if (head_dim == 64) return all_weighted_values<T, 4>(weights, values, count, group, 0, acc);
    if (head_dim == 128) return all_weighted_values<T, 8>(weights, values, count, group, 0, acc);
  }
#endif
  std::fill(acc, acc + group * head_dim, 0.f);
  for (int64_t i = 0; i < count; ++i)
    for (int64_t g = 0; g < group; ++g)
      for (int64_t d = 0; d < head_dim; ++d) acc[g * head_dim + d] += weights[g * count + i] * load(values[i], d);
}

// tables: per row, its blocks (a block table) or, with by_slot, the cache slot of each key position
template <typename T>
static void decode_kernel(const T* query, const T* k_cache, const T* v_cache, const int64_t* tables,
                          const int64_t* context_lens, T* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                          int64_t head_dim, int64_t block_size, int64_t table_width, bool by_slot, double scale,
                          int64_t window, double softcap) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * head_dim), scores, acc(group * head_dim);
    std::vector<const T*> keys, values;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t length = context_lens[seq];
      const int64_t first = window > 0 ? std::max<int64_t>(0, length - window) : 0;
      const int64_t* table = tables + seq * table_width;
      const int64_t count = length - first;
      keys.resize(count);
      values.resize(count);
      for (int64_t pos = first; pos < length; ++pos) {
        const int64_t slot = by_slot ? table[pos] : table[pos / block_size] * block_size + pos % block_size;
        keys[pos - first] = k_cache + slot * token_stride + kv_head * head_dim;
        values[pos - first] = v_cache + slot * token_stride + kv_head * head_dim;
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          q[g * head_dim + d] = load(query, (seq * num_heads + kv_head * group + g) * head_dim + d);
      scores.resize(group * count);
      item_scores(q.data(), keys.data(), values.data(), count, group, head_dim, scores.data());
      for (int64_t g = 0; g < group; ++g) {
        float* row = scores.data() + g * count;
        for (int64_t i = 0; i < count; ++i) {
          float score = row[i] * static_cast<float>(scale);
          if (softcap > 0) score = std::tanh(score / static_cast<float>(softcap)) * static_cast<float>(softcap);
          row[i] = score;
        }
        float top = row[0];  // no infinities: the fast-math build assumes finite values
        for (int64_t i = 1; i < count; ++i) top = std::max(top, row[i]);
        float total = 0.f;
        for (int64_t i = 0; i < count; ++i) { row[i] = std::exp(row[i] - top); total += row[i]; }
        for (int64_t i = 0; i < count; ++i) row[i] /= total;
      }
      item_values(scores.data(), values.data(), count, group, head_dim, acc.data());
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          out[(seq * num_heads + kv_head * group + g) * head_dim + d] = static_cast<T>(acc[g * head_dim + d]);
    }
  });
}

torch::Tensor paged_decode(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables_in,
                           torch::Tensor context_lens, bool by_slot, double scale, int64_t window, double softcap) {
  TORCH_CHECK(query.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous tensors expected");
  auto tables = tables_in.to(torch::kLong).contiguous();
  auto lengths = context_lens.to(torch::kLong).contiguous();
  auto out = torch::empty_like(query);
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(query.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            tables.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), num_seqs,
                            num_heads, num_kv_heads, head_dim, block_size, tables.size(1), by_slot, scale, window, softcap);
  });
  return out;
}
"""
# fast math lets the compiler vectorize the dot products over head_dim (reassociated: in an order the code fixes, not
# the batch) and the softmax's exponentials (glibc's vector expf); the kernel keeps every value finite. OpenMP: ATen's parallel_for
# spreads (sequence, KV head) pairs over torch's threads only when the extension is built with it
COMPILER_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
KERNEL = CppKernel("llmc_paged_decode", SOURCE, ["paged_decode"], COMPILER_FLAGS, "decoding on the torch reference")


def compiled_kernel():
    """The compiled extension; None where it cannot be built (the reference still decodes)."""
    return KERNEL.get()


def decode_attention_cpu(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    shape: ScoreShape = PLAIN,
) -> torch.Tensor:
    """Same contract as attention.decode_attention_reference, for caches in the compute dtype."""
    assert k_scale is None and v_scale is None, "FP8 caches decode on the reference"
    return compiled_kernel().paged_decode(query.contiguous(), k_cache, v_cache, block_tables, context_lens, False, scale,
                                          shape.window or 0, shape.softcap or 0.0)


def attend_rows_cpu(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, buckets: list[DecodeRows], scale: float,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, shape: ScoreShape = PLAIN,
) -> torch.Tensor:
    """Same contract as attention.attend_rows (draft rows, each over its own key slots), by the same kernel and in the
    same order as decoding: a draft row computes bit for bit what decoding its token would."""
    assert k_scale is None and v_scale is None, "FP8 caches decode on the reference"
    out = torch.empty_like(query)
    for bucket in buckets:
        by_slot = not bucket.whole_blocks
        out[bucket.rows] = compiled_kernel().paged_decode(query[bucket.rows].contiguous(), k_cache, v_cache, bucket.slots,
                                                          bucket.lengths, by_slot, scale, shape.window or 0, shape.softcap or 0.0)
    return out


# caches in the compute dtype on the CPU, where the kernel builds: decode rows and draft rows on the C++ kernel, which
# walks the block tables itself, so nothing is prepared per step
CPP_ATTENTION = AttentionBackend("cpp", decode_attention_cpu, attend_rows_cpu, prepares_decode_rows=False)
