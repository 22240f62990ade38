// Few rows (decode, verification) are bound by reading the weights once; many rows
// (prefill) by the FMA units. One layout serves both: each 16-column block of the weight
// is read from memory once per call, and up to 6 input rows at a time (12 with AVX-512)
// are multiplied against it while it sits in cache (a 6x16 AVX2 tile: 12 accumulator
// registers, 2 weight loads and 6 broadcasts per k). Weights are fp32 or bf16 (half the
// bytes to read, widened to fp32 in registers: the products and sums stay fp32).
#include "matmul.h"

#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>

#include "pool.h"

namespace {

constexpr int64_t COLS = BLOCK_COLS;
// Rows one job multiplies against a block: decode and verification are one job per
// block (the weight read once); prefill splits its rows so every core has work.
constexpr int64_t JOB_ROWS = 48;
// Weight lines are requested this many k (4 KB) ahead: with several rows per tile the
// FMAs between loads keep the out-of-order window from reaching that far by itself.
constexpr int64_t PREFETCH_K = 64;

// The weight lines a tile requests ahead of its loads, one every `every` k. A block's only
// tile requests its own lines PREFETCH_K ahead. A block of several tiles is read from
// memory by its first tile and from cache by the rest, so its tiles share the next block's
// lines between them: memory streams while every tile computes, not during the first alone.
template <typename W>
struct Ahead {
  const W* line;
  int64_t every, wait = 1;  // wait: k until the next request

  __attribute__((always_inline)) void step() {
    if (--wait) return;
    _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
    line += COLS;
    wait = every;
  }
};

// Where a tile's outputs go: `cols` valid columns of rows `ld` apart, plus optional
// bias (per column) and residual (same layout as y) added on the way out.
struct Target {
  float* y;
  const float* bias;
  const float* residual;
  int64_t ld, cols;
};

// Always inlined: it runs once per tile row, inside every matmul's innermost loop.
__attribute__((always_inline)) inline void store_row(__m256 lo, __m256 hi, const Target& t,
                                                     int64_t r) {
  float* y = t.y + r * t.ld;
  const float* res = t.residual ? t.residual + r * t.ld : nullptr;
  if (t.cols == COLS) {
    if (t.bias) {
      lo = _mm256_add_ps(lo, _mm256_loadu_ps(t.bias));
      hi = _mm256_add_ps(hi, _mm256_loadu_ps(t.bias + 8));
    }
    if (res) {
      lo = _mm256_add_ps(lo, _mm256_loadu_ps(res));
      hi = _mm256_add_ps(hi, _mm256_loadu_ps(res + 8));
    }
    _mm256_storeu_ps(y, lo);
    _mm256_storeu_ps(y + 8, hi);
    return;
  }
  alignas(32) float tmp[COLS];
  _mm256_store_ps(tmp, lo);
  _mm256_store_ps(tmp + 8, hi);
  for (int64_t c = 0; c < t.cols; ++c)
    y[c] = tmp[c] + (t.bias ? t.bias[c] : 0.f) + (res ? res[c] : 0.f);
}

// A block's k-th line of 16 weights as fp32 (bf16 is fp32's upper half: widening is exact).
inline void load_line(const float* w, int64_t k, __m256& lo, __m256& hi) {
  lo = _mm256_load_ps(w + k * COLS);
  hi = _mm256_load_ps(w + k * COLS + 8);
}

inline __m256 widen_bf16(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline void load_line(const uint16_t* w, int64_t k, __m256& lo, __m256& hi) {
  const __m256i line = _mm256_load_si256(reinterpret_cast<const __m256i*>(w + k * COLS));
  lo = widen_bf16(_mm256_castsi256_si128(line));
  hi = widen_bf16(_mm256_extracti128_si256(line, 1));
}

__attribute__((target("avx512f"))) inline __m512 load_line512(const float* w, int64_t k) {
  return _mm512_load_ps(w + k * COLS);
}

__attribute__((target("avx512f"))) inline __m512 load_line512(const uint16_t* w, int64_t k) {
  const __m256i line = _mm256_load_si256(reinterpret_cast<const __m256i*>(w + k * COLS));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(line), 16));
}

// Accumulators are named variables, not an array: GCC keeps an array of them in memory
// and stores it back every k.
#define TILE_ROW(r)                                   \
  if constexpr (R > r) {                              \
    __m256 xb = _mm256_broadcast_ss(x + r * K + k);   \
    a##r##0 = _mm256_fmadd_ps(xb, w0, a##r##0);       \
    a##r##1 = _mm256_fmadd_ps(xb, w1, a##r##1);       \
  }
#define TILE_STORE(r) \
  if constexpr (R > r) store_row(a##r##0, a##r##1, t, r);

// R rows of x [R, K] times one block w [K, 16] (W: float or bf16 bits).
template <int R, typename W>
void tile(const float* x, const W* w, int64_t K, const Target& t, Ahead<W> ahead) {
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
         a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  for (int64_t k = 0; k < K; ++k) {
    ahead.step();
    __m256 w0, w1;
    load_line(w, k, w0, w1);
    TILE_ROW(0) TILE_ROW(1) TILE_ROW(2) TILE_ROW(3) TILE_ROW(4) TILE_ROW(5)
  }
  TILE_STORE(0) TILE_STORE(1) TILE_STORE(2) TILE_STORE(3) TILE_STORE(4) TILE_STORE(5)
}

// With AVX-512 a block is one register, so a tile holds twice the rows: 8 verified
// tokens are one pass over the block with enough accumulators to fill the FMA units.
#define TILE512_ROW(r) \
  if constexpr (R > r) a##r = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k]), wk, a##r);
#define TILE512_STORE(r)                                                                  \
  if constexpr (R > r)                                                                    \
    store_row(_mm512_castps512_ps256(a##r),                                               \
              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a##r), 1)), t, r);

template <int R, typename W>
__attribute__((target("avx512f"))) void tile512(const float* x, const W* w, int64_t K,
                                                const Target& t, Ahead<W> ahead) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
         a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0;
  for (int64_t k = 0; k < K; ++k) {
    ahead.step();
    const __m512 wk = load_line512(w, k);
    TILE512_ROW(0) TILE512_ROW(1) TILE512_ROW(2) TILE512_ROW(3) TILE512_ROW(4) TILE512_ROW(5)
    TILE512_ROW(6) TILE512_ROW(7) TILE512_ROW(8) TILE512_ROW(9) TILE512_ROW(10) TILE512_ROW(11)
  }
  TILE512_STORE(0) TILE512_STORE(1) TILE512_STORE(2) TILE512_STORE(3) TILE512_STORE(4)
  TILE512_STORE(5) TILE512_STORE(6) TILE512_STORE(7) TILE512_STORE(8) TILE512_STORE(9)
  TILE512_STORE(10) TILE512_STORE(11)
}

// Tiles of up to 6 rows run the AVX2 kernel (as fast as AVX-512's for so few rows), so
// both kernels serve on a machine with AVX-512.
const int64_t TILE_ROWS = __builtin_cpu_supports("avx512f") ? 12 : 6;

// The tile of exactly `rows` (1..R) rows.
template <int R, typename W>
void tile_rows(int64_t rows, const float* x, const W* w, int64_t K, const Target& t,
               Ahead<W> ahead) {
  if constexpr (R > 1)
    if (rows < R) return tile_rows<R - 1>(rows, x, w, K, t, ahead);
  if constexpr (R > 6) tile512<R>(x, w, K, t, ahead);
  else tile<R>(x, w, K, t, ahead);
}

// x [rows, K] times one 16-column block w [K, 16], in tiles of even sizes (8 rows: 4 + 4,
// not 6 + 2: a tile of few rows has too few accumulators to keep both FMA units busy);
// `next` is the block likely multiplied after this one, `t` addresses the first row's
// outputs.
template <typename W>
void block_rows(const float* x, int64_t rows, int64_t K, const W* w, const W* next, Target t) {
  const int64_t tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
  for (int64_t i = 0; i < tiles; ++i) {
    const int64_t tile = rows / tiles + (i < rows % tiles);
    const Ahead<W> ahead = tiles == 1 ? Ahead<W>{w + PREFETCH_K * COLS, 1}
                                      : Ahead<W>{next + i * K / tiles * COLS, tiles};
    tile_rows<12>(tile, x, w, K, t, ahead);
    x += tile * K;
    t.y += tile * t.ld;
    if (t.residual) t.residual += tile * t.ld;
  }
}

template <typename W>
void linear_blocks(const float* x, int64_t m, int64_t k, const W* w, int64_t blocks, int64_t n,
                   const float* bias, const float* residual, float* y, const Reads& next) {
  const int64_t chunks = (m + JOB_ROWS - 1) / JOB_ROWS;
  // Jobs run block-major, so consecutive jobs of one claim reuse a cached block.
  parallel_jobs(blocks * chunks, [&](int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / chunks, col = b * COLS, first = (job % chunks) * JOB_ROWS;
      Target t{y + first * n + col, bias ? bias + col : nullptr,
               residual ? residual + first * n + col : nullptr, n, std::min(COLS, n - col)};
      const W* block = w + b * k * COLS;
      block_rows(x + first * k, std::min(m, first + JOB_ROWS) - first, k, block, block + k * COLS,
                 t);
    }
  }, next);
}

}  // namespace

torch::Tensor huge_page_empty(torch::IntArrayRef sizes, torch::TensorOptions options) {
  const size_t page = size_t{1} << 21;
  const size_t bytes = (c10::multiply_integers(sizes) * options.dtype().itemsize() + page - 1) /
                       page * page;
  void* data = std::aligned_alloc(page, bytes);
  TORCH_CHECK(data, "out of memory for ", bytes, " bytes on huge pages");
  madvise(data, bytes, MADV_HUGEPAGE);
  return torch::from_blob(data, sizes, [](void* p) { std::free(p); }, options);
}

torch::Tensor block_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == torch::kFloat ||
                                    weight.scalar_type() == torch::kBFloat16),
              "a 2-D fp32 or bf16 weight");
  const int64_t n = weight.size(0), k = weight.size(1), blocks = (n + COLS - 1) / COLS;
  auto blocked = huge_page_empty({blocks, k, COLS}, weight.options());
  auto padded = torch::zeros({blocks * COLS, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  blocked.copy_(padded.view({blocks, COLS, k}).transpose(1, 2));
  return blocked;
}

torch::Tensor blocked_linear(const torch::Tensor& x, const torch::Tensor& blocked, int64_t n,
                             const torch::Tensor& bias, const std::optional<torch::Tensor>& residual) {
  const int64_t m = x.size(0);
  TORCH_CHECK(x.is_contiguous(), "x [M, K] contiguous");
  TORCH_CHECK(!residual || (residual->is_contiguous() && residual->size(0) == m), "residual [M, N]");
  auto y = torch::empty({m, n}, x.options());
  blocked_linear_into(x.data_ptr<float>(), m, x.size(1), blocked, n, data_or_null(bias),
                      residual ? residual->data_ptr<float>() : nullptr, y.data_ptr<float>());
  return y;
}

void blocked_linear_into(const float* x, int64_t m, int64_t k, const torch::Tensor& blocked,
                         int64_t n, const float* bias, const float* residual, float* y,
                         const Reads& next) {
  const int64_t blocks = blocked.size(0);
  TORCH_CHECK(blocked.size(1) == k, "x's K as the weight's");
  if (blocked.scalar_type() == torch::kBFloat16)
    linear_blocks(x, m, k, reinterpret_cast<const uint16_t*>(blocked.data_ptr()), blocks, n, bias,
                  residual, y, next);
  else
    linear_blocks(x, m, k, blocked.data_ptr<float>(), blocks, n, bias, residual, y, next);
}

Reads blocked_reads(const torch::Tensor& blocked, int64_t rows) {
  if (rows > JOB_ROWS) return {};
  // a job per block, as linear_blocks' for one chunk of rows
  return {blocked.data_ptr(), blocked.size(0), blocked.stride(0) * blocked.element_size()};
}

void matmul_rows(const float* x, int64_t rows, int64_t k, const float* w, int64_t block_stride,
                 int64_t n, float* y, int64_t ld, bool accumulate) {
  for (int64_t col = 0; col < n; col += COLS) {
    const float* block = w + col / COLS * block_stride;
    block_rows(x, rows, k, block, block + block_stride,
               {y + col, nullptr, accumulate ? y + col : nullptr, ld, std::min(COLS, n - col)});
  }
}
