// Flash attention on CPU (Dao et al. 2022): a job takes one KV head and a block of query
// positions, with every query head of that KV group as rows of one tile (grouped-query
// attention reads each K/V tile once per group). It walks the context a tile of keys at
// a time, keeping per row a running max m, the running sum l of 2^(s - m) and the
// unnormalised output o, scores in base 2 (e^x = 2^(x log2 e)):
//   s = q k^T log2(e) / sqrt(dim)         [rows, keys]
//   m' = max_j s_j if it passes m by more than RESCALE_ABOVE, else m
//   p = 2^(s - m');  l = l 2^(m - m') + sum_j p_j;  o = o 2^(m - m') + p v   [rows, dim]
// and writes o / l (m cancels out; p stays below 2^RESCALE_ABOVE). No [rows, context]
// scores exist at once, and tiles past a row's position (causality) are never computed.
// Both products run through matmul.cpp's tiles, with K and V packed into its 16-column
// block layout as they are read from the cache.
#include "attention.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <vector>

#include "matmul.h"
#include "pool.h"
#include "simd.h"

namespace {

constexpr int64_t QUERY_POSITIONS = 32;  // per job; rows are that times the group size
constexpr int64_t KEYS = 128;            // per tile
constexpr int64_t COLS = BLOCK_COLS;

int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// Packed K and V are read by aligned loads, as matmul.cpp's weights are. The buffer
// outlives the call: every layer of a step reuses it, instead of pages the OS would
// zero on each call.
class Buffer {
 public:
  float* reserve(int64_t floats) {
    if (floats > size_) {
      data_.reset(static_cast<float*>(
          std::aligned_alloc(64, round_up(floats * int64_t{sizeof(float)}, 64))));
      size_ = floats;
    }
    return data_.get();
  }

 private:
  std::unique_ptr<float, decltype(&std::free)> data_{nullptr, &std::free};
  int64_t size_ = 0;
};

thread_local Buffer k_buffer, v_buffer;

// One job's buffers, reused from tile to tile.
struct Scratch {
  std::vector<float> q, s, o, m, l;
  Scratch(int64_t rows, int64_t dim)
      : q(rows * dim), s(rows * KEYS), o(rows * dim), m(rows), l(rows) {}
};

// Every tile of keys of one KV head, packed once for all query blocks: K as blocks of 16
// keys [KEYS / 16, dim, 16] and V as blocks of 16 dims [ceil(dim / 16), KEYS, 16]. Past
// the last key, V is zero up to the next 16 (a probability of 0 times stale memory could
// be NaN); K is not read there (those scores are masked).
struct PackedKV {
  int64_t tile_floats;
  float *k, *v;

  PackedKV(const float* kc, const float* vc, const int64_t* ctx, int64_t keys, int64_t kv_heads,
           int64_t dim)
      : tile_floats(KEYS * round_up(dim, COLS)),
        k(k_buffer.reserve(kv_heads * tiles(keys) * tile_floats)),
        v(v_buffer.reserve(kv_heads * tiles(keys) * tile_floats)) {
    const int64_t n = tiles(keys), stride = kv_heads * dim;
    parallel_jobs(kv_heads * n, [&](int64_t begin, int64_t end) {
      for (int64_t job = begin; job < end; ++job) {
        float *kt = k + job * tile_floats, *vt = v + job * tile_floats;
        const int64_t head = job / n, first = (job % n) * KEYS;
        const int64_t count = std::min(KEYS, keys - first);
        // key c's row of this head in cache `kc` or `vc`
        const auto row = [&](const float* cache, int64_t c) {
          return cache + ctx[first + c] * stride + head * dim;
        };
        int64_t c = 0;
        for (; c + 8 <= count && dim % 8 == 0; c += 8)  // K by 8 x 8 transposes
          for (int64_t d = 0; d < dim; d += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(row(kc, c + i) + d);
            transpose8(r);
            float* kb = kt + (c / COLS) * dim * COLS + d * COLS + c % COLS;
            for (int i = 0; i < 8; ++i) _mm256_store_ps(kb + i * COLS, r[i]);
          }
        for (; c < count; ++c) {
          float* kb = kt + (c / COLS) * dim * COLS + c % COLS;
          for (int64_t d = 0; d < dim; ++d) kb[d * COLS] = row(kc, c)[d];
        }
        for (int64_t c = 0; c < count; ++c) {
          const float* vr = row(vc, c);
          float* vb = vt + c * COLS;
          int64_t d = 0;
          for (; d + 8 <= dim; d += 8)
            _mm256_store_ps(vb + (d / COLS) * KEYS * COLS + d % COLS, _mm256_loadu_ps(vr + d));
          for (; d < dim; ++d) vb[(d / COLS) * KEYS * COLS + d % COLS] = vr[d];
        }
        for (int64_t block = 0; block < round_up(dim, COLS) / COLS; ++block)
          std::fill(vt + (block * KEYS + count) * COLS,
                    vt + (block * KEYS + round_up(count, COLS)) * COLS, 0.f);
      }
    });
  }

  static int64_t tiles(int64_t keys) { return (keys + KEYS - 1) / KEYS; }
};

// 2^x for x <= 0, clamped at -126 (a probability below 2^-126 adds nothing to a sum that
// holds 1): 2^x = 2^n 2^r with n = round(x) and |r| <= 1/2, 2^r by a degree-5 polynomial
// fitted to it (relative error < 1e-7), 2^n built in the exponent bits.
inline __m256 exp2_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-126.f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.326697039e-03f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(9.675459746e-03f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.550742616e-02f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(2.402212175e-01f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(6.931469492e-01f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.000000071e+00f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// A row's running max m moves only when a score passes it by more than this (base 2):
// probabilities up to 2^8 are as exact as those up to 1, and most tiles then rescale
// nothing.
constexpr float RESCALE_ABOVE = 8.f;

// Scores of one row (`keys` of them, a multiple of 8; base-2 units: q was scaled by
// log2(e)) -> 2^(s - m) for its first `seen` keys (0 past them), adding their sum to the
// row's l; returns the factor its output must be rescaled by (1 if m stayed).
float softmax_row(float* s, int64_t seen, int64_t keys, float& m, float& l) {
  if (seen <= 0) {
    std::fill(s, s + keys, 0.f);
    return 1.f;
  }
  std::fill(s + seen, s + keys, -INFINITY);
  __m256 top0 = _mm256_set1_ps(-INFINITY), top1 = top0;
  for (int64_t c = 0; c < keys; c += 16) {  // keys is a multiple of 16 (COLS)
    top0 = _mm256_max_ps(top0, _mm256_loadu_ps(s + c));
    top1 = _mm256_max_ps(top1, _mm256_loadu_ps(s + c + 8));
  }
  const float row_max = hmax(_mm256_max_ps(top0, top1));
  float alpha = 1.f;
  if (row_max > m + RESCALE_ABOVE) {
    alpha = std::exp2(m - row_max);  // 0 on the first tile (m = -inf)
    l *= alpha;
    m = row_max;
  }
  const __m256 shift = _mm256_set1_ps(m);
  __m256 sum0 = _mm256_setzero_ps(), sum1 = sum0;
  for (int64_t c = 0; c < keys; c += 16) {
    const __m256 p0 = exp2_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + c), shift));
    const __m256 p1 = exp2_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + c + 8), shift));
    _mm256_storeu_ps(s + c, p0);
    _mm256_storeu_ps(s + c + 8, p1);
    sum0 = _mm256_add_ps(sum0, p0);
    sum1 = _mm256_add_ps(sum1, p1);
  }
  std::fill(s + seen, s + keys, 0.f);  // keys it may not see: not 2^-126
  l += hsum(_mm256_add_ps(sum0, sum1));
  return alpha;
}

void scale_row(float* o, int64_t dim, float alpha) {
  const __m256 a = _mm256_set1_ps(alpha);
  int64_t d = 0;
  for (; d + 8 <= dim; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(a, _mm256_loadu_ps(o + d)));
  for (; d < dim; ++d) o[d] *= alpha;
}

}  // namespace

void causal_attention(const float* q, int64_t ld, const float* k_cache, const float* v_cache,
                      const int64_t* ctx, int64_t num_cached, int64_t num_new, int64_t heads,
                      int64_t kv_heads, int64_t dim, float* out) {
  const int64_t group = heads / kv_heads, keys = num_cached + num_new;
  const int64_t blocks = (num_new + QUERY_POSITIONS - 1) / QUERY_POSITIONS;
  const float scale = 1.44269504f / std::sqrt(static_cast<float>(dim));  // log2(e)
  const PackedKV kv_tiles(k_cache, v_cache, ctx, keys, kv_heads, dim);
  // The last query blocks see the most keys: they come first, so that the pool's
  // shrinking claims end the region evenly.
  parallel_jobs(kv_heads * blocks, [&](int64_t begin, int64_t end) {
    Scratch w(QUERY_POSITIONS * group, dim);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t kv = job % kv_heads, first = (blocks - 1 - job / kv_heads) * QUERY_POSITIONS;
      const int64_t n = std::min(QUERY_POSITIONS, num_new - first), rows = n * group;
      // row i * group + h: query head kv * group + h of new row first + i, pre-scaled
      for (int64_t i = 0; i < n; ++i)
        for (int64_t h = 0; h < group; ++h) {
          const float* src = q + (first + i) * ld + (kv * group + h) * dim;
          float* dst = w.q.data() + (i * group + h) * dim;
          for (int64_t d = 0; d < dim; ++d) dst[d] = src[d] * scale;
        }
      std::fill(w.o.begin(), w.o.begin() + rows * dim, 0.f);
      std::fill(w.m.begin(), w.m.begin() + rows, -INFINITY);
      std::fill(w.l.begin(), w.l.begin() + rows, 0.f);
      const int64_t visible = num_cached + first + n;  // the block's last row sees these
      for (int64_t t = 0; t * KEYS < visible; ++t) {
        // the keys of this tile that some row of the block sees, in whole 16-key blocks
        const int64_t kpad = round_up(std::min(KEYS, visible - t * KEYS), COLS);
        const int64_t tile = (kv * PackedKV::tiles(keys) + t) * kv_tiles.tile_floats;
        const float *kt = kv_tiles.k + tile, *vt = kv_tiles.v + tile;
        matmul_rows(w.q.data(), rows, dim, kt, dim * COLS, kpad, w.s.data(), kpad, false);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t seen = std::min(kpad, num_cached + first + r / group + 1 - t * KEYS);
          const float alpha = softmax_row(w.s.data() + r * kpad, seen, kpad, w.m[r], w.l[r]);
          if (alpha != 1.f) scale_row(w.o.data() + r * dim, dim, alpha);
        }
        matmul_rows(w.s.data(), rows, kpad, vt, KEYS * COLS, dim, w.o.data(), dim, true);
      }
      for (int64_t i = 0; i < n; ++i)
        for (int64_t h = 0; h < group; ++h) {
          const int64_t r = i * group + h;
          const float* src = w.o.data() + r * dim;
          float* dst = out + (first + i) * heads * dim + (kv * group + h) * dim;
          for (int64_t d = 0; d < dim; ++d) dst[d] = src[d] / w.l[r];
        }
    }
  });
}

namespace {

// Dots of q with 8 rows from `offset` on (dim a multiple of 8) in one register: 8
// independent FMA chains, then their lanes summed by a transpose of adds (lane t: row t).
__m256 dot8(const float* q, const float* const rows[8], int64_t offset, int64_t dim) {
  __m256 acc[8];
  for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t d = 0; d < dim; d += 8) {
    const __m256 qd = _mm256_loadu_ps(q + d);
    for (int t = 0; t < 8; ++t)
      acc[t] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(rows[t] + offset + d), acc[t]);
  }
  const __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  const __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
  // low: [rows 0-3, dims of the low 128 bits | the high 128 bits], high: rows 4-7
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20),
                       _mm256_permute2f128_ps(low, high, 0x31));
}

// out[0 .. 8R) = sum_j p[j] v_j, v_j the V row of key j from `offset` on, the sums held
// in R registers.
template <int R>
void weighted_rows(const float* p, const KVRows& kv, int64_t keys, int64_t offset, float* out) {
  const int64_t stride = kv.kv_heads * kv.dim;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t j = 0; j < keys; ++j) {
    if (p[j] == 0.f) continue;  // masked (exp of -inf), or too small to count
    const float* v = kv.v + kv.ctx[j] * stride + offset;
    const __m256 w = _mm256_set1_ps(p[j]);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * r), acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

// p[0 .. padded) scores of keys begin.. -> e^(s - m) (masked keys and the padding 0);
// returns m, -inf where no key is seen.
float softmax_chunk(float* p, int64_t n, int64_t padded, int64_t begin, int64_t cached,
                    const bool* mask) {
  for (int64_t j = std::max<int64_t>(0, cached - begin); mask && j < n; ++j)
    if (!mask[begin + j - cached]) p[j] = -INFINITY;
  std::fill(p + n, p + padded, -INFINITY);
  __m256 top = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < padded; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(p + j));
  const float m = hmax(top);
  if (m == -INFINITY) return m;
  const __m256 shift = _mm256_set1_ps(m);
  for (int64_t j = 0; j < padded; j += 8) {
    // exp256 clamps at -87: masked keys and the padding are zeroed, not e^-87
    const __m256 s = _mm256_loadu_ps(p + j);
    const __m256 seen = _mm256_cmp_ps(s, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    _mm256_storeu_ps(p + j, _mm256_and_ps(seen, exp256(_mm256_sub_ps(s, shift))));
  }
  return m;
}

// Loads one float of every 64-byte line of the chunk's K and V rows, keys [0, n). These
// loads depend on nothing, so the core keeps many misses in flight and the chunk arrives
// at the memory's rate; the scoring and weighing passes then read it from L2 (software
// prefetches issued among the scoring's FMAs arrive late).
void load_chunk(const KVRows& chunk, int64_t n) {
  const int64_t stride = chunk.kv_heads * chunk.dim, line = 64 / sizeof(float);
  __m128 sink = _mm_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const float *k = chunk.k + chunk.ctx[j] * stride, *v = chunk.v + chunk.ctx[j] * stride;
    for (int64_t d = 0; d < stride; d += line)
      sink = _mm_or_ps(sink, _mm_or_ps(_mm_load_ss(k + d), _mm_load_ss(v + d)));
  }
  asm volatile("" : : "x"(sink));  // keeps the loads, whose values nothing reads
}

}  // namespace

void partial_attention(const float* q, int64_t heads, const KVRows& kv, int64_t begin,
                       int64_t end, int64_t cached, const bool* mask, float* p, float* out,
                       float* max, float* sum) {
  const int64_t n = end - begin, padded = round_up(n, 8), dim = kv.dim;
  const int64_t stride = kv.kv_heads * dim, group = heads / kv.kv_heads;
  const KVRows chunk{kv.k, kv.v, kv.ctx + begin, kv.kv_heads, dim};
  load_chunk(chunk, n);
  // scores, 8 keys at a time (the last 8 padded with the last key, then cut)
  const __m256 scaling = _mm256_set1_ps(1.f / std::sqrt(static_cast<float>(dim)));
  for (int64_t j = 0; j < n; j += 8) {
    const float* rows[8];
    for (int t = 0; t < 8; ++t) rows[t] = kv.k + chunk.ctx[std::min(j + t, n - 1)] * stride;
    for (int64_t h = 0; h < heads; ++h)
      _mm256_storeu_ps(p + h * padded + j,
                       _mm256_mul_ps(dot8(q + h * dim, rows, h / group * dim, dim), scaling));
  }
  for (int64_t h = 0; h < heads; ++h) {
    float *ph = p + h * padded, *oh = out + h * dim;
    max[h] = softmax_chunk(ph, n, padded, begin, cached, mask);
    __m256 total = _mm256_setzero_ps();
    for (int64_t j = 0; j < padded; j += 8) total = _mm256_add_ps(total, _mm256_loadu_ps(ph + j));
    sum[h] = hsum(total);
    const int64_t kv_at = h / group * dim;  // the head's KV head in a slot's row
    int64_t d = 0;
    for (; d + 64 <= dim; d += 64) weighted_rows<8>(ph, chunk, n, kv_at + d, oh + d);
    for (; d < dim; d += 8) weighted_rows<1>(ph, chunk, n, kv_at + d, oh + d);
  }
}

void merge_partials(const float* parts, int64_t count, int64_t step, int64_t out_at,
                    int64_t max_at, int64_t sum_at, int64_t dim, float* out) {
  float top = -INFINITY, total = 0.f;
  for (int64_t c = 0; c < count; ++c) top = std::max(top, parts[c * step + max_at]);
  std::fill(out, out + dim, 0.f);
  for (int64_t c = 0; c < count; ++c) {
    const float* part = parts + c * step;
    if (part[max_at] == -INFINITY) continue;  // a chunk of masked keys only
    const float w = std::exp(part[max_at] - top);
    total += w * part[sum_at];
    for (int64_t d = 0; d < dim; ++d) out[d] += w * part[out_at + d];
  }
  const float inv = 1.f / total;
  for (int64_t d = 0; d < dim; ++d) out[d] *= inv;
}
