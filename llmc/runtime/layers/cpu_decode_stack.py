"""A decode step's whole decoder stack as one C++ call on the CPU: for a few rows that each decode one token, every
layer's RMSNorm, fused QKV projection (+ bias), q/k norms, rotary embedding, KV cache write, paged attention, output
projection and residual, norm, gate/up projection, SiLU-and-multiply, down projection and residual run in C++ without
returning to Python. Eager, a layer is some eighty torch ops of a few microseconds each, which on a small model at
one row cost as much as its matmuls (SmolLM2-135M W4A16: 13.0 ms a step eager, 7.3 here).

What it takes (models/decode_stack.py's `refusal` says what is missing): bfloat16 on the CPU with AVX-512 BF16, a
cache in the compute dtype, plain attention (no window, no soft cap), pre-norm dense layers with SiLU (no sandwich norms, no
experts), and every Linear of every layer on the nibble kernel (int4 W4A16, NVFP4A16, MXFP4A16: cpu_nibble_gemv.py).
Each operation rounds to bfloat16 where the eager layers round (norm, projection, bias, rotary product and sum,
residual, activation, product), with the nibble kernel's and the attention kernel's arithmetic (layers/
cpu_attention.py, compiled in); a row's bits depend on that row alone. Compiled on first use like cpu_attention.py."""
from llmc.runtime.layers import cpu_attention
from llmc.runtime.layers.cpp_kernel import CppKernel
from llmc.runtime.layers.cpu_nibble_gemv import CORE

STACK = r"""
#include <pybind11/stl.h>

#ifdef LLMC_NIBBLE_GEMV
using bf16 = c10::BFloat16;
static inline float f32(bf16 value) { return static_cast<float>(value); }

struct Nibbles {
  torch::Tensor codes, scales, table, bias;  // bias undefined where the Linear has none
  int64_t in_features = 0, out_features = 0;
  int group_shift = 0;
};

static Nibbles nibbles(torch::Tensor codes, torch::Tensor scales, torch::Tensor table, int64_t group_size,
                       c10::optional<torch::Tensor> bias) {
  Nibbles linear;
  linear.codes = codes.contiguous();
  linear.scales = scales.contiguous();
  linear.table = table.contiguous();
  if (bias.has_value()) linear.bias = bias->contiguous();
  linear.out_features = codes.size(0);
  linear.in_features = codes.size(1) * 2;
  linear.group_shift = __builtin_ctzll(group_size);
  return linear;
}

// x [rows, in] times the Linear, each output rounded to bfloat16 (then plus the bias, rounded), handed to store
template <typename Store>
static void project(const Nibbles& linear, const bf16* x, int64_t rows, Store store) {
  const uint16_t* table = reinterpret_cast<const uint16_t*>(linear.table.data_ptr<bf16>());
  const bf16* bias = linear.bias.defined() ? linear.bias.data_ptr<bf16>() : nullptr;
  at::parallel_for(0, linear.out_features, 16, [&](int64_t begin, int64_t end) {
    nibble_rows(x, linear.in_features, rows, linear.in_features, linear.codes.data_ptr<uint8_t>(), linear.scales.data_ptr<float>(),
                linear.group_shift, table, begin, end, [&](int64_t r, int64_t o, float sum) {
                  bf16 value(sum);
                  if (bias != nullptr) value = bf16(f32(value) + f32(bias[o]));
                  store(r, o, value);
                });
  });
}

// norms.py's arithmetic, as cpu_elementwise's kernel: squares summed 16 lanes at a time, the normed value rounded to
// bfloat16, then times the bfloat16 gain, rounded
// LLMC_EXACT (the nibble kernel's CORE): IEEE arithmetic as the elementwise extension compiles it
LLMC_EXACT static void rms_norm_row(const bf16* x, const bf16* weight, bf16* out, int64_t hidden, float eps) {
  __m512 sum = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= hidden; i += 16) {
    const __m512 v = widen16(x + i);
    sum = _mm512_add_ps(sum, _mm512_mul_ps(v, v));
  }
  float squares = _mm512_reduce_add_ps(sum);
  for (; i < hidden; ++i) squares += f32(x[i]) * f32(x[i]);
  const float inverse = 1.f / std::sqrt(squares / static_cast<float>(hidden) + eps);
  for (int64_t j = 0; j < hidden; ++j) out[j] = bf16(f32(weight[j]) * f32(bf16(f32(x[j]) * inverse)));
}

// rotary.py's arithmetic, as cpu_elementwise's kernel: the first rotary_dim features of a head turned, each product and
// the sum rounded to bfloat16
LLMC_EXACT static void rotate_head(bf16* head, const bf16* cos, const bf16* sin, int64_t rotary_dim) {
  const int64_t half = rotary_dim / 2;
  bf16 turned[512], result[512];
  for (int64_t d = 0; d < rotary_dim; ++d) turned[d] = d < half ? bf16(-f32(head[d + half])) : head[d - half];
  for (int64_t d = 0; d < rotary_dim; ++d)
    result[d] = bf16(f32(bf16(f32(head[d]) * f32(cos[d]))) + f32(bf16(f32(turned[d]) * f32(sin[d]))));
  std::memcpy(head, result, rotary_dim * sizeof(bf16));
}

struct Layer {
  torch::Tensor input_norm, post_norm, q_norm, k_norm, cos, sin, k_cache, v_cache;  // q/k norms, cos/sin may be undefined
  Nibbles qkv, o, gate_up, down;
};

class DecodeStack {
 public:
  DecodeStack(int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale)
      : hidden_(hidden), heads_(num_heads), kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale) {}

  void add_layer(std::vector<torch::Tensor> norms, std::vector<torch::Tensor> rope, torch::Tensor k_cache, torch::Tensor v_cache,
                 std::vector<torch::Tensor> codes, std::vector<torch::Tensor> scales, std::vector<torch::Tensor> tables,
                 std::vector<int64_t> group_sizes, std::vector<c10::optional<torch::Tensor>> biases) {
    TORCH_CHECK(norms.size() == 4 && rope.size() == 2 && codes.size() == 4 && scales.size() == 4 && tables.size() == 4 &&
                group_sizes.size() == 4 && biases.size() == 4, "add_layer: four norms (q/k may be empty), cos/sin, four Linears");
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == torch::kBFloat16,
                "add_layer: a contiguous bfloat16 cache");
    Layer layer;
    layer.input_norm = norms[0].contiguous();
    layer.post_norm = norms[1].contiguous();
    if (norms[2].numel()) layer.q_norm = norms[2].contiguous(), layer.k_norm = norms[3].contiguous();
    if (rope[0].numel()) layer.cos = rope[0].contiguous(), layer.sin = rope[1].contiguous();
    layer.k_cache = k_cache;
    layer.v_cache = v_cache;
    Nibbles* linears[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
    for (int i = 0; i < 4; ++i) *linears[i] = nibbles(codes[i], scales[i], tables[i], group_sizes[i], biases[i]);
    layers_.push_back(layer);
  }

  // hidden [rows, hidden] bfloat16 (the embeddings) -> the last layer's output; each row one token at `positions`,
  // its K/V written at `slots`, attending over its block table's first `lengths` positions
  torch::Tensor forward(torch::Tensor hidden_in, torch::Tensor positions, torch::Tensor slots, torch::Tensor block_tables,
                        torch::Tensor lengths) {
    TORCH_CHECK(hidden_in.dim() == 2 && hidden_in.size(1) == hidden_ && hidden_in.scalar_type() == torch::kBFloat16,
                "forward: bfloat16 [rows, hidden]");
    torch::Tensor hidden = hidden_in.contiguous().clone();
    const int64_t rows = hidden.size(0), q_width = heads_ * head_dim_, kv_width = kv_heads_ * head_dim_;
    auto where = positions.to(torch::kLong).contiguous();
    auto slot = slots.to(torch::kLong).contiguous();
    auto tables = block_tables.to(torch::kLong).contiguous();
    auto length = lengths.to(torch::kLong).contiguous();
    auto options = hidden.options();
    torch::Tensor normed = torch::empty({rows, hidden_}, options), queries = torch::empty({rows, q_width}, options);
    torch::Tensor attended = torch::empty({rows, q_width}, options);
    bf16* h = hidden.data_ptr<bf16>();
    bf16* n = normed.data_ptr<bf16>();
    for (const Layer& layer : layers_) {
      const int64_t qkv_width = layer.qkv.out_features, intermediate = layer.gate_up.out_features / 2;
      torch::Tensor qkv = torch::empty({rows, qkv_width}, options), gate_up = torch::empty({rows, 2 * intermediate}, options);
      torch::Tensor act = torch::empty({rows, intermediate}, options);
      bf16* qkv_data = qkv.data_ptr<bf16>();
      for (int64_t r = 0; r < rows; ++r)
        rms_norm_row(h + r * hidden_, layer.input_norm.data_ptr<bf16>(), n + r * hidden_, hidden_, eps_);
      project(layer.qkv, n, rows, [&](int64_t r, int64_t o, bf16 value) { qkv_data[r * qkv_width + o] = value; });
      const int64_t block_size = layer.k_cache.size(1), token_stride = kv_width;
      bf16* k_cache = layer.k_cache.data_ptr<bf16>();
      bf16* v_cache = layer.v_cache.data_ptr<bf16>();
      for (int64_t r = 0; r < rows; ++r) {
        bf16* row = qkv_data + r * qkv_width;
        const int64_t position = where.data_ptr<int64_t>()[r];
        for (int64_t head = 0; head < heads_ + kv_heads_; ++head) {
          bf16* features = row + head * head_dim_;
          if (layer.q_norm.defined()) {
            const bf16* gain = (head < heads_ ? layer.q_norm : layer.k_norm).data_ptr<bf16>();
            bf16 out[512];
            rms_norm_row(features, gain, out, head_dim_, eps_);
            std::memcpy(features, out, head_dim_ * sizeof(bf16));
          }
          if (layer.cos.defined()) {
            const int64_t rotary_dim = layer.cos.size(1);
            rotate_head(features, layer.cos.data_ptr<bf16>() + position * rotary_dim, layer.sin.data_ptr<bf16>() + position * rotary_dim,
                        rotary_dim);
          }
        }
        std::memcpy(queries.data_ptr<bf16>() + r * q_width, row, q_width * sizeof(bf16));
        const int64_t at = slot.data_ptr<int64_t>()[r] * token_stride;
        std::memcpy(k_cache + at, row + q_width, kv_width * sizeof(bf16));
        std::memcpy(v_cache + at, row + q_width + kv_width, kv_width * sizeof(bf16));
      }
      decode_kernel<bf16>(queries.data_ptr<bf16>(), k_cache, v_cache, tables.data_ptr<int64_t>(), length.data_ptr<int64_t>(),
                          attended.data_ptr<bf16>(), rows, heads_, kv_heads_, head_dim_, block_size, tables.size(1), false,
                          scale_, 0, 0.0);
      project(layer.o, attended.data_ptr<bf16>(), rows, [&](int64_t r, int64_t o, bf16 value) {
        h[r * hidden_ + o] = bf16(f32(h[r * hidden_ + o]) + f32(value));
      });
      for (int64_t r = 0; r < rows; ++r)
        rms_norm_row(h + r * hidden_, layer.post_norm.data_ptr<bf16>(), n + r * hidden_, hidden_, eps_);
      bf16* gu = gate_up.data_ptr<bf16>();
      project(layer.gate_up, n, rows, [&](int64_t r, int64_t o, bf16 value) { gu[r * 2 * intermediate + o] = value; });
      // torch's own SiLU and product on the same views as the eager MLP: its vectorized exponential, its bits
      at::mul_out(act, at::silu(gate_up.slice(1, 0, intermediate)), gate_up.slice(1, intermediate, 2 * intermediate));
      bf16* a = act.data_ptr<bf16>();
      project(layer.down, a, rows, [&](int64_t r, int64_t o, bf16 value) {
        h[r * hidden_ + o] = bf16(f32(h[r * hidden_ + o]) + f32(value));
      });
    }
    return hidden;
  }

 private:
  int64_t hidden_, heads_, kv_heads_, head_dim_;
  float eps_;
  double scale_;
  std::vector<Layer> layers_;
};
#endif

bool stack_available() {
#ifdef LLMC_NIBBLE_GEMV
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &stack_available);
#ifdef LLMC_NIBBLE_GEMV
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, double, double>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("forward", &DecodeStack::forward);
#endif
}
"""
# the attention kernel's source and flags (fast math: its vectorized exponentials; the rest LLMC_EXACT), the nibble
# kernel's arithmetic: the eager layers' bits, so that speculative verification (eager) agrees with decoding (here)
KERNEL = CppKernel("llmc_decode_stack", cpu_attention.SOURCE + CORE + STACK, None, cpu_attention.COMPILER_FLAGS,
                   "decoding layer by layer")
MAX_HEAD_DIM = 512  # the C++ keeps a head in a fixed buffer
