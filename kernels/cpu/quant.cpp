// Decode reads every weight once a step, so its time is the weights' bytes: at 5 bits a
// weight (Q4_1) a step reads ~6x less than fp32. The activations are quantized to int16 per
// 32 values (scale dx; an error ~2^-15 of the block's largest, far below what flips a
// greedy token, where int8's does), so a block's products are integer multiply-adds
// (madd: int16 pairs summed to int32):
//   sum_i w_i x_i = d dx sum_i q_i xq_i  + m dx sum_i xq_i
// (Q4_1, Q5_1; Q4_0, Q5_0: m = -8 d, -16 d, from d in the kernel). Eight output columns go
// together (quant_pack's groups), so their block totals land in the 8 lanes of one register
// by horizontal adds, and their scales d and offsets m are one fp16 load each: one FMA
// applies the eight columns' scales, one more their offsets. Each weight register is
// expanded once and multiplied with up to 2 activation rows.
//
// 4-, 5- and 6-bit values share one layout: their low 4 bits as nibbles, read by shifts and
// masks (no shuffles) into 16-bit lanes in the activations' evens-first order, then the
// bits above (5-bit: 1, 6-bit: 2 a value), laid out so that one shift and mask put them
// above the nibbles of two values at once.
//
// K-quants keep their superblocks' integer sub-block scales as integers (a byte each) and
// apply them per activation block, in fp32 with that block's dx:
//   Q4_K, sub-block j (32 weights, one activation block):
//     sum w x = (d s_j) dx sum q xq - (dmin m_j) dx sum xq
//   8 columns' d s_j: one 8-byte load, converted, times their 8 d (shared by the rows).
//   Q6_K, an activation block's two 16-weight sub-blocks A (values 0-15), B (16-31):
//     sum w x = d dx (s_A (sum_A q xq - 32 sum_A xq) + s_B (sum_B q xq - 32 sum_B xq))
//   The registers holding values 0-15 (expand's w[0], w[1]) and 16-31 (w[2], w[3]) are
//   madd'ed apart anyway, so A's and B's totals come out of the same products; sum_A xq is
//   kept from quantizing x. The integer totals stay far inside int32 (16 * 63 * 32767 <
//   2^25); the scales multiply in fp32, as s (q - 32) xq over 32 values could pass 2^31.
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
constexpr int64_t GROUP = 8;         // output columns packed together
constexpr int64_t JOB_GROUPS = 4;    // column groups per job
constexpr int64_t JOB_ROWS = 64;     // activation rows per job: their int16 rows stay in L2
// Weight bytes requested ahead of the block being multiplied (matmul.cpp's 4 KB).
constexpr int64_t PREFETCH_BYTES = 4096;

// x quantized per row and block: int16 values, the block's scale dx, dx * sum(xq), and
// sum(xq) over its values 0-15 and 16-31 (Q6_K's sub-blocks). A block's values are stored
// evens first: x0 x2 .. x30, then x1 x3 .. x31, the order in which the kernels' 16-bit lanes
// hold the weights they multiply (no shuffles there).
struct QuantRows {
  std::vector<int16_t> q;
  std::vector<float> scale, scaled_sum;
  std::vector<int32_t> half_sums;
  int64_t blocks;  // per row

  int64_t at(int64_t row, int64_t block) const { return row * blocks + block; }
  const int16_t* values(int64_t row, int64_t block) const { return q.data() + at(row, block) * QK; }
};

// 16 int16 of a and then b's (int32 lanes, |value| < 2^15) in order.
inline __m256i pack16(__m256i a, __m256i b) {
  return _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);  // packs works per half
}

// One block of 32 values v as int16 q (evens first) with scale d: q = round(v / d), d =
// max |v| / 32767; half[0], half[1]: the sums of q over values 0-15 and 16-31.
void quantize_block(const float* v, int16_t* q, float& d, int32_t half[2]) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 x[4], top = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    x[j] = _mm256_loadu_ps(v + 8 * j);
    top = _mm256_max_ps(top, _mm256_andnot_ps(sign, x[j]));
  }
  const float amax = hmax(top);
  d = amax / 32767.f;
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 1.f / d : 0.f);
  __m256i i[4];  // rounded to nearest even, as nearbyint
  for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(x[j], inv));
  half[0] = hsum_epi32(_mm256_add_epi32(i[0], i[1]));
  half[1] = hsum_epi32(_mm256_add_epi32(i[2], i[3]));
  // int16 pairs (x0, x1), (x2, x3) ..: evens are each int32 lane's low half, odds its high
  const __m256i lo = pack16(i[0], i[1]), hi = pack16(i[2], i[3]);
  const auto evens = [](__m256i w) { return _mm256_srai_epi32(_mm256_slli_epi32(w, 16), 16); };
  const auto odds = [](__m256i w) { return _mm256_srai_epi32(w, 16); };
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), pack16(evens(lo), evens(hi)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + QK / 2), pack16(odds(lo), odds(hi)));
}

QuantRows quantize_rows(const float* x, int64_t rows, int64_t k) {
  const int64_t blocks = k / QK;
  QuantRows out{std::vector<int16_t>(rows * k), std::vector<float>(rows * blocks),
                std::vector<float>(rows * blocks), std::vector<int32_t>(rows * blocks * 2),
                blocks};
  parallel_jobs(rows, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * blocks; i < end * blocks; ++i) {  // block i of all rows
      int32_t* half = out.half_sums.data() + 2 * i;
      quantize_block(x + i * QK, out.q.data() + i * QK, out.scale[i], half);
      out.scaled_sum[i] = out.scale[i] * static_cast<float>(half[0] + half[1]);
    }
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

// quant_pack's values of one 32-weight block of a group. Q8_0: 8 columns' 32 int8. Else
// 4 rows of 32 bytes of nibbles (columns p and p + 4 in row p, 16 bytes each, value j and
// j + 16 in byte j), then the high bits, high_bits registers of 32 bytes (`place_values`).
constexpr int64_t NIBBLE_BYTES = GROUP * QK / 2;
constexpr int64_t values_bytes(int64_t type) {
  return type == GGML_Q8_0 ? GROUP * QK : NIBBLE_BYTES + GROUP * QK * high_bits(type) / 8;
}
// A K-quant superblock's scales, before its 8 blocks' values. Q4_K: 8 fp16 d, 8 fp16 dmin,
// uint8 s [8 sub-blocks][8 columns], uint8 m likewise; Q6_K: 8 fp16 d, int8 s [16][8].
constexpr int64_t header_bytes(int64_t type) {
  return type == GGML_Q4_K   ? 4 * GROUP + 2 * SUBS * GROUP
         : type == GGML_Q6_K ? 2 * GROUP + QK_K / Q6_SUB * GROUP
                             : 0;
}
// One GGUF block of a group's 8 columns: a 32-weight block's values, then 8 fp16 d (and 8
// fp16 m where stored); a superblock's header, then its 8 blocks' values.
constexpr int64_t group_bytes(int64_t type) {
  return k_quant(type) ? header_bytes(type) + SUBS * values_bytes(type)
                       : values_bytes(type) + GROUP * 2 * (stored_offset(type) ? 2 : 1);
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
inline __m256 fp16x8(const uint8_t* p) { return _mm256_cvtph_ps(load128(p)); }
inline __m256 u8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(
      static_cast<const void*>(p)))));
}
inline __m256 i8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(
      static_cast<const void*>(p)))));
}

// The 8 lane sums of each of 8 columns' registers v[c], column c in lane c, reduced as
// the column pairs arrive (few registers live): pair[p] = hadd(v[2p], v[2p + 1]).
inline __m256i column_totals(const __m256i pair[4]) {
  const __m256i low = _mm256_hadd_epi32(pair[0], pair[1]);   // [c0..c3 lanes 0-3 | 4-7]
  const __m256i high = _mm256_hadd_epi32(pair[2], pair[3]);  // the same of c4..c7
  return _mm256_add_epi32(_mm256_permute2x128_si256(low, high, 0x20),
                          _mm256_permute2x128_si256(low, high, 0x31));
}

inline __m256i madd2(__m256i w0, __m256i x0, __m256i w1, __m256i x1) {
  return _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1));
}

inline __m256i shift_left(__m256i v, int bits) {  // bits < 0: right
  return bits >= 0 ? _mm256_slli_epi16(v, bits) : _mm256_srli_epi16(v, -bits);
}

// Row p (0-3) of a block's values as 16-bit lanes: w[0..3] hold values 2i, 2i + 1, 2i + 16,
// 2i + 17 of column p in lane i (0-7), of column p + 4 in lane 8 + i. A lane's nibbles are
// bytes 2i, 2i + 1 of its column (value 2i low in byte 2i, 2i + 16 high).
// 5- and 6-bit values: the High bits above each nibble are OR'ed in while two values share a
// lane (values 2i, 2i + 1 as its bytes; 2i + 16, 2i + 17), at bits 4 and 12 of a lane of the
// register of High bits that `place_values` aligned for it: one shift and mask each.
template <int High>
inline void expand(const uint8_t* values, int p, __m256i w[4]) {
  const __m256i raw = load256(values + p * QK);
  if constexpr (High == 0) {
    const __m256i nibble = _mm256_set1_epi16(0x000F);
    w[0] = _mm256_and_si256(raw, nibble);
    w[1] = _mm256_and_si256(_mm256_srli_epi16(raw, 8), nibble);
    w[2] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
    w[3] = _mm256_srli_epi16(raw, 12);
  } else {
    constexpr int ROWS = 4 / High;  // rows whose high bits share a register
    const __m256i nibbles = _mm256_set1_epi16(0x0F0F), byte = _mm256_set1_epi16(0x00FF);
    const __m256i mask = _mm256_set1_epi16(((1 << High) - 1) * 0x1010);
    const __m256i h = load256(values + NIBBLE_BYTES + p / ROWS * QK);
    const int at = 2 * High * (p % ROWS);  // row p's bits for values 2i, 2i + 1 (then 16, 17)
    const __m256i low = _mm256_or_si256(_mm256_and_si256(raw, nibbles),
                                        _mm256_and_si256(shift_left(h, 4 - at), mask));
    const __m256i high = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), nibbles),
                                         _mm256_and_si256(shift_left(h, 4 - at - High), mask));
    w[0] = _mm256_and_si256(low, byte);
    w[1] = _mm256_srli_epi16(low, 8);
    w[2] = _mm256_and_si256(high, byte);
    w[3] = _mm256_srli_epi16(high, 8);
  }
}

// sum q xq of a 4-, 5- or 6-bit block's 8 columns for R activation rows, column c in lane c
// of totals[r][part]: Parts 1, over the block; 2, over its values 0-15, then 16-31.
template <int High, int Parts, int R>
inline void block_totals(const uint8_t* values, const int16_t* const xq[R],
                         __m256i totals[R][Parts]) {
  __m256i xs[R][4];  // x0 x2 .. x14, x1 .. x15, x16 .. x30, x17 .. x31, in both halves
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j)
      xs[r][j] = _mm256_broadcastsi128_si256(load128(xq[r] + (j % 2) * 16 + (j / 2) * 8));
  __m256i halves[R][Parts][2];
  for (int p = 0; p < 4; ++p) {
    __m256i w[4];
    expand<High>(values, p, w);
    for (int r = 0; r < R; ++r) {
      // [column p's 4 partial sums | column p + 4's] over values 0-15 and over 16-31
      const __m256i low = madd2(w[0], xs[r][0], w[1], xs[r][1]);
      const __m256i high = madd2(w[2], xs[r][2], w[3], xs[r][3]);
      const __m256i v[2] = {Parts == 1 ? _mm256_add_epi32(low, high) : low, high};
      for (int part = 0; part < Parts; ++part) {
        __m256i& half = halves[r][part][p / 2];
        half = p % 2 ? _mm256_hadd_epi32(half, v[part]) : v[part];
      }
    }
  }
  for (int r = 0; r < R; ++r)  // [c0 c1 c2 c3 | c4 c5 c6 c7]
    for (int part = 0; part < Parts; ++part)
      totals[r][part] = _mm256_hadd_epi32(halves[r][part][0], halves[r][part][1]);
}

// sum q xq of a Q8_0 block's 8 columns for R activation rows, column c in lane c.
template <int R>
inline void q8_totals(const uint8_t* values, const int16_t* const xq[R], __m256i totals[R][1]) {
  // 16-bit lane i of a column's 32 bytes: values 2i (low byte) and 2i + 1
  __m256i pairs[R][4];
  for (int c = 0; c < GROUP; ++c) {
    const __m256i q = load256(values + c * QK);
    const __m256i even = _mm256_srai_epi16(_mm256_slli_epi16(q, 8), 8);
    const __m256i odd = _mm256_srai_epi16(q, 8);
    for (int r = 0; r < R; ++r) {
      const __m256i v = madd2(even, load256(xq[r]), odd, load256(xq[r] + QK / 2));
      pairs[r][c / 2] = c % 2 ? _mm256_hadd_epi32(pairs[r][c / 2], v) : v;
    }
  }
  for (int r = 0; r < R; ++r) totals[r][0] = column_totals(pairs[r]);
}

// Shared by both kernels: a block's activation rows, and what they read of a group's block g
// besides its values (8 columns' scales, column c in lane c; where the values lie).
template <int R>
inline void row_values(const QuantRows& x, int64_t row, int64_t a, const int16_t* xq[R]) {
  for (int r = 0; r < R; ++r) xq[r] = x.values(row + r, a);
}
// A 32-weight block's offsets m: in the file (Q4_1, Q5_1), or -centre d.
template <int64_t Type>
inline __m256 block_offsets(const uint8_t* g, __m256 d) {
  if constexpr (stored_offset(Type)) return fp16x8(g + values_bytes(Type) + 2 * GROUP);
  else return _mm256_mul_ps(d, _mm256_set1_ps(-centre(Type)));
}
// A K-quant superblock's sub-block (activation block) j's values.
inline const uint8_t* sub_values(int64_t type, const uint8_t* g, int64_t j) {
  return g + header_bytes(type) + j * values_bytes(type);
}
// Q4_K sub-block j's d s_j and dmin m_j, from the superblock's d and dmin (fp16x8(g),
// fp16x8(g + 2 * GROUP), converted once a superblock).
inline void q4k_scales(const uint8_t* g, __m256 d, __m256 dmin, int64_t j, __m256& scale,
                       __m256& min) {
  const uint8_t* scales = g + 4 * GROUP;
  scale = _mm256_mul_ps(d, u8x8(scales + j * GROUP));
  min = _mm256_mul_ps(dmin, u8x8(scales + (SUBS + j) * GROUP));
}
// Q6_K activation block j's two 16-weight sub-blocks' d s, from the superblock's d.
inline void q6k_scales(const uint8_t* g, __m256 d, int64_t j, __m256 scale[2]) {
  for (int half = 0; half < 2; ++half)
    scale[half] = _mm256_mul_ps(d, i8x8(g + 2 * GROUP + (2 * j + half) * GROUP));
}
// The weight lines PREFETCH_BYTES past block g requested.
template <int64_t Type>
inline void prefetch_ahead(const uint8_t* g) {
  for (int64_t line = 0; line < group_bytes(Type); line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(g + PREFETCH_BYTES + line), _MM_HINT_T0);
}

// R rows' running sums of a group's 8 outputs: the scaled totals and the offset terms.
template <int R>
struct Sums {
  __m256 acc[R], off[R];
};

// A 32-weight block g, activation block a of rows row..row+R-1:
// acc += d dx sum q xq, off += m dx sum xq.
template <int64_t Type, int R>
inline void small_block(const uint8_t* g, const QuantRows& x, int64_t row, int64_t a,
                        Sums<R>& s) {
  const int16_t* xq[R];
  row_values<R>(x, row, a, xq);
  __m256i totals[R][1];
  if constexpr (Type == GGML_Q8_0) q8_totals<R>(g, xq, totals);
  else block_totals<high_bits(Type), 1, R>(g, xq, totals);
  const __m256 d = fp16x8(g + values_bytes(Type));
  for (int r = 0; r < R; ++r) {
    const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(x.scale[x.at(row + r, a)]));
    s.acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(totals[r][0]), scale, s.acc[r]);
  }
  if constexpr (Type != GGML_Q8_0) {
    const __m256 m = block_offsets<Type>(g, d);
    for (int r = 0; r < R; ++r)
      s.off[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.scaled_sum[x.at(row + r, a)]), s.off[r]);
  }
}

// A Q4_K superblock g, activation blocks a..a+7; per sub-block j:
// acc += d s_j dx sum q xq, off -= dmin m_j dx sum xq.
template <int R>
inline void q4k_block(const uint8_t* g, const QuantRows& x, int64_t row, int64_t a, Sums<R>& s) {
  const __m256 d = fp16x8(g), dmin = fp16x8(g + 2 * GROUP);
  for (int64_t j = 0; j < SUBS; ++j) {
    const int16_t* xq[R];
    row_values<R>(x, row, a + j, xq);
    __m256i totals[R][1];
    block_totals<0, 1, R>(sub_values(GGML_Q4_K, g, j), xq, totals);
    __m256 scale, min;
    q4k_scales(g, d, dmin, j, scale, min);
    for (int r = 0; r < R; ++r) {
      const int64_t i = x.at(row + r, a + j);
      const __m256 dx_scale = _mm256_mul_ps(scale, _mm256_set1_ps(x.scale[i]));
      s.acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(totals[r][0]), dx_scale, s.acc[r]);
      s.off[r] = _mm256_fnmadd_ps(min, _mm256_set1_ps(x.scaled_sum[i]), s.off[r]);
    }
  }
}

// A Q6_K superblock g, activation blocks a..a+7, each two sub-blocks A, B of 16 weights:
// acc += d dx (s_A (sum_A q xq - 32 sum_A xq) + s_B (sum_B q xq - 32 sum_B xq)).
template <int R>
inline void q6k_block(const uint8_t* g, const QuantRows& x, int64_t row, int64_t a, Sums<R>& s) {
  const __m256 d = fp16x8(g);
  for (int64_t j = 0; j < SUBS; ++j) {
    const int16_t* xq[R];
    row_values<R>(x, row, a + j, xq);
    __m256i totals[R][2];
    block_totals<2, 2, R>(sub_values(GGML_Q6_K, g, j), xq, totals);
    __m256 scale[2];
    q6k_scales(g, d, j, scale);
    for (int r = 0; r < R; ++r) {
      const int64_t i = x.at(row + r, a + j);
      __m256 sum = _mm256_setzero_ps();
      for (int half = 0; half < 2; ++half) {
        const int32_t offset = centre(GGML_Q6_K) * x.half_sums[2 * i + half];
        const __m256i centred = _mm256_sub_epi32(totals[r][half], _mm256_set1_epi32(offset));
        sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(centred), scale[half], sum);
      }
      s.acc[r] = _mm256_fmadd_ps(sum, _mm256_set1_ps(x.scale[i]), s.acc[r]);
    }
  }
}

// One group's 8 outputs for activation rows row..row+R-1: y[r * ld + c] (no bias).
template <int64_t Type, int R>
void group_rows(const uint8_t* g, const QuantRows& x, int64_t row, float* y, int64_t ld) {
  Sums<R> s;
  for (int r = 0; r < R; ++r) s.acc[r] = s.off[r] = _mm256_setzero_ps();
  constexpr int64_t step = block_weights(Type) / QK;  // activation blocks per GGUF block
  for (int64_t a = 0; a < x.blocks; a += step, g += group_bytes(Type)) {
    prefetch_ahead<Type>(g);
    if constexpr (Type == GGML_Q4_K) q4k_block<R>(g, x, row, a, s);
    else if constexpr (Type == GGML_Q6_K) q6k_block<R>(g, x, row, a, s);
    else small_block<Type, R>(g, x, row, a, s);
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ld, _mm256_add_ps(s.acc[r], s.off[r]));
}

// With AVX-512 VNNI, vpdpwssd multiplies 32 int16 pairs and adds them into 16 int32 lanes
// in one instruction (AVX2: a madd, then an add, at half the width). A 512-bit register
// holds two packed rows of a block's values, so its 128-bit lanes hold columns p, p + 4,
// p + 1, p + 5 (Q8_0: lanes 0-1 column c, 2-3 column c + 1). The lanes' int32 partial sums
// are scaled per block in fp32 where they lie (the block's scales spread to the lanes by one
// permute), and reduced to the 8 column totals once, after the last block.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")
namespace vnni {

// The 8 values of v (lane c: column c) spread to register h's lanes of 4: (h = 0) columns
// 0, 4, 1, 5; (h = 1) 2, 6, 3, 7; Q8_0's register j: columns 2j, 2j + 1, 8 lanes each.
inline __m512 spread(__m256 v, const __m512i& lanes) {
  return _mm512_permutexvar_ps(lanes, _mm512_castps256_ps512(v));
}
inline __m512i nibble_lanes(int h) {
  return _mm512_set_epi32(2 * h + 5, 2 * h + 5, 2 * h + 5, 2 * h + 5, 2 * h + 1, 2 * h + 1,
                          2 * h + 1, 2 * h + 1, 2 * h + 4, 2 * h + 4, 2 * h + 4, 2 * h + 4,
                          2 * h, 2 * h, 2 * h, 2 * h);
}
inline __m512i q8_lanes(int j) {
  const __m256i lo = _mm256_set1_epi32(2 * j), hi = _mm256_set1_epi32(2 * j + 1);
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// Rows 2h, 2h + 1 of a block's values as `::expand` reads one row, side by side.
template <int High>
inline void expand(const uint8_t* values, int h, __m512i w[4]) {
  if constexpr (High == 0) {
    const __m512i raw = _mm512_loadu_si512(values + 2 * h * QK);
    const __m512i nibble = _mm512_set1_epi16(0x000F);
    w[0] = _mm512_and_si512(raw, nibble);
    w[1] = _mm512_and_si512(_mm512_srli_epi16(raw, 8), nibble);
    w[2] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
    w[3] = _mm512_srli_epi16(raw, 12);
  } else {
    __m256i a[4], b[4];
    ::expand<High>(values, 2 * h, a);
    ::expand<High>(values, 2 * h + 1, b);
    for (int j = 0; j < 4; ++j) w[j] = _mm512_inserti64x4(_mm512_castsi256_si512(a[j]), b[j], 1);
  }
}

inline __m512i dot(__m512i w0, __m512i x0, __m512i w1, __m512i x1) {
  return _mm512_dpwssd_epi32(_mm512_madd_epi16(w0, x0), w1, x1);
}

// A 4-, 5- or 6-bit block's lane sums for R rows: totals[r][part][h], register h's lanes;
// Parts 1: over the block; 2: over its values 0-15, then 16-31. Centred: q - Centre.
template <int High, int Parts, int Centre, int R>
inline void block_totals(const uint8_t* values, const int16_t* const xq[R],
                         __m512i totals[R][Parts][2]) {
  __m512i xs[R][4];  // as ::block_totals' xs, in all four lanes
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j)
      xs[r][j] = _mm512_broadcast_i32x4(load128(xq[r] + (j % 2) * 16 + (j / 2) * 8));
  for (int h = 0; h < 2; ++h) {
    __m512i w[4];
    expand<High>(values, h, w);
    if constexpr (Centre != 0)
      for (int j = 0; j < 4; ++j) w[j] = _mm512_sub_epi16(w[j], _mm512_set1_epi16(Centre));
    for (int r = 0; r < R; ++r) {
      const __m512i low = dot(w[0], xs[r][0], w[1], xs[r][1]);
      if constexpr (Parts == 1) {
        totals[r][0][h] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(low, w[2], xs[r][2]), w[3],
                                              xs[r][3]);
      } else {
        totals[r][0][h] = low;
        totals[r][1][h] = dot(w[2], xs[r][2], w[3], xs[r][3]);
      }
    }
  }
}

// R rows' running lane sums (4 registers: Q8_0's; 2: the others') and offset terms.
template <int R>
struct Sums {
  __m512 acc[R][4];
  __m256 off[R];
};

// acc += lane totals t (register h of a block) times the block's 8 column scales.
inline void add_scaled(__m512& acc, __m512i t, __m256 scale, const __m512i& lanes) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), spread(scale, lanes), acc);
}

// A Q8_0 block g: register j, columns 2j and 2j + 1 (16-bit lane i: values 2i, 2i + 1 as
// even and odd), times the rows' evens and odds in both halves.
template <int R>
inline void q8_block(const uint8_t* g, const QuantRows& x, int64_t row, int64_t a, Sums<R>& s) {
  __m512i even_x[R], odd_x[R];
  __m256 scale[R];
  const __m256 d = fp16x8(g + values_bytes(GGML_Q8_0));
  for (int r = 0; r < R; ++r) {
    const int16_t* xq = x.values(row + r, a);
    even_x[r] = _mm512_broadcast_i64x4(load256(xq));
    odd_x[r] = _mm512_broadcast_i64x4(load256(xq + QK / 2));
    scale[r] = _mm256_mul_ps(d, _mm256_set1_ps(x.scale[x.at(row + r, a)]));
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i q = _mm512_loadu_si512(g + 2 * j * QK);
    const __m512i even = _mm512_srai_epi16(_mm512_slli_epi16(q, 8), 8);
    const __m512i odd = _mm512_srai_epi16(q, 8);
    for (int r = 0; r < R; ++r)
      add_scaled(s.acc[r][j], dot(even, even_x[r], odd, odd_x[r]), scale[r], q8_lanes(j));
  }
}

// A 32-weight block g of the 4- and 5-bit types, as ::small_block.
template <int64_t Type, int R>
inline void small_block(const uint8_t* g, const QuantRows& x, int64_t row, int64_t a,
                        Sums<R>& s) {
  const int16_t* xq[R];
  row_values<R>(x, row, a, xq);
  __m512i totals[R][1][2];
  block_totals<high_bits(Type), 1, 0, R>(g, xq, totals);
  const __m256 d = fp16x8(g + values_bytes(Type)), m = block_offsets<Type>(g, d);
  for (int r = 0; r < R; ++r) {
    const int64_t i = x.at(row + r, a);
    const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(x.scale[i]));
    for (int h = 0; h < 2; ++h) add_scaled(s.acc[r][h], totals[r][0][h], scale, nibble_lanes(h));
    s.off[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.scaled_sum[i]), s.off[r]);
  }
}

// A Q4_K superblock, as ::q4k_block.
template <int R>
inline void q4k_block(const uint8_t* g, const QuantRows& x, int64_t row, int64_t a, Sums<R>& s) {
  const __m256 d = fp16x8(g), dmin = fp16x8(g + 2 * GROUP);
  for (int64_t j = 0; j < SUBS; ++j) {
    const int16_t* xq[R];
    row_values<R>(x, row, a + j, xq);
    __m512i totals[R][1][2];
    block_totals<0, 1, 0, R>(sub_values(GGML_Q4_K, g, j), xq, totals);
    __m256 scale, min;
    q4k_scales(g, d, dmin, j, scale, min);
    for (int r = 0; r < R; ++r) {
      const int64_t i = x.at(row + r, a + j);
      const __m256 dx_scale = _mm256_mul_ps(scale, _mm256_set1_ps(x.scale[i]));
      for (int h = 0; h < 2; ++h)
        add_scaled(s.acc[r][h], totals[r][0][h], dx_scale, nibble_lanes(h));
      s.off[r] = _mm256_fnmadd_ps(min, _mm256_set1_ps(x.scaled_sum[i]), s.off[r]);
    }
  }
}

// A Q6_K superblock, as ::q6k_block but with q - 32 multiplied (int16 holds it), so its
// sub-blocks need no centring term.
template <int R>
inline void q6k_block(const uint8_t* g, const QuantRows& x, int64_t row, int64_t a, Sums<R>& s) {
  const __m256 d = fp16x8(g);
  for (int64_t j = 0; j < SUBS; ++j) {
    const int16_t* xq[R];
    row_values<R>(x, row, a + j, xq);
    __m512i totals[R][2][2];
    block_totals<2, 2, centre(GGML_Q6_K), R>(sub_values(GGML_Q6_K, g, j), xq, totals);
    __m256 scale[2];
    q6k_scales(g, d, j, scale);
    for (int r = 0; r < R; ++r) {
      const __m256 dx = _mm256_set1_ps(x.scale[x.at(row + r, a + j)]);
      for (int part = 0; part < 2; ++part)
        for (int h = 0; h < 2; ++h)
          add_scaled(s.acc[r][h], totals[r][part][h], _mm256_mul_ps(scale[part], dx),
                     nibble_lanes(h));
    }
  }
}

// The 8 column totals of lane sums: 4 registers (Q8_0) of two columns' 8 lanes, or 2 of
// four columns' 4 lanes (columns 0, 4, 1, 5 and 2, 6, 3, 7), column c in lane c.
inline __m256 lo(__m512 v) { return _mm512_castps512_ps256(v); }
inline __m256 hi(__m512 v) { return _mm512_extractf32x8_ps(v, 1); }
inline __m256 column_totals(const __m512 acc[4], bool q8) {
  if (!q8) {  // [c0 c1 c2 c3 | c4 c5 c6 c7] after two rounds of pairwise sums
    return _mm256_hadd_ps(_mm256_hadd_ps(lo(acc[0]), hi(acc[0])),
                          _mm256_hadd_ps(lo(acc[1]), hi(acc[1])));
  }
  __m256 pair[4];  // [c2j c2j c2j+1 c2j+1 | the same of lanes 4-7]
  for (int j = 0; j < 4; ++j) pair[j] = _mm256_hadd_ps(lo(acc[j]), hi(acc[j]));
  const __m256 low = _mm256_hadd_ps(pair[0], pair[1]), high = _mm256_hadd_ps(pair[2], pair[3]);
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20),
                       _mm256_permute2f128_ps(low, high, 0x31));
}

// One group's 8 outputs for rows row..row+R-1, as ::group_rows.
template <int64_t Type, int R>
void group_rows(const uint8_t* g, const QuantRows& x, int64_t row, float* y, int64_t ld) {
  Sums<R> s;
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) s.acc[r][j] = _mm512_setzero_ps();
    s.off[r] = _mm256_setzero_ps();
  }
  constexpr int64_t step = block_weights(Type) / QK;
  for (int64_t a = 0; a < x.blocks; a += step, g += group_bytes(Type)) {
    prefetch_ahead<Type>(g);
    if constexpr (Type == GGML_Q8_0) q8_block<R>(g, x, row, a, s);
    else if constexpr (Type == GGML_Q4_K) q4k_block<R>(g, x, row, a, s);
    else if constexpr (Type == GGML_Q6_K) q6k_block<R>(g, x, row, a, s);
    else small_block<Type, R>(g, x, row, a, s);
  }
  for (int r = 0; r < R; ++r)
    _mm256_storeu_ps(y + r * ld,
                     _mm256_add_ps(column_totals(s.acc[r], Type == GGML_Q8_0), s.off[r]));
}

}  // namespace vnni
#pragma GCC pop_options

const bool HAS_VNNI = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
bool use_vnni = HAS_VNNI;

template <int64_t Type>
void linear(const QuantRows& x, int64_t rows, const uint8_t* packed, int64_t n, const float* bias,
            const float* residual, float* y) {
  const int64_t groups = (n + GROUP - 1) / GROUP;
  const int64_t stride = x.blocks * QK / block_weights(Type) * group_bytes(Type);
  const int64_t col_jobs = (groups + JOB_GROUPS - 1) / JOB_GROUPS;
  const int64_t row_jobs = (rows + JOB_ROWS - 1) / JOB_ROWS;
  // passes[n - 1]: the kernel for n rows, chosen once a call
  using Pass = void (*)(const uint8_t*, const QuantRows&, int64_t, float*, int64_t);
  const Pass passes[2] = {use_vnni ? vnni::group_rows<Type, 1> : group_rows<Type, 1>,
                          use_vnni ? vnni::group_rows<Type, 2> : group_rows<Type, 2>};
  parallel_jobs(col_jobs * row_jobs, [&](int64_t begin, int64_t end) {
    alignas(32) float out[2 * GROUP];
    for (int64_t job = begin; job < end; ++job) {
      const int64_t g0 = (job % col_jobs) * JOB_GROUPS, r0 = (job / col_jobs) * JOB_ROWS;
      const int64_t g1 = std::min(groups, g0 + JOB_GROUPS), r1 = std::min(rows, r0 + JOB_ROWS);
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t cols = std::min(GROUP, n - g * GROUP);
        for (int64_t r = r0; r < r1; r += 2) {
          const int64_t count = std::min<int64_t>(2, r1 - r);
          passes[count - 1](packed + g * stride, x, r, out, GROUP);
          for (int64_t i = 0; i < count; ++i)
            for (int64_t c = 0; c < cols; ++c) {
              const int64_t col = g * GROUP + c;
              y[(r + i) * n + col] = out[i * GROUP + c] + (bias ? bias[col] : 0.f) +
                                     (residual ? residual[(r + i) * n + col] : 0.f);
            }
        }
      }
    }
  });
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

// Column c's 32 values q (unsigned, 4 + high bits) of one block into a packed block's
// values, as `expand` reads them. High bits: 32-byte registers of 4 / high rows each; in
// 16-bit lane i of column c's half (c < 4: lanes 0-7), at bit 2 high (row's place among
// them), the bits of values 2i (low byte) and 2i + 1 (high byte), then of 2i + 16, 2i + 17.
void place_values(const uint8_t* q, int high, int64_t c, uint8_t* values) {
  uint8_t* nib = values + (c % 4) * QK + (c / 4) * (QK / 2);
  for (int64_t j = 0; j < QK / 2; ++j) nib[j] = (q[j] & 15) | (q[j + QK / 2] & 15) << 4;
  if (high == 0) return;
  const int rows = 4 / high, at = 2 * high * (c % 4 % rows);
  uint8_t* reg = values + NIBBLE_BYTES + c % 4 / rows * QK;
  for (int i = 0; i < 8; ++i) {
    uint8_t* lane = reg + 2 * ((c / 4) * 8 + i);
    for (int b = 0; b < 2; ++b)
      lane[b] |= (q[2 * i + b] >> 4) << at | (q[2 * i + b + 16] >> 4) << (at + high);
  }
}

// A decoded block of column c into its group's packed block o.
template <int64_t Type>
void place(const Decoded& b, int64_t c, uint8_t* o) {
  if constexpr (k_quant(Type)) {
    std::memcpy(o + 2 * c, &b.d, 2);
    if constexpr (Type == GGML_Q4_K) {
      std::memcpy(o + 2 * GROUP + 2 * c, &b.m, 2);
      for (int64_t j = 0; j < SUBS; ++j) {
        o[4 * GROUP + j * GROUP + c] = b.scales[j];
        o[4 * GROUP + (SUBS + j) * GROUP + c] = b.mins[j];
      }
    } else {
      for (int64_t j = 0; j < QK_K / Q6_SUB; ++j) o[2 * GROUP + j * GROUP + c] = b.scales[j];
    }
    for (int64_t j = 0; j < SUBS; ++j)
      place_values(b.q + j * QK, high_bits(Type), c,
                   o + header_bytes(Type) + j * values_bytes(Type));
  } else {
    uint8_t* scales = o + values_bytes(Type);
    std::memcpy(scales + 2 * c, &b.d, 2);
    if constexpr (stored_offset(Type)) std::memcpy(scales + 2 * GROUP + 2 * c, &b.m, 2);
    if constexpr (Type == GGML_Q8_0) std::memcpy(o + c * QK, b.q, QK);
    else place_values(b.q, high_bits(Type), c, o);
  }
}

template <int64_t Type>
void pack(const uint8_t* w, int64_t n, int64_t blocks, uint8_t* out) {
  const int64_t groups = (n + GROUP - 1) / GROUP, row_bytes = blocks * gguf_bytes(Type);
  parallel_jobs(groups, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* o = out + (g * blocks + b) * group_bytes(Type);
        std::fill(o, o + group_bytes(Type), 0);
        for (int64_t c = 0; c < std::min(GROUP, n - g * GROUP); ++c)
          place<Type>(decode<Type>(w + (g * GROUP + c) * row_bytes + b * gguf_bytes(Type)), c, o);
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
  const int64_t groups = (n + GROUP - 1) / GROUP;
  return by_type(type, [&](auto t) {
    constexpr int64_t T = decltype(t)::value;
    Tensor out = torch::empty({groups, blocks * group_bytes(T)}, torch::kUInt8);
    pack<T>(weight.data_ptr<uint8_t>(), n, blocks, out.data_ptr<uint8_t>());
    return out;
  });
}

bool quant_vnni(std::optional<bool> enable) {
  TORCH_CHECK(!enable.value_or(false) || HAS_VNNI, "this CPU has no AVX-512 VNNI");
  if (enable) use_vnni = *enable;
  return use_vnni;
}

Tensor quant_linear(const Tensor& x, const Tensor& packed, int64_t type, int64_t n,
                    const Tensor& bias, const std::optional<Tensor>& residual) {
  if (type == GGML_BF16) return blocked_linear(x, packed, n, bias, residual);
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat,
              "x [M, K] contiguous fp32");
  by_type(type, [&](auto t) {
    constexpr int64_t T = decltype(t)::value;
    TORCH_CHECK(k % block_weights(T) == 0, "x's K = ", k, " is not whole blocks of ",
                block_weights(T), " weights (K-quants' superblocks are 256)");
    TORCH_CHECK(packed.dim() == 2 && packed.size(0) == (n + GROUP - 1) / GROUP &&
                    packed.size(1) == k / block_weights(T) * group_bytes(T),
                "packed weight does not match [", n, ", ", k, "]");
  });
  TORCH_CHECK(!residual || (residual->is_contiguous() && residual->size(0) == rows &&
                            residual->size(1) == n),
              "residual [M, N]");
  TORCH_CHECK(bias.numel() == 0 || bias.numel() == n, "bias [N]");
  Tensor y = torch::empty({rows, n}, x.options());
  const QuantRows xq = quantize_rows(x.data_ptr<float>(), rows, k);
  const float* b = bias.numel() ? bias.data_ptr<float>() : nullptr;
  const float* res = residual ? residual->data_ptr<float>() : nullptr;
  by_type(type, [&](auto t) {
    linear<decltype(t)::value>(xq, rows, packed.data_ptr<uint8_t>(), n, b, res,
                               y.data_ptr<float>());
  });
  return y;
}
