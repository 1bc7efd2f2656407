// glasslm's CPU kernels for block-quantized matrix products: what qmatmul.py says, fast.
//
// Read qmatmul.py first: it holds the readable definition of every op here (quantize_rows_reference,
// qmatmul_reference), the packed weight layout (pack_levels) and the tests' error bounds. This file
// computes the same numbers:
//
//   activations: each row cut into blocks of 32; a block is rounded to int8 with the float32 scale
//                d1 = max|x| / 127, and what that leaves over is rounded to int8 with d2 = d1 / 256:
//                x ~ d2 * (256 * q1 + q2), a 16-bit integer per input, in two bytes;
//   weights:     unsigned levels u (0..15, or 0..255 for 8-bit weights stored as w + 128) in panels
//                of 16 output rows, with a scale per group of blocks (fp16 or bf16) and, optionally,
//                a minimum; the weight is W = (u - offset) * scale + min;
//   product:     y[o] = sum over blocks b of  scale * d2 * (sum_i u_i (256 q1_i + q2_i) - offset * s)
//                                            + min * d2 * s,        s = sum_i (256 q1_i + q2_i),
//                the bracket in exact int32 arithmetic, then times row_scale[o], plus bias[o].
//
// One panel's 16 rows are interleaved four inputs at a time, so one 32-bit lane of a 512-bit register
// holds four inputs of one output row and a single VNNI instruction (vpdpbusd: unsigned bytes times
// signed bytes, summed in fours into int32) feeds 16 outputs from one broadcast of four activation
// bytes; each byte of the activations gets its own sums, joined as 256 * first + second.
// Three paths share that layout, chosen at run time (select_isa): AVX-512 VNNI, AVX2 (vpmaddubsw),
// and plain C++, which also runs where the CPU is not x86.

#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string_view>
#include <tuple>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define GLASSLM_X86 1
#define GLASSLM_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))
#define GLASSLM_AVX2 __attribute__((target("avx2,fma,f16c")))
#else
#define GLASSLM_X86 0
#endif

namespace glasslm_kernels {

constexpr int64_t kBlock = 32;  // inputs per block (activations and weights alike)
constexpr int64_t kPanel = 16;  // output rows interleaved in one panel
constexpr int kTile = 4;        // activation rows sharing one pass over a panel's weights
constexpr int kPasses = 2;
// How far ahead of the block being multiplied its weights are asked for (into L2), in bytes: a
// decoding step streams every weight once from memory, and without this the integer arithmetic and
// the waits for memory took turns. Measured on one core of the AMD EPYC here (Zen 5), all of GPT-2
// small's matrices in turn, variants interleaved in one process: 6 KiB ahead streamed 8-bit weights
// 5-10% faster than 16 KiB (the earlier distance) and 4-bit ones 0-3% faster than 8 KiB; 4 KiB or
// less was 6-28% slower than 16 KiB, and no prefetch at all ~7% slower.
constexpr int64_t kAheadBytes = 6144;
constexpr float kSecondStep = 1.0f / 256;
constexpr int64_t kKeptScratch = 1 << 16;  // activations per call whose int8 rows stay allocated per thread  // the second pass's scale, relative to the first's

enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// ----------------------------------------------------------------------------------------------
// Which path runs.

int64_t supported_isa() {
#if GLASSLM_X86
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni")) {
    return kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return kAvx2;
  }
#endif
  return kScalar;
}

std::atomic<int64_t> g_isa{-1};

// The path used from now on: `level` (0 plain C++, 1 AVX2, 2 AVX-512 VNNI), lowered to what this CPU
// has; a negative level means the best there is. Returns the path chosen.
int64_t select_isa(int64_t level) {
  const int64_t best = supported_isa();
  const int64_t chosen = level < 0 ? best : std::min(level, best);
  g_isa.store(chosen);
  return chosen;
}

int64_t current_isa() {
  const int64_t isa = g_isa.load();
  return isa >= 0 ? isa : select_isa(-1);
}

// ----------------------------------------------------------------------------------------------
// The operands, as raw pointers.

struct Weights {
  const uint8_t* levels;   // (panels, blocks, 16 * 32 * bits / 8): see pack_levels in qmatmul.py
  const uint16_t* scales;  // (panels, groups, 16) fp16 or bf16 bits
  const uint16_t* mins;    // the same, or null
  int64_t blocks, groups, group_blocks, panels, d_out;
  int bits, offset;
  bool bf16;
  const float* row_scale;  // (d_out) or null
  const float* bias;       // (d_out) or null

  int64_t panel_block_bytes() const { return kPanel * kBlock * bits / 8; }
};

// Activation row r is int8 rows 2r (q1) and 2r + 1 (q2); d holds each pass's scale (d2 = d1 / 256),
// sums each pass's sum of levels.
struct Rows {
  const int8_t* q;       // (2 * count, blocks * 32)
  const float* d;        // (2 * count, blocks)
  const int32_t* sums;   // (2 * count, blocks)
  int64_t count, blocks;

  const int8_t* levels(int64_t row, int pass, int64_t block) const {
    return q + ((kPasses * row + pass) * blocks + block) * kBlock;
  }
  int64_t at(int64_t row, int pass, int64_t block) const { return (kPasses * row + pass) * blocks + block; }
  // The block's s = sum of 256 * q1 + q2, and its scale d2.
  int32_t joined_sum(int64_t row, int64_t block) const { return 256 * sums[at(row, 0, block)] + sums[at(row, 1, block)]; }
  float step(int64_t row, int64_t block) const { return d[at(row, 1, block)]; }
};

float scale_value(uint16_t bits, bool bf16) {
  if (bf16) {
    return static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits()));
  }
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// The level of input 4k + t of panel row `lane` in one block's packed bytes (qmatmul.pack_levels).
inline int level_at(const uint8_t* block, int bits, int k, int lane, int t) {
  if (bits == 8) {
    return block[64 * k + 4 * lane + t];
  }
  const uint8_t byte = block[64 * (k & 3) + 4 * lane + t];
  return k < 4 ? (byte & 0x0F) : (byte >> 4);
}

// ----------------------------------------------------------------------------------------------
// Plain C++: the layout read one level at a time.

void tile_scalar(const Weights& w, const Rows& x, int64_t panel, int64_t row0, int rows, float* y, int64_t ld_y) {
  const int64_t step = w.panel_block_bytes();
  for (int64_t row = row0; row < row0 + rows; ++row) {
    float acc[kPanel] = {};
    for (int64_t b = 0; b < w.blocks; ++b) {
      const uint8_t* block = w.levels + (panel * w.blocks + b) * step;
      const int64_t group = panel * w.groups + b / w.group_blocks;
      const int32_t sum = x.joined_sum(row, b);
      const float dx = x.step(row, b);
      for (int lane = 0; lane < kPanel; ++lane) {
        int32_t dot = -w.offset * sum;
        for (int pass = 0; pass < kPasses; ++pass) {
          const int8_t* xq = x.levels(row, pass, b);
          const int32_t weight = pass == 0 ? 256 : 1;
          for (int i = 0; i < kBlock; ++i) dot += weight * level_at(block, w.bits, i / 4, lane, i % 4) * xq[i];
        }
        const float scale = scale_value(w.scales[group * kPanel + lane], w.bf16);
        acc[lane] += (scale * dx) * static_cast<float>(dot);
        if (w.mins != nullptr) {
          acc[lane] += scale_value(w.mins[group * kPanel + lane], w.bf16) * (dx * static_cast<float>(sum));
        }
      }
    }
    for (int lane = 0; lane < kPanel && panel * kPanel + lane < w.d_out; ++lane) {
      const int64_t o = panel * kPanel + lane;
      const float scaled = w.row_scale != nullptr ? acc[lane] * w.row_scale[o] : acc[lane];
      y[row * ld_y + o] = w.bias != nullptr ? scaled + w.bias[o] : scaled;
    }
  }
}

#if GLASSLM_X86

// ----------------------------------------------------------------------------------------------
// AVX-512 VNNI: a panel's 16 rows are one register; vpdpbusd does 64 multiply-adds per instruction.

// Ask for one block-panel's weights (BITS * 64 bytes, from `ahead`) into L2: unrolled, no branches.
template <int BITS>
inline void prefetch_block(const uint8_t* ahead) {
  for (int line = 0; line < BITS; ++line) _mm_prefetch(reinterpret_cast<const char*>(ahead + 64 * line), _MM_HINT_T1);
}

template <bool BF16>
GLASSLM_AVX512 inline __m512 load16_scales(const uint16_t* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (BF16) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  } else {
    return _mm512_cvtph_ps(bits);
  }
}

GLASSLM_AVX512 inline __m512i broadcast4(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, 4);
  return _mm512_set1_epi32(four);
}

// One block's 32 inputs x 16 rows as eight registers of unsigned levels, register k holding inputs
// 4k..4k+3 of every row (pack_levels puts quads k and k + 4 in the low and high nibbles of chunk k).
template <int BITS>
GLASSLM_AVX512 inline void unpack_block512(const uint8_t* block, __m512i* levels) {
  if constexpr (BITS == 4) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int k = 0; k < 4; ++k) {
      const __m512i bytes = _mm512_loadu_si512(block + 64 * k);
      levels[k] = _mm512_and_si512(bytes, low4);
      levels[k + 4] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
    }
  } else {
    for (int k = 0; k < 8; ++k) {
      levels[k] = _mm512_loadu_si512(block + 64 * k);
    }
  }
}

// sum_i u_i xq_i over one block for all 16 rows, added to `start`: two chains of four vpdpbusd, so
// consecutive ones do not wait on each other.
GLASSLM_AVX512 inline __m512i block_dot512(const __m512i* levels, const int8_t* xq, __m512i start) {
  __m512i odd = _mm512_setzero_si512();
  for (int k = 0; k < 8; k += 2) {
    start = _mm512_dpbusd_epi32(start, levels[k], broadcast4(xq + 4 * k));
    odd = _mm512_dpbusd_epi32(odd, levels[k + 1], broadcast4(xq + 4 * k + 4));
  }
  return _mm512_add_epi32(start, odd);
}

template <int BITS, bool BF16, bool MINS, int ROWS>
GLASSLM_AVX512 void tile_avx512(const Weights& w, const Rows& x, int64_t panel, int64_t row0, float* y,
                                int64_t ld_y) {
  const int64_t step = w.panel_block_bytes();
  const uint8_t* block = w.levels + panel * w.blocks * step;
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  int64_t b = 0;
  for (int64_t g = 0; g < w.groups; ++g) {
    const __m512 scale = load16_scales<BF16>(w.scales + (panel * w.groups + g) * kPanel);
    __m512 min = _mm512_setzero_ps();
    if constexpr (MINS) min = load16_scales<BF16>(w.mins + (panel * w.groups + g) * kPanel);
    for (const int64_t end = std::min(b + w.group_blocks, w.blocks); b < end; ++b, block += step) {
      prefetch_block<BITS>(block + kAheadBytes);
      __m512i levels[8];
      unpack_block512<BITS>(block, levels);
      for (int r = 0; r < ROWS; ++r) {
        const int64_t row = row0 + r;
        const int32_t sum = x.joined_sum(row, b);
        // 256 * (first byte's sums) + (second byte's), the offset taken off in the same integers.
        const __m512i first = block_dot512(levels, x.levels(row, 0, b), _mm512_setzero_si512());
        const __m512i second = block_dot512(levels, x.levels(row, 1, b), _mm512_set1_epi32(-w.offset * sum));
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(first, 8), second));
        const float dx = x.step(row, b);
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(scale, _mm512_set1_ps(dx)), dot, acc[r]);
        if constexpr (MINS) acc[r] = _mm512_fmadd_ps(min, _mm512_set1_ps(dx * static_cast<float>(sum)), acc[r]);
      }
    }
  }
  const int64_t first = panel * kPanel;
  const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(kPanel, w.d_out - first)) - 1);
  const __m512 row_scale = w.row_scale ? _mm512_maskz_loadu_ps(mask, w.row_scale + first) : _mm512_set1_ps(1.0f);
  const __m512 bias = w.bias ? _mm512_maskz_loadu_ps(mask, w.bias + first) : _mm512_setzero_ps();
  for (int r = 0; r < ROWS; ++r) {
    _mm512_mask_storeu_ps(y + (row0 + r) * ld_y + first, mask, _mm512_fmadd_ps(acc[r], row_scale, bias));
  }
}

// ----------------------------------------------------------------------------------------------
// AVX2: each panel as two halves of 8 rows (the first and last 32 bytes of every 64-byte chunk);
// vpmaddubsw multiplies unsigned by signed bytes into int16 pairs, vpmaddwd sums those into int32.

template <bool BF16>
GLASSLM_AVX2 inline __m256 load8_scales(const uint16_t* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (BF16) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  } else {
    return _mm256_cvtph_ps(bits);
  }
}

GLASSLM_AVX2 inline __m256i broadcast4_avx2(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, 4);
  return _mm256_set1_epi32(four);
}

// sum_i w_i x_i over one block for 8 rows, in int32. 4-bit levels (0..15) go straight into
// vpmaddubsw: a pair is at most 2 * 15 * 127 in size, eight pairs' sum still fits int16. 8-bit levels
// are turned back into signed weights (u xor 0x80 = w) and multiplied as |w| times x with w's sign, as
// vpmaddubsw's unsigned operand must be; a pair is then at most 2 * 128 * 127 < 2^15.
template <int BITS>
GLASSLM_AVX2 inline __m256i block_dot_avx2(const __m256i* levels, const int8_t* xq) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (BITS == 4) {
    __m256i pairs = _mm256_maddubs_epi16(levels[0], broadcast4_avx2(xq));
    for (int k = 1; k < 8; ++k) {
      pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(levels[k], broadcast4_avx2(xq + 4 * k)));
    }
    return _mm256_madd_epi16(pairs, ones);
  } else {
    __m256i sum = _mm256_setzero_si256();
    for (int k = 0; k < 8; ++k) {
      const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(levels[k]),
                                                 _mm256_sign_epi8(broadcast4_avx2(xq + 4 * k), levels[k]));
      sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, ones));
    }
    return sum;
  }
}

template <int BITS>
GLASSLM_AVX2 inline void unpack_half_block256(const uint8_t* half, __m256i* levels) {
  if constexpr (BITS == 4) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int k = 0; k < 4; ++k) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(half + 64 * k));
      levels[k] = _mm256_and_si256(bytes, low4);
      levels[k + 4] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
    }
  } else {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int k = 0; k < 8; ++k) {
      levels[k] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(half + 64 * k)), flip);
    }
  }
}

template <int BITS, bool BF16, bool MINS, int ROWS>
GLASSLM_AVX2 void tile_avx2(const Weights& w, const Rows& x, int64_t panel, int64_t row0, float* y, int64_t ld_y) {
  const int64_t step = w.panel_block_bytes();
  // 8-bit weights are multiplied as signed numbers here, so no offset is taken off.
  const int32_t offset = BITS == 4 ? w.offset : 0;
  for (int half = 0; half < 2; ++half) {
    const uint8_t* block = w.levels + panel * w.blocks * step + 32 * half;
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
    int64_t b = 0;
    for (int64_t g = 0; g < w.groups; ++g) {
      const int64_t at_scale = (panel * w.groups + g) * kPanel + 8 * half;
      const __m256 scale = load8_scales<BF16>(w.scales + at_scale);
      __m256 min = _mm256_setzero_ps();
      if constexpr (MINS) min = load8_scales<BF16>(w.mins + at_scale);
      for (const int64_t end = std::min(b + w.group_blocks, w.blocks); b < end; ++b, block += step) {
        if (half == 0) prefetch_block<BITS>(block + kAheadBytes);  // the second half reads the panel again, from cache
        __m256i levels[8];
        unpack_half_block256<BITS>(block, levels);
        for (int r = 0; r < ROWS; ++r) {
          const int64_t row = row0 + r;
          const int32_t sum = x.joined_sum(row, b);
          const __m256i first = block_dot_avx2<BITS>(levels, x.levels(row, 0, b));
          const __m256i second = block_dot_avx2<BITS>(levels, x.levels(row, 1, b));
          const __m256i dot = _mm256_add_epi32(_mm256_add_epi32(_mm256_slli_epi32(first, 8), second),
                                               _mm256_set1_epi32(-offset * sum));
          const float dx = x.step(row, b);
          acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(scale, _mm256_set1_ps(dx)), _mm256_cvtepi32_ps(dot), acc[r]);
          if constexpr (MINS) acc[r] = _mm256_fmadd_ps(min, _mm256_set1_ps(dx * static_cast<float>(sum)), acc[r]);
        }
      }
    }
    const int64_t first = panel * kPanel + 8 * half;
    const int valid = static_cast<int>(std::clamp<int64_t>(w.d_out - first, 0, 8));
    for (int r = 0; r < ROWS && valid > 0; ++r) {
      alignas(32) float out[8];
      _mm256_store_ps(out, acc[r]);
      float* dst = y + (row0 + r) * ld_y + first;
      for (int lane = 0; lane < valid; ++lane) {
        const float scaled = w.row_scale ? out[lane] * w.row_scale[first + lane] : out[lane];
        dst[lane] = w.bias ? scaled + w.bias[first + lane] : scaled;
      }
    }
  }
}

#endif  // GLASSLM_X86

// ----------------------------------------------------------------------------------------------
// Choosing the instantiation, and the loops over panels and rows.

using TileFn = void (*)(const Weights&, const Rows&, int64_t, int64_t, float*, int64_t);

template <template <int, bool, bool, int> class Pick, int BITS, bool BF16, bool MINS>
TileFn pick_rows(int rows) {
  switch (rows) {
    case 1: return Pick<BITS, BF16, MINS, 1>::fn;
    case 2: return Pick<BITS, BF16, MINS, 2>::fn;
    case 3: return Pick<BITS, BF16, MINS, 3>::fn;
    default: return Pick<BITS, BF16, MINS, 4>::fn;
  }
}

template <template <int, bool, bool, int> class Pick>
TileFn pick_tile(const Weights& w, int rows) {
  if (w.bits == 4) {
    if (w.bf16) return w.mins ? pick_rows<Pick, 4, true, true>(rows) : pick_rows<Pick, 4, true, false>(rows);
    return w.mins ? pick_rows<Pick, 4, false, true>(rows) : pick_rows<Pick, 4, false, false>(rows);
  }
  if (w.bf16) return w.mins ? pick_rows<Pick, 8, true, true>(rows) : pick_rows<Pick, 8, true, false>(rows);
  return w.mins ? pick_rows<Pick, 8, false, true>(rows) : pick_rows<Pick, 8, false, false>(rows);
}

#if GLASSLM_X86
template <int BITS, bool BF16, bool MINS, int ROWS>
struct Avx512Tile {
  static constexpr TileFn fn = tile_avx512<BITS, BF16, MINS, ROWS>;
};
template <int BITS, bool BF16, bool MINS, int ROWS>
struct Avx2Tile {
  static constexpr TileFn fn = tile_avx2<BITS, BF16, MINS, ROWS>;
};
#endif

void run_tile(const Weights& w, const Rows& x, int64_t panel, int64_t row0, int rows, float* y, int64_t ld_y,
              int64_t isa) {
#if GLASSLM_X86
  if (isa == kAvx512) return pick_tile<Avx512Tile>(w, rows)(w, x, panel, row0, y, ld_y);
  if (isa == kAvx2) return pick_tile<Avx2Tile>(w, rows)(w, x, panel, row0, y, ld_y);
#endif
  tile_scalar(w, x, panel, row0, rows, y, ld_y);
}

void matmul_rows(const Weights& w, const Rows& x, float* y) {
  const int64_t isa = current_isa();
  // Threads split the panels; a chunk is at least ~256 block-rows of work, so the small products of
  // a decoding step (a few dozen panels) still split in two but never into slivers.
  const int64_t grain = std::max<int64_t>(1, 256 / std::max<int64_t>(1, w.blocks * x.count));
  at::parallel_for(0, w.panels, grain, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel) {
      for (int64_t row0 = 0; row0 < x.count; row0 += kTile) {
        run_tile(w, x, panel, row0, static_cast<int>(std::min<int64_t>(kTile, x.count - row0)), y, w.d_out, isa);
      }
    }
  });
}

// ----------------------------------------------------------------------------------------------
// Activations: rows of float32 to int8 blocks (quantize_rows_reference in qmatmul.py, bit for bit).

// round(x * inverse) into q, clamped to -127..127 (half to even, as torch.round); returns the sum.
int32_t round_block(const float* x, float inverse, int8_t* q) {
  int32_t total = 0;
  for (int i = 0; i < kBlock; ++i) {
    const float v = std::nearbyint(x[i] * inverse);
    q[i] = static_cast<int8_t>(std::clamp(v, -127.0f, 127.0f));
    total += q[i];
  }
  return total;
}

// One block of one row into its two passes (at `first` and `second`, indices of blocks in q, d, sums).
void quantize_block(const float* x, int64_t first, int64_t second, int8_t* q, float* d, int32_t* sums) {
  float amax = 0.0f;
  for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = amax / 127.0f;
  const float inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
  sums[first] = round_block(x, inverse, q + first * kBlock);
  d[first] = scale;
  float left[kBlock];  // what the first pass left over: multiplied, then subtracted, as the reference
  for (int i = 0; i < kBlock; ++i) left[i] = x[i] - static_cast<float>(q[first * kBlock + i]) * scale;
  sums[second] = round_block(left, inverse * 256.0f, q + second * kBlock);
  d[second] = scale * kSecondStep;
}

#if GLASSLM_X86
// The same block in two registers: the same float operations, one at a time, so the same bits (a
// decoding step quantizes ~30 of these per 1,000 weights it reads, and the plain loop took ~40 ns each).
GLASSLM_AVX512 __m512i round16_avx512(__m512 x, __m512 inverse, int8_t* q) {
  // cvtps_epi32 rounds to nearest even (the default rounding mode), as torch.round.
  const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(x, inverse));
  const __m512i clamped = _mm512_min_epi32(_mm512_max_epi32(v, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(clamped));
  return clamped;
}

GLASSLM_AVX512 void quantize_block_avx512(const float* x, int64_t first, int64_t second, int8_t* q, float* d,
                                          int32_t* sums) {
  const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  const float scale = amax / 127.0f;
  const float inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
  const __m512 by = _mm512_set1_ps(inverse), step = _mm512_set1_ps(scale), by2 = _mm512_set1_ps(inverse * 256.0f);
  const __m512i q_lo = round16_avx512(lo, by, q + first * kBlock), q_hi = round16_avx512(hi, by, q + first * kBlock + 16);
  const __m512 left_lo = _mm512_sub_ps(lo, _mm512_mul_ps(_mm512_cvtepi32_ps(q_lo), step));
  const __m512 left_hi = _mm512_sub_ps(hi, _mm512_mul_ps(_mm512_cvtepi32_ps(q_hi), step));
  const __m512i r_lo = round16_avx512(left_lo, by2, q + second * kBlock), r_hi = round16_avx512(left_hi, by2, q + second * kBlock + 16);
  sums[first] = _mm512_reduce_add_epi32(_mm512_add_epi32(q_lo, q_hi));
  sums[second] = _mm512_reduce_add_epi32(_mm512_add_epi32(r_lo, r_hi));
  d[first] = scale;
  d[second] = scale * kSecondStep;
}
#endif

void quantize_into(const float* x, int64_t rows, int64_t width, int8_t* q, float* d, int32_t* sums) {
  const int64_t blocks = width / kBlock;
  const bool avx512 = current_isa() == kAvx512;
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / width), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t first = kPasses * row * blocks + b;
#if GLASSLM_X86
        if (avx512) {
          quantize_block_avx512(x + row * width + b * kBlock, first, first + blocks, q, d, sums);
          continue;
        }
#endif
        quantize_block(x + row * width + b * kBlock, first, first + blocks, q, d, sums);
      }
    }
  });
}

// ----------------------------------------------------------------------------------------------
// The ops, with their argument checks.

void check_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "glasslm_kernels: activations must be float32 on the CPU, got ",
              x.scalar_type(), " on ", x.device());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % kBlock == 0, "glasslm_kernels: a row's width must be a multiple of 32, got ",
              x.sizes());
}

struct Activations {
  at::Tensor q, d, sums;
  Rows rows() const {
    return Rows{q.const_data_ptr<int8_t>(), d.const_data_ptr<float>(), sums.const_data_ptr<int32_t>(),
                q.size(0) / kPasses, q.size(1) / kBlock};
  }
};

Activations quantized(const at::Tensor& x) {
  check_rows(x);
  const at::Tensor rows = x.contiguous();
  const int64_t width = x.size(-1), count = rows.numel() / width;
  Activations out{at::empty({kPasses * count, width}, rows.options().dtype(at::kChar)),
                  at::empty({kPasses * count, width / kBlock}, rows.options()),
                  at::empty({kPasses * count, width / kBlock}, rows.options().dtype(at::kInt))};
  quantize_into(rows.const_data_ptr<float>(), count, width, out.q.mutable_data_ptr<int8_t>(),
                out.d.mutable_data_ptr<float>(), out.sums.mutable_data_ptr<int32_t>());
  return out;
}

// (q, d, sums) of x's rows: row r of x is rows 2r and 2r + 1.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x) {
  Activations a = quantized(x);
  return {a.q, a.d, a.sums};
}

Weights weights_of(const at::Tensor& levels, const at::Tensor& scales, const std::optional<at::Tensor>& mins, int64_t bits,
                   int64_t offset, int64_t group_blocks, int64_t d_out, const std::optional<at::Tensor>& row_scale,
                   const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(bits == 4 || bits == 8, "glasslm_kernels: weights have 4 or 8 bits, got ", bits);
  TORCH_CHECK(levels.scalar_type() == at::kByte && levels.dim() == 3 && levels.is_contiguous() &&
                  levels.size(2) == kPanel * kBlock * bits / 8,
              "glasslm_kernels: packed levels must be contiguous uint8 (panels, blocks, ", kPanel * kBlock * bits / 8,
              "), got ", levels.scalar_type(), " ", levels.sizes());
  const int64_t panels = levels.size(0), blocks = levels.size(1);
  TORCH_CHECK(group_blocks >= 1, "glasslm_kernels: group_blocks must be positive");
  const int64_t groups = (blocks + group_blocks - 1) / group_blocks;
  const bool bf16 = scales.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16 || scales.scalar_type() == at::kHalf) && scales.is_contiguous() &&
                  scales.sizes() == at::IntArrayRef({panels, groups, kPanel}),
              "glasslm_kernels: scales must be contiguous fp16 or bf16 (", panels, ", ", groups, ", 16), got ",
              scales.scalar_type(), " ", scales.sizes());
  if (mins) {
    TORCH_CHECK(mins->scalar_type() == scales.scalar_type() && mins->is_contiguous() && mins->sizes() == scales.sizes(),
                "glasslm_kernels: mins must be laid out as the scales");
  }
  TORCH_CHECK(d_out > (panels - 1) * kPanel && d_out <= panels * kPanel, "glasslm_kernels: d_out ", d_out,
              " does not fit ", panels, " panels of 16 rows");
  for (const auto* vector : {&row_scale, &bias}) {
    if (*vector) {
      TORCH_CHECK((*vector)->scalar_type() == at::kFloat && (*vector)->is_contiguous() && (*vector)->numel() == d_out,
                  "glasslm_kernels: row scales and bias must be contiguous float32 of d_out values");
    }
  }
  return Weights{levels.const_data_ptr<uint8_t>(),
                 reinterpret_cast<const uint16_t*>(scales.const_data_ptr()),
                 mins ? reinterpret_cast<const uint16_t*>(mins->const_data_ptr()) : nullptr,
                 blocks, groups, group_blocks, panels, d_out, static_cast<int>(bits), static_cast<int>(offset), bf16,
                 row_scale ? row_scale->const_data_ptr<float>() : nullptr,
                 bias ? bias->const_data_ptr<float>() : nullptr};
}

// Rows already in int8 blocks. One pass (llama.cpp's activations) is run as two, the second zero.
Activations given_rows(const at::Tensor& q, const at::Tensor& d, const at::Tensor& sums, int64_t passes, int64_t blocks) {
  TORCH_CHECK(passes == 1 || passes == kPasses, "glasslm_kernels: activations take 1 or 2 passes, got ", passes);
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous() && q.size(1) == blocks * kBlock &&
                  q.size(0) % passes == 0,
              "glasslm_kernels: activation levels must be contiguous int8 (rows, ", blocks * kBlock, "), got ", q.sizes());
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.is_contiguous() && d.sizes() == at::IntArrayRef({q.size(0), blocks}) &&
                  sums.scalar_type() == at::kInt && sums.is_contiguous() && sums.sizes() == d.sizes(),
              "glasslm_kernels: activation scales (float32) and sums (int32) must be contiguous (rows, blocks)");
  if (passes == kPasses) {
    const at::Tensor pairs = d.reshape({-1, kPasses, blocks});
    TORCH_CHECK(pairs.select(1, 1).equal(pairs.select(1, 0) * kSecondStep),
                "glasslm_kernels: a second pass's scales must be the first's / 256");
    return Activations{q, d, sums};
  }
  auto second = [&](const at::Tensor& first, const at::Tensor& next) {
    return at::stack({first, next}, 1).reshape({-1, first.size(1)}).contiguous();
  };
  return Activations{second(q, at::zeros_like(q)), second(d, d * kSecondStep), second(sums, at::zeros_like(sums))};
}

at::Tensor qmatmul(const at::Tensor& q, const at::Tensor& d, const at::Tensor& sums, int64_t passes,
                   const at::Tensor& levels, const at::Tensor& scales, const std::optional<at::Tensor>& mins, int64_t bits,
                   int64_t offset, int64_t group_blocks, int64_t d_out, const std::optional<at::Tensor>& row_scale,
                   const std::optional<at::Tensor>& bias) {
  const Weights w = weights_of(levels, scales, mins, bits, offset, group_blocks, d_out, row_scale, bias);
  const Activations a = given_rows(q, d, sums, passes, w.blocks);
  const Rows x = a.rows();
  at::Tensor y = at::empty({x.count, d_out}, q.options().dtype(at::kFloat));
  matmul_rows(w, x, y.mutable_data_ptr<float>());
  return y;
}

// x's rows quantized into this thread's scratch, then multiplied: `qlinear` after its checks of the
// weights, which block.cpp makes once per matrix (a decoding step's ~50 products then allocate only
// their outputs).
at::Tensor qlinear_checked(const at::Tensor& x, const Weights& w) {
  check_rows(x);
  TORCH_CHECK(x.size(-1) == w.blocks * kBlock, "glasslm_kernels: input width ", x.size(-1), " is not the weight's ",
              w.blocks * kBlock);
  const at::Tensor rows = x.contiguous();
  const int64_t width = x.size(-1), count = rows.numel() / width;
  // Kept between calls for decoding's few rows; a long prefill's rows get their own tensors, freed after
  // (and never zeroed: quantize_into writes every byte).
  thread_local std::vector<int8_t> kept_q;
  thread_local std::vector<float> kept_d;
  thread_local std::vector<int32_t> kept_sums;
  Activations own;
  int8_t* q;
  float* d;
  int32_t* sums;
  if (count * width <= kKeptScratch) {
    kept_q.resize(kPasses * count * width);
    kept_d.resize(kPasses * count * w.blocks);
    kept_sums.resize(kPasses * count * w.blocks);
    q = kept_q.data(), d = kept_d.data(), sums = kept_sums.data();
  } else {
    own = Activations{at::empty({kPasses * count, width}, rows.options().dtype(at::kChar)),
                      at::empty({kPasses * count, w.blocks}, rows.options()),
                      at::empty({kPasses * count, w.blocks}, rows.options().dtype(at::kInt))};
    q = own.q.mutable_data_ptr<int8_t>(), d = own.d.mutable_data_ptr<float>(), sums = own.sums.mutable_data_ptr<int32_t>();
  }
  quantize_into(rows.const_data_ptr<float>(), count, width, q, d, sums);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = w.d_out;
  at::Tensor y = at::empty(shape, x.options());
  matmul_rows(w, Rows{q, d, sums, count, w.blocks}, y.mutable_data_ptr<float>());
  return y;
}

// The checked operands of one matrix, kept by block.cpp (which holds the tensors they point into).
std::shared_ptr<const Weights> checked_weights(const at::Tensor& levels, const at::Tensor& scales,
                                               const std::optional<at::Tensor>& mins, int64_t bits, int64_t offset,
                                               int64_t group_blocks, int64_t d_out,
                                               const std::optional<at::Tensor>& row_scale,
                                               const std::optional<at::Tensor>& bias) {
  return std::make_shared<const Weights>(weights_of(levels, scales, mins, bits, offset, group_blocks, d_out, row_scale, bias));
}

// quantize_rows then qmatmul, in one call: (..., d_in) float32 -> (..., d_out) float32.
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& levels, const at::Tensor& scales,
                   const std::optional<at::Tensor>& mins, int64_t bits, int64_t offset, int64_t group_blocks, int64_t d_out,
                   const std::optional<at::Tensor>& row_scale, const std::optional<at::Tensor>& bias) {
  return qlinear_checked(x, weights_of(levels, scales, mins, bits, offset, group_blocks, d_out, row_scale, bias));
}

// ----------------------------------------------------------------------------------------------
// Packing (pack_levels and pack(block_matrix(...)) in Python, done here for speed at load time).

// Byte 4 * lane + t of chunk k holds input 4k + t; 4-bit chunks k and k + 4 share a byte (low, high).
template <typename LevelOf>
void pack_panel_block(int bits, int64_t lanes, LevelOf level_of, uint8_t* out) {
  const int64_t chunk_count = bits == 8 ? 8 : 4;
  std::memset(out, 0, chunk_count * 64);
  for (int64_t lane = 0; lane < lanes; ++lane) {
    for (int k = 0; k < chunk_count; ++k) {
      for (int t = 0; t < 4; ++t) {
        const int value = bits == 8 ? level_of(lane, 4 * k + t) : level_of(lane, 4 * k + t) | (level_of(lane, 4 * k + 16 + t) << 4);
        out[64 * k + 4 * lane + t] = static_cast<uint8_t>(value);
      }
    }
  }
}

at::Tensor pack_levels(const at::Tensor& levels, int64_t bits) {
  TORCH_CHECK(levels.scalar_type() == at::kByte && levels.dim() == 2 && levels.size(1) % kBlock == 0 && (bits == 4 || bits == 8),
              "glasslm_kernels: pack_levels takes (d_out, d_in) uint8 levels, d_in a multiple of 32, and 4 or 8 bits");
  const at::Tensor rows = levels.contiguous();
  const int64_t d_out = rows.size(0), d_in = rows.size(1), blocks = d_in / kBlock;
  const int64_t panels = (d_out + kPanel - 1) / kPanel, step = kPanel * kBlock * bits / 8;
  at::Tensor out = at::empty({panels, blocks, step}, rows.options());
  const uint8_t* in = rows.const_data_ptr<uint8_t>();
  uint8_t* dst = out.mutable_data_ptr<uint8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t lanes = std::min<int64_t>(kPanel, d_out - p * kPanel);
      for (int64_t b = 0; b < blocks; ++b) {
        auto level_of = [&](int64_t lane, int i) { return static_cast<int>(in[(p * kPanel + lane) * d_in + b * kBlock + i]); };
        pack_panel_block(static_cast<int>(bits), lanes, level_of, dst + (p * blocks + b) * step);
      }
    }
  });
  return out;
}

// llama.cpp's blocks straight into the packed layout: (levels, fp16 scales d, fp16 minimums m or None).
std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>> pack_ggml(const at::Tensor& blocks, std::string_view qtype) {
  const bool q8 = qtype == "q8_0", q41 = qtype == "q4_1";
  TORCH_CHECK(q8 || q41 || qtype == "q4_0", "glasslm_kernels: pack_ggml takes q4_0, q4_1 or q8_0, not ", qtype);
  const int64_t size = q8 ? 34 : (q41 ? 20 : 18), header = q41 ? 4 : 2, bits = q8 ? 8 : 4;
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.size(1) % size == 0,
              "glasslm_kernels: ", qtype, " blocks must be (rows, n_blocks * ", size, ") uint8");
  const at::Tensor rows = blocks.contiguous();
  const int64_t d_out = rows.size(0), row_bytes = rows.size(1), count = row_bytes / size;
  const int64_t panels = (d_out + kPanel - 1) / kPanel, step = kPanel * kBlock * bits / 8;
  at::Tensor levels = at::empty({panels, count, step}, rows.options());
  at::Tensor scales = at::zeros({panels, count, kPanel}, rows.options().dtype(at::kHalf));
  at::Tensor mins = at::zeros({panels, count, kPanel}, rows.options().dtype(at::kHalf));
  const uint8_t* in = rows.const_data_ptr<uint8_t>();
  uint8_t* dst = levels.mutable_data_ptr<uint8_t>();
  uint16_t* d = reinterpret_cast<uint16_t*>(scales.mutable_data_ptr());
  uint16_t* m = reinterpret_cast<uint16_t*>(mins.mutable_data_ptr());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t lanes = std::min<int64_t>(kPanel, d_out - p * kPanel);
      for (int64_t b = 0; b < count; ++b) {
        auto block_of = [&](int64_t lane) { return in + (p * kPanel + lane) * row_bytes + b * size; };
        for (int64_t lane = 0; lane < lanes; ++lane) {
          std::memcpy(d + (p * count + b) * kPanel + lane, block_of(lane), 2);
          if (q41) std::memcpy(m + (p * count + b) * kPanel + lane, block_of(lane) + 2, 2);
        }
        auto level_of = [&](int64_t lane, int i) {
          const uint8_t* q = block_of(lane) + header;
          if (q8) return static_cast<int>(q[i] ^ 0x80);  // int8 q -> q + 128
          return static_cast<int>(i < 16 ? q[i] & 0x0F : q[i - 16] >> 4);
        };
        pack_panel_block(static_cast<int>(bits), lanes, level_of, dst + (p * count + b) * step);
      }
    }
  });
  return {levels, scales, q41 ? std::optional<at::Tensor>(mins) : std::nullopt};
}

TORCH_LIBRARY(glasslm_kernels, m) {
  m.def("quantize_rows(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("qmatmul(Tensor q, Tensor d, Tensor sums, int passes, Tensor levels, Tensor scales, Tensor? mins, int bits, int offset, "
        "int group_blocks, int d_out, Tensor? row_scale, Tensor? bias) -> Tensor");
  m.def("qlinear(Tensor x, Tensor levels, Tensor scales, Tensor? mins, int bits, int offset, int group_blocks, "
        "int d_out, Tensor? row_scale, Tensor? bias) -> Tensor");
  m.def("pack_levels(Tensor levels, int bits) -> Tensor");
  m.def("pack_ggml(Tensor blocks, str qtype) -> (Tensor, Tensor, Tensor?)");
  m.def("select_isa(int level) -> int", &select_isa);
  m.def("supported_isa() -> int", &supported_isa);
  m.def("current_isa() -> int", &current_isa);
}

TORCH_LIBRARY_IMPL(glasslm_kernels, CPU, m) {
  m.impl("quantize_rows", &quantize_rows);
  m.impl("qmatmul", &qmatmul);
  m.impl("qlinear", &qlinear);
  m.impl("pack_levels", &pack_levels);
  m.impl("pack_ggml", &pack_ggml);
}

}  // namespace glasslm_kernels
