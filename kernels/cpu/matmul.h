// Matmuls over weights laid out in column blocks, for CPU steps of any row count.
#pragma once
#include <torch/extension.h>

#include <optional>

#include "pool.h"

// An optional fp32 tensor's data (a bias, a residual), null where it is empty.
inline const float* data_or_null(const torch::Tensor& t) {
  return t.numel() ? t.data_ptr<float>() : nullptr;
}

// An uninitialised tensor in 2 MB-aligned memory on huge pages (where the kernel gives
// them): memory read through 4 KB pages streams slower here (a plain sum: 26-34 GB/s
// against 34-37 on huge pages), and a step reads every weight. Python has it zeroed, as
// `huge_page_zeros(sizes, dtype)` (bench_step's probe of such memory).
torch::Tensor huge_page_empty(torch::IntArrayRef sizes, torch::TensorOptions options);

// Output columns per block of block_weight's layout.
constexpr int64_t BLOCK_COLS = 16;

// A weight [N, K] (fp32 or bf16) as [ceil(N / 16), K, 16] of its dtype: each block holds 16
// output columns, one line (64 bytes; bf16 32) per k, so a block streams sequentially and its
// 16 columns are two AVX registers. The tail block is zero-padded. On huge pages.
torch::Tensor block_weight(const torch::Tensor& weight);

// x [M, K] @ weight.T (+ bias [N]) (+ residual [M, N]) -> [M, N] in fp32, with `blocked`
// from block_weight and N its weight's row count.
torch::Tensor blocked_linear(const torch::Tensor& x, const torch::Tensor& blocked, int64_t n,
                             const torch::Tensor& bias, const std::optional<torch::Tensor>& residual);

// The same into y [m, n] from rows x [m, k] (contiguous): bias [n] and residual [m, n] may be
// null, and residual may be y itself (each output adds its own element). `next`: the reads
// of the region the caller runs after this one (parallel_jobs).
void blocked_linear_into(const float* x, int64_t m, int64_t k, const torch::Tensor& blocked,
                         int64_t n, const float* bias, const float* residual, float* y,
                         const Reads& next = {});

// What blocked_linear_into's region over `blocked` reads first for `rows` rows (none for
// more rows than one job holds: such a step is bound by its FMAs, not its reads).
Reads blocked_reads(const torch::Tensor& blocked, int64_t rows);

// y [rows, n] = x [rows, k] @ w (+ y itself where `accumulate`), w in block_weight's
// layout (ceil(n / 16) blocks [k, 16], zero-padded, `block_stride` floats apart: k * 16
// when packed tight); y's rows are `ld` apart. On the calling thread: for callers that
// split the work into jobs themselves (attention tiles).
void matmul_rows(const float* x, int64_t rows, int64_t k, const float* w, int64_t block_stride,
                 int64_t n, float* y, int64_t ld, bool accumulate);
