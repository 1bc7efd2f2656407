// glasslm's CPU kernels for the small steps of a one-token decoding step: what decode.py says, fast.
//
// Read decode.py first: it holds the readable definition of each op here (rms_norm_reference,
// decode_attention_reference), built from the readable core's own pieces. A one-token step of a small
// model spends most of its time outside the matrix products: a norm is ~10 tensor operators, rotary
// and the cache write another ~20, attention over the cache a few more, each a dispatcher call of a few
// microseconds on a vector of a few hundred floats. Here each of those is one call:
//
//   rms_norm:          y = x / sqrt(mean(x^2) + eps) * w          (w or 1 + w: Gemma's unit offset)
//   add_rms_norm:      x += r, then rms_norm(x)                   (the residual add and the next norm)
//   layer_norm:        y = (x - mean(x)) / sqrt(var(x) + eps) * w + b     (var biased, b optional)
//   add_layer_norm:    x += r, then layer_norm(x)
//   gelu_tanh:         y = x / 2 * (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
//   silu_mul:          y = gate / (1 + e^-gate) * up
//   decode_attention:  split one row of q|k|v per batch row into heads, rotate q and k by the row's
//                      position (adjacent pairs, the first rotary_dims features), write k and v into
//                      cache slot `slot`, and attend each query head over the cache slots it may see
//                      (the filled prefix [0, slot], minus masked slots, within a sliding window):
//                      softmax(q k^T * scale) v, in float32.
//
// Vectors are float32. Dot products and updates run AVX-512 or AVX2 where the CPU has it (the path
// qmatmul.cpp's select_isa chose), else plain C++; only the order of float additions differs.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "ops.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define GLASSLM_X86 1
#define GLASSLM_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))
#define GLASSLM_AVX2 __attribute__((target("avx2,fma")))
#else
#define GLASSLM_X86 0
#endif

namespace glasslm_kernels {

int64_t current_isa();  // qmatmul.cpp: 0 plain C++, 1 AVX2, 2 AVX-512

namespace {

// ----------------------------------------------------------------------------------------------
// Two vector primitives over a head's rows of the cache: its scores (a dot product with each key)
// and the weighted sum of its values.
//
// The plain C++ is the definition; the AVX-512 and AVX2 paths keep sixteen or eight partial sums per
// key, reduced at the end of the row, then add the features past the last whole vector. Scores go four
// keys at a time: a single key's multiply-adds wait on each other, and one key at a time made attention
// ~8% of GPT-2 small's int8 decoding step.

float dot_scalar(const float* a, const float* b, int64_t n) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // eight partial sums, as a vector unit would keep
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) lanes[k] += a[i + k] * b[i + k];
  }
  float total = 0;
  for (float lane : lanes) total += lane;
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

// scores[j] = q . keys[j] for the n rows of `keys` (d floats each).
void dots_scalar(const float* q, const float* keys, int64_t n, int64_t d, float* scores) {
  for (int64_t j = 0; j < n; ++j) scores[j] = dot_scalar(q, keys + j * d, d);
}

// z += sum_j p[j] * values[j], row after row; rows whose p is 0 (masked keys) are skipped, as their
// slots may hold anything.
void weighted_sum_scalar(const float* p, const float* values, int64_t n, int64_t d, float* z) {
  for (int64_t j = 0; j < n; ++j) {
    if (p[j] == 0) continue;
    for (int64_t i = 0; i < d; ++i) z[i] += p[j] * values[j * d + i];
  }
}

// The features of four keys past the last whole vector, added to their reduced sums.
void dot_tails(const float* q, const float* k, int64_t from, int64_t d, float* scores) {
  for (int r = 0; r < 4; ++r) {
    for (int64_t i = from; i < d; ++i) scores[r] += q[i] * k[r * d + i];
  }
}

#if GLASSLM_X86
GLASSLM_AVX512 void dots_avx512(const float* q, const float* keys, int64_t n, int64_t d, float* scores) {
  const int64_t whole = d - d % 16;
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const float* k = keys + j * d;
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t i = 0; i < whole; i += 16) {
      const __m512 qi = _mm512_loadu_ps(q + i);
      for (int r = 0; r < 4; ++r) acc[r] = _mm512_fmadd_ps(qi, _mm512_loadu_ps(k + r * d + i), acc[r]);
    }
    for (int r = 0; r < 4; ++r) scores[j + r] = _mm512_reduce_add_ps(acc[r]);
    dot_tails(q, k, whole, d, scores + j);
  }
  for (; j < n; ++j) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < whole; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(keys + j * d + i), acc);
    scores[j] = _mm512_reduce_add_ps(acc);
    for (int64_t i = whole; i < d; ++i) scores[j] += q[i] * keys[j * d + i];
  }
}

// z kept in registers, 64 features at a time (masked at the row's end), over all n rows.
GLASSLM_AVX512 void weighted_sum_avx512(const float* p, const float* values, int64_t n, int64_t d, float* z) {
  for (int64_t i = 0; i < d; i += 64) {
    __mmask16 mask[4];
    __m512 acc[4];
    for (int c = 0; c < 4; ++c) {
      const int64_t count = std::clamp<int64_t>(d - i - 16 * c, 0, 16);
      mask[c] = static_cast<__mmask16>((1u << count) - 1);
      acc[c] = _mm512_maskz_loadu_ps(mask[c], z + i + 16 * c);
    }
    for (int64_t j = 0; j < n; ++j) {
      if (p[j] == 0) continue;
      const __m512 weight = _mm512_set1_ps(p[j]);
      const float* v = values + j * d + i;
      for (int c = 0; c < 4; ++c) acc[c] = _mm512_fmadd_ps(weight, _mm512_maskz_loadu_ps(mask[c], v + 16 * c), acc[c]);
    }
    for (int c = 0; c < 4; ++c) _mm512_mask_storeu_ps(z + i + 16 * c, mask[c], acc[c]);
  }
}

GLASSLM_AVX2 float sum8(__m256 v) {
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
}

GLASSLM_AVX2 void dots_avx2(const float* q, const float* keys, int64_t n, int64_t d, float* scores) {
  const int64_t whole = d - d % 8;
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const float* k = keys + j * d;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < whole; i += 8) {
      const __m256 qi = _mm256_loadu_ps(q + i);
      for (int r = 0; r < 4; ++r) acc[r] = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k + r * d + i), acc[r]);
    }
    for (int r = 0; r < 4; ++r) scores[j + r] = sum8(acc[r]);
    dot_tails(q, k, whole, d, scores + j);
  }
  for (; j < n; ++j) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < whole; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(keys + j * d + i), acc);
    scores[j] = sum8(acc);
    for (int64_t i = whole; i < d; ++i) scores[j] += q[i] * keys[j * d + i];
  }
}

GLASSLM_AVX2 void weighted_sum_avx2(const float* p, const float* values, int64_t n, int64_t d, float* z) {
  const int64_t whole = d - d % 8;
  for (int64_t i = 0; i < whole; i += 32) {
    const int chunks = static_cast<int>(std::min<int64_t>(4, (whole - i) / 8));
    __m256 acc[4];
    for (int c = 0; c < chunks; ++c) acc[c] = _mm256_loadu_ps(z + i + 8 * c);
    for (int64_t j = 0; j < n; ++j) {
      if (p[j] == 0) continue;
      const __m256 weight = _mm256_set1_ps(p[j]);
      for (int c = 0; c < chunks; ++c) acc[c] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(values + j * d + i + 8 * c), acc[c]);
    }
    for (int c = 0; c < chunks; ++c) _mm256_storeu_ps(z + i + 8 * c, acc[c]);
  }
  if (whole < d) {
    for (int64_t j = 0; j < n; ++j) {
      if (p[j] == 0) continue;
      for (int64_t i = whole; i < d; ++i) z[i] += p[j] * values[j * d + i];
    }
  }
}
#endif

struct Vec {
  void (*dots)(const float*, const float*, int64_t, int64_t, float*) = dots_scalar;
  void (*weighted_sum)(const float*, const float*, int64_t, int64_t, float*) = weighted_sum_scalar;
};

Vec vector_path() {
  Vec v;
#if GLASSLM_X86
  const int64_t isa = current_isa();
  if (isa >= 2) {
    v.dots = dots_avx512;
    v.weighted_sum = weighted_sum_avx512;
  } else if (isa == 1) {
    v.dots = dots_avx2;
    v.weighted_sum = weighted_sum_avx2;
  }
#endif
  return v;
}

// ----------------------------------------------------------------------------------------------
// RMSNorm.

}  // namespace

void check_float_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, name, " must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.is_contiguous() && x.dim() >= 1, name, " must be contiguous with at least one dim");
}

void rms_norm_rows(const float* x, const float* w, float eps, bool unit_offset, int64_t rows, int64_t d, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    double squares = 0;  // a float64 sum: the mean of squares is then exact to float32's last bit
    for (int64_t i = 0; i < d; ++i) squares += static_cast<double>(xr[i]) * xr[i];
    const float inverse = 1.0f / std::sqrt(static_cast<float>(squares / d) + eps);
    for (int64_t i = 0; i < d; ++i) {
      const float gain = unit_offset ? 1.0f + w[i] : w[i];
      y[r * d + i] = (xr[i] * inverse) * gain;
    }
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset) {
  check_float_rows(x, "x");
  check_float_rows(weight, "weight");
  const int64_t d = x.size(-1);
  TORCH_CHECK(weight.numel() == d, "weight has ", weight.numel(), " features, x has ", d);
  at::Tensor y = at::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), static_cast<float>(eps), unit_offset, x.numel() / d, d,
                y.data_ptr<float>());
  return y;
}

void add_in_place(at::Tensor& x, const at::Tensor& residual) {
  check_float_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes(), "residual ", residual.sizes(), " and x ", x.sizes(), " differ in shape");
  check_float_rows(x, "x");
  float* xs = x.data_ptr<float>();
  const float* rs = residual.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) xs[i] += rs[i];
}

at::Tensor add_rms_norm(at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps, bool unit_offset) {
  add_in_place(x, residual);
  return rms_norm(x, weight, eps, unit_offset);
}

// The mean and the variance in float64 sums, like the RMSNorm above: float32's last bit, whatever d.
void layer_norm_rows(const float* x, const float* w, const float* b, float eps, int64_t rows, int64_t d, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    double total = 0;
    for (int64_t i = 0; i < d; ++i) total += xr[i];
    const float mean = static_cast<float>(total / d);
    double squares = 0;
    for (int64_t i = 0; i < d; ++i) squares += static_cast<double>(xr[i] - mean) * (xr[i] - mean);
    const float inverse = 1.0f / std::sqrt(static_cast<float>(squares / d) + eps);
    for (int64_t i = 0; i < d; ++i) {
      const float scaled = ((xr[i] - mean) * inverse) * w[i];
      y[r * d + i] = b != nullptr ? scaled + b[i] : scaled;
    }
  }
}

at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias, double eps) {
  check_float_rows(x, "x");
  check_float_rows(weight, "weight");
  const int64_t d = x.size(-1);
  TORCH_CHECK(weight.numel() == d, "weight has ", weight.numel(), " features, x has ", d);
  if (bias) {
    check_float_rows(*bias, "bias");
    TORCH_CHECK(bias->numel() == d, "bias has ", bias->numel(), " features, x has ", d);
  }
  at::Tensor y = at::empty_like(x);
  layer_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), bias ? bias->data_ptr<float>() : nullptr,
                  static_cast<float>(eps), x.numel() / d, d, y.data_ptr<float>());
  return y;
}

at::Tensor add_layer_norm(at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias, double eps) {
  add_in_place(x, residual);
  return layer_norm(x, weight, bias, eps);
}

// ----------------------------------------------------------------------------------------------
// The MLP's activations, in place: GELU in its tanh form (GPT-2's) and SiLU(gate) * up (SwiGLU's).
//
// The plain C++ with std::tanh and std::exp is the definition. The AVX-512 path takes e^x as 2^n e^r,
// r = x - n ln 2 within ln 2 / 2 of zero and e^r its Taylor series to r^6 (within ~2 float32 steps of
// std::exp), and GELU as x / (1 + e^-2u), the same value as x (1 + tanh u) / 2. ATen's own activation
// cost ~6 us a call on a decoding step's row, most of it dispatch.

namespace {

constexpr float kGeluBeta = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluKappa = 0.044715f;

void gelu_tanh_scalar(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    x[i] = 0.5f * v * (1.0f + std::tanh(kGeluBeta * (v + kGeluKappa * v * v * v)));
  }
}

void silu_mul_scalar(float* gate, const float* up, int64_t n) {
  for (int64_t i = 0; i < n; ++i) gate[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

#if GLASSLM_X86
GLASSLM_AVX512 __m512 exp512(__m512 x) {
  // Past these, 2^n is already infinite or zero (scalef overflows and underflows as e^x does); inside
  // them n stays a small integer.
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(89.0f)), _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);  // ln 2 in two parts: n ln 2 exactly
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 series = _mm512_set1_ps(1.0f / 720);
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) {
    series = _mm512_fmadd_ps(series, r, _mm512_set1_ps(c));
  }
  return _mm512_scalef_ps(series, n);
}

GLASSLM_AVX512 __mmask16 tail_mask(int64_t left) {
  return static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1);
}

GLASSLM_AVX512 void gelu_tanh_avx512(float* x, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = tail_mask(n - i);
    const __m512 v = _mm512_maskz_loadu_ps(mask, x + i);
    const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(v, v), v);
    const __m512 u = _mm512_mul_ps(_mm512_set1_ps(kGeluBeta), _mm512_fmadd_ps(_mm512_set1_ps(kGeluKappa), cube, v));
    // x (1 + tanh u) / 2 = x / (1 + e^-2u): no 1 + tanh u to cancel where tanh u is near -1
    const __m512 e = exp512(_mm512_mul_ps(_mm512_set1_ps(-2.0f), u));
    _mm512_mask_storeu_ps(x + i, mask, _mm512_div_ps(v, _mm512_add_ps(one, e)));
  }
}

GLASSLM_AVX512 void silu_mul_avx512(float* gate, const float* up, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = tail_mask(n - i);
    const __m512 g = _mm512_maskz_loadu_ps(mask, gate + i);
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    _mm512_mask_storeu_ps(gate + i, mask, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(mask, up + i)));
  }
}
#endif

}  // namespace

void gelu_tanh_in_place(at::Tensor& x) {
  check_float_rows(x, "x");
#if GLASSLM_X86
  if (current_isa() >= 2) return gelu_tanh_avx512(x.data_ptr<float>(), x.numel());
#endif
  gelu_tanh_scalar(x.data_ptr<float>(), x.numel());
}

void silu_mul_in_place(at::Tensor& gate, const at::Tensor& up) {
  check_float_rows(gate, "gate");
  check_float_rows(up, "up");
  TORCH_CHECK(gate.sizes() == up.sizes(), "gate ", gate.sizes(), " and up ", up.sizes(), " differ in shape");
#if GLASSLM_X86
  if (current_isa() >= 2) return silu_mul_avx512(gate.data_ptr<float>(), up.data_ptr<float>(), gate.numel());
#endif
  silu_mul_scalar(gate.data_ptr<float>(), up.data_ptr<float>(), gate.numel());
}

at::Tensor gelu_tanh(const at::Tensor& x) {
  at::Tensor y = x.clone();
  gelu_tanh_in_place(y);
  return y;
}

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  at::Tensor y = gate.clone();
  silu_mul_in_place(y, up);
  return y;
}

namespace {

// ----------------------------------------------------------------------------------------------
// One query per row against the cache.

struct Step {
  int64_t batch, heads, kv_heads, d_head, slots, slot, rotary_dims, window;
  float scale;
  const int64_t* positions;
  const float* cos;  // (context, rotary_dims / 2) or null
  const float* sin;
  int64_t context;
  const bool* key_mask;  // (batch, slots) or null
};

// Rotate adjacent pairs (v[2i], v[2i+1]) of the first rotary_dims features by angle row `c`, `s`.
void rotate(float* v, const float* c, const float* s, int64_t rotary_dims) {
  for (int64_t i = 0; i < rotary_dims / 2; ++i) {
    const float first = v[2 * i], second = v[2 * i + 1];
    v[2 * i] = first * c[i] - second * s[i];
    v[2 * i + 1] = first * s[i] + second * c[i];
  }
}

// Queries (batch, heads, d_head) rotated into `queries`; the new keys (rotated) and values into the cache.
void place(const Step& st, const float* qkv, float* queries, float* keys, float* values) {
  const int64_t width = (st.heads + 2 * st.kv_heads) * st.d_head;
  for (int64_t b = 0; b < st.batch; ++b) {
    const float* row = qkv + b * width;
    float* q = queries + b * st.heads * st.d_head;
    std::copy(row, row + st.heads * st.d_head, q);
    for (int64_t g = 0; g < st.kv_heads; ++g) {
      const int64_t at = ((b * st.kv_heads + g) * st.slots + st.slot) * st.d_head;
      const float* k = row + (st.heads + g) * st.d_head;
      const float* v = row + (st.heads + st.kv_heads + g) * st.d_head;
      std::copy(k, k + st.d_head, keys + at);
      std::copy(v, v + st.d_head, values + at);
    }
    if (st.cos == nullptr) continue;
    const int64_t p = st.positions[b];
    TORCH_CHECK(p >= 0 && p < st.context, "position ", p, " is outside the rotary table's ", st.context, " rows");
    const float* c = st.cos + p * (st.rotary_dims / 2);
    const float* s = st.sin + p * (st.rotary_dims / 2);
    for (int64_t h = 0; h < st.heads; ++h) rotate(q + h * st.d_head, c, s, st.rotary_dims);
    for (int64_t g = 0; g < st.kv_heads; ++g) {
      rotate(keys + ((b * st.kv_heads + g) * st.slots + st.slot) * st.d_head, c, s, st.rotary_dims);
    }
  }
}

// softmax(q K^T * scale) V for the `group` query heads that share one kv head, over the slots row b
// may see. Keys go in chunks of ~32 KiB, each chunk read by all `group` heads while it is in L1.
// scores is scratch (group, slots).
void attend_group(const Step& st, const Vec& vec, int64_t b, int64_t group, const float* queries, const float* keys,
                  const float* values, float* scores, float* z) {
  const int64_t first = st.window > 0 ? std::max<int64_t>(0, st.slot - st.window + 1) : 0, seen = st.slot + 1 - first;
  const int64_t chunk = std::max<int64_t>(4, 8192 / st.d_head);
  for (int64_t start = first; start <= st.slot; start += chunk) {
    const int64_t rows = std::min(chunk, st.slot + 1 - start);
    for (int64_t h = 0; h < group; ++h) {
      vec.dots(queries + h * st.d_head, keys + start * st.d_head, rows, st.d_head, scores + h * st.slots + start);
    }
  }
  const bool* real = st.key_mask == nullptr ? nullptr : st.key_mask + b * st.slots;
  const float minus_inf = -std::numeric_limits<float>::infinity();
  std::fill(z, z + group * st.d_head, 0.0f);
  for (int64_t h = 0; h < group; ++h) {
    float* row = scores + h * st.slots + first;
    for (int64_t j = 0; j < seen; ++j) row[j] = real == nullptr || real[first + j] ? row[j] * st.scale : minus_inf;
    const float top = *std::max_element(row, row + seen);
    if (!std::isfinite(top)) continue;  // every key masked: zeros, as the readable softmax gives
    float total = 0;
    for (int64_t j = 0; j < seen; ++j) {
      row[j] = std::exp(row[j] - top);
      total += row[j];
    }
    for (int64_t j = 0; j < seen; ++j) row[j] /= total;
    vec.weighted_sum(row, values + first * st.d_head, seen, st.d_head, z + h * st.d_head);
  }
}

void attend(const Step& st, const float* queries, const float* keys, const float* values, float* out) {
  const Vec vec = vector_path();
  const int64_t group = st.heads / st.kv_heads;
  // Threads only for caches long enough to pay for waking them: ~64k multiply-adds a chunk.
  const int64_t per_kv_head = std::max<int64_t>(1, (st.slot + 1) * st.d_head * 2 * group);
  const int64_t grain = std::max<int64_t>(1, 65536 / per_kv_head);
  at::parallel_for(0, st.batch * st.kv_heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * st.slots);
    for (int64_t bg = begin; bg < end; ++bg) {
      const int64_t b = bg / st.kv_heads, g = bg % st.kv_heads;
      const int64_t cache = bg * st.slots * st.d_head;
      const int64_t first_head = (b * st.heads + g * group) * st.d_head;  // query heads g*group .. (g+1)*group-1
      attend_group(st, vec, b, group, queries + first_head, keys + cache, values + cache, scores.data(),
                   out + first_head);
    }
  });
}

void check_cache(const at::Tensor& cache, int64_t batch, int64_t kv_heads, int64_t d_head, const char* name) {
  TORCH_CHECK(cache.scalar_type() == at::kFloat && cache.is_contiguous() && cache.dim() == 4, name,
              " must be a contiguous float32 (batch, kv_heads, slots, d_head) buffer");
  TORCH_CHECK(cache.size(0) == batch && cache.size(1) == kv_heads && cache.size(3) == d_head, name, " has shape ",
              cache.sizes(), ", expected (", batch, ", ", kv_heads, ", slots, ", d_head, ")");
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& qkv, at::Tensor& keys, at::Tensor& values, int64_t slot,
                            const at::Tensor& positions, const std::optional<at::Tensor>& cos,
                            const std::optional<at::Tensor>& sin, int64_t heads, int64_t kv_heads, int64_t rotary_dims,
                            double scale, const std::optional<at::Tensor>& key_mask, int64_t window) {
  check_float_rows(qkv, "qkv");
  TORCH_CHECK(qkv.dim() == 2, "qkv must be (batch, (heads + 2 kv_heads) d_head), got ", qkv.sizes());
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  const int64_t batch = qkv.size(0), d_head = qkv.size(1) / (heads + 2 * kv_heads);
  TORCH_CHECK(d_head * (heads + 2 * kv_heads) == qkv.size(1), "qkv's width does not split into heads");
  check_cache(keys, batch, kv_heads, d_head, "keys");
  check_cache(values, batch, kv_heads, d_head, "values");
  const int64_t slots = keys.size(2);
  TORCH_CHECK(slot >= 0 && slot < slots, "KV cache is full: ", slot + 1, " slots needed, ", slots, " allocated");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == batch,
              "positions must be (batch,) int64");
  Step st{batch, heads, kv_heads, d_head, slots, slot, rotary_dims, window, static_cast<float>(scale),
          positions.data_ptr<int64_t>(), nullptr, nullptr, 0, nullptr};
  if (cos.has_value()) {
    TORCH_CHECK(sin.has_value(), "cos and sin come together");
    check_float_rows(*cos, "cos");
    check_float_rows(*sin, "sin");
    TORCH_CHECK(rotary_dims % 2 == 0 && rotary_dims <= d_head && cos->size(-1) == rotary_dims / 2 &&
                    sin->sizes() == cos->sizes(), "cos and sin must be (context, rotary_dims / 2)");
    st.cos = cos->data_ptr<float>();
    st.sin = sin->data_ptr<float>();
    st.context = cos->size(0);
  }
  if (key_mask.has_value()) {
    TORCH_CHECK(key_mask->scalar_type() == at::kBool && key_mask->is_contiguous() && key_mask->dim() == 2 &&
                    key_mask->size(0) == batch && key_mask->size(1) == slots,
                "key_mask must be a contiguous (batch, slots) bool tensor");
    st.key_mask = key_mask->data_ptr<bool>();
  }
  at::Tensor queries = at::empty({batch, heads, d_head}, qkv.options());
  at::Tensor out = at::empty({batch, heads * d_head}, qkv.options());
  place(st, qkv.data_ptr<float>(), queries.data_ptr<float>(), keys.data_ptr<float>(), values.data_ptr<float>());
  attend(st, queries.data_ptr<float>(), keys.data_ptr<float>(), values.data_ptr<float>(), out.data_ptr<float>());
  return out;
}

TORCH_LIBRARY_FRAGMENT(glasslm_kernels, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool unit_offset) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) x, Tensor residual, Tensor weight, float eps, bool unit_offset) -> Tensor");
  m.def("layer_norm(Tensor x, Tensor weight, Tensor? bias, float eps) -> Tensor");
  m.def("add_layer_norm(Tensor(a!) x, Tensor residual, Tensor weight, Tensor? bias, float eps) -> Tensor");
  m.def("gelu_tanh(Tensor x) -> Tensor");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("decode_attention(Tensor qkv, Tensor(a!) keys, Tensor(b!) values, int slot, Tensor positions, Tensor? cos, "
        "Tensor? sin, int heads, int kv_heads, int rotary_dims, float scale, Tensor? key_mask, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(glasslm_kernels, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("layer_norm", &layer_norm);
  m.impl("add_layer_norm", &add_layer_norm);
  m.impl("gelu_tanh", &gelu_tanh);
  m.impl("silu_mul", &silu_mul);
  m.impl("decode_attention", &decode_attention);
}

}  // namespace glasslm_kernels
