// Decode reads every weight once a step, so its time is the weights' bytes: at 5 bits a
// weight (Q4_1) a step reads ~6x less than fp32. The activations are quantized to int16 per
// 32 values (scale dx; an error ~2^-15 of the block's largest, far below what flips a
// greedy token, where int8's does), so a block's products are integer multiply-adds
// (madd: int16 pairs summed to int32):
//   sum_i w_i x_i = d dx sum_i q_i xq_i  + m dx sum_i xq_i   (Q4_1; Q4_0: m = -8 d)
// Eight output columns go together (quant_pack's groups), so their block totals land in
// the 8 lanes of one register by horizontal adds, and their scales d and offsets m are
// one fp16 load each: one FMA applies the eight columns' scales, one more their offsets.
// Each weight register is expanded once and multiplied with up to 2 activation rows.
#include "quant.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "pool.h"

namespace {

using torch::Tensor;

constexpr int64_t QK = 32;        // weights (and activations) per block
constexpr int64_t GROUP = 8;      // output columns packed together
constexpr int64_t JOB_GROUPS = 4;  // column groups per job
constexpr int64_t JOB_ROWS = 64;   // activation rows per job: their int16 rows stay in L2
// Weight bytes requested ahead of the block being multiplied (matmul.cpp's 4 KB).
constexpr int64_t PREFETCH_BYTES = 4096;

// x quantized per row and block: int16 values, the block's scale dx and dx * sum(xq).
// A block's values are stored evens first: x0 x2 .. x30, then x1 x3 .. x31, the order in
// which the kernels' 16-bit lanes hold the weights they multiply (no shuffles there).
struct QuantRows {
  std::vector<int16_t> q;
  std::vector<float> scale, scaled_sum;
  int64_t blocks;
};

QuantRows quantize_rows(const float* x, int64_t rows, int64_t k) {
  const int64_t blocks = k / QK;
  QuantRows out{std::vector<int16_t>(rows * k), std::vector<float>(rows * blocks),
                std::vector<float>(rows * blocks), blocks};
  parallel_jobs(rows, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * blocks; i < end * blocks; ++i) {  // block i of all rows
      const float* v = x + i * QK;
      float amax = 0.f;
      for (int64_t j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(v[j]));
      const float d = amax / 32767.f, inv = amax > 0.f ? 1.f / d : 0.f;
      int16_t* q = out.q.data() + i * QK;
      int sum = 0;
      for (int64_t j = 0; j < QK; ++j)
        sum += q[j % 2 * (QK / 2) + j / 2] = static_cast<int16_t>(std::nearbyint(v[j] * inv));
      out.scale[i] = d;
      out.scaled_sum[i] = d * static_cast<float>(sum);
    }
  });
  return out;
}

constexpr bool four_bit(int64_t type) { return type != GGML_Q8_0; }

// GGUF's block: fp16 d, (Q4_1) fp16 m, then the values.
constexpr int64_t gguf_bytes(int64_t type) {
  return type == GGML_Q8_0 ? 2 + QK : type == GGML_Q4_1 ? 4 + QK / 2 : 2 + QK / 2;
}
constexpr int64_t gguf_values_at(int64_t type) { return type == GGML_Q4_1 ? 4 : 2; }

// quant_pack's block of a group: the values of its 8 columns, then 8 fp16 d (and 8 m).
constexpr int64_t values_bytes(int64_t type) { return GROUP * (four_bit(type) ? QK / 2 : QK); }
constexpr int64_t group_bytes(int64_t type) {
  return values_bytes(type) + GROUP * 2 * (four_bit(type) ? 2 : 1);
}

float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline __m256i load256(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
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

// One group's 8 outputs for activation rows row..row+R-1: y[r * ld + c] (no bias).
template <int64_t Type, int R>
void group_rows(const uint8_t* g, const QuantRows& x, int64_t row, float* y, int64_t ld) {
  __m256 acc[R], off[R];
  for (int r = 0; r < R; ++r) acc[r] = off[r] = _mm256_setzero_ps();
  const int64_t k = x.blocks * QK;
  for (int64_t b = 0; b < x.blocks; ++b, g += group_bytes(Type)) {
    for (int64_t line = 0; line < group_bytes(Type); line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(g + PREFETCH_BYTES + line), _MM_HINT_T0);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(g + values_bytes(Type))));
    const int16_t* xq[R];  // evens, then odds
    for (int r = 0; r < R; ++r) xq[r] = x.q.data() + (row + r) * k + b * QK;
    __m256i totals[R];
    if constexpr (four_bit(Type)) {
      // 16-bit lane i of pair p's 32 bytes: bytes 2i, 2i + 1 of column p (lanes 0-7) or
      // p + 4 (8-15), whose nibbles are values 2i, 2i + 1 (low) and 2i + 16, 2i + 17 (high)
      const __m256i nibble = _mm256_set1_epi16(0x000F);
      __m256i xs[R][4];  // x0 x2 .. x14, x1 .. x15, x16 .. x30, x17 .. x31, in both halves
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j)
          xs[r][j] = _mm256_broadcastsi128_si256(_mm_loadu_si128(
              reinterpret_cast<const __m128i*>(xq[r] + (j % 2) * 16 + (j / 2) * 8)));
      __m256i halves[R][2];
      for (int p = 0; p < 4; ++p) {
        const __m256i raw = load256(g + p * QK);
        const __m256i w0 = _mm256_and_si256(raw, nibble);
        const __m256i w1 = _mm256_and_si256(_mm256_srli_epi16(raw, 8), nibble);
        const __m256i w2 = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
        const __m256i w3 = _mm256_srli_epi16(raw, 12);
        for (int r = 0; r < R; ++r) {
          // [column p's 4 partial sums | column p + 4's]
          const __m256i v = _mm256_add_epi32(madd2(w0, xs[r][0], w1, xs[r][1]),
                                             madd2(w2, xs[r][2], w3, xs[r][3]));
          halves[r][p / 2] = p % 2 ? _mm256_hadd_epi32(halves[r][p / 2], v) : v;
        }
      }
      for (int r = 0; r < R; ++r)  // [c0 c1 c2 c3 | c4 c5 c6 c7]
        totals[r] = _mm256_hadd_epi32(halves[r][0], halves[r][1]);
    } else {
      // 16-bit lane i of a column's 32 bytes: values 2i (low byte) and 2i + 1
      __m256i pairs[R][4];
      for (int c = 0; c < GROUP; ++c) {
        const __m256i q = load256(g + c * QK);
        const __m256i even = _mm256_srai_epi16(_mm256_slli_epi16(q, 8), 8);
        const __m256i odd = _mm256_srai_epi16(q, 8);
        for (int r = 0; r < R; ++r) {
          const __m256i v = madd2(even, load256(xq[r]), odd, load256(xq[r] + QK / 2));
          pairs[r][c / 2] = c % 2 ? _mm256_hadd_epi32(pairs[r][c / 2], v) : v;
        }
      }
      for (int r = 0; r < R; ++r) totals[r] = column_totals(pairs[r]);
    }
    for (int r = 0; r < R; ++r) {
      const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(x.scale[(row + r) * x.blocks + b]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(totals[r]), scale, acc[r]);
    }
    if constexpr (four_bit(Type)) {
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(g + values_bytes(Type) + 2 * GROUP)));
      for (int r = 0; r < R; ++r)
        off[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.scaled_sum[(row + r) * x.blocks + b]), off[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ld, _mm256_add_ps(acc[r], off[r]));
}

template <int64_t Type>
void linear(const QuantRows& x, int64_t rows, const uint8_t* packed, int64_t n, const float* bias,
            const float* residual, float* y) {
  const int64_t groups = (n + GROUP - 1) / GROUP, stride = x.blocks * group_bytes(Type);
  const int64_t col_jobs = (groups + JOB_GROUPS - 1) / JOB_GROUPS;
  const int64_t row_jobs = (rows + JOB_ROWS - 1) / JOB_ROWS;
  parallel_jobs(col_jobs * row_jobs, [&](int64_t begin, int64_t end) {
    alignas(32) float out[2 * GROUP];
    for (int64_t job = begin; job < end; ++job) {
      const int64_t g0 = (job % col_jobs) * JOB_GROUPS, r0 = (job / col_jobs) * JOB_ROWS;
      const int64_t g1 = std::min(groups, g0 + JOB_GROUPS), r1 = std::min(rows, r0 + JOB_ROWS);
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t cols = std::min(GROUP, n - g * GROUP);
        for (int64_t r = r0; r < r1; r += 2) {
          const int64_t count = std::min<int64_t>(2, r1 - r);
          if (count == 2) group_rows<Type, 2>(packed + g * stride, x, r, out, GROUP);
          else group_rows<Type, 1>(packed + g * stride, x, r, out, GROUP);
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

template <int64_t Type>
void pack(const uint8_t* w, int64_t n, int64_t blocks, uint8_t* out) {
  const int64_t groups = (n + GROUP - 1) / GROUP, row_bytes = blocks * gguf_bytes(Type);
  parallel_jobs(groups, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* o = out + (g * blocks + b) * group_bytes(Type);
        std::fill(o, o + group_bytes(Type), 0);
        for (int64_t c = 0; c < std::min(GROUP, n - g * GROUP); ++c) {
          const uint8_t* src = w + (g * GROUP + c) * row_bytes + b * gguf_bytes(Type);
          const uint8_t* values = src + gguf_values_at(Type);
          uint8_t* scales = o + values_bytes(Type);
          std::memcpy(scales + 2 * c, src, 2);  // d
          if constexpr (four_bit(Type)) {
            std::memcpy(o + (c % 4) * QK + (c / 4) * (QK / 2), values, QK / 2);
            // Q4_0's offset is -8 d
            uint16_t m = _cvtss_sh(-8.f * fp16(src), 0);
            if constexpr (Type == GGML_Q4_1) std::memcpy(&m, src + 2, 2);
            std::memcpy(scales + 2 * GROUP + 2 * c, &m, 2);
          } else {
            std::memcpy(o + c * QK, values, QK);
          }
        }
      }
  });
}

template <typename Fn>
auto by_type(int64_t type, Fn&& fn) {
  switch (type) {
    case GGML_Q8_0: return fn(std::integral_constant<int64_t, GGML_Q8_0>{});
    case GGML_Q4_0: return fn(std::integral_constant<int64_t, GGML_Q4_0>{});
    case GGML_Q4_1: return fn(std::integral_constant<int64_t, GGML_Q4_1>{});
  }
  TORCH_CHECK(false, "GGML block type ", type, " is not served (Q8_0, Q4_0, Q4_1 are)");
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
  return by_type(type, [](auto t) { return gguf_bytes(decltype(t)::value); });
}

Tensor quant_pack(const Tensor& weight, int64_t type) {
  const int64_t blocks = gguf_blocks(weight, type), n = weight.size(0);
  const int64_t groups = (n + GROUP - 1) / GROUP;
  return by_type(type, [&](auto t) {
    constexpr int64_t T = decltype(t)::value;
    Tensor out = torch::empty({groups, blocks * group_bytes(T)}, torch::kUInt8);
    pack<T>(weight.data_ptr<uint8_t>(), n, blocks, out.data_ptr<uint8_t>());
    return out;
  });
}

Tensor quant_linear(const Tensor& x, const Tensor& packed, int64_t type, int64_t n,
                    const Tensor& bias, const std::optional<Tensor>& residual) {
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat &&
                  k % QK == 0,
              "x [M, K] contiguous fp32, K a multiple of 32");
  by_type(type, [&](auto t) {
    TORCH_CHECK(packed.dim() == 2 && packed.size(0) == (n + GROUP - 1) / GROUP &&
                    packed.size(1) == k / QK * group_bytes(decltype(t)::value),
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
