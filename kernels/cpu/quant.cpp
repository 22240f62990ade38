// Decode reads every weight once a step, so its time is the weights' bytes: at 5 bits a
// weight (Q4_1) a step reads ~6x less than fp32. The activations are quantized to int16 per
// 32 values (scale dx; an error ~2^-15 of the block's largest, far below what flips a
// greedy token, where int8's does), so a block's products are integer sums:
//   sum_i w_i x_i = d dx sum_i q_i xq_i  + m dx sum_i xq_i
// (Q4_1, Q5_1; Q4_0, Q5_0: m = -8 d, -16 d, from d in the kernel).
//
// Sixteen output columns go together (a panel), one per 32-bit lane of a 512-bit register,
// and each lane holds 4 consecutive values of its column (a quad; 8 quads a block): the
// lanes' sums are the 16 columns' totals, scaled by their 16 d in one FMA, with no
// horizontal adds. With AVX-512 VNNI, vpdpbusd multiplies 64 unsigned bytes by 64 signed
// ones and adds each lane's 4 products into it. An int16 activation is two bytes,
//   xq = 256 hi + lo   (hi = xq >> 8 signed, lo = xq & 255 unsigned),
// and a 4-, 5- or 6-bit q is both a valid unsigned and signed byte, so
//   sum q xq = 256 dpbusd(q, hi) + dpbusd(lo, q)
// exactly: two instructions per 64 weights, from values unpacked to bytes by one mask (and
// a shift), not widened to 16 bits. Q8_0's signed q goes in as q + 128 (q ^ 0x80) against
// hi, less 128 sum(hi). Without VNNI (AVX2), the same bytes widen to int16 and madd with xq.
//
// 4-, 5- and 6-bit values share one layout: their low 4 bits as nibbles, quads j and j + 4
// in the low and high nibbles of one register's bytes (unpacked by a mask, or a shift and
// a mask), then the bits above (5-bit: 1, 6-bit: 2 a value), laid out so that one shift and
// mask put a quad's above its nibbles.
//
// K-quants keep their superblocks' integer sub-block scales as integers (a byte each) and
// apply them per activation block, in fp32 with that block's dx:
//   Q4_K, sub-block j (32 weights, one activation block):
//     sum w x = (d s_j) dx sum q xq - (dmin m_j) dx sum xq
//   Q6_K, an activation block's two 16-weight sub-blocks A (values 0-15: quads 0-3) and B
//   (values 16-31: quads 4-7), summed apart anyway:
//     sum w x = d dx (s_A (sum_A q xq - 32 sum_A xq) + s_B (sum_B q xq - 32 sum_B xq))
//   sum_A xq is kept from quantizing x. The integer totals stay far inside int32 (16 * 63 *
//   32767 < 2^25); the scales multiply in fp32, as s (q - 32) xq over 32 values could pass
//   2^31.
#include "quant.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "matmul.h"
#include "pool.h"
#include "simd.h"

namespace {

using torch::Tensor;

constexpr int64_t QK = 32;           // activations per block; weights per 32-weight block
constexpr int64_t QK_K = 256;        // weights per K-quant superblock
constexpr int64_t SUBS = QK_K / QK;  // activation blocks per superblock (Q4_K's sub-blocks)
constexpr int64_t Q6_SUB = 16;       // weights per Q6_K sub-block scale
constexpr int64_t PANEL = 16;        // output columns packed together, a 32-bit lane each
constexpr int64_t QUAD = 4;          // a column's values in one 32-bit lane
constexpr int64_t QUADS = QK / QUAD;            // per block: 8
constexpr int64_t QUAD_BYTES = PANEL * QUAD;    // a quad of a panel: one 512-bit register
constexpr int64_t JOB_PANELS = 2;    // panels per job
constexpr int64_t JOB_ROWS = 64;     // activation rows per job: their quantized rows stay in L2
// Weight bytes requested ahead of the block being multiplied (twice matmul.cpp's 4 KB:
// a panel's bytes take fewer cycles than fp32 columns', so the same latency spans more).
constexpr int64_t PREFETCH_BYTES = 8192;

// x quantized per row and block of 32: int16 values q (for the AVX2 kernel), their bytes
// lo = q & 255 and hi = q >> 8 (VNNI's), the block's scale dx, dx * sum(q), sum(q) over
// values 0-15 and 16-31 (Q6_K's sub-blocks) and sum(hi) (Q8_0's).
struct QuantRows {
  std::vector<int16_t> q;
  std::vector<uint8_t> lo;
  std::vector<int8_t> hi;
  std::vector<float> scale, scaled_sum;
  std::vector<int32_t> half_sums, hi_sums;
  int64_t blocks;  // per row

  int64_t at(int64_t row, int64_t block) const { return row * blocks + block; }
  int64_t value(int64_t row, int64_t block) const { return at(row, block) * QK; }
};

// One block i of 32 values v into `rows`: int16 q = round(v / d) with d = max |v| / 32767,
// their bytes, and the sums.
void quantize_block(const float* v, int64_t i, QuantRows& rows) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 x[4], top = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    x[j] = _mm256_loadu_ps(v + 8 * j);
    top = _mm256_max_ps(top, _mm256_andnot_ps(sign, x[j]));
  }
  const float amax = hmax(top), d = amax / 32767.f;
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 1.f / d : 0.f);
  // packs works per 128-bit half, to 16- and 8-bit alike: a permute puts values in order
  const auto in_order = [](__m256i v) { return _mm256_permute4x64_epi64(v, 0xD8); };
  __m256i q[2];  // values 0-15, 16-31
  for (int h = 0; h < 2; ++h) {  // rounded to nearest even, as nearbyint
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(x[2 * h], inv));
    const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(x[2 * h + 1], inv));
    rows.half_sums[2 * i + h] = hsum_epi32(_mm256_add_epi32(a, b));
    q[h] = in_order(_mm256_packs_epi32(a, b));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(rows.q.data() + i * QK + 16 * h), q[h]);
  }
  const __m256i byte = _mm256_set1_epi16(255);
  const __m256i hi[2] = {_mm256_srai_epi16(q[0], 8), _mm256_srai_epi16(q[1], 8)};
  const __m256i lo = _mm256_packus_epi16(_mm256_and_si256(q[0], byte), _mm256_and_si256(q[1], byte));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(rows.lo.data() + i * QK), in_order(lo));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(rows.hi.data() + i * QK),
                      in_order(_mm256_packs_epi16(hi[0], hi[1])));
  const __m256i ones = _mm256_set1_epi16(1);
  rows.hi_sums[i] = hsum_epi32(
      _mm256_add_epi32(_mm256_madd_epi16(hi[0], ones), _mm256_madd_epi16(hi[1], ones)));
  rows.scale[i] = d;
  rows.scaled_sum[i] = d * static_cast<float>(rows.half_sums[2 * i] + rows.half_sums[2 * i + 1]);
}

QuantRows quantize_rows(const float* x, int64_t rows, int64_t k) {
  const int64_t blocks = k / QK, n = rows * blocks;
  QuantRows out{std::vector<int16_t>(rows * k), std::vector<uint8_t>(rows * k),
                std::vector<int8_t>(rows * k),  std::vector<float>(n),
                std::vector<float>(n),          std::vector<int32_t>(2 * n),
                std::vector<int32_t>(n),        blocks};
  parallel_jobs(rows, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * blocks; i < end * blocks; ++i) quantize_block(x + i * QK, i, out);
  });
  return out;
}

constexpr bool k_quant(int64_t type) { return type == GGML_Q4_K || type == GGML_Q6_K; }
constexpr int64_t block_weights(int64_t type) { return k_quant(type) ? QK_K : QK; }
// Bits of a 4-, 5- or 6-bit value above its low nibble.
constexpr int high_bits(int64_t type) {
  return type == GGML_Q5_0 || type == GGML_Q5_1 ? 1 : type == GGML_Q6_K ? 2 : 0;
}
// A block's offset m is in the file (Q4_1, Q5_1), or -centre * d (Q4_0, Q5_0).
constexpr bool stored_offset(int64_t type) { return type == GGML_Q4_1 || type == GGML_Q5_1; }
// The q of a zero weight in the symmetric types: w = d (q - centre).
constexpr int centre(int64_t type) {
  return type == GGML_Q4_0 ? 8 : type == GGML_Q5_0 ? 16 : type == GGML_Q6_K ? 32 : 0;
}

// GGUF's block.
constexpr int64_t gguf_bytes(int64_t type) {
  switch (type) {
    case GGML_Q8_0: return 2 + QK;          // d, int8 q
    case GGML_Q4_0: return 2 + QK / 2;      // d, nibbles
    case GGML_Q4_1: return 4 + QK / 2;      // d, m, nibbles
    case GGML_Q5_0: return 6 + QK / 2;      // d, 32 fifth bits, nibbles
    case GGML_Q5_1: return 8 + QK / 2;      // d, m, 32 fifth bits, nibbles
    case GGML_Q4_K: return 16 + QK_K / 2;   // d, dmin, 12 bytes of 6-bit scales, nibbles
    case GGML_Q6_K: return QK_K / 2 + QK_K / 4 + QK_K / Q6_SUB + 2;  // nibbles, 2-bit highs,
                                                                     // int8 scales, d
  }
  return 0;
}

// quant_pack's values of one 32-weight block of a panel, in 64-byte registers whose byte
// 4c + i is column c's: Q8_0, register j holds quad j (values 4j + i). Else 4 registers of
// nibbles (register r: quad r low, quad r + 4 high), then the high bits: 5-bit, one register,
// quad j's at bit j; 6-bit, two, quad j's at bits 2 (j % 4) of register j / 4.
constexpr int64_t NIBBLE_BYTES = PANEL * QK / 2;
constexpr int64_t values_bytes(int64_t type) {
  return type == GGML_Q8_0 ? PANEL * QK : NIBBLE_BYTES + PANEL * QK * high_bits(type) / 8;
}
// A K-quant superblock's scales, before its 8 blocks' values. Q4_K: 16 fp16 d, 16 fp16
// dmin, uint8 s [8 sub-blocks][16 columns], uint8 m likewise; Q6_K: 16 fp16 d, int8 s
// [16][16].
constexpr int64_t header_bytes(int64_t type) {
  return type == GGML_Q4_K   ? 4 * PANEL + 2 * SUBS * PANEL
         : type == GGML_Q6_K ? 2 * PANEL + QK_K / Q6_SUB * PANEL
                             : 0;
}
// One GGUF block of a panel's 16 columns: a 32-weight block's values, then 16 fp16 d (and
// 16 fp16 m where stored); a superblock's header, then its 8 blocks' values.
constexpr int64_t panel_bytes(int64_t type) {
  return k_quant(type) ? header_bytes(type) + SUBS * values_bytes(type)
                       : values_bytes(type) + PANEL * 2 * (stored_offset(type) ? 2 : 1);
}
// Where a block's d (and m) lie in a 32-weight type's panel block.
constexpr int64_t d_at(int64_t type) { return values_bytes(type); }
constexpr int64_t m_at(int64_t type) { return values_bytes(type) + 2 * PANEL; }
// Q4_K's per sub-block scales and mins, Q6_K's per 16 weights, in the superblock header.
constexpr int64_t Q4K_SCALES = 4 * PANEL, Q4K_MINS = Q4K_SCALES + SUBS * PANEL;
constexpr int64_t Q6K_SCALES = 2 * PANEL;
// A K-quant superblock's sub-block (activation block) j's values.
constexpr int64_t sub_values(int64_t type, int64_t j) {
  return header_bytes(type) + j * values_bytes(type);
}

uint16_t bits16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}

inline __m256i load256(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}
inline __m128i load128(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
inline __m128i load64(const void* p) {
  return _mm_loadl_epi64(static_cast<const __m128i*>(p));
}

inline __m256i shift_left(__m256i v, int bits) {  // bits < 0: right
  return bits >= 0 ? _mm256_slli_epi16(v, bits) : _mm256_srli_epi16(v, -bits);
}

// The weight lines PREFETCH_BYTES past panel block g requested.
template <int64_t Type>
inline void prefetch_ahead(const uint8_t* g) {
  for (int64_t line = 0; line < panel_bytes(Type); line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(g + PREFETCH_BYTES + line), _MM_HINT_T0);
}

// AVX2: a panel as two halves h (columns 8h .. 8h + 7), the 32 bytes of each 64-byte
// register that are theirs; their quads' bytes widen to int16 and madd with xq's pairs.

// Quad j of a block's values as bytes, column c's 4 in 32-bit lane c of half h.
template <int64_t Type>
inline __m256i quad_bytes(const uint8_t* v, int h, int j) {
  if constexpr (Type == GGML_Q8_0) {
    return load256(v + j * QUAD_BYTES + 32 * h);
  } else {
    constexpr int High = high_bits(Type);
    const __m256i raw = load256(v + (j % 4) * QUAD_BYTES + 32 * h);
    __m256i q = _mm256_and_si256(j < 4 ? raw : _mm256_srli_epi16(raw, 4), _mm256_set1_epi8(15));
    if constexpr (High > 0) {  // shifts by 16-bit lanes: what crosses a byte is masked off
      const int reg = High == 1 ? 0 : j / 4, at = High == 1 ? j : 2 * (j % 4);
      const __m256i bits = load256(v + NIBBLE_BYTES + reg * QUAD_BYTES + 32 * h);
      const __m256i mask = _mm256_set1_epi8(static_cast<char>(((1 << High) - 1) << 4));
      q = _mm256_or_si256(q, _mm256_and_si256(shift_left(bits, 4 - at), mask));
    }
    return q;
  }
}

// sum q xq of a block's half panel for R rows, column c in lane c of totals[r][part]: part
// 0 over quads 0-3 (values 0-15), 1 over quads 4-7.
template <int64_t Type, int R>
inline void half_totals(const uint8_t* v, int h, const int16_t* const xq[R],
                        __m256i totals[R][2]) {
  const auto widen = [](__m128i b) {
    return Type == GGML_Q8_0 ? _mm256_cvtepi8_epi16(b) : _mm256_cvtepu8_epi16(b);
  };
  // lanes (column, value pair): columns 0-3 of the half in low, 4-7 in high
  __m256i low[R][2], high[R][2];
  for (int j = 0; j < QUADS; ++j) {
    const __m256i q = quad_bytes<Type>(v, h, j);
    const __m256i w0 = widen(_mm256_castsi256_si128(q)), w1 = widen(_mm256_extracti128_si256(q, 1));
    for (int r = 0; r < R; ++r) {
      int64_t pair;  // xq's 4 values of quad j, in each 64 bits
      std::memcpy(&pair, xq[r] + QUAD * j, 8);
      const __m256i x = _mm256_set1_epi64x(pair);
      const __m256i a = _mm256_madd_epi16(w0, x), b = _mm256_madd_epi16(w1, x);
      __m256i &lo = low[r][j / 4], &hi = high[r][j / 4];
      lo = j % 4 ? _mm256_add_epi32(lo, a) : a;
      hi = j % 4 ? _mm256_add_epi32(hi, b) : b;
    }
  }
  for (int r = 0; r < R; ++r)
    for (int part = 0; part < 2; ++part)  // hadd: [c0 c1 c4 c5 | c2 c3 c6 c7], then in order
      totals[r][part] = _mm256_permute4x64_epi64(
          _mm256_hadd_epi32(low[r][part], high[r][part]), 0xD8);
}

inline __m256 fp16x8(const uint8_t* p) { return _mm256_cvtph_ps(load128(p)); }
inline __m256 u8x8(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(load64(p))); }
inline __m256 i8x8(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load64(p))); }
inline __m256 set8(float v) { return _mm256_set1_ps(v); }

// R rows' running sums of a half panel's 8 outputs: the scaled totals and the offset terms.
template <int R>
struct Sums {
  __m256 acc[R], off[R];
};

// A 32-weight block g, activation block a of rows row..row+R-1:
// acc += d dx sum q xq, off += m dx sum xq.
template <int64_t Type, int R>
inline void small_block(const uint8_t* g, int h, const QuantRows& x, int64_t row, int64_t a,
                        Sums<R>& s) {
  const int16_t* xq[R];
  for (int r = 0; r < R; ++r) xq[r] = x.q.data() + x.value(row + r, a);
  __m256i t[R][2];
  half_totals<Type, R>(g, h, xq, t);
  const __m256 d = fp16x8(g + d_at(Type) + 16 * h);
  const __m256 m = stored_offset(Type) ? fp16x8(g + m_at(Type) + 16 * h)
                                       : _mm256_mul_ps(d, set8(-centre(Type)));
  for (int r = 0; r < R; ++r) {
    const int64_t i = x.at(row + r, a);
    const __m256 total = _mm256_cvtepi32_ps(_mm256_add_epi32(t[r][0], t[r][1]));
    s.acc[r] = _mm256_fmadd_ps(total, _mm256_mul_ps(d, set8(x.scale[i])), s.acc[r]);
    if constexpr (Type != GGML_Q8_0)
      s.off[r] = _mm256_fmadd_ps(m, set8(x.scaled_sum[i]), s.off[r]);
  }
}

// A Q4_K superblock g, activation blocks a..a+7; per sub-block j:
// acc += d s_j dx sum q xq, off -= dmin m_j dx sum xq.
template <int R>
inline void q4k_block(const uint8_t* g, int h, const QuantRows& x, int64_t row, int64_t a,
                      Sums<R>& s) {
  const __m256 d = fp16x8(g + 16 * h), dmin = fp16x8(g + 2 * PANEL + 16 * h);
  for (int64_t j = 0; j < SUBS; ++j) {
    const int16_t* xq[R];
    for (int r = 0; r < R; ++r) xq[r] = x.q.data() + x.value(row + r, a + j);
    __m256i t[R][2];
    half_totals<GGML_Q4_K, R>(g + sub_values(GGML_Q4_K, j), h, xq, t);
    const __m256 scale = _mm256_mul_ps(d, u8x8(g + Q4K_SCALES + j * PANEL + 8 * h));
    const __m256 min = _mm256_mul_ps(dmin, u8x8(g + Q4K_MINS + j * PANEL + 8 * h));
    for (int r = 0; r < R; ++r) {
      const int64_t i = x.at(row + r, a + j);
      const __m256 total = _mm256_cvtepi32_ps(_mm256_add_epi32(t[r][0], t[r][1]));
      s.acc[r] = _mm256_fmadd_ps(total, _mm256_mul_ps(scale, set8(x.scale[i])), s.acc[r]);
      s.off[r] = _mm256_fnmadd_ps(min, set8(x.scaled_sum[i]), s.off[r]);
    }
  }
}

// A Q6_K superblock g, activation blocks a..a+7, each two sub-blocks A, B of 16 weights:
// acc += d dx (s_A (sum_A q xq - 32 sum_A xq) + s_B (sum_B q xq - 32 sum_B xq)).
template <int R>
inline void q6k_block(const uint8_t* g, int h, const QuantRows& x, int64_t row, int64_t a,
                      Sums<R>& s) {
  const __m256 d = fp16x8(g + 16 * h);
  for (int64_t j = 0; j < SUBS; ++j) {
    const int16_t* xq[R];
    for (int r = 0; r < R; ++r) xq[r] = x.q.data() + x.value(row + r, a + j);
    __m256i t[R][2];
    half_totals<GGML_Q6_K, R>(g + sub_values(GGML_Q6_K, j), h, xq, t);
    __m256 scale[2];
    for (int part = 0; part < 2; ++part)
      scale[part] = _mm256_mul_ps(d, i8x8(g + Q6K_SCALES + (2 * j + part) * PANEL + 8 * h));
    for (int r = 0; r < R; ++r) {
      const int64_t i = x.at(row + r, a + j);
      __m256 sum = _mm256_setzero_ps();
      for (int part = 0; part < 2; ++part) {
        const int32_t offset = centre(GGML_Q6_K) * x.half_sums[2 * i + part];
        const __m256i centred = _mm256_sub_epi32(t[r][part], _mm256_set1_epi32(offset));
        sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(centred), scale[part], sum);
      }
      s.acc[r] = _mm256_fmadd_ps(sum, set8(x.scale[i]), s.acc[r]);
    }
  }
}

// One panel's 16 outputs for activation rows row..row+R-1: y[r * ld + c] (no bias).
template <int64_t Type, int R>
void panel_rows(const uint8_t* panel, const QuantRows& x, int64_t row, float* y, int64_t ld) {
  constexpr int64_t step = block_weights(Type) / QK;  // activation blocks per GGUF block
  for (int h = 0; h < 2; ++h) {
    Sums<R> s;
    for (int r = 0; r < R; ++r) s.acc[r] = s.off[r] = _mm256_setzero_ps();
    const uint8_t* g = panel;
    for (int64_t a = 0; a < x.blocks; a += step, g += panel_bytes(Type)) {
      if (h == 0) prefetch_ahead<Type>(g);
      if constexpr (Type == GGML_Q4_K) q4k_block<R>(g, h, x, row, a, s);
      else if constexpr (Type == GGML_Q6_K) q6k_block<R>(g, h, x, row, a, s);
      else small_block<Type, R>(g, h, x, row, a, s);
    }
    for (int r = 0; r < R; ++r)
      _mm256_storeu_ps(y + r * ld + 8 * h, _mm256_add_ps(s.acc[r], s.off[r]));
  }
}

// With AVX-512 VNNI: a whole panel in 512-bit registers, its products by vpdpbusd.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")
namespace vnni {

inline __m512i load512(const void* p) { return _mm512_loadu_si512(p); }
inline __m512i shift_left(__m512i v, int bits) {  // bits < 0: right
  return bits >= 0 ? _mm512_slli_epi16(v, bits) : _mm512_srli_epi16(v, -bits);
}

// Quad j of a block's values as bytes, column c's 4 in 32-bit lane c, as ::quad_bytes.
template <int64_t Type>
inline __m512i quad_bytes(const uint8_t* v, int j) {
  if constexpr (Type == GGML_Q8_0) {
    return load512(v + j * QUAD_BYTES);
  } else {
    constexpr int High = high_bits(Type);
    const __m512i raw = load512(v + (j % 4) * QUAD_BYTES);
    __m512i q = _mm512_and_si512(j < 4 ? raw : _mm512_srli_epi16(raw, 4), _mm512_set1_epi8(15));
    if constexpr (High > 0) {
      const int reg = High == 1 ? 0 : j / 4, at = High == 1 ? j : 2 * (j % 4);
      const __m512i bits = load512(v + NIBBLE_BYTES + reg * QUAD_BYTES);
      const __m512i mask = _mm512_set1_epi8(static_cast<char>(((1 << High) - 1) << 4));
      q = _mm512_or_si512(q, _mm512_and_si512(shift_left(bits, 4 - at), mask));
    }
    return q;
  }
}

inline __m512i set_quad(const void* p) {  // 4 bytes at p in every 32-bit lane
  int32_t quad;
  std::memcpy(&quad, p, 4);
  return _mm512_set1_epi32(quad);
}

// sum q xq of a block's panel for R rows (their block i[r]), column c in lane c of
// totals[r][part]: part 0 over quads 0-3 (values 0-15), 1 over quads 4-7; Q8_0's in part 0
// and 1 together.
template <int64_t Type, int R>
inline void block_totals(const uint8_t* v, const QuantRows& x, const int64_t i[R],
                         __m512i totals[R][2]) {
  __m512i by_hi[R][2], by_lo[R][2];  // dpbusd(q, hi), dpbusd(lo, q)
  for (int r = 0; r < R; ++r)
    for (int part = 0; part < 2; ++part) by_hi[r][part] = by_lo[r][part] = _mm512_setzero_si512();
  for (int j = 0; j < QUADS; ++j) {
    const __m512i q = quad_bytes<Type>(v, j);
    const __m512i q_unsigned = Type == GGML_Q8_0 ? _mm512_xor_si512(q, _mm512_set1_epi8(-128)) : q;
    for (int r = 0; r < R; ++r) {
      const int64_t at = i[r] * QK + QUAD * j;
      __m512i &hi = by_hi[r][j / 4], &lo = by_lo[r][j / 4];
      hi = _mm512_dpbusd_epi32(hi, q_unsigned, set_quad(x.hi.data() + at));
      lo = _mm512_dpbusd_epi32(lo, set_quad(x.lo.data() + at), q);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int part = 0; part < 2; ++part)
      totals[r][part] = _mm512_add_epi32(_mm512_slli_epi32(by_hi[r][part], 8), by_lo[r][part]);
    if constexpr (Type == GGML_Q8_0)  // q + 128 against hi: less 128 sum(hi), times 256
      totals[r][0] = _mm512_sub_epi32(totals[r][0], _mm512_set1_epi32(32768 * x.hi_sums[i[r]]));
  }
}

inline __m512 fp16x16(const uint8_t* p) { return _mm512_cvtph_ps(load256(p)); }
inline __m512 u8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(load128(p)));
}
inline __m512 i8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load128(p)));
}
inline __m512 set16(float v) { return _mm512_set1_ps(v); }

template <int R>
struct Sums {
  __m512 acc[R], off[R];
};

template <int R>
inline void block_rows(const QuantRows& x, int64_t row, int64_t a, int64_t i[R]) {
  for (int r = 0; r < R; ++r) i[r] = x.at(row + r, a);
}

// A 32-weight block g, as ::small_block.
template <int64_t Type, int R>
inline void small_block(const uint8_t* g, const QuantRows& x, int64_t row, int64_t a,
                        Sums<R>& s) {
  int64_t i[R];
  block_rows<R>(x, row, a, i);
  __m512i t[R][2];
  block_totals<Type, R>(g, x, i, t);
  const __m512 d = fp16x16(g + d_at(Type));
  const __m512 m = stored_offset(Type) ? fp16x16(g + m_at(Type))
                                       : _mm512_mul_ps(d, set16(-centre(Type)));
  for (int r = 0; r < R; ++r) {
    const __m512 total = _mm512_cvtepi32_ps(_mm512_add_epi32(t[r][0], t[r][1]));
    s.acc[r] = _mm512_fmadd_ps(total, _mm512_mul_ps(d, set16(x.scale[i[r]])), s.acc[r]);
    if constexpr (Type != GGML_Q8_0)
      s.off[r] = _mm512_fmadd_ps(m, set16(x.scaled_sum[i[r]]), s.off[r]);
  }
}

// A Q4_K superblock, as ::q4k_block.
template <int R>
inline void q4k_block(const uint8_t* g, const QuantRows& x, int64_t row, int64_t a, Sums<R>& s) {
  const __m512 d = fp16x16(g), dmin = fp16x16(g + 2 * PANEL);
  for (int64_t j = 0; j < SUBS; ++j) {
    int64_t i[R];
    block_rows<R>(x, row, a + j, i);
    __m512i t[R][2];
    block_totals<GGML_Q4_K, R>(g + sub_values(GGML_Q4_K, j), x, i, t);
    const __m512 scale = _mm512_mul_ps(d, u8x16(g + Q4K_SCALES + j * PANEL));
    const __m512 min = _mm512_mul_ps(dmin, u8x16(g + Q4K_MINS + j * PANEL));
    for (int r = 0; r < R; ++r) {
      const __m512 total = _mm512_cvtepi32_ps(_mm512_add_epi32(t[r][0], t[r][1]));
      s.acc[r] = _mm512_fmadd_ps(total, _mm512_mul_ps(scale, set16(x.scale[i[r]])), s.acc[r]);
      s.off[r] = _mm512_fnmadd_ps(min, set16(x.scaled_sum[i[r]]), s.off[r]);
    }
  }
}

// A Q6_K superblock, as ::q6k_block.
template <int R>
inline void q6k_block(const uint8_t* g, const QuantRows& x, int64_t row, int64_t a, Sums<R>& s) {
  const __m512 d = fp16x16(g);
  for (int64_t j = 0; j < SUBS; ++j) {
    int64_t i[R];
    block_rows<R>(x, row, a + j, i);
    __m512i t[R][2];
    block_totals<GGML_Q6_K, R>(g + sub_values(GGML_Q6_K, j), x, i, t);
    __m512 scale[2];
    for (int part = 0; part < 2; ++part)
      scale[part] = _mm512_mul_ps(d, i8x16(g + Q6K_SCALES + (2 * j + part) * PANEL));
    for (int r = 0; r < R; ++r) {
      __m512 sum = _mm512_setzero_ps();
      for (int part = 0; part < 2; ++part) {
        const int32_t offset = centre(GGML_Q6_K) * x.half_sums[2 * i[r] + part];
        const __m512i centred = _mm512_sub_epi32(t[r][part], _mm512_set1_epi32(offset));
        sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(centred), scale[part], sum);
      }
      s.acc[r] = _mm512_fmadd_ps(sum, set16(x.scale[i[r]]), s.acc[r]);
    }
  }
}

// One panel's 16 outputs for rows row..row+R-1, as ::panel_rows.
template <int64_t Type, int R>
void panel_rows(const uint8_t* g, const QuantRows& x, int64_t row, float* y, int64_t ld) {
  Sums<R> s;
  for (int r = 0; r < R; ++r) s.acc[r] = s.off[r] = _mm512_setzero_ps();
  constexpr int64_t step = block_weights(Type) / QK;
  for (int64_t a = 0; a < x.blocks; a += step, g += panel_bytes(Type)) {
    prefetch_ahead<Type>(g);
    if constexpr (Type == GGML_Q4_K) q4k_block<R>(g, x, row, a, s);
    else if constexpr (Type == GGML_Q6_K) q6k_block<R>(g, x, row, a, s);
    else small_block<Type, R>(g, x, row, a, s);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ld, _mm512_add_ps(s.acc[r], s.off[r]));
}

}  // namespace vnni
#pragma GCC pop_options

const bool HAS_VNNI = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
bool use_vnni = HAS_VNNI;

// linear's jobs over a row job's `panels` panels: JOB_PANELS each.
constexpr int64_t panel_jobs(int64_t panels) { return (panels + JOB_PANELS - 1) / JOB_PANELS; }

template <int64_t Type>
void linear(const QuantRows& x, int64_t rows, const uint8_t* packed, int64_t n, const float* bias,
            const float* residual, float* y, const Reads& next) {
  const int64_t panels = (n + PANEL - 1) / PANEL;
  const int64_t stride = x.blocks * QK / block_weights(Type) * panel_bytes(Type);
  const int64_t col_jobs = panel_jobs(panels);
  const int64_t row_jobs = (rows + JOB_ROWS - 1) / JOB_ROWS;
  // passes[n - 1]: the kernel for n rows, chosen once a call
  using Pass = void (*)(const uint8_t*, const QuantRows&, int64_t, float*, int64_t);
  const Pass passes[2] = {use_vnni ? vnni::panel_rows<Type, 1> : panel_rows<Type, 1>,
                          use_vnni ? vnni::panel_rows<Type, 2> : panel_rows<Type, 2>};
  parallel_jobs(col_jobs * row_jobs, [&](int64_t begin, int64_t end) {
    alignas(64) float out[2 * PANEL];
    for (int64_t job = begin; job < end; ++job) {
      const int64_t p0 = (job % col_jobs) * JOB_PANELS, r0 = (job / col_jobs) * JOB_ROWS;
      const int64_t p1 = std::min(panels, p0 + JOB_PANELS), r1 = std::min(rows, r0 + JOB_ROWS);
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t cols = std::min(PANEL, n - p * PANEL);
        for (int64_t r = r0; r < r1; r += 2) {
          const int64_t count = std::min<int64_t>(2, r1 - r);
          passes[count - 1](packed + p * stride, x, r, out, PANEL);
          for (int64_t i = 0; i < count; ++i)
            for (int64_t c = 0; c < cols; ++c) {
              const int64_t col = p * PANEL + c;
              y[(r + i) * n + col] = out[i * PANEL + c] + (bias ? bias[col] : 0.f) +
                                     (residual ? residual[(r + i) * n + col] : 0.f);
            }
        }
      }
    }
  }, next);
}

// One GGUF block of one column, decoded: its values (unsigned; Q8_0's int8 bits), fp16 d
// and m (Q4_1, Q5_1: the offset; Q4_K: dmin), and its sub-block scales (Q4_K: 6-bit, with
// 6-bit mins; Q6_K: int8).
struct Decoded {
  uint8_t q[QK_K];
  uint16_t d, m;
  uint8_t scales[QK_K / Q6_SUB], mins[SUBS];
};

// 32 values' low nibbles as the 32-weight types hold them: value j low in byte j, j + 16 high.
void nibbles(const uint8_t* bytes, uint8_t* q) {
  for (int64_t j = 0; j < QK / 2; ++j) {
    q[j] = bytes[j] & 15;
    q[j + QK / 2] = bytes[j] >> 4;
  }
}

void decode_q4k(const uint8_t* src, Decoded& out) {
  out.d = bits16(src);
  out.m = bits16(src + 2);
  // 12 bytes: sub-blocks 0-3's scales and mins in bytes 0-3 and 4-7 (low 6 bits); 4-7's low
  // 4 bits in bytes 8-11 (scale low nibble, min high), their top 2 in bytes 0-7's top bits
  const uint8_t* s = src + 4;
  for (int j = 0; j < 4; ++j) {
    out.scales[j] = s[j] & 63;
    out.mins[j] = s[j + 4] & 63;
    out.scales[j + 4] = (s[j + 8] & 15) | (s[j] >> 6) << 4;
    out.mins[j + 4] = (s[j + 8] >> 4) | (s[j + 4] >> 6) << 4;
  }
  // 64 weights per 32 bytes: the first 32 in the low nibbles, the next 32 in the high
  const uint8_t* qs = src + 16;
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) {
      out.q[64 * c + l] = qs[32 * c + l] & 15;
      out.q[64 * c + 32 + l] = qs[32 * c + l] >> 4;
    }
}

void decode_q6k(const uint8_t* src, Decoded& out) {
  const uint8_t* ql = src;             // per 128 weights 64 bytes of low nibbles
  const uint8_t* qh = src + QK_K / 2;  // and 32 bytes of 2-bit highs
  std::memcpy(out.scales, qh + QK_K / 4, QK_K / Q6_SUB);
  out.d = bits16(qh + QK_K / 4 + QK_K / Q6_SUB);
  // weight l + 32 i of a 128: nibble of ql[l + 32 (i % 2)] (low for i < 2), bits 2i of qh[l]
  for (int h = 0; h < 2; ++h, ql += 64, qh += 32)
    for (int l = 0; l < 32; ++l)
      for (int i = 0; i < 4; ++i)
        out.q[128 * h + 32 * i + l] =
            ((ql[l + 32 * (i % 2)] >> 4 * (i / 2)) & 15) | ((qh[l] >> 2 * i) & 3) << 4;
}

template <int64_t Type>
Decoded decode(const uint8_t* src) {
  Decoded out{};
  if constexpr (Type == GGML_Q4_K) {
    decode_q4k(src, out);
  } else if constexpr (Type == GGML_Q6_K) {
    decode_q6k(src, out);
  } else {
    out.d = bits16(src);
    if constexpr (stored_offset(Type)) out.m = bits16(src + 2);
    const uint8_t* end = src + gguf_bytes(Type);
    if constexpr (Type == GGML_Q8_0) {
      std::memcpy(out.q, src + 2, QK);
    } else {
      nibbles(end - QK / 2, out.q);
      if constexpr (high_bits(Type)) {  // 32 fifth bits before the nibbles, value j's bit j
        uint32_t fifth;
        std::memcpy(&fifth, end - QK / 2 - 4, 4);
        for (int j = 0; j < QK; ++j) out.q[j] |= (fifth >> j & 1) << 4;
      }
    }
  }
  return out;
}

// Column c's 32 values q (unsigned, 4 + high bits; Q8_0: its int8 bits) of one block into
// a panel block's values, as quad_bytes reads them.
void place_values(const uint8_t* q, int64_t type, int64_t c, uint8_t* values) {
  for (int64_t j = 0; j < QUADS; ++j)
    for (int64_t i = 0; i < QUAD; ++i) {
      const uint8_t value = q[QUAD * j + i];
      const int64_t lane = QUAD * c + i;
      if (type == GGML_Q8_0) {
        values[j * QUAD_BYTES + lane] = value;
        continue;
      }
      values[j % 4 * QUAD_BYTES + lane] |= (value & 15) << (j < 4 ? 0 : 4);
      const int high = high_bits(type);
      if (high == 0) continue;
      const int64_t reg = high == 1 ? 0 : j / 4, at = high == 1 ? j : 2 * (j % 4);
      values[NIBBLE_BYTES + reg * QUAD_BYTES + lane] |= (value >> 4) << at;
    }
}

// A decoded block of column c into its panel's packed block o.
template <int64_t Type>
void place(const Decoded& b, int64_t c, uint8_t* o) {
  if constexpr (k_quant(Type)) {
    std::memcpy(o + 2 * c, &b.d, 2);
    if constexpr (Type == GGML_Q4_K) {
      std::memcpy(o + 2 * PANEL + 2 * c, &b.m, 2);
      for (int64_t j = 0; j < SUBS; ++j) {
        o[Q4K_SCALES + j * PANEL + c] = b.scales[j];
        o[Q4K_MINS + j * PANEL + c] = b.mins[j];
      }
    } else {
      for (int64_t j = 0; j < QK_K / Q6_SUB; ++j) o[Q6K_SCALES + j * PANEL + c] = b.scales[j];
    }
    for (int64_t j = 0; j < SUBS; ++j)
      place_values(b.q + j * QK, Type, c, o + sub_values(Type, j));
  } else {
    std::memcpy(o + d_at(Type) + 2 * c, &b.d, 2);
    if constexpr (stored_offset(Type)) std::memcpy(o + m_at(Type) + 2 * c, &b.m, 2);
    place_values(b.q, Type, c, o);
  }
}

template <int64_t Type>
void pack(const uint8_t* w, int64_t n, int64_t blocks, uint8_t* out) {
  const int64_t panels = (n + PANEL - 1) / PANEL, row_bytes = blocks * gguf_bytes(Type);
  parallel_jobs(panels, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* o = out + (p * blocks + b) * panel_bytes(Type);
        std::fill(o, o + panel_bytes(Type), 0);
        for (int64_t c = 0; c < std::min(PANEL, n - p * PANEL); ++c)
          place<Type>(decode<Type>(w + (p * PANEL + c) * row_bytes + b * gguf_bytes(Type)), c, o);
      }
  });
}

template <typename Fn>
auto by_type(int64_t type, Fn&& fn) {
  switch (type) {
    case GGML_Q8_0: return fn(std::integral_constant<int64_t, GGML_Q8_0>{});
    case GGML_Q4_0: return fn(std::integral_constant<int64_t, GGML_Q4_0>{});
    case GGML_Q4_1: return fn(std::integral_constant<int64_t, GGML_Q4_1>{});
    case GGML_Q5_0: return fn(std::integral_constant<int64_t, GGML_Q5_0>{});
    case GGML_Q5_1: return fn(std::integral_constant<int64_t, GGML_Q5_1>{});
    case GGML_Q4_K: return fn(std::integral_constant<int64_t, GGML_Q4_K>{});
    case GGML_Q6_K: return fn(std::integral_constant<int64_t, GGML_Q6_K>{});
  }
  TORCH_CHECK(false, "GGML block type ", type,
              " is not served (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K, BF16 are)");
  __builtin_unreachable();
}

// Blocks per row of a GGUF weight of `type`.
int64_t gguf_blocks(const Tensor& weight, int64_t type) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kUInt8 && weight.is_contiguous(),
              "a GGUF weight is contiguous uint8 [N, row bytes]");
  const int64_t bytes = quant_block_bytes(type);
  TORCH_CHECK(weight.size(1) % bytes == 0, "a row of ", weight.size(1),
              " bytes is not whole blocks of ", bytes);
  return weight.size(1) / bytes;
}

}  // namespace

int64_t quant_block_bytes(int64_t type) {
  if (type == GGML_BF16) return 2;
  return by_type(type, [](auto t) { return gguf_bytes(decltype(t)::value); });
}

Tensor quant_pack(const Tensor& weight, int64_t type) {
  if (type == GGML_BF16) {
    gguf_blocks(weight, type);
    return block_weight(weight.view(torch::kBFloat16));
  }
  const int64_t blocks = gguf_blocks(weight, type), n = weight.size(0);
  const int64_t panels = (n + PANEL - 1) / PANEL;
  return by_type(type, [&](auto t) {
    constexpr int64_t T = decltype(t)::value;
    Tensor out = huge_page_empty({panels, blocks * panel_bytes(T)}, torch::kUInt8);
    pack<T>(weight.data_ptr<uint8_t>(), n, blocks, out.data_ptr<uint8_t>());
    return out;
  });
}

Reads quant_reads(const Tensor& packed, int64_t type, int64_t rows) {
  if (type == GGML_BF16) return blocked_reads(packed, rows);
  if (rows > JOB_ROWS) return {};
  return {packed.data_ptr(), panel_jobs(packed.size(0)), JOB_PANELS * packed.size(1)};
}

bool quant_vnni(std::optional<bool> enable) {
  TORCH_CHECK(!enable.value_or(false) || HAS_VNNI, "this CPU has no AVX-512 VNNI");
  if (enable) use_vnni = *enable;
  return use_vnni;
}

Tensor quant_linear(const Tensor& x, const Tensor& packed, int64_t type, int64_t n,
                    const Tensor& bias, const std::optional<Tensor>& residual) {
  const int64_t rows = x.size(0);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat,
              "x [M, K] contiguous fp32");
  TORCH_CHECK(!residual || (residual->is_contiguous() && residual->size(0) == rows &&
                            residual->size(1) == n),
              "residual [M, N]");
  TORCH_CHECK(bias.numel() == 0 || bias.numel() == n, "bias [N]");
  Tensor y = torch::empty({rows, n}, x.options());
  quant_linear_into(x.data_ptr<float>(), rows, x.size(1), packed, type, n, data_or_null(bias),
                    residual ? residual->data_ptr<float>() : nullptr, y.data_ptr<float>());
  return y;
}

void quant_linear_into(const float* x, int64_t rows, int64_t k, const Tensor& packed,
                       int64_t type, int64_t n, const float* bias, const float* residual,
                       float* y, const Reads& next) {
  if (type == GGML_BF16)
    return blocked_linear_into(x, rows, k, packed, n, bias, residual, y, next);
  by_type(type, [&](auto t) {
    constexpr int64_t T = decltype(t)::value;
    TORCH_CHECK(k % block_weights(T) == 0, "x's K = ", k, " is not whole blocks of ",
                block_weights(T), " weights (K-quants' superblocks are 256)");
    TORCH_CHECK(packed.dim() == 2 && packed.size(0) == (n + PANEL - 1) / PANEL &&
                    packed.size(1) == k / block_weights(T) * panel_bytes(T),
                "packed weight does not match [", n, ", ", k, "]");
  });
  const QuantRows xq = quantize_rows(x, rows, k);
  by_type(type, [&](auto t) {
    linear<decltype(t)::value>(xq, rows, packed.data_ptr<uint8_t>(), n, bias, residual, y, next);
  });
}
