// glasslm's CPU kernels for block-quantized matrix products: what qmatmul.py says, fast.
//
// Read qmatmul.py first: it holds the readable definition of every op here (quantize_rows_reference,
// qmatmul_reference), the packed weight layout (pack_levels) and the tests' error bounds. This file
// computes the same numbers:
//
//   activations: each row cut into blocks of 32; a block is rounded to int8 with the float32 scale
//                d1 = max|x| / 127, and what that leaves over is rounded to int8 with d2 = d1 / 256:
//                x ~ d2 * (256 * q1 + q2), a 16-bit integer per input, in two bytes;
//   weights:     unsigned levels u of 4, 5, 6 or 8 bits (8-bit weights stored as w + 128) in panels
//                of 16 output rows, with a scale per group of inputs and, optionally, a minimum; the
//                weight is W = (u - offset) * scale + min. A group is one or more blocks, or half a
//                block (llama.cpp's Q6_K); its scale and minimum are fp16 or bf16, or (the K-quants)
//                an 8-bit integer times an fp16 super-scale shared by 256 inputs;
//   product:     y[o] = sum over groups g of  scale * d2 * (sum_i u_i (256 q1_i + q2_i) - offset * s)
//                                            + min * d2 * s,        s = sum_i (256 q1_i + q2_i),
//                the bracket in exact int32 arithmetic, then times row_scale[o], plus bias[o].
//
// One panel's 16 rows are interleaved four inputs at a time, so one 32-bit lane of a 512-bit register
// holds four inputs of one output row and a single VNNI instruction (vpdpbusd: unsigned bytes times
// signed bytes, summed in fours into int32) feeds 16 outputs from one broadcast of four activation
// bytes; each byte of the activations gets its own sums, joined as 256 * first + second.
// Three paths share that layout, chosen at run time (select_isa): AVX-512 VNNI, AVX2 (vpmaddubsw),
// and plain C++, which also runs where the CPU is not x86.
//
// Float weights (a GGUF file's F16, BF16 and F32 tensors) are read as they are, the (d_out, d_in)
// matrix row by row (tile_float_*): a loader hands the layers views of the mapped file, so loading
// them copies nothing.

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

#include "ops.h"

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
constexpr int kWideTile = 16;  // ... on AVX-512 (32 registers), for a long prefill: a quarter of the unpacking per row
// (16 rows measured 10-13% over 8 on Q4_K/Q5_K/Q6_K 512-row products, one thread of the Xeon here; 12 in between)
static_assert(kWideTile == 16, "Rows::at shifts by 4 for a tile of rows");
constexpr int64_t kTiledRows = kWideTile;  // rows from which activations are stored a tile at a time (Rows::tiled)
constexpr int64_t kRowBytes = 1 << 18;  // activation bytes a chunk of rows keeps in L2 while every panel passes
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

// How a group's scale and minimum are stored.
// (kFloat: float32 weights, kept as they are, like the 16-bit ones.)
enum ScaleKind : int { kHalf = 0, kBf16 = 1, kSubU8 = 2, kSubI8 = 3, kFloat = 4 };

struct Weights {
  const uint8_t* levels;   // (panels, blocks, panel_block_bytes): see pack_levels in qmatmul.py; floats: (d_out, d_in)
  const void* scales;      // (panels, groups, 16): fp16 or bf16 bits, or the integer sub-scales
  const void* mins;        // the same, or null
  const uint16_t* super_scales;  // (panels, supers, 16) fp16: what sub-scales multiply; null without
  const uint16_t* super_mins;
  int64_t blocks, groups, group_size, super_groups, panels, d_out;
  int bits, offset, scale_kind;
  const float* row_scale;  // (d_out) or null
  const float* bias;       // (d_out) or null

  // 16 rows x 32 levels: the low four bits as nibbles (or whole bytes at 8 bits), a 64-byte plane per
  // higher bit; float weights (fp16, bf16 or float32 as scale_kind says, no scales) as they are.
  int64_t panel_block_bytes() const {
    return bits >= 8 ? kPanel * kBlock * bits / 8 : kPanel * kBlock / 2 + 64 * (bits - 4);
  }
  bool halves() const { return group_size == kBlock / 2; }
  bool floats() const { return bits >= 16; }  // 16- or 32-bit float weights, multiplied by float rows
  int64_t group_blocks() const { return halves() ? 1 : group_size / kBlock; }
  int64_t supers() const { return super_groups > 0 ? groups / super_groups : 0; }

  // Group g's scale (or, with `min`, its minimum) for panel row `lane`, as float32 (exact: a sub-scale
  // of 8 bits times an fp16 number fits float32's 24-bit mantissa).
  float group_value(int64_t panel, int64_t g, int lane, bool min) const;
};

// Activation row r is int8 rows 2r (q1) and 2r + 1 (q2); d holds each pass's scale (d2 = d1 / 256),
// sums each pass's sum of levels.
struct Rows {
  const int8_t* q;       // (2 * count, blocks * 32)
  const float* d;        // (2 * count, blocks)
  const int32_t* sums;   // (2 * count, blocks)
  int64_t count, blocks;
  const float* x = nullptr;  // (count, blocks * 32): the rows themselves, for 16-bit weights
  // Passes multiplied: both, or (a prefill asked for 8-bit activations) the first alone: x ~ d1 * q1,
  // llama.cpp's rounding, half the integer products. The layout keeps both either way.
  int passes = kPasses;
  // (count, blocks, 2): -offset times the joined sum of each half block's activations, made once per
  // product for a long prefill on half-block groups (Q6_K), which would otherwise sum them again for
  // every panel; where it is, a tile reads its start from memory.
  const int32_t* half_starts = nullptr;
  // (count, blocks * 32): 256 * q1 + q2 as int16, made once per product for 8-bit weights on AVX2
  // (tile8_joined_avx2), which would otherwise join them again for every half panel.
  const int16_t* joined = nullptr;

  // A long prefill's rows on AVX-512 are stored a tile at a time (`tiled`; qlinear_parts decides):
  // each pass of a tile's 16 rows as blocks of 16 x 32 levels, so what the wide tile multiplies next
  // is the next half kilobyte, at offsets it knows when it is compiled, and a one-pass product reads
  // no second pass. Only the wide tile reads them (`tile_at`); every other tile reads rows laid out
  // as `at` says, whose plain formula a decoding step's tiles fold into their loops (one covering
  // both layouts cost the 1B model's Q4_K_M decoding 4%).
  bool tiled = false;

  int64_t at(int64_t row, int pass, int64_t block) const { return (kPasses * row + pass) * blocks + block; }
  int64_t tile_at(int64_t row, int pass, int64_t block) const {
    return ((row / kWideTile * kPasses + pass) * blocks + block) * kWideTile + row % kWideTile;
  }
  int64_t stored_at(int64_t row, int pass, int64_t block) const { return tiled ? tile_at(row, pass, block) : at(row, pass, block); }
  const int8_t* levels(int64_t row, int pass, int64_t block) const { return q + at(row, pass, block) * kBlock; }
  // The block's s = sum of 256 * q1 + q2 (one pass: of q1), and its scale d2 (one pass: d1).
  int32_t joined_sum(int64_t row, int64_t block) const {
    return passes == 1 ? sums[at(row, 0, block)] : 256 * sums[at(row, 0, block)] + sums[at(row, 1, block)];
  }
  float step(int64_t row, int64_t block) const { return d[at(row, passes - 1, block)]; }
};

float half_value(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

// Element `at` of float weights (fp16, bf16 or float32 as `kind` says) as float32.
float float_weight(const uint8_t* values, int kind, int64_t at) {
  if (kind == kFloat) return reinterpret_cast<const float*>(values)[at];
  const uint16_t bits = reinterpret_cast<const uint16_t*>(values)[at];
  return kind == kBf16 ? static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits())) : half_value(bits);
}

float Weights::group_value(int64_t panel, int64_t g, int lane, bool min) const {
  const void* values = min ? mins : scales;
  const int64_t at = (panel * groups + g) * kPanel + lane;
  if (scale_kind == kHalf) return half_value(static_cast<const uint16_t*>(values)[at]);
  if (scale_kind == kBf16) {
    return static_cast<float>(c10::BFloat16(static_cast<const uint16_t*>(values)[at], c10::BFloat16::from_bits()));
  }
  const float sub = scale_kind == kSubU8 ? static_cast<float>(static_cast<const uint8_t*>(values)[at])
                                         : static_cast<float>(static_cast<const int8_t*>(values)[at]);
  const uint16_t* per_super = min ? super_mins : super_scales;
  return sub * half_value(per_super[(panel * supers() + g / super_groups) * kPanel + lane]);
}

// The level of input 4k + t of panel row `lane` in one block's packed bytes (qmatmul.pack_levels).
inline int level_at(const uint8_t* block, int bits, int k, int lane, int t) {
  if (bits == 8) {
    return block[64 * k + 4 * lane + t];
  }
  const uint8_t byte = block[64 * (k & 3) + 4 * lane + t];
  int level = k < 4 ? (byte & 0x0F) : (byte >> 4);
  for (int bit = 4; bit < bits; ++bit) level |= ((block[256 + 64 * (bit - 4) + 4 * lane + t] >> k) & 1) << bit;
  return level;
}

// ----------------------------------------------------------------------------------------------
// Plain C++: the layout read one level at a time.

// Sum of one pass's levels of a row's block over inputs [begin, end).
int32_t level_sum(const int8_t* xq, int begin, int end) {
  int32_t total = 0;
  for (int i = begin; i < end; ++i) total += xq[i];
  return total;
}

// Float weights are the model's own rows, (d_out, d_in) as the file holds them (a loader maps them
// rather than copying), so a product is one dot product per (weight row, activation row) pair. Each
// pair's sum runs over the inputs in order whatever rows are multiplied beside it, so a row's result
// never depends on its neighbours. A panel here is just 16 consecutive output rows.
void tile_float_scalar(const Weights& w, const Rows& x, int64_t panel, int64_t row0, int rows, float* y, int64_t ld_y) {
  const int64_t width = w.blocks * kBlock, size = w.bits / 8;
  for (int64_t row = row0; row < row0 + rows; ++row) {
    const float* xr = x.x + row * width;
    for (int64_t o = panel * kPanel; o < std::min(w.d_out, (panel + 1) * kPanel); ++o) {
      const uint8_t* p = w.levels + o * width * size;
      float acc = 0.0f;
      for (int64_t i = 0; i < width; ++i) acc += xr[i] * float_weight(p, w.scale_kind, i);
      y[row * ld_y + o] = w.bias != nullptr ? acc + w.bias[o] : acc;
    }
  }
}

void tile_scalar(const Weights& w, const Rows& x, int64_t panel, int64_t row0, int rows, float* y, int64_t ld_y) {
  if (w.floats()) return tile_float_scalar(w, x, panel, row0, rows, y, ld_y);
  const int64_t step = w.panel_block_bytes();
  const int parts = w.halves() ? 2 : 1, width = kBlock / parts;  // a half-block group is its own part
  for (int64_t row = row0; row < row0 + rows; ++row) {
    float acc[kPanel] = {};
    for (int64_t b = 0; b < w.blocks; ++b) {
      const uint8_t* block = w.levels + (panel * w.blocks + b) * step;
      const float dx = x.step(row, b);
      for (int part = 0; part < parts; ++part) {
        const int64_t group = w.halves() ? 2 * b + part : b / w.group_blocks();
        const int begin = part * width, end = begin + width;
        const int32_t sum = x.passes == 1 ? level_sum(x.levels(row, 0, b), begin, end)
                                          : 256 * level_sum(x.levels(row, 0, b), begin, end) + level_sum(x.levels(row, 1, b), begin, end);
        for (int lane = 0; lane < kPanel; ++lane) {
          int32_t dot = -w.offset * sum;
          for (int pass = 0; pass < x.passes; ++pass) {
            const int8_t* xq = x.levels(row, pass, b);
            const int32_t weight = pass == 0 && x.passes == kPasses ? 256 : 1;
            for (int i = begin; i < end; ++i) dot += weight * level_at(block, w.bits, i / 4, lane, i % 4) * xq[i];
          }
          acc[lane] += (w.group_value(panel, group, lane, false) * dx) * static_cast<float>(dot);
          if (w.mins != nullptr) acc[lane] += w.group_value(panel, group, lane, true) * (dx * static_cast<float>(sum));
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

// acc[r] * row_scale + bias into row row0 + r of y, for the panel's rows that exist.
template <int ROWS>
GLASSLM_AVX512 inline void store_tile512(const Weights& w, const __m512* acc, int64_t panel, int64_t row0, float* y,
                                         int64_t ld_y, int rows = ROWS) {
  const int64_t first = panel * kPanel;
  const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(kPanel, w.d_out - first)) - 1);
  const __m512 row_scale = w.row_scale ? _mm512_maskz_loadu_ps(mask, w.row_scale + first) : _mm512_set1_ps(1.0f);
  const __m512 bias = w.bias ? _mm512_maskz_loadu_ps(mask, w.bias + first) : _mm512_setzero_ps();
  for (int r = 0; r < std::min(ROWS, rows); ++r) {
    _mm512_mask_storeu_ps(y + (row0 + r) * ld_y + first, mask, _mm512_fmadd_ps(acc[r], row_scale, bias));
  }
}

// 16 panel rows' values of one group (its scales, or with MIN its minimums) as float32.
template <int SCALE, bool MIN>
GLASSLM_AVX512 inline __m512 group_values512(const Weights& w, int64_t panel, int64_t g) {
  const int64_t at = (panel * w.groups + g) * kPanel;
  const void* values = MIN ? w.mins : w.scales;
  if constexpr (SCALE == kHalf || SCALE == kBf16) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(values) + at));
    if constexpr (SCALE == kBf16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
    return _mm512_cvtph_ps(bits);
  } else {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(values) + at));
    const __m512i sub = SCALE == kSubU8 ? _mm512_cvtepu8_epi32(bytes) : _mm512_cvtepi8_epi32(bytes);
    const uint16_t* per_super = (MIN ? w.super_mins : w.super_scales) + (panel * w.supers() + g / w.super_groups) * kPanel;
    const __m512 super = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(per_super)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(sub), super);  // exact: an 8-bit integer times an fp16 number
  }
}

// acc + dpbusd(levels, the 4 bytes at p in every lane), read by the vpdpbusd itself ({1to16}): GCC
// otherwise broadcasts them with an instruction of their own, and half the instructions of a prefill
// tile were those (the wide tile measured 7-14% faster without them).
GLASSLM_AVX512 inline __m512i dpbusd_at(__m512i acc, __m512i levels, const int8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(levels), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// One block's 32 inputs x 16 rows as eight registers of unsigned levels, register k holding inputs
// 4k..4k+3 of every row (pack_levels puts quads k and k + 4 in the low and high nibbles of chunk k,
// and bit k of each byte of a high-bit plane is that bit of register k's byte).
template <int BITS>
GLASSLM_AVX512 inline void unpack_block512(const uint8_t* block, __m512i* levels) {
  if constexpr (BITS == 8) {
    for (int k = 0; k < 8; ++k) levels[k] = _mm512_loadu_si512(block + 64 * k);
  } else {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int k = 0; k < 4; ++k) {
      const __m512i bytes = _mm512_loadu_si512(block + 64 * k);
      levels[k] = _mm512_and_si512(bytes, low4);
      levels[k + 4] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
    }
    for (int bit = 4; bit < BITS; ++bit) {
      const __m512i plane = _mm512_loadu_si512(block + 256 + 64 * (bit - 4));
      const __m512i value = _mm512_set1_epi8(static_cast<char>(1 << bit));
      for (int k = 0; k < 8; ++k) {
        const __mmask64 set = _mm512_test_epi8_mask(plane, _mm512_set1_epi8(static_cast<char>(1 << k)));
        levels[k] = _mm512_mask_add_epi8(levels[k], set, levels[k], value);  // (the bit is clear: add is or)
      }
    }
  }
}

// sum_i u_i xq_i over register quads [k0, k1) of one block for all 16 rows, added to `start`: two
// chains of vpdpbusd, so consecutive ones do not wait on each other.
GLASSLM_AVX512 inline __m512i quads_dot512(const __m512i* levels, const int8_t* xq, __m512i start, int k0, int k1) {
  __m512i odd = _mm512_setzero_si512();
  for (int k = k0; k < k1; k += 2) {
    start = dpbusd_at(start, levels[k], xq + 4 * k);
    odd = dpbusd_at(odd, levels[k + 1], xq + 4 * k + 4);
  }
  return _mm512_add_epi32(start, odd);
}

// sum_i (u_i - offset) (256 q1_i + q2_i) over quads [k0, k1), whose activations sum to `sum`, as float32.
GLASSLM_AVX512 inline __m512 joined_dot512(const __m512i* levels, const Rows& x, int64_t row, int64_t b, int offset,
                                           int32_t sum, int k0, int k1) {
  if (x.passes == 1) {
    return _mm512_cvtepi32_ps(quads_dot512(levels, x.levels(row, 0, b), _mm512_set1_epi32(-offset * sum), k0, k1));
  }
  const __m512i first = quads_dot512(levels, x.levels(row, 0, b), _mm512_setzero_si512(), k0, k1);
  const __m512i second = quads_dot512(levels, x.levels(row, 1, b), _mm512_set1_epi32(-offset * sum), k0, k1);
  return _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(first, 8), second));
}

// Groups of whole blocks.
template <int BITS, int SCALE, bool MINS, int ROWS>
GLASSLM_AVX512 void tile_avx512(const Weights& w, const Rows& x, int64_t panel, int64_t row0, float* y,
                                int64_t ld_y) {
  const int64_t step = w.panel_block_bytes();
  const uint8_t* block = w.levels + panel * w.blocks * step;
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  int64_t b = 0;
  for (int64_t g = 0; g < w.groups; ++g) {
    const __m512 scale = group_values512<SCALE, false>(w, panel, g);
    __m512 min = _mm512_setzero_ps();
    if constexpr (MINS) min = group_values512<SCALE, true>(w, panel, g);
    for (const int64_t end = std::min(b + w.group_blocks(), w.blocks); b < end; ++b, block += step) {
      prefetch_block<BITS>(block + kAheadBytes);
      __m512i levels[8];
      unpack_block512<BITS>(block, levels);
      for (int r = 0; r < ROWS; ++r) {
        const int64_t row = row0 + r;
        const int32_t sum = x.joined_sum(row, b);
        // 256 * (first byte's sums) + (second byte's), the offset taken off in the same integers.
        const __m512 dot = joined_dot512(levels, x, row, b, w.offset, sum, 0, 8);
        const float dx = x.step(row, b);
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(scale, _mm512_set1_ps(dx)), dot, acc[r]);
        if constexpr (MINS) acc[r] = _mm512_fmadd_ps(min, _mm512_set1_ps(dx * static_cast<float>(sum)), acc[r]);
      }
    }
  }
  store_tile512<ROWS>(w, acc, panel, row0, y, ld_y);
}

// The sum of a block's first 16 levels of one pass (sad_epu8 sums unsigned bytes: flip, then take 16 * 128 off).
inline int32_t first_half_sum(const int8_t* q) {  // (SSE2: every x86-64 CPU)
  const __m128i flipped = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)), _mm_set1_epi8(static_cast<char>(0x80)));
  const __m128i sums = _mm_sad_epu8(flipped, _mm_setzero_si128());
  return _mm_cvtsi128_si32(sums) + _mm_extract_epi16(sums, 4) - 16 * 128;
}

// -offset * joined_sum over each half of a block (its first and last 16 inputs): what a half's dot
// product starts from.
// (`at`: where the row's blocks are, Rows::at or, for rows stored tiled, Rows::stored_at.)
template <typename At>
inline void half_starts_at(const Rows& x, At at, int64_t row, int64_t b, int32_t offset, int32_t* starts) {
  const int32_t once = first_half_sum(x.q + at(row, 0, b) * kBlock);
  const int32_t first = x.passes == 1 ? once : 256 * once + first_half_sum(x.q + at(row, 1, b) * kBlock);
  const int32_t joined = x.passes == 1 ? x.sums[at(row, 0, b)] : 256 * x.sums[at(row, 0, b)] + x.sums[at(row, 1, b)];
  starts[0] = -offset * first, starts[1] = -offset * (joined - first);
}

inline void half_starts_of(const Rows& x, int64_t row, int64_t b, int32_t offset, int32_t* starts) {
  if (x.half_starts != nullptr) {
    starts[0] = x.half_starts[2 * (row * x.blocks + b)], starts[1] = x.half_starts[2 * (row * x.blocks + b) + 1];
    return;
  }
  half_starts_at(x, [&](int64_t r, int pass, int64_t block) { return x.at(r, pass, block); }, row, b, offset, starts);
}

// sum_i (u_i - offset) (256 q1_i + q2_i) over one half block (quads k0..k0 + 3), from `start`: one chain
// of vpdpbusd per pass (the tile's other rows keep the unit busy meanwhile).
GLASSLM_AVX512 inline __m512 half_dot512(const __m512i* levels, const Rows& x, int64_t row, int64_t b, __m512i start, int k0) {
  const int8_t* q1 = x.levels(row, 0, b);
  if (x.passes == 1) {
    for (int k = k0; k < k0 + 4; ++k) start = dpbusd_at(start, levels[k], q1 + 4 * k);
    return _mm512_cvtepi32_ps(start);
  }
  const int8_t* q2 = x.levels(row, 1, b);
  __m512i first = _mm512_setzero_si512();
  for (int k = k0; k < k0 + 4; ++k) {
    first = dpbusd_at(first, levels[k], q1 + 4 * k);
    start = dpbusd_at(start, levels[k], q2 + 4 * k);
  }
  return _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(first, 8), start));
}

// Groups of half a block (llama.cpp's Q6_K: a scale per 16 inputs, no minimums): each block's two
// halves (quads 0..3 and 4..7) get their own dot product and scale.
template <int BITS, int SCALE, bool MINS, int ROWS>
GLASSLM_AVX512 void tile_halves_avx512(const Weights& w, const Rows& x, int64_t panel, int64_t row0, float* y,
                                       int64_t ld_y) {
  static_assert(!MINS, "half-block groups have no minimums");
  const int64_t step = w.panel_block_bytes();
  const uint8_t* block = w.levels + panel * w.blocks * step;
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.blocks; ++b, block += step) {
    const __m512 first_scale = group_values512<SCALE, false>(w, panel, 2 * b);
    const __m512 second_scale = group_values512<SCALE, false>(w, panel, 2 * b + 1);
    prefetch_block<BITS>(block + kAheadBytes);
    __m512i levels[8];
    unpack_block512<BITS>(block, levels);
    for (int r = 0; r < ROWS; ++r) {
      const int64_t row = row0 + r;
      int32_t starts[2];
      half_starts_of(x, row, b, w.offset, starts);
      const __m512 first = half_dot512(levels, x, row, b, _mm512_set1_epi32(starts[0]), 0);
      const __m512 second = half_dot512(levels, x, row, b, _mm512_set1_epi32(starts[1]), 4);
      // (the block's two halves joined before its activation step: one multiply fewer per row)
      const __m512 halves = _mm512_fmadd_ps(second_scale, second, _mm512_mul_ps(first_scale, first));
      acc[r] = _mm512_fmadd_ps(halves, _mm512_set1_ps(x.step(row, b)), acc[r]);
    }
  }
  store_tile512<ROWS>(w, acc, panel, row0, y, ld_y);
}

// ----------------------------------------------------------------------------------------------
// The wide tile of a long prefill on AVX-512: the same numbers as tile_avx512 / tile_halves_avx512 with
// ROWS = 16 (the same float operations in the same order), from rows stored a tile at a time
// (Rows::tiled), so each pass of the tile's rows at block b is 512 consecutive bytes and every
// activation is an address plus a constant. Measured on one thread of the Xeon here: vpdpbusd issues
// twice a cycle (6.3e9 a second in a loop of independent ones), and the general tile reached a third
// of that. Here eight chains of vpdpbusd from different rows go side by side (the general tile: a
// row's two, each waiting 5 cycles on the last), and each row's scalars (its step dx, dx * s,
// -offset * s) are made 16 at a time from three vector loads, a block ahead, so that they are read
// from the cache rather than forwarded from stores still in flight (without that, this tile was no
// faster than the general one). 512-row products of the 1B model's matrices, best of 3, against the
// general tile: Q8_0 20-40% faster, Q4_K 15-22%, Q5_K 7-15%, Q6_K 0-11%.

struct TileScalars {
  alignas(64) float dx[kWideTile];       // the step of each row's block (its last pass's scale)
  alignas(64) float dx_sum[kWideTile];   // dx * s, s = the joined sum of its activations
  alignas(64) int32_t start[kWideTile];  // -offset * s
};

template <int PASSES>
GLASSLM_AVX512 inline void tile_scalars512(const Rows& x, int64_t row0, int64_t b, int offset, TileScalars& out) {
  const __m512i first = _mm512_loadu_si512(x.sums + x.tile_at(row0, 0, b));
  const __m512i sum = PASSES == 1 ? first
                                  : _mm512_add_epi32(_mm512_slli_epi32(first, 8), _mm512_loadu_si512(x.sums + x.tile_at(row0, 1, b)));
  const __m512 dx = _mm512_loadu_ps(x.d + x.tile_at(row0, PASSES - 1, b));
  _mm512_store_ps(out.dx, dx);
  _mm512_store_ps(out.dx_sum, _mm512_mul_ps(dx, _mm512_cvtepi32_ps(sum)));
  _mm512_store_si512(out.start, _mm512_mullo_epi32(sum, _mm512_set1_epi32(-offset)));
}

// Rows r0 .. r0 + N - 1's sums of (u_i - offset) (256 q1_i + q2_i) over one block (q1, q2: the tile's
// passes at this block), as float32: one chain per row and pass, N * PASSES = 8 of them interleaved.
template <int PASSES, int N>
GLASSLM_AVX512 inline void block_dots512(const __m512i* levels, const int8_t* q1, const int8_t* q2,
                                         const TileScalars& rows, int r0, __m512* dots) {
  __m512i first[N], second[N];
  for (int j = 0; j < N; ++j) {
    first[j] = PASSES == 1 ? _mm512_set1_epi32(rows.start[r0 + j]) : _mm512_setzero_si512();
    if constexpr (PASSES == kPasses) second[j] = _mm512_set1_epi32(rows.start[r0 + j]);
  }
  for (int k = 0; k < 8; ++k) {
    for (int j = 0; j < N; ++j) {
      first[j] = dpbusd_at(first[j], levels[k], q1 + kBlock * (r0 + j) + 4 * k);
      if constexpr (PASSES == kPasses) second[j] = dpbusd_at(second[j], levels[k], q2 + kBlock * (r0 + j) + 4 * k);
    }
  }
  for (int j = 0; j < N; ++j) {
    dots[j] = _mm512_cvtepi32_ps(PASSES == 1 ? first[j] : _mm512_add_epi32(_mm512_slli_epi32(first[j], 8), second[j]));
  }
}

template <int BITS, int SCALE, bool MINS, int PASSES>
GLASSLM_AVX512 void wide_tile512(const Weights& w, const Rows& x, int64_t panel, int64_t row0, float* y, int64_t ld_y) {
  constexpr int N = 8 / PASSES;
  const int64_t step = w.panel_block_bytes();
  const uint8_t* block = w.levels + panel * w.blocks * step;
  __m512 acc[kWideTile];
  for (int r = 0; r < kWideTile; ++r) acc[r] = _mm512_setzero_ps();
  TileScalars ahead[2];  // block b's at b % 2, made a block early: read from the cache, not from stores in flight
  tile_scalars512<PASSES>(x, row0, 0, w.offset, ahead[0]);
  int64_t b = 0;
  for (int64_t g = 0; g < w.groups; ++g) {
    const __m512 scale = group_values512<SCALE, false>(w, panel, g);
    __m512 min = _mm512_setzero_ps();
    if constexpr (MINS) min = group_values512<SCALE, true>(w, panel, g);
    for (const int64_t end = std::min(b + w.group_blocks(), w.blocks); b < end; ++b, block += step) {
      prefetch_block<BITS>(block + kAheadBytes);
      __m512i levels[8];
      unpack_block512<BITS>(block, levels);
      if (b + 1 < w.blocks) tile_scalars512<PASSES>(x, row0, b + 1, w.offset, ahead[(b + 1) % 2]);
      const TileScalars& rows = ahead[b % 2];
      const int8_t* q1 = x.q + x.tile_at(row0, 0, b) * kBlock;
      const int8_t* q2 = x.q + x.tile_at(row0, PASSES - 1, b) * kBlock;
#pragma GCC unroll 16
      for (int r0 = 0; r0 < kWideTile; r0 += N) {
        __m512 dots[N];
        block_dots512<PASSES, N>(levels, q1, q2, rows, r0, dots);
        for (int j = 0; j < N; ++j) {
          const int r = r0 + j;
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(scale, _mm512_set1_ps(rows.dx[r])), dots[j], acc[r]);
          if constexpr (MINS) acc[r] = _mm512_fmadd_ps(min, _mm512_set1_ps(rows.dx_sum[r]), acc[r]);
        }
      }
    }
  }
  // (the last tile's rows past x.count were zeros: multiplied, never stored)
  store_tile512<kWideTile>(w, acc, panel, row0, y, ld_y, static_cast<int>(std::min<int64_t>(kWideTile, x.count - row0)));
}

// The same for half-block groups (Q6_K): each row's two halves (quads 0..3 and 4..7) their own chains,
// starting from the product's table (Rows::half_starts); 8 / (2 * PASSES) rows at a time.
template <int PASSES, int N>
GLASSLM_AVX512 inline void half_dots512(const __m512i* levels, const int8_t* q1, const int8_t* q2, const int32_t* starts,
                                        int64_t stride, int r0, __m512* firsts, __m512* seconds) {
  __m512i one[N][2], two[N][2];  // [row][half]: the first pass's chains, and the second's
  for (int j = 0; j < N; ++j) {
    for (int h = 0; h < 2; ++h) {
      const __m512i start = _mm512_set1_epi32(starts[stride * (r0 + j) + h]);
      one[j][h] = PASSES == 1 ? start : _mm512_setzero_si512();
      if constexpr (PASSES == kPasses) two[j][h] = start;
    }
  }
  for (int k = 0; k < 4; ++k) {
    for (int j = 0; j < N; ++j) {
      for (int h = 0; h < 2; ++h) {
        const int quad = 4 * h + k;
        one[j][h] = dpbusd_at(one[j][h], levels[quad], q1 + kBlock * (r0 + j) + 4 * quad);
        if constexpr (PASSES == kPasses) two[j][h] = dpbusd_at(two[j][h], levels[quad], q2 + kBlock * (r0 + j) + 4 * quad);
      }
    }
  }
  for (int j = 0; j < N; ++j) {
    __m512 half[2];
    for (int h = 0; h < 2; ++h) {
      half[h] = _mm512_cvtepi32_ps(PASSES == 1 ? one[j][h] : _mm512_add_epi32(_mm512_slli_epi32(one[j][h], 8), two[j][h]));
    }
    firsts[j] = half[0], seconds[j] = half[1];
  }
}

template <int BITS, int SCALE, int PASSES>
GLASSLM_AVX512 void wide_halves_tile512(const Weights& w, const Rows& x, int64_t panel, int64_t row0, float* y,
                                        int64_t ld_y) {
  constexpr int N = 4 / PASSES;
  const int64_t step = w.panel_block_bytes();
  const uint8_t* block = w.levels + panel * w.blocks * step;
  __m512 acc[kWideTile];
  for (int r = 0; r < kWideTile; ++r) acc[r] = _mm512_setzero_ps();
  TileScalars ahead[2];  // (as wide_tile512)
  tile_scalars512<PASSES>(x, row0, 0, w.offset, ahead[0]);
  for (int64_t b = 0; b < w.blocks; ++b, block += step) {
    const __m512 first_scale = group_values512<SCALE, false>(w, panel, 2 * b);
    const __m512 second_scale = group_values512<SCALE, false>(w, panel, 2 * b + 1);
    prefetch_block<BITS>(block + kAheadBytes);
    __m512i levels[8];
    unpack_block512<BITS>(block, levels);
    if (b + 1 < w.blocks) tile_scalars512<PASSES>(x, row0, b + 1, w.offset, ahead[(b + 1) % 2]);
    const TileScalars& rows = ahead[b % 2];
    const int8_t* q1 = x.q + x.tile_at(row0, 0, b) * kBlock;
    const int8_t* q2 = x.q + x.tile_at(row0, PASSES - 1, b) * kBlock;
    const int32_t* starts = x.half_starts + 2 * (row0 * x.blocks + b);
#pragma GCC unroll 16
    for (int r0 = 0; r0 < kWideTile; r0 += N) {
      __m512 firsts[N], seconds[N];
      half_dots512<PASSES, N>(levels, q1, q2, starts, 2 * x.blocks, r0, firsts, seconds);
      for (int j = 0; j < N; ++j) {
        // (the block's two halves joined before its activation step, as tile_halves_avx512 does)
        const __m512 halves = _mm512_fmadd_ps(second_scale, seconds[j], _mm512_mul_ps(first_scale, firsts[j]));
        acc[r0 + j] = _mm512_fmadd_ps(halves, _mm512_set1_ps(rows.dx[r0 + j]), acc[r0 + j]);
      }
    }
  }
  // (the last tile's rows past x.count were zeros: multiplied, never stored)
  store_tile512<kWideTile>(w, acc, panel, row0, y, ld_y, static_cast<int>(std::min<int64_t>(kWideTile, x.count - row0)));
}

// The wide tile where its rows are stored tiled (matmul_tiled's), else the general one.
template <int BITS, int SCALE, bool MINS, bool HALVES>
GLASSLM_AVX512 void tile_wide_avx512(const Weights& w, const Rows& x, int64_t panel, int64_t row0, float* y, int64_t ld_y) {
  if constexpr (HALVES) {
    if (!x.tiled) return tile_halves_avx512<BITS, SCALE, MINS, kWideTile>(w, x, panel, row0, y, ld_y);
    return x.passes == 1 ? wide_halves_tile512<BITS, SCALE, 1>(w, x, panel, row0, y, ld_y)
                         : wide_halves_tile512<BITS, SCALE, kPasses>(w, x, panel, row0, y, ld_y);
  } else {
    if (!x.tiled) return tile_avx512<BITS, SCALE, MINS, kWideTile>(w, x, panel, row0, y, ld_y);
    return x.passes == 1 ? wide_tile512<BITS, SCALE, MINS, 1>(w, x, panel, row0, y, ld_y)
                         : wide_tile512<BITS, SCALE, MINS, kPasses>(w, x, panel, row0, y, ld_y);
  }
}

// 16 consecutive fp16, bf16 or float32 weights (KIND), as float32.
template <int KIND>
GLASSLM_AVX512 inline __m512 weights16_512(const uint8_t* p) {
  if constexpr (KIND == kFloat) return _mm512_loadu_ps(reinterpret_cast<const float*>(p));
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (KIND == kBf16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  return _mm512_cvtph_ps(bits);
}

// WR weight rows (from o) times ROWS activation rows (from row0): one chain of multiply-adds per
// pair, 16 inputs a step, summed across lanes at the end.
template <int KIND, int WR, int ROWS>
GLASSLM_AVX512 inline void float_dots512(const Weights& w, const Rows& x, int64_t o, int64_t row0, float* y, int64_t ld_y) {
  constexpr int64_t kSize = KIND == kFloat ? 4 : 2;  // bytes per weight
  const int64_t width = w.blocks * kBlock;
  const uint8_t* p = w.levels + o * width * kSize;
  const float* xr = x.x + row0 * width;
  __m512 acc[WR][ROWS];
  for (int r = 0; r < WR; ++r) {
    for (int j = 0; j < ROWS; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  // The next WR rows (the next call's, which follow these in memory) are asked for into L2 as these
  // are read, in step: each row is a stream of its own, and rows as short as one page (2048 fp16
  // weights) leave the hardware's prefetcher little to learn from (1B F16 decoding: 5.5 tokens/s
  // against 5.3 with each row's own line 6 KiB ahead; the panels this replaced, 5.6-5.9).
  const char* next = reinterpret_cast<const char*>(p + WR * width * kSize);
  for (int64_t i = 0; i < width; i += kBlock) {  // a block of 32 inputs: one or two lines of each row
    for (int64_t line = 0; line < WR * kBlock * kSize; line += 64) _mm_prefetch(next + WR * i * kSize + line, _MM_HINT_T1);
    for (int64_t k = i; k < i + kBlock; k += 16) {
      __m512 v[WR];
      for (int r = 0; r < WR; ++r) v[r] = weights16_512<KIND>(p + (r * width + k) * kSize);
      for (int j = 0; j < ROWS; ++j) {
        const __m512 xv = _mm512_loadu_ps(xr + j * width + k);
        for (int r = 0; r < WR; ++r) acc[r][j] = _mm512_fmadd_ps(v[r], xv, acc[r][j]);
      }
    }
  }
  for (int j = 0; j < ROWS; ++j) {
    for (int r = 0; r < WR; ++r) {
      const float sum = _mm512_reduce_add_ps(acc[r][j]);
      y[(row0 + j) * ld_y + o + r] = w.bias != nullptr ? sum + w.bias[o + r] : sum;
    }
  }
}

// A panel's rows (16, or what is left of d_out), four at a time.
template <int KIND, int ROWS>
GLASSLM_AVX512 void tile_float_avx512(const Weights& w, const Rows& x, int64_t panel, int64_t row0, float* y, int64_t ld_y) {
  const int64_t end = std::min(w.d_out, (panel + 1) * kPanel);
  int64_t o = panel * kPanel;
  for (; o + 4 <= end; o += 4) float_dots512<KIND, 4, ROWS>(w, x, o, row0, y, ld_y);
  for (; o < end; ++o) float_dots512<KIND, 1, ROWS>(w, x, o, row0, y, ld_y);
}

// ----------------------------------------------------------------------------------------------
// AVX2: each panel as two halves of 8 rows (the first and last 32 bytes of every 64-byte chunk);
// vpmaddubsw multiplies unsigned by signed bytes into int16 pairs, vpmaddwd sums those into int32.

// 8 panel rows' values of one group (rows 8 * half .. 8 * half + 7) as float32; `super` is the group's
// super-block counted over all panels (panel * w.supers() + g / w.super_groups), which a tile that counts
// its blocks knows without dividing.
template <int SCALE, bool MIN>
GLASSLM_AVX2 inline __m256 group_values256(const Weights& w, int64_t panel, int64_t g, int half, int64_t super) {
  const int64_t at = (panel * w.groups + g) * kPanel + 8 * half;
  const void* values = MIN ? w.mins : w.scales;
  if constexpr (SCALE == kHalf || SCALE == kBf16) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(values) + at));
    if constexpr (SCALE == kBf16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
    return _mm256_cvtph_ps(bits);
  } else {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(values) + at));
    const __m256i sub = SCALE == kSubU8 ? _mm256_cvtepu8_epi32(bytes) : _mm256_cvtepi8_epi32(bytes);
    const uint16_t* per_super = (MIN ? w.super_mins : w.super_scales) + super * kPanel;
    return _mm256_mul_ps(_mm256_cvtepi32_ps(sub), _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(per_super + 8 * half))));
  }
}

template <int SCALE, bool MIN>
GLASSLM_AVX2 inline __m256 group_values256(const Weights& w, int64_t panel, int64_t g, int half) {
  return group_values256<SCALE, MIN>(w, panel, g, half, SCALE == kHalf || SCALE == kBf16 ? 0 : panel * w.supers() + g / w.super_groups);
}

GLASSLM_AVX2 inline __m256i broadcast4_avx2(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, 4);
  return _mm256_set1_epi32(four);
}

// sum_i w_i x_i over one block for 8 rows, in int32, for 8-bit weights and one pass of activations. The
// stored levels are turned back into signed weights (u xor 0x80 = w) and multiplied as |w| times x with
// w's sign, as vpmaddubsw's unsigned operand must be; a pair is then at most 2 * 128 * 127 < 2^15.
GLASSLM_AVX2 inline __m256i signed_dot_avx2(const __m256i* weights, const int8_t* xq) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i sum = _mm256_setzero_si256();
  for (int k = 0; k < 8; ++k) {
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(weights[k]),
                                               _mm256_sign_epi8(broadcast4_avx2(xq + 4 * k), weights[k]));
    sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, ones));
  }
  return sum;
}

// One half block's 8-bit weights, signed (the stored u = w + 128, xor 0x80), quad k in weights[k].
GLASSLM_AVX2 inline void signed_half_block256(const uint8_t* half, __m256i* weights) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int k = 0; k < 8; ++k) {
    weights[k] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(half + 64 * k)), flip);
  }
}

template <int ROWS>
GLASSLM_AVX2 inline void store_half_tile256(const Weights& w, const __m256* acc, int64_t panel, int half, int64_t row0,
                                            float* y, int64_t ld_y) {
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

// Each sum as it is made, kept in a register: the compiler would otherwise reassociate a chain of
// integer additions into a tree (wrapping addition is associative), which holds every product of the
// chain at once, for every row, and spills them on 16 registers (perf annotate on a Zen 3: Q8_0's tile
// went from 22 to 40 GMAC/s when its sums were pinned).
GLASSLM_AVX2 inline void in_register(__m256i& v) { asm("" : "+x"(v)); }

// 8-bit weights with both passes: one product of 16-bit numbers instead of two of bytes. The joined
// activation x = 256 q1 + q2 fits int16 (|x| <= 256 * 127 + 128), the stored u = w + 128 is 0..255, and
// vpmaddwd sums their products in int32 exactly (32 * 255 * 32640 < 2^31), so
//   sum_i w_i x_i = sum_i u_i x_i - 128 * s
// is the same integer the two vpmaddubsw passes make, in 4 instructions a quad and row (and the
// quad's widening, shared by the tile's rows) instead of 11.
GLASSLM_AVX2 inline void joined_block16(const Rows& x, int64_t row, int64_t b, int16_t* joined) {
  const __m256i q1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.levels(row, 0, b)));
  const __m256i q2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.levels(row, 1, b)));
  for (int h = 0; h < 2; ++h) {
    const __m256i first = _mm256_cvtepi8_epi16(h ? _mm256_extracti128_si256(q1, 1) : _mm256_castsi256_si128(q1));
    const __m256i second = _mm256_cvtepi8_epi16(h ? _mm256_extracti128_si256(q2, 1) : _mm256_castsi256_si128(q2));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(joined + 16 * h), _mm256_add_epi16(_mm256_slli_epi16(first, 8), second));
  }
}

// sum_i u_i x_i for the 8 rows of one half block (bytes of quad k at half + 64 k: rows 0-3 in the
// first 16, 4-7 in the next), in row order, for each of ROWS activation rows: a quad's weights are
// widened once for all of them.
template <int ROWS>
GLASSLM_AVX2 inline void joined_dots8_avx2(const uint8_t* half, const int16_t* const* joined, __m256i* dots) {
  __m256i low[ROWS], high[ROWS];  // rows 0-3 and 4-7 of the panel half, two sums a row
  for (int r = 0; r < ROWS; ++r) low[r] = high[r] = _mm256_setzero_si256();
  for (int k = 0; k < 8; ++k) {
    const __m128i* quad = reinterpret_cast<const __m128i*>(half + 64 * k);
    const __m256i first = _mm256_cvtepu8_epi16(_mm_loadu_si128(quad)), second = _mm256_cvtepu8_epi16(_mm_loadu_si128(quad + 1));
    for (int r = 0; r < ROWS; ++r) {
      int64_t four;
      std::memcpy(&four, joined[r] + 4 * k, 8);
      const __m256i xs = _mm256_set1_epi64x(four);
      low[r] = _mm256_add_epi32(low[r], _mm256_madd_epi16(first, xs));
      high[r] = _mm256_add_epi32(high[r], _mm256_madd_epi16(second, xs));
      in_register(low[r]), in_register(high[r]);  // (as in quads_dots256)
    }
  }
  // hadd: lanes (p0 p1 p4 p5 | p2 p3 p6 p7) for panel rows p; the 64-bit permute puts them in order.
  for (int r = 0; r < ROWS; ++r) {
    dots[r] = _mm256_permute4x64_epi64(_mm256_hadd_epi32(low[r], high[r]), _MM_SHUFFLE(3, 1, 2, 0));
  }
}

template <int SCALE, int ROWS>
GLASSLM_AVX2 void tile8_joined_avx2(const Weights& w, const Rows& x, int64_t panel, int64_t row0, float* y, int64_t ld_y) {
  const int64_t step = w.panel_block_bytes();
  for (int half = 0; half < 2; ++half) {
    const uint8_t* block = w.levels + panel * w.blocks * step + 32 * half;
    __m256 acc[ROWS], scale = _mm256_setzero_ps();
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < w.blocks; ++b, block += step) {
      if (b % w.group_blocks() == 0) scale = group_values256<SCALE, false>(w, panel, b / w.group_blocks(), half);
      if (half == 0) prefetch_block<8>(block + kAheadBytes);
      alignas(32) int16_t made[ROWS][kBlock];
      const int16_t* joined[ROWS];
      for (int r = 0; r < ROWS; ++r) {
        if (x.joined != nullptr) {
          joined[r] = x.joined + ((row0 + r) * x.blocks + b) * kBlock;
        } else {
          joined_block16(x, row0 + r, b, made[r]);
          joined[r] = made[r];
        }
      }
      __m256i dots[ROWS];
      joined_dots8_avx2<ROWS>(block, joined, dots);
      for (int r = 0; r < ROWS; ++r) {  // (both passes: Rows::joined_sum and step without their branch)
        const int64_t first = x.at(row0 + r, 0, b), second = first + x.blocks;
        const __m256i start = _mm256_set1_epi32(-w.offset * (256 * x.sums[first] + x.sums[second]));
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(dots[r], start));
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(scale, _mm256_set1_ps(x.d[second])), dot, acc[r]);
      }
    }
    store_half_tile256<ROWS>(w, acc, panel, half, row0, y, ld_y);
  }
}

// Quad k's levels of one half block (8 rows x 4 inputs), unpacked where they are used: chunk k's low
// nibbles are quad k, its high nibbles quad k + 4; bits 4 and up come from their planes. Bit k of a
// plane's byte is quad k's: moved to `bit` by a 16-bit shift of |bit - k| (either way it reads only its
// own byte's bits) and kept by the mask, 3 instructions where compare and select take 4.
template <int BITS>
GLASSLM_AVX2 inline __m256i quad_levels256(const uint8_t* half, int k) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(half + 64 * (k % 4)));
  __m256i levels = _mm256_and_si256(k < 4 ? bytes : _mm256_srli_epi16(bytes, 4), low4);
  for (int bit = 4; bit < BITS; ++bit) {
    const __m256i plane = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(half + 256 + 64 * (bit - 4)));
    const __m256i moved = k <= bit ? _mm256_slli_epi16(plane, bit - k) : _mm256_srli_epi16(plane, k - bit);
    levels = _mm256_or_si256(levels, _mm256_and_si256(moved, _mm256_set1_epi8(static_cast<char>(1 << bit))));
  }
  return levels;
}

// sum_i u_i (256 q1_i + q2_i) over quads [k0, k1) of one half block, for ROWS rows (q1: each row's first
// pass; its second is pass_stride bytes on), in int32. Quad by quad: each quad's levels go into every
// row's int16 sums (one a pass) as soon as they are unpacked. Runs of quads are summed in int16 (8 of
// 4-bit levels, 4 of 5-bit, 2 of 6-bit: at most 8 * 2 * 15 * 128, 4 * 2 * 31 * 128 and 2 * 2 * 63 * 128,
// under 2^15), then widened by vpmaddwd, the first pass's times 256: the integers tile_avx2 makes.
template <int BITS, int PASSES, int ROWS>
GLASSLM_AVX2 inline __attribute__((always_inline)) void quads_dots256(const uint8_t* half, const int8_t* const* q1,
                                                                      int64_t pass_stride, int k0, int k1, __m256i* dots) {
  constexpr int kRun = BITS == 4 ? 8 : BITS == 5 ? 4 : 2;
  const __m256i ones = _mm256_set1_epi16(1), first_weight = _mm256_set1_epi16(PASSES == 1 ? 1 : 256);
#pragma GCC unroll 8
  for (int run = k0; run < k1; run += kRun) {
    __m256i one[ROWS], two[ROWS];
    for (int r = 0; r < ROWS; ++r) one[r] = two[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int k = run; k < run + kRun; ++k) {
      const __m256i levels = quad_levels256<BITS>(half, k);
#pragma GCC unroll 4
      for (int r = 0; r < ROWS; ++r) {
        one[r] = _mm256_add_epi16(one[r], _mm256_maddubs_epi16(levels, broadcast4_avx2(q1[r] + 4 * k)));
        in_register(one[r]);
        if constexpr (PASSES == kPasses) {
          two[r] = _mm256_add_epi16(two[r], _mm256_maddubs_epi16(levels, broadcast4_avx2(q1[r] + pass_stride + 4 * k)));
          in_register(two[r]);
        }
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      __m256i joined = _mm256_madd_epi16(one[r], first_weight);
      if constexpr (PASSES == kPasses) joined = _mm256_add_epi32(joined, _mm256_madd_epi16(two[r], ones));
      dots[r] = run == k0 ? joined : _mm256_add_epi32(dots[r], joined);
    }
  }
}

// The second half-block group's product (quads 4-7) into acc, after the first's (as tile_avx2 adds them).
template <int BITS, int PASSES, int ROWS>
GLASSLM_AVX2 inline __attribute__((always_inline)) void halves_second256(const Rows& x, const uint8_t* half,
                                                                         const int8_t* const* q1, int64_t row0, int64_t b,
                                                                         const int32_t (*starts)[2], __m256 scale, __m256* acc) {
  __m256i dots[ROWS];
  quads_dots256<BITS, PASSES, ROWS>(half, q1, x.blocks * kBlock, 4, 8, dots);
  for (int r = 0; r < ROWS; ++r) {
    const __m256 dx = _mm256_set1_ps(x.d[x.at(row0 + r, PASSES - 1, b)]);
    acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(scale, dx), _mm256_cvtepi32_ps(_mm256_add_epi32(dots[r], _mm256_set1_epi32(starts[r][1]))), acc[r]);
  }
}

// 4- to 6-bit weights, groups of whole blocks or (HALVES: Q6_K) of half a block: tile_avx2's numbers,
// quad by quad (quads_dots256). tile_avx2 unpacked a block's eight quads first and then went row by
// row; on 16 registers that spilled the levels and the accumulators (perf annotate on a Zen 3).
template <int BITS, int SCALE, bool MINS, bool HALVES, int PASSES, int ROWS>
GLASSLM_AVX2 void tile_quads_avx2(const Weights& w, const Rows& x, int64_t panel, int64_t row0, float* y, int64_t ld_y) {
  const int64_t step = w.panel_block_bytes(), pass_stride = x.blocks * kBlock;
  for (int half = 0; half < 2; ++half) {
    const uint8_t* block = w.levels + panel * w.blocks * step + 32 * half;
    __m256 acc[ROWS], scale = _mm256_setzero_ps(), min = _mm256_setzero_ps(), second_scale = scale;
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
    // Groups and super-blocks counted as the blocks go (a division a block cost Q6_K's tile ~6%).
    const int64_t group_blocks = w.group_blocks(), super_blocks = std::max<int64_t>(1, w.super_groups * w.group_size / kBlock);
    int64_t group = 0, super = SCALE == kHalf || SCALE == kBf16 ? 0 : panel * w.supers(), into_group = 0, into_super = 0;
    for (int64_t b = 0; b < w.blocks; ++b, block += step) {
      if (HALVES) {
        scale = group_values256<SCALE, false>(w, panel, 2 * b, half, super);
        second_scale = group_values256<SCALE, false>(w, panel, 2 * b + 1, half, super);
      } else if (into_group == 0) {
        scale = group_values256<SCALE, false>(w, panel, group, half, super);
        if constexpr (MINS) min = group_values256<SCALE, true>(w, panel, group, half, super);
      }
      if (++into_group == group_blocks) into_group = 0, ++group;
      if (++into_super == super_blocks) into_super = 0, ++super;
      if (half == 0) prefetch_block<BITS>(block + kAheadBytes);
      const int8_t* q1[ROWS];
      int32_t starts[ROWS][2];  // (HALVES: what each half's product starts from)
      for (int r = 0; r < ROWS; ++r) {
        q1[r] = x.levels(row0 + r, 0, b);
        if constexpr (HALVES) half_starts_of(x, row0 + r, b, w.offset, starts[r]);
      }
      __m256i dots[ROWS];
      quads_dots256<BITS, PASSES, ROWS>(block, q1, pass_stride, 0, HALVES ? 4 : 8, dots);
      for (int r = 0; r < ROWS; ++r) {
        const int64_t first = x.at(row0 + r, 0, b), last = first + (PASSES - 1) * x.blocks;  // (Rows::joined_sum, step)
        const __m256 dx = _mm256_set1_ps(x.d[last]);
        if constexpr (HALVES) {
          acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(scale, dx), _mm256_cvtepi32_ps(_mm256_add_epi32(dots[r], _mm256_set1_epi32(starts[r][0]))), acc[r]);
          continue;
        }
        const int32_t sum = PASSES == 1 ? x.sums[first] : 256 * x.sums[first] + x.sums[last];
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(dots[r], _mm256_set1_epi32(-w.offset * sum)));
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(scale, dx), dot, acc[r]);
        if constexpr (MINS) acc[r] = _mm256_fmadd_ps(min, _mm256_mul_ps(dx, _mm256_set1_ps(static_cast<float>(sum))), acc[r]);
      }
      if constexpr (HALVES) halves_second256<BITS, PASSES, ROWS>(x, block, q1, row0, b, starts, second_scale, acc);
    }
    store_half_tile256<ROWS>(w, acc, panel, half, row0, y, ld_y);
  }
}

// 8-bit weights and one pass of activations (a prefill asked for int8 activations): signed products,
// so no offset is taken off.
template <int SCALE, int ROWS>
GLASSLM_AVX2 void tile8_one_pass_avx2(const Weights& w, const Rows& x, int64_t panel, int64_t row0, float* y, int64_t ld_y) {
  const int64_t step = w.panel_block_bytes();
  for (int half = 0; half < 2; ++half) {
    const uint8_t* block = w.levels + panel * w.blocks * step + 32 * half;
    __m256 acc[ROWS], scale = _mm256_setzero_ps();
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < w.blocks; ++b, block += step) {
      if (b % w.group_blocks() == 0) scale = group_values256<SCALE, false>(w, panel, b / w.group_blocks(), half);
      if (half == 0) prefetch_block<8>(block + kAheadBytes);  // the second half reads the panel again, from cache
      __m256i weights[8];
      signed_half_block256(block, weights);
      for (int r = 0; r < ROWS; ++r) {
        const __m256 dot = _mm256_cvtepi32_ps(signed_dot_avx2(weights, x.levels(row0 + r, 0, b)));
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(scale, _mm256_set1_ps(x.step(row0 + r, b))), dot, acc[r]);
      }
    }
    store_half_tile256<ROWS>(w, acc, panel, half, row0, y, ld_y);
  }
}

// The AVX2 tile for these weights and this product's passes.
template <int BITS, int SCALE, bool MINS, bool HALVES, int ROWS>
GLASSLM_AVX2 void tile_avx2(const Weights& w, const Rows& x, int64_t panel, int64_t row0, float* y, int64_t ld_y) {
  if constexpr (BITS == 8 && !MINS && !HALVES) {
    return x.passes == kPasses ? tile8_joined_avx2<SCALE, ROWS>(w, x, panel, row0, y, ld_y)
                               : tile8_one_pass_avx2<SCALE, ROWS>(w, x, panel, row0, y, ld_y);
  } else {
    static_assert(BITS <= 6, "8-bit weights come with fp16 scales, no minimums, whole blocks");
    return x.passes == kPasses ? tile_quads_avx2<BITS, SCALE, MINS, HALVES, kPasses, ROWS>(w, x, panel, row0, y, ld_y)
                               : tile_quads_avx2<BITS, SCALE, MINS, HALVES, 1, ROWS>(w, x, panel, row0, y, ld_y);
  }
}

template <int KIND>
GLASSLM_AVX2 inline __m256 weights16_256(const uint8_t* p) {
  if constexpr (KIND == kFloat) return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (KIND == kBf16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  return _mm256_cvtph_ps(bits);
}

GLASSLM_AVX2 inline float sum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// float_dots512 with 8 inputs a step (F16C converts fp16; bf16 is a shift; float32 a load), two
// weight rows at a time (16 registers).
template <int KIND, int WR, int ROWS>
GLASSLM_AVX2 inline void float_dots256(const Weights& w, const Rows& x, int64_t o, int64_t row0, float* y, int64_t ld_y) {
  constexpr int64_t kSize = KIND == kFloat ? 4 : 2;
  const int64_t width = w.blocks * kBlock;
  const uint8_t* p = w.levels + o * width * kSize;
  const float* xr = x.x + row0 * width;
  __m256 acc[WR][ROWS];
  for (int r = 0; r < WR; ++r) {
    for (int j = 0; j < ROWS; ++j) acc[r][j] = _mm256_setzero_ps();
  }
  const char* next = reinterpret_cast<const char*>(p + WR * width * kSize);  // (as float_dots512)
  for (int64_t i = 0; i < width; i += kBlock) {
    for (int64_t line = 0; line < WR * kBlock * kSize; line += 64) _mm_prefetch(next + WR * i * kSize + line, _MM_HINT_T1);
    for (int64_t k = i; k < i + kBlock; k += 8) {
      __m256 v[WR];
      for (int r = 0; r < WR; ++r) v[r] = weights16_256<KIND>(p + (r * width + k) * kSize);
      for (int j = 0; j < ROWS; ++j) {
        const __m256 xv = _mm256_loadu_ps(xr + j * width + k);
        for (int r = 0; r < WR; ++r) acc[r][j] = _mm256_fmadd_ps(v[r], xv, acc[r][j]);
      }
    }
  }
  for (int j = 0; j < ROWS; ++j) {
    for (int r = 0; r < WR; ++r) {
      const float sum = sum256(acc[r][j]);
      y[(row0 + j) * ld_y + o + r] = w.bias != nullptr ? sum + w.bias[o + r] : sum;
    }
  }
}

template <int KIND, int ROWS>
GLASSLM_AVX2 void tile_float_avx2(const Weights& w, const Rows& x, int64_t panel, int64_t row0, float* y, int64_t ld_y) {
  const int64_t end = std::min(w.d_out, (panel + 1) * kPanel);
  int64_t o = panel * kPanel;
  for (; o + 2 <= end; o += 2) float_dots256<KIND, 2, ROWS>(w, x, o, row0, y, ld_y);
  for (; o < end; ++o) float_dots256<KIND, 1, ROWS>(w, x, o, row0, y, ld_y);
}

#endif  // GLASSLM_X86

// ----------------------------------------------------------------------------------------------
// Choosing the instantiation, and the loops over panels and rows.

using TileFn = void (*)(const Weights&, const Rows&, int64_t, int64_t, float*, int64_t);

template <template <int, int, bool, bool, int> class Pick, int BITS, int SCALE, bool MINS, bool HALVES>
TileFn pick_rows(int rows) {
  switch (rows) {
    case 1: return Pick<BITS, SCALE, MINS, HALVES, 1>::fn;
    case 2: return Pick<BITS, SCALE, MINS, HALVES, 2>::fn;
    case 3: return Pick<BITS, SCALE, MINS, HALVES, 3>::fn;
    case kWideTile: return Pick<BITS, SCALE, MINS, HALVES, kWideTile>::fn;
    default: return Pick<BITS, SCALE, MINS, HALVES, 4>::fn;
  }
}

// The vector paths are built for the formats glasslm's layers use; any other takes the plain path.
//   4 bits: Q4_0 (fp16), Q4_1 (fp16, mins), int4 (bf16, mins), Q4_K (sub-scales, mins)
//   5 bits: Q5_0, Q5_1, Q5_K;   6 bits: Q6_K (int8 sub-scales per half block);   8 bits: Q8_0 and int8 (fp16)
template <template <int, int, bool, bool, int> class Pick>
TileFn pick_tile(const Weights& w, int rows) {
  const bool mins = w.mins != nullptr;
  const int kind = w.scale_kind;
  if (w.floats()) {
    if (kind == kFloat) return pick_rows<Pick, 32, kFloat, false, false>(rows);
    return kind == kBf16 ? pick_rows<Pick, 16, kBf16, false, false>(rows) : pick_rows<Pick, 16, kHalf, false, false>(rows);
  }
  if (w.halves()) {
    return w.bits == 6 && kind == kSubI8 && !mins ? pick_rows<Pick, 6, kSubI8, false, true>(rows) : nullptr;
  }
  if (w.bits == 4 || w.bits == 5) {
    const bool four = w.bits == 4;
    if (kind == kHalf && mins) return four ? pick_rows<Pick, 4, kHalf, true, false>(rows) : pick_rows<Pick, 5, kHalf, true, false>(rows);
    if (kind == kHalf) return four ? pick_rows<Pick, 4, kHalf, false, false>(rows) : pick_rows<Pick, 5, kHalf, false, false>(rows);
    if (kind == kSubU8 && mins) return four ? pick_rows<Pick, 4, kSubU8, true, false>(rows) : pick_rows<Pick, 5, kSubU8, true, false>(rows);
    if (kind == kBf16 && mins && four) return pick_rows<Pick, 4, kBf16, true, false>(rows);
  }
  if (w.bits == 8 && kind == kHalf && !mins) return pick_rows<Pick, 8, kHalf, false, false>(rows);
  return nullptr;
}

#if GLASSLM_X86
template <int BITS, int SCALE, bool MINS, bool HALVES, int ROWS>
struct Avx512Tile {
  static constexpr TileFn pick() {
    if constexpr (BITS >= 16 && ROWS > kTile) {
      return nullptr;  // (float weights take four rows at a time)
    } else if constexpr (BITS >= 16) {
      return tile_float_avx512<SCALE, ROWS>;
    } else if constexpr (ROWS == kWideTile) {
      return tile_wide_avx512<BITS, SCALE, MINS, HALVES>;
    } else if constexpr (HALVES) {
      return tile_halves_avx512<BITS, SCALE, MINS, ROWS>;
    } else {
      return tile_avx512<BITS, SCALE, MINS, ROWS>;
    }
  }
  static constexpr TileFn fn = pick();
};
template <int BITS, int SCALE, bool MINS, bool HALVES, int ROWS>
struct Avx2Tile {
  static constexpr TileFn pick() {
    if constexpr (ROWS > kTile) {
      return nullptr;  // (16 registers: four rows at a time)
    } else if constexpr (BITS >= 16) {
      return tile_float_avx2<SCALE, ROWS>;
    } else {
      return tile_avx2<BITS, SCALE, MINS, HALVES, ROWS>;
    }
  }
  static constexpr TileFn fn = pick();
};
#endif

void run_tile(const Weights& w, const Rows& x, int64_t panel, int64_t row0, int rows, float* y, int64_t ld_y,
              int64_t isa) {
#if GLASSLM_X86
  const TileFn tile = isa == kAvx512 ? pick_tile<Avx512Tile>(w, rows) : isa == kAvx2 ? pick_tile<Avx2Tile>(w, rows) : nullptr;
  if (tile != nullptr) return tile(w, x, panel, row0, y, ld_y);
#endif
  tile_scalar(w, x, panel, row0, rows, y, ld_y);
}

// How matmul_rows and matmul_tiled split a product. Threads split the panels; a thread's share is at
// least ~256 block-rows of work, so the small products of a decoding step (a few dozen panels) still
// split in two but never into slivers. A long prefill's rows go a chunk at a time, a thread's panels all
// passing over one chunk while its activations stay in L2 (the whole prefill's rows would be re-read
// from L3 for each panel).
struct Split {
  int64_t chunk, grain;  // rows a chunk (whole tiles of 16), panels at least a thread
};

Split split_of(const Weights& w, const Rows& x) {
  const int64_t row_bytes = w.blocks * kBlock * (w.floats() ? 4 : kPasses);
  return {std::max<int64_t>(kWideTile, kRowBytes / row_bytes / kWideTile * kWideTile),
          std::max<int64_t>(1, 256 / std::max<int64_t>(1, w.blocks * x.count))};
}

#if GLASSLM_X86
// The AVX-512 wide tile of these weights (null where the format has no vector path).
TileFn wide_tile_of(const Weights& w) { return pick_tile<Avx512Tile>(w, kWideTile); }

// A long prefill whose rows are stored tiled (qlinear_parts, on AVX-512): every 16 rows through the
// wide tile, the last tile's rows past x.count zeros, multiplied and never stored; a chunk of rows at a
// time, as matmul_rows goes.
void matmul_tiled(const Weights& w, const Rows& x, float* y, int64_t ld_y) {
  const TileFn wide = wide_tile_of(w);
  const Split split = split_of(w, x);
  const int64_t chunk = split.chunk, grain = split.grain;
  std::vector<int32_t> half_starts;
  Rows summed = x;
  if (w.halves()) {
    const int64_t stored = (x.count + kWideTile - 1) / kWideTile * kWideTile;
    half_starts.assign(2 * stored * x.blocks, 0);
    for (int64_t row = 0; row < x.count; ++row) {
      for (int64_t b = 0; b < x.blocks; ++b) {
        half_starts_at(x, [&](int64_t r, int pass, int64_t block) { return x.tile_at(r, pass, block); }, row, b, w.offset,
                       half_starts.data() + 2 * (row * x.blocks + b));
      }
    }
    summed.half_starts = half_starts.data();
  }
  at::parallel_for(0, w.panels, grain, [&](int64_t begin, int64_t end) {
    for (int64_t first = 0; first < x.count; first += chunk) {
      const int64_t last = std::min(x.count, first + chunk);
      for (int64_t panel = begin; panel < end; ++panel) {
        for (int64_t row0 = first; row0 < last; row0 += kWideTile) wide(w, summed, panel, row0, y, ld_y);
      }
    }
  });
}
#endif

// What every panel's tiles would otherwise compute again from the same rows, made once per product.
struct ProductTables {
  std::vector<int32_t> half_starts;
  std::vector<int16_t> joined;
};

Rows with_product_tables(const Weights& w, const Rows& x, int64_t isa, ProductTables& tables) {
  Rows summed = x;
#if GLASSLM_X86
  // Half-block starts (8-bit weights take no offset on the AVX2 path: half-block groups of them would not
  // use the table); on AVX2 for every product: a decoding step's tiles would otherwise sum each half
  // block again for every panel.
  if (w.halves() && w.bits < 8 && isa != kScalar && (x.count >= kWideTile || isa == kAvx2) && x.half_starts == nullptr) {
    tables.half_starts.resize(2 * x.count * x.blocks);
    for (int64_t row = 0; row < x.count; ++row) {
      for (int64_t b = 0; b < x.blocks; ++b) half_starts_of(x, row, b, w.offset, tables.half_starts.data() + 2 * (row * x.blocks + b));
    }
    summed.half_starts = tables.half_starts.data();
  }
  if (w.bits == 8 && !w.halves() && w.mins == nullptr && isa == kAvx2 && x.passes == kPasses && !x.tiled) {
    tables.joined.resize(x.count * x.blocks * kBlock);
    for (int64_t row = 0; row < x.count; ++row) {
      for (int64_t b = 0; b < x.blocks; ++b) joined_block16(x, row, b, tables.joined.data() + (row * x.blocks + b) * kBlock);
    }
    summed.joined = tables.joined.data();
  }
#endif
  return summed;
}

// y (rows of ld_y floats; this matrix's outputs in their first d_out columns) = x @ W.T.
void matmul_rows(const Weights& w, const Rows& x, float* y, int64_t ld_y) {
#if GLASSLM_X86
  if (x.tiled && !w.floats()) return matmul_tiled(w, x, y, ld_y);
#endif
  const int64_t isa = current_isa();
  const Split split = split_of(w, x);  // (on AVX-512, sixteen rows share each unpacking of a block's levels)
  const int64_t chunk = split.chunk, grain = split.grain;
  const int wide = isa == kAvx512 && !w.floats() ? kWideTile : kTile;  // (float tiles keep four rows)
  ProductTables tables;
  const Rows summed = with_product_tables(w, x, isa, tables);
  at::parallel_for(0, w.panels, grain, [&](int64_t begin, int64_t end) {
    for (int64_t first = 0; first < x.count; first += chunk) {  // (each thread: its panels over one chunk, then the next)
      const int64_t last = std::min(x.count, first + chunk);
      for (int64_t panel = begin; panel < end; ++panel) {
        for (int64_t row0 = first; row0 < last;) {
          const int rows = last - row0 >= wide ? wide : static_cast<int>(std::min<int64_t>(kTile, last - row0));
          run_tile(w, summed, panel, row0, rows, y, ld_y, isa);
          row0 += rows;
        }
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

// The same with 8 lanes (AVX2): round and clamp as round16_avx512, the block's 32 levels packed to bytes
// in their order (the int16 and int8 packs interleave 128-bit lanes; the permute undoes it).
GLASSLM_AVX2 void round32_avx2(const __m256* x, __m256 inverse, int8_t* q, __m256i* levels) {
  for (int i = 0; i < 4; ++i) {
    const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], inverse));
    levels[i] = _mm256_min_epi32(_mm256_max_epi32(v, _mm256_set1_epi32(-127)), _mm256_set1_epi32(127));
  }
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(levels[0], levels[1]), _mm256_packs_epi32(levels[2], levels[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

GLASSLM_AVX2 int32_t sum32_avx2(const __m256i* levels) {
  const __m256i v = _mm256_add_epi32(_mm256_add_epi32(levels[0], levels[1]), _mm256_add_epi32(levels[2], levels[3]));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
}

// quantize_block on AVX2, the same float operations (the plain loop's nearbyint is a library call an
// input: ~8% of a SmolLM2 prefill on a Zen 3).
GLASSLM_AVX2 void quantize_block_avx2(const float* x, int64_t first, int64_t second, int8_t* q, float* d, int32_t* sums) {
  __m256 v[4], left[4];
  __m256 amax = _mm256_setzero_ps();
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(_mm256_and_ps(v[i], magnitude), amax);
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  const float scale = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m))) / 127.0f;
  const float inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
  __m256i levels[4], rest[4];
  round32_avx2(v, _mm256_set1_ps(inverse), q + first * kBlock, levels);
  for (int i = 0; i < 4; ++i) left[i] = _mm256_sub_ps(v[i], _mm256_mul_ps(_mm256_cvtepi32_ps(levels[i]), _mm256_set1_ps(scale)));
  round32_avx2(left, _mm256_set1_ps(inverse * 256.0f), q + second * kBlock, rest);
  sums[first] = sum32_avx2(levels), sums[second] = sum32_avx2(rest);
  d[first] = scale;
  d[second] = scale * kSecondStep;
}
#endif

// x's rows into the int8 blocks `layout` says where (its q, d and sums are where they go; `tiled` or not).
void quantize_into(const float* x, int64_t rows, int64_t width, const Rows& layout) {
  const int64_t blocks = width / kBlock;
  const int64_t isa = current_isa();
  int8_t* q = const_cast<int8_t*>(layout.q);
  float* d = const_cast<float*>(layout.d);
  int32_t* sums = const_cast<int32_t*>(layout.sums);
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / width), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t first = layout.stored_at(row, 0, b), second = layout.stored_at(row, 1, b);
#if GLASSLM_X86
        if (isa == kAvx512) {
          quantize_block_avx512(x + row * width + b * kBlock, first, second, q, d, sums);
          continue;
        }
        if (isa == kAvx2) {
          quantize_block_avx2(x + row * width + b * kBlock, first, second, q, d, sums);
          continue;
        }
#endif
        quantize_block(x + row * width + b * kBlock, first, second, q, d, sums);
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
  quantize_into(rows.const_data_ptr<float>(), count, width, out.rows());
  return out;
}

// (q, d, sums) of x's rows: row r of x is rows 2r and 2r + 1.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x) {
  Activations a = quantized(x);
  return {a.q, a.d, a.sums};
}

// A matrix's operands as the ops take them (qmatmul.py's PackedMatrix.operands()).
struct Operands {
  const at::Tensor& levels;
  const std::optional<at::Tensor>& scales;
  const std::optional<at::Tensor>& mins;
  const std::optional<at::Tensor>& super_scales;
  const std::optional<at::Tensor>& super_mins;
  int64_t bits, offset, group_size, super_groups, d_out;
  const std::optional<at::Tensor>& row_scale;
  const std::optional<at::Tensor>& bias;
};

int scale_kind_of(const Operands& m) {
  TORCH_CHECK(m.scales, "glasslm_kernels: quantized weights need their scales");
  const at::ScalarType type = m.scales->scalar_type();
  if (m.super_scales) {
    TORCH_CHECK(type == at::kByte || type == at::kChar, "glasslm_kernels: sub-scales must be uint8 or int8, got ", type);
    return type == at::kByte ? kSubU8 : kSubI8;
  }
  TORCH_CHECK(type == at::kHalf || type == at::kBFloat16, "glasslm_kernels: scales must be fp16 or bf16, got ", type);
  return type == at::kHalf ? kHalf : kBf16;
}

void check_laid_out(const at::Tensor& t, at::ScalarType type, at::IntArrayRef sizes, const char* what) {
  TORCH_CHECK(t.scalar_type() == type && t.is_contiguous() && t.sizes() == sizes, "glasslm_kernels: ", what,
              " must be contiguous ", type, " ", sizes, ", got ", t.scalar_type(), " ", t.sizes());
}

void check_vectors(const Operands& m) {
  for (const auto* vector : {&m.row_scale, &m.bias}) {
    if (*vector) {
      TORCH_CHECK((*vector)->scalar_type() == at::kFloat && (*vector)->is_contiguous() && (*vector)->numel() == m.d_out,
                  "glasslm_kernels: row scales and bias must be contiguous float32 of d_out values");
    }
  }
}

// Float weights: the (d_out, d_in) fp16, bf16 (16 bits) or float32 (32 bits) matrix itself (qmatmul.py's
// pack_floats), no scales.
Weights weights_float_of(const Operands& m) {
  const at::ScalarType type = m.levels.scalar_type();
  const bool wide = m.bits == 32;
  TORCH_CHECK((wide ? type == at::kFloat : (type == at::kHalf || type == at::kBFloat16)) && m.levels.dim() == 2 &&
                  m.levels.is_contiguous() && m.levels.size(0) == m.d_out && m.levels.size(1) % kBlock == 0,
              "glasslm_kernels: ", m.bits, "-bit weights must be a contiguous ", wide ? "float32" : "fp16 or bf16",
              " (d_out = ", m.d_out, ", d_in a multiple of 32) matrix, got ", type, " ", m.levels.sizes());
  TORCH_CHECK(!m.scales && !m.mins && !m.super_scales && !m.super_mins, "glasslm_kernels: float weights take no scales");
  check_vectors(m);
  Weights w{};
  w.levels = static_cast<const uint8_t*>(m.levels.const_data_ptr());
  w.bits = static_cast<int>(m.bits), w.scale_kind = wide ? kFloat : type == at::kHalf ? kHalf : kBf16;
  w.blocks = m.levels.size(1) / kBlock, w.panels = (m.d_out + kPanel - 1) / kPanel, w.d_out = m.d_out;
  w.group_size = w.blocks * kBlock;
  w.row_scale = m.row_scale ? m.row_scale->const_data_ptr<float>() : nullptr;
  w.bias = m.bias ? m.bias->const_data_ptr<float>() : nullptr;
  return w;
}

Weights weights_of(const Operands& m) {
  const int64_t bits = m.bits;
  if (bits == 16 || bits == 32) return weights_float_of(m);
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "glasslm_kernels: weights have 4, 5, 6, 8, 16 or 32 bits, got ",
              bits);
  Weights w{};
  w.bits = static_cast<int>(bits);
  TORCH_CHECK(m.levels.scalar_type() == at::kByte && m.levels.dim() == 3 && m.levels.is_contiguous() &&
                  m.levels.size(2) == w.panel_block_bytes(),
              "glasslm_kernels: packed levels must be contiguous uint8 (panels, blocks, ", w.panel_block_bytes(), "), got ",
              m.levels.scalar_type(), " ", m.levels.sizes());
  const int64_t panels = m.levels.size(0), blocks = m.levels.size(1);
  TORCH_CHECK(m.group_size == kBlock / 2 || (m.group_size >= kBlock && m.group_size % kBlock == 0),
              "glasslm_kernels: a group is 16 inputs or whole blocks of 32, got ", m.group_size);
  w.group_size = m.group_size;
  const int64_t groups = m.group_size == kBlock / 2 ? 2 * blocks : (blocks + w.group_blocks() - 1) / w.group_blocks();
  w.scale_kind = scale_kind_of(m);
  check_laid_out(*m.scales, m.scales->scalar_type(), {panels, groups, kPanel}, "scales");
  if (m.mins) check_laid_out(*m.mins, m.scales->scalar_type(), {panels, groups, kPanel}, "mins (as the scales)");
  if (m.super_scales) {
    TORCH_CHECK(m.super_groups > 0 && groups % m.super_groups == 0 && (m.super_groups * m.group_size) % kBlock == 0,
                "glasslm_kernels: ", groups, " groups do not make whole super-blocks of ", m.super_groups);
    check_laid_out(*m.super_scales, at::kHalf, {panels, groups / m.super_groups, kPanel}, "super-scales");
    TORCH_CHECK(!m.mins || m.super_mins, "glasslm_kernels: sub-minimums need super-minimums");
    if (m.super_mins) check_laid_out(*m.super_mins, at::kHalf, {panels, groups / m.super_groups, kPanel}, "super-minimums");
  }
  TORCH_CHECK(m.d_out > (panels - 1) * kPanel && m.d_out <= panels * kPanel, "glasslm_kernels: d_out ", m.d_out,
              " does not fit ", panels, " panels of 16 rows");
  check_vectors(m);
  w.levels = m.levels.const_data_ptr<uint8_t>();
  w.scales = m.scales->const_data_ptr();
  w.mins = m.mins ? m.mins->const_data_ptr() : nullptr;
  w.super_scales = m.super_scales ? reinterpret_cast<const uint16_t*>(m.super_scales->const_data_ptr()) : nullptr;
  w.super_mins = m.super_mins && m.mins ? reinterpret_cast<const uint16_t*>(m.super_mins->const_data_ptr()) : nullptr;
  w.blocks = blocks, w.groups = groups, w.super_groups = m.super_scales ? m.super_groups : 0;
  w.panels = panels, w.d_out = m.d_out, w.offset = static_cast<int>(m.offset);
  w.row_scale = m.row_scale ? m.row_scale->const_data_ptr<float>() : nullptr;
  w.bias = m.bias ? m.bias->const_data_ptr<float>() : nullptr;
  return w;
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
                   const at::Tensor& levels, const std::optional<at::Tensor>& scales, const std::optional<at::Tensor>& mins,
                   const std::optional<at::Tensor>& super_scales, const std::optional<at::Tensor>& super_mins, int64_t bits,
                   int64_t offset, int64_t group_size, int64_t super_groups, int64_t d_out,
                   const std::optional<at::Tensor>& row_scale, const std::optional<at::Tensor>& bias) {
  const Weights w = weights_of({levels, scales, mins, super_scales, super_mins, bits, offset, group_size, super_groups, d_out,
                                row_scale, bias});
  TORCH_CHECK(!w.floats(), "glasslm_kernels: qmatmul takes quantized weights; float ones take float rows (qlinear)");
  const Activations a = given_rows(q, d, sums, passes, w.blocks);
  const Rows x = a.rows();
  at::Tensor y = at::empty({x.count, d_out}, q.options().dtype(at::kFloat));
  matmul_rows(w, x, y.mutable_data_ptr<float>(), d_out);
  return y;
}

// Whether a long prefill's rows are stored tiled for these weights: on AVX-512, where every quantized
// one has a wide tile.
bool wide_tiles(const std::vector<const Weights*>& parts) {
#if GLASSLM_X86
  if (current_isa() != kAvx512) return false;
  return std::all_of(parts.begin(), parts.end(), [](const Weights* w) { return w->floats() || wide_tile_of(*w) != nullptr; });
#else
  return false;
#endif
}

// The last tile's rows past x.count as zeros (levels, scales and sums), for the wide tile to multiply.
void zero_last_tile(const Rows& x) {
  const int64_t start = x.tile_at(x.count / kWideTile * kWideTile, 0, 0), size = kPasses * x.blocks * kWideTile;
  std::memset(const_cast<int8_t*>(x.q) + start * kBlock, 0, size * kBlock);
  std::memset(const_cast<float*>(x.d) + start, 0, size * sizeof(float));
  std::memset(const_cast<int32_t*>(x.sums) + start, 0, size * sizeof(int32_t));
}

// x's rows quantized into this thread's scratch, then multiplied by each matrix of `parts` in turn,
// their outputs side by side (a row split's parts: one quantization of x for all of them): `qlinear`
// after its checks of the weights, which block.cpp makes once per matrix (a decoding step's ~50
// products then allocate only their outputs).
at::Tensor qlinear_parts(const at::Tensor& x, const std::vector<const Weights*>& parts, int64_t passes) {
  TORCH_CHECK(passes == 1 || passes == kPasses, "glasslm_kernels: activations take 1 or 2 passes, got ", passes);
  check_rows(x);
  const Weights& first = *parts.front();
  int64_t d_out = 0;
  for (const Weights* w : parts) {
    TORCH_CHECK(x.size(-1) == w->blocks * kBlock, "glasslm_kernels: input width ", x.size(-1), " is not the weight's ",
                w->blocks * kBlock);
    d_out += w->d_out;
  }
  const at::Tensor rows = x.contiguous();
  const int64_t width = x.size(-1), count = rows.numel() / width;
  const bool quantized = std::any_of(parts.begin(), parts.end(), [](const Weights* w) { return !w->floats(); });
  // Kept between calls for decoding's few rows; a long prefill's rows get their own tensors, freed after
  // (and never zeroed: quantize_into writes every byte).
  thread_local std::vector<int8_t> kept_q;
  thread_local std::vector<float> kept_d;
  thread_local std::vector<int32_t> kept_sums;
  Activations own;
  Rows act{nullptr, nullptr, nullptr, count, first.blocks, rows.const_data_ptr<float>(), static_cast<int>(passes)};
  act.tiled = quantized && count >= kTiledRows && wide_tiles(parts);
  const int64_t stored = act.tiled ? (count + kWideTile - 1) / kWideTile * kWideTile : count;  // (whole tiles)
  if (!quantized) {
    // float weights read the float rows
  } else if (stored * width <= kKeptScratch) {
    kept_q.resize(kPasses * stored * width);
    kept_d.resize(kPasses * stored * first.blocks);
    kept_sums.resize(kPasses * stored * first.blocks);
    act.q = kept_q.data(), act.d = kept_d.data(), act.sums = kept_sums.data();
  } else {
    own = Activations{at::empty({kPasses * stored, width}, rows.options().dtype(at::kChar)),
                      at::empty({kPasses * stored, first.blocks}, rows.options()),
                      at::empty({kPasses * stored, first.blocks}, rows.options().dtype(at::kInt))};
    act.q = own.q.const_data_ptr<int8_t>(), act.d = own.d.const_data_ptr<float>(), act.sums = own.sums.const_data_ptr<int32_t>();
  }
  if (act.tiled && stored > count) zero_last_tile(act);
  if (quantized) quantize_into(rows.const_data_ptr<float>(), count, width, act);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = d_out;
  at::Tensor y = at::empty(shape, x.options());
  int64_t column = 0;
  for (const Weights* w : parts) {
    matmul_rows(*w, act, y.mutable_data_ptr<float>() + column, d_out);
    column += w->d_out;
  }
  return y;
}

// (block.cpp's calls: both passes.)
at::Tensor qlinear_parts(const at::Tensor& x, const std::vector<const Weights*>& parts) {
  return qlinear_parts(x, parts, kPasses);
}

at::Tensor qlinear_checked(const at::Tensor& x, const Weights& w, int64_t passes) { return qlinear_parts(x, {&w}, passes); }

// Row `row` of the matrix the weights stand for, as float32 (exactly ggml's dequantized values: every
// product of a level and a scale is exact, so (level - offset) * scale + min rounds once, at the add).
void row_values(const Weights& w, int64_t row, float* out) {
  const int64_t panel = row / kPanel, width = w.blocks * kBlock;
  const int lane = static_cast<int>(row % kPanel);
  if (w.floats()) {  // (its own row of the matrix)
    const uint8_t* p = w.levels + row * width * (w.bits / 8);
    for (int64_t i = 0; i < width; ++i) out[i] = float_weight(p, w.scale_kind, i);
  } else {
    for (int64_t b = 0; b < w.blocks; ++b) {
      const uint8_t* block = w.levels + (panel * w.blocks + b) * w.panel_block_bytes();
      for (int i = 0; i < kBlock; ++i) {
        const int64_t group = w.halves() ? 2 * b + i / (kBlock / 2) : b / w.group_blocks();
        const float q = static_cast<float>(level_at(block, w.bits, i / 4, lane, i % 4) - w.offset);
        const float value = q * w.group_value(panel, group, lane, false);
        out[b * kBlock + i] = w.mins != nullptr ? value + w.group_value(panel, group, lane, true) : value;
      }
    }
  }
  if (w.row_scale != nullptr) {
    for (int64_t i = 0; i < width; ++i) out[i] *= w.row_scale[row];
  }
}

// Rows `ids` of the matrix (an embedding table looked up in its packed form): (len(ids), d_in) float32.
at::Tensor lookup_rows(const at::Tensor& ids, const at::Tensor& levels, const std::optional<at::Tensor>& scales,
                           const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& super_scales,
                           const std::optional<at::Tensor>& super_mins, int64_t bits, int64_t offset, int64_t group_size,
                           int64_t super_groups, int64_t d_out, const std::optional<at::Tensor>& row_scale) {
  const Weights w = weights_of({levels, scales, mins, super_scales, super_mins, bits, offset, group_size, super_groups,
                                d_out, row_scale, std::nullopt});
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "glasslm_kernels: row ids must be a 1-D int64 tensor");
  const at::Tensor rows = ids.contiguous();
  const int64_t* id = rows.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.numel(); ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < d_out, "glasslm_kernels: row id ", id[i], " is outside the matrix's ", d_out, " rows");
  }
  at::Tensor out = at::empty({rows.numel(), w.blocks * kBlock}, levels.options().dtype(at::kFloat));
  float* dst = out.mutable_data_ptr<float>();
  at::parallel_for(0, rows.numel(), 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) row_values(w, id[i], dst + i * w.blocks * kBlock);
  });
  return out;
}

// The checked operands of one matrix, kept by block.cpp (which holds the tensors they point into).
std::shared_ptr<const Weights> checked_weights(const at::Tensor& levels, const std::optional<at::Tensor>& scales,
                                               const std::optional<at::Tensor>& mins,
                                               const std::optional<at::Tensor>& super_scales,
                                               const std::optional<at::Tensor>& super_mins, int64_t bits, int64_t offset,
                                               int64_t group_size, int64_t super_groups, int64_t d_out,
                                               const std::optional<at::Tensor>& row_scale,
                                               const std::optional<at::Tensor>& bias) {
  return std::make_shared<const Weights>(weights_of(
      {levels, scales, mins, super_scales, super_mins, bits, offset, group_size, super_groups, d_out, row_scale, bias}));
}

// quantize_rows then qmatmul, in one call: (..., d_in) float32 -> (..., d_out) float32.
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& levels, const std::optional<at::Tensor>& scales,
                   const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& super_scales,
                   const std::optional<at::Tensor>& super_mins, int64_t bits, int64_t offset, int64_t group_size,
                   int64_t super_groups, int64_t d_out, const std::optional<at::Tensor>& row_scale,
                   const std::optional<at::Tensor>& bias, int64_t passes) {
  return qlinear_checked(x, weights_of({levels, scales, mins, super_scales, super_mins, bits, offset, group_size,
                                        super_groups, d_out, row_scale, bias}), passes);
}

// ----------------------------------------------------------------------------------------------
// Packing (pack_levels and pack(block_matrix(...)) in Python, done here for speed at load time).

// Byte 4 * lane + t of chunk k holds input 4k + t; 4-bit chunks k and k + 4 share a byte (low, high);
// bit k of byte 4 * lane + t of a high-bit plane is that bit of chunk k's level.
template <typename LevelOf>
static void pack_panel_block(int bits, int64_t lanes, LevelOf level_of, uint8_t* out) {
  std::memset(out, 0, bits == 8 ? kPanel * kBlock : kPanel * kBlock / 2 + 64 * (bits - 4));
  for (int64_t lane = 0; lane < lanes; ++lane) {
    uint8_t level[kBlock];
    for (int i = 0; i < kBlock; ++i) level[i] = static_cast<uint8_t>(level_of(lane, i));
    uint32_t quad[8];  // quad k: inputs 4k..4k+3, byte t of the word being input 4k + t (little-endian)
    std::memcpy(quad, level, kBlock);
    uint8_t* row = out + 4 * lane;  // byte t of this row's quad in each 64-byte chunk
    if (bits == 8) {
      for (int k = 0; k < 8; ++k) std::memcpy(row + 64 * k, &quad[k], 4);
      continue;
    }
    for (int k = 0; k < 4; ++k) {  // byte t: input 4k + t in the low nibble, input 4k + 16 + t in the high
      const uint32_t nibbles = (quad[k] & 0x0F0F0F0Fu) | ((quad[k + 4] & 0x0F0F0F0Fu) << 4);
      std::memcpy(row + 64 * k, &nibbles, 4);
    }
    for (int bit = 4; bit < bits; ++bit) {  // bit k of byte t: that bit of input 4k + t, all four t at once
      uint32_t plane = 0;
      for (int k = 0; k < 8; ++k) plane |= ((quad[k] >> bit) & 0x01010101u) << k;
      std::memcpy(row + 256 + 64 * (bit - 4), &plane, 4);
    }
  }
}

at::Tensor pack_levels(const at::Tensor& levels, int64_t bits) {
  TORCH_CHECK(levels.scalar_type() == at::kByte && levels.dim() == 2 && levels.size(1) % kBlock == 0 &&
                  (bits == 4 || bits == 5 || bits == 6 || bits == 8),
              "glasslm_kernels: pack_levels takes (d_out, d_in) uint8 levels, d_in a multiple of 32, and 4, 5, 6 or 8 bits");
  const at::Tensor rows = levels.contiguous();
  const int64_t d_out = rows.size(0), d_in = rows.size(1), blocks = d_in / kBlock;
  const int64_t panels = (d_out + kPanel - 1) / kPanel;
  const int64_t step = bits == 8 ? kPanel * kBlock : kPanel * kBlock / 2 + 64 * (bits - 4);
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

// ----------------------------------------------------------------------------------------------
// llama.cpp's blocks, read (the readable definitions: transforms/ggml.py) and packed in one pass.

struct GgmlFormat {
  std::string_view name;
  int inputs, bytes;         // per block of the file (a super-block of 256 for the K-quants)
  int bits, offset, group_size, scale_kind;
  bool mins, supers;
};

constexpr GgmlFormat kGgmlFormats[] = {
    {"q4_0", 32, 18, 4, 8, 32, kHalf, false, false},     {"q4_1", 32, 20, 4, 0, 32, kHalf, true, false},
    {"q5_0", 32, 22, 5, 16, 32, kHalf, false, false},    {"q5_1", 32, 24, 5, 0, 32, kHalf, true, false},
    {"q8_0", 32, 34, 8, 128, 32, kHalf, false, false},   {"q4_k", 256, 144, 4, 0, 32, kSubU8, true, true},
    {"q5_k", 256, 176, 5, 0, 32, kSubU8, true, true},    {"q6_k", 256, 210, 6, 32, 16, kSubI8, false, true},
};

static uint16_t read16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

// One file block's scales: its groups' scales and minimums (fp16 bits, or 8-bit sub-scales) and, for
// the K-quants, the super-scale d and the minimums' super-scale -dmin (the levels: direct_block).
struct DecodedBlock {
  uint16_t scales[16], mins[16];
  uint16_t super_scale, super_min;
};

// The 6-bit sub-scale and sub-minimum of group j of a Q4_K / Q5_K super-block (llama.cpp's get_scale_min_k4).
static void k_scale_min(const uint8_t* q, int j, uint16_t* scale, uint16_t* min) {
  if (j < 4) {
    *scale = q[j] & 63, *min = q[j + 4] & 63;
  } else {
    *scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

template <int K>
static void decode_small(const uint8_t* in, DecodedBlock& out) {
  constexpr GgmlFormat f = kGgmlFormats[K];
  out.scales[0] = read16(in);
  if (f.mins) out.mins[0] = read16(in + 2);  // q4_1 and q5_1 carry m after d
}

template <int K>
static void decode_k(const uint8_t* in, DecodedBlock& out) {
  constexpr GgmlFormat f = kGgmlFormats[K];
  if (f.bits == 6) {  // ql[128] qh[64] scales[16] (int8) d
    for (int g = 0; g < 16; ++g) out.scales[g] = in[192 + g];  // int8 bits
    out.super_scale = read16(in + 208);
    return;
  }
  // d dmin scales[12] (qh[32] for Q5_K) qs[128]
  out.super_scale = read16(in), out.super_min = read16(in + 2) ^ 0x8000;  // -dmin: the sign bit flipped
  for (int j = 0; j < 8; ++j) k_scale_min(in + 4, j, &out.scales[j], &out.mins[j]);
}

static const GgmlFormat& ggml_format(std::string_view qtype) {
  for (const GgmlFormat& f : kGgmlFormats) {
    if (f.name == qtype) return f;
  }
  TORCH_CHECK(false, "glasslm_kernels: pack_ggml takes q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q5_k or q6_k, not ", qtype);
}

// The packed operands of a file's rows of blocks: (levels, scales, mins?, super_scales?, super_mins?),
// and where each one's bytes are (looked up once: a tensor's accessors cost more than the bytes they guard).
struct PackedGgml {
  at::Tensor levels, scales, mins, supers, super_mins;
  uint8_t *level_bytes = nullptr, *scale_bytes = nullptr, *min_bytes = nullptr;
  uint16_t *super_values = nullptr, *super_min_values = nullptr;

  void find_bytes() {
    level_bytes = levels.mutable_data_ptr<uint8_t>();
    scale_bytes = static_cast<uint8_t*>(scales.mutable_data_ptr());
    if (mins.defined()) min_bytes = static_cast<uint8_t*>(mins.mutable_data_ptr());
    if (supers.defined()) super_values = static_cast<uint16_t*>(supers.mutable_data_ptr());
    if (super_mins.defined()) super_min_values = static_cast<uint16_t*>(super_mins.mutable_data_ptr());
  }
};

static PackedGgml empty_packed(const GgmlFormat& f, int64_t panels, int64_t d_in, const at::TensorOptions& bytes) {
  const int64_t blocks = d_in / kBlock, groups = d_in / f.group_size, supers = d_in / 256;
  const at::ScalarType scale_type = f.scale_kind == kHalf ? at::kHalf : (f.scale_kind == kSubU8 ? at::kByte : at::kChar);
  const int64_t step = f.bits == 8 ? kPanel * kBlock : kPanel * kBlock / 2 + 64 * (f.bits - 4);
  PackedGgml out{at::empty({panels, blocks, step}, bytes), at::zeros({panels, groups, kPanel}, bytes.dtype(scale_type))};
  if (f.mins) out.mins = at::zeros({panels, groups, kPanel}, bytes.dtype(scale_type));
  if (f.supers) out.supers = at::zeros({panels, supers, kPanel}, bytes.dtype(at::kHalf));
  if (f.supers && f.mins) out.super_mins = at::zeros({panels, supers, kPanel}, bytes.dtype(at::kHalf));
  out.find_bytes();
  return out;
}

// Where block b (of 32 inputs) of a file block keeps its levels' low nibbles: 16 bytes `q`, input j in
// the low nibble of q[j] and input j + 16 in the high (q4_0 ... q5_1 store exactly that), or (the
// K-quants) 32 bytes holding two blocks, input l in the low (`high_half` false) or high nibble of q[l].
struct NibbleSource {
  const uint8_t* q;
  bool k_pairs, high_half;
};

template <int K>
static NibbleSource nibbles_of(const uint8_t* block, int64_t b) {
  constexpr GgmlFormat f = kGgmlFormats[K];
  if (!f.supers) return {block + (f.mins ? 4 : 2) + (f.bits == 5 ? 4 : 0), false, false};
  if (f.bits == 6) return {block + 64 * (b / 4) + 32 * (b % 2), true, (b % 4) >= 2};  // ql: 64 bytes per 128 inputs
  return {block + (f.bits == 5 ? 48 : 16) + 32 * (b / 2), true, b % 2 == 1};       // qs after scales (and qh)
}

// Bit k of the result: bit `s` of byte k of x (each byte's bit moved to the top byte by one multiply:
// the product's terms for byte k land on bit 56 + k, the others on distinct bits, so nothing carries).
static inline uint32_t bits_of_bytes(uint64_t x, int s) {
  return static_cast<uint32_t>((((x >> s) & 0x0101010101010101ull) * 0x0102040810204080ull) >> 56);
}

// The K-quants' level bits above the nibble, as the packed planes (bit k of byte t: that bit of input
// 4k + t of a block), made once per row's super-block for all its blocks. Both formats keep them in
// 32-byte runs `qh` where bit s of qh[l] is a high bit of input l of some block (q5_k: qh[32], bit b
// the fifth bit of block b; q6_k: qh[64], bits 2m and 2m + 1 of qh[32n + l] the two high bits of
// block 4n + m), so a run's eight planes, `planes[s]` the one of bit s, are all a super-block needs.
// (run_planes_avx2 below makes the same words: the order of the bytes first, then one bit of each.)
static void run_planes(const uint8_t* qh, uint32_t planes[8]) {
  uint64_t by_t[4];  // byte k of by_t[t]: qh[4k + t]
  for (int t = 0; t < 4; ++t) {
    uint64_t x = 0;
    for (int k = 0; k < 8; ++k) x |= static_cast<uint64_t>(qh[4 * k + t]) << (8 * k);
    by_t[t] = x;
  }
  for (int s = 0; s < 8; ++s) {
    planes[s] = bits_of_bytes(by_t[0], s) | bits_of_bytes(by_t[1], s) << 8 | bits_of_bytes(by_t[2], s) << 16 |
                bits_of_bytes(by_t[3], s) << 24;
  }
}

GLASSLM_AVX2 static void run_planes_avx2(const uint8_t* qh, uint32_t planes[8]) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
  // In each 128-bit lane, bytes 4k + t to dword t (k 0-3 in the low lane, 4-7 in the high), then the
  // two lanes' dword t side by side: byte 8t + k = qh[4k + t], so the top bits of the bytes are a plane.
  const __m256i by_t = _mm256_permutevar8x32_epi32(
      _mm256_shuffle_epi8(bytes, _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                                  0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15)),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  for (int s = 0; s < 8; ++s) {  // (a word shift by 7 - s puts bit s of each byte at its top: none crosses)
    planes[s] = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_sll_epi16(by_t, _mm_cvtsi32_si128(7 - s))));
  }
}

// Every plane of one row's super-block: planes[8n + s] from run n (q5_k: one run, q6_k: two).
template <int K>
static void high_planes(const uint8_t* block, bool avx2, uint32_t planes[16]) {
  constexpr GgmlFormat f = kGgmlFormats[K];
  for (int n = 0; n < (f.bits == 6 ? 2 : 1); ++n) {
    const uint8_t* qh = f.bits == 5 ? block + 16 : block + 128 + 32 * n;
    avx2 ? run_planes_avx2(qh, planes + 8 * n) : run_planes(qh, planes + 8 * n);
  }
}

// Plane `bit` (4 or 5) of block b: bit k of byte t is that bit of input 4k + t's level (pack_panel_block's planes).
template <int K>
static uint32_t high_plane(const uint8_t* block, int64_t b, int bit, const uint32_t planes[16]) {
  constexpr GgmlFormat f = kGgmlFormats[K];
  if (!f.supers) {  // q5_0 / q5_1: one 32-bit word, bit i the fifth bit of input i
    const uint8_t* qh = block + (f.mins ? 4 : 2);
    const uint32_t bits = static_cast<uint32_t>(qh[0]) | (qh[1] << 8) | (qh[2] << 16) | (static_cast<uint32_t>(qh[3]) << 24);
    uint32_t plane = 0;
    for (int k = 0; k < 8; ++k) {  // bits 4k..4k+3 spread to bit 0 of bytes 0..3, then to bit k
      plane |= ((((bits >> (4 * k)) & 0xF) * 0x00204081u) & 0x01010101u) << k;
    }
    return plane;
  }
  return f.bits == 5 ? planes[b] : planes[8 * (b / 4) + 2 * (b % 4) + bit - 4];
}

// Block b (of 32 inputs) of one row's file block, into its row's 4 bytes of each packed chunk (`row`:
// byte 4 * lane of the panel block): what pack_panel_block makes of the levels block_fields (ggml.py)
// reads, byte for byte, formed from the file's bytes without a level decoded one at a time.
template <int K>
static void direct_block(const uint8_t* block, int64_t b, uint8_t* row, const uint32_t planes[16]) {
  constexpr GgmlFormat f = kGgmlFormats[K];
  if (f.bits == 8) {  // int8 q -> q + 128, chunk k holding inputs 4k..4k+3
    uint32_t quads[8];  // (a word at a time: each chunk's four bytes are one store)
    std::memcpy(quads, block + 2, 32);
    for (int k = 0; k < 8; ++k) {
      const uint32_t shifted = quads[k] ^ 0x80808080u;
      std::memcpy(row + 64 * k, &shifted, 4);
    }
    return;
  }
  uint8_t pairs[16];  // byte j: input j's low nibble (low) and input j + 16's (high), as chunk j / 4 wants
  const NibbleSource src = nibbles_of<K>(block, b);
  if (!src.k_pairs) {
    std::memcpy(pairs, src.q, 16);
  } else if (src.high_half) {  // (two loops, not a choice per byte: each one a few vector instructions)
    for (int j = 0; j < 16; ++j) pairs[j] = static_cast<uint8_t>((src.q[j] >> 4) | (src.q[j + 16] & 0xF0));
  } else {
    for (int j = 0; j < 16; ++j) pairs[j] = static_cast<uint8_t>((src.q[j] & 0x0F) | (src.q[j + 16] << 4));
  }
  for (int k = 0; k < 4; ++k) std::memcpy(row + 64 * k, pairs + 4 * k, 4);
  for (int bit = 4; bit < f.bits; ++bit) {
    const uint32_t plane = high_plane<K>(block, b, bit, planes);
    std::memcpy(row + 256 + 64 * (bit - 4), &plane, 4);
  }
}

// One panel's file blocks number `fb` (rows p * 16 ..): packed a row at a time (its 1-8 blocks'
// bytes land in 2-3 KB that stay in L1 while the panel's 16 rows fill them), and their scales stored.
constexpr int64_t kAhead = 2;  // file blocks: each lane's next-but-one is fetched while this one is packed
template <int K>
static void pack_file_block(const uint8_t* in, int64_t row_bytes, int64_t p, int64_t lanes, int64_t fb, int64_t d_in,
                            bool avx2, PackedGgml& out) {
  constexpr GgmlFormat f = kGgmlFormats[K];
  constexpr int64_t step = f.bits == 8 ? kPanel * kBlock : kPanel * kBlock / 2 + 64 * (f.bits - 4);
  constexpr int64_t per_block = f.inputs / kBlock, per_groups = f.inputs / f.group_size;
  const int64_t blocks = d_in / kBlock, groups = d_in / f.group_size;
  uint8_t* dst = out.level_bytes + (p * blocks + fb * per_block) * step;  // block b's at dst + b * step
  if (lanes < kPanel) std::memset(dst, 0, per_block * step);  // (rows past d_out: level 0, as pack_panel_block leaves them)
  DecodedBlock decoded[kPanel];
  const bool fetch_ahead = fb + kAhead < d_in / f.inputs;  // (a row's file blocks: d_in / f.inputs)
  for (int64_t lane = 0; lane < lanes; ++lane) {
    const uint8_t* block = in + (p * kPanel + lane) * row_bytes + fb * f.bytes;
    if (fetch_ahead) {
      for (int64_t c = 0; c < f.bytes; c += 64) __builtin_prefetch(block + kAhead * f.bytes + c);
    }
    f.supers ? decode_k<K>(block, decoded[lane]) : decode_small<K>(block, decoded[lane]);
    uint32_t planes[16];
    if constexpr (f.supers && f.bits > 4) high_planes<K>(block, avx2, planes);
    for (int64_t b = 0; b < per_block; ++b) direct_block<K>(block, b, dst + b * step + 4 * lane, planes);
  }
  const bool half = f.scale_kind == kHalf;
  for (int64_t lane = 0; lane < lanes; ++lane) {
    for (int64_t g = 0; g < per_groups; ++g) {
      const int64_t at = (p * groups + fb * per_groups + g) * kPanel + lane;
      if (half) {
        reinterpret_cast<uint16_t*>(out.scale_bytes)[at] = decoded[lane].scales[g];
        if (f.mins) reinterpret_cast<uint16_t*>(out.min_bytes)[at] = decoded[lane].mins[g];
      } else {  // 8-bit sub-scales (their bits; int8 for q6_k)
        out.scale_bytes[at] = static_cast<uint8_t>(decoded[lane].scales[g]);
        if (f.mins) out.min_bytes[at] = static_cast<uint8_t>(decoded[lane].mins[g]);
      }
    }
    if (f.supers) {
      const int64_t at = (p * (d_in / 256) + fb) * kPanel + lane;
      out.super_values[at] = decoded[lane].super_scale;
      if (f.mins) out.super_min_values[at] = decoded[lane].super_min;
    }
  }
}

template <int K>
static void pack_panels(const uint8_t* in, int64_t row_bytes, int64_t d_out, int64_t d_in, PackedGgml& out) {
  const bool avx2 = current_isa() >= kAvx2;
  const int64_t panels = (d_out + kPanel - 1) / kPanel, file_blocks = d_in / kGgmlFormats[K].inputs;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t lanes = std::min<int64_t>(kPanel, d_out - p * kPanel);
      for (int64_t fb = 0; fb < file_blocks; ++fb) pack_file_block<K>(in, row_bytes, p, lanes, fb, d_in, avx2, out);
    }
  });
}

std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>, std::optional<at::Tensor>>
pack_ggml(const at::Tensor& blocks, std::string_view qtype) {
  const GgmlFormat& f = ggml_format(qtype);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.size(1) % f.bytes == 0,
              "glasslm_kernels: ", qtype, " blocks must be (rows, n_blocks * ", f.bytes, ") uint8");
  const at::Tensor rows = blocks.contiguous();
  const int64_t d_out = rows.size(0), row_bytes = rows.size(1), file_blocks = row_bytes / f.bytes;
  const int64_t d_in = file_blocks * f.inputs, panels = (d_out + kPanel - 1) / kPanel;
  PackedGgml out = empty_packed(f, panels, d_in, rows.options());
  const uint8_t* in = rows.const_data_ptr<uint8_t>();
  switch (&f - kGgmlFormats) {  // one instance per format: its layout's numbers are constants in the loops
    case 0: pack_panels<0>(in, row_bytes, d_out, d_in, out); break;
    case 1: pack_panels<1>(in, row_bytes, d_out, d_in, out); break;
    case 2: pack_panels<2>(in, row_bytes, d_out, d_in, out); break;
    case 3: pack_panels<3>(in, row_bytes, d_out, d_in, out); break;
    case 4: pack_panels<4>(in, row_bytes, d_out, d_in, out); break;
    case 5: pack_panels<5>(in, row_bytes, d_out, d_in, out); break;
    case 6: pack_panels<6>(in, row_bytes, d_out, d_in, out); break;
    default: pack_panels<7>(in, row_bytes, d_out, d_in, out); break;
  }
  auto maybe = [](const at::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; };
  return {out.levels, out.scales, maybe(out.mins), maybe(out.supers), maybe(out.super_mins)};
}

TORCH_LIBRARY(glasslm_kernels, m) {
  m.def("quantize_rows(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("qmatmul(Tensor q, Tensor d, Tensor sums, int passes, Tensor levels, Tensor? scales, Tensor? mins, "
        "Tensor? super_scales, Tensor? super_mins, int bits, int offset, int group_size, int super_groups, int d_out, "
        "Tensor? row_scale, Tensor? bias) -> Tensor");
  m.def("qlinear(Tensor x, Tensor levels, Tensor? scales, Tensor? mins, Tensor? super_scales, Tensor? super_mins, "
        "int bits, int offset, int group_size, int super_groups, int d_out, Tensor? row_scale, Tensor? bias, int passes=2) -> Tensor");
  m.def("lookup_rows(Tensor ids, Tensor levels, Tensor? scales, Tensor? mins, Tensor? super_scales, "
        "Tensor? super_mins, int bits, int offset, int group_size, int super_groups, int d_out, Tensor? row_scale) -> Tensor");
  m.def("pack_levels(Tensor levels, int bits) -> Tensor");
  m.def("pack_ggml(Tensor blocks, str qtype) -> (Tensor, Tensor, Tensor?, Tensor?, Tensor?)");
  m.def("select_isa(int level) -> int", &select_isa);
  m.def("supported_isa() -> int", &supported_isa);
  m.def("current_isa() -> int", &current_isa);
}

TORCH_LIBRARY_IMPL(glasslm_kernels, CPU, m) {
  m.impl("quantize_rows", &quantize_rows);
  m.impl("qmatmul", &qmatmul);
  m.impl("qlinear", &qlinear);
  m.impl("lookup_rows", &lookup_rows);
  m.impl("pack_levels", &pack_levels);
  m.impl("pack_ggml", &pack_ggml);
}

}  // namespace glasslm_kernels
