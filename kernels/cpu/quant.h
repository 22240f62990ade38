// Matmuls over weights in GGUF's quantized blocks, without expanding them to fp32.
#pragma once
#include <torch/extension.h>

#include <optional>

#include "pool.h"

// GGML's ids of the block types served here.
// 32 weights a block, each block with an fp16 scale d (and for Q4_1, Q5_1 an fp16 offset m):
//   Q8_0 w = d q (int8 q); Q4_0 w = d (q - 8), Q4_1 w = d q + m (4-bit q);
//   Q5_0 w = d (q - 16), Q5_1 w = d q + m (5-bit q).
// K-quants, 256 weights a superblock:
//   Q4_K: fp16 d and dmin, 8 sub-blocks of 32 weights, each a 6-bit scale s and min m:
//         w = d s q - dmin m (4-bit q);
//   Q6_K: fp16 d, 16 sub-blocks of 16 weights, each an int8 scale s: w = d s (q - 32)
//         (6-bit q).
constexpr int64_t GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8,
                  GGML_Q4_K = 12, GGML_Q6_K = 14;
// BF16 (a "block" of one weight, 2 bytes): packed and multiplied by matmul.cpp's column
// blocks, widened to fp32 in registers.
constexpr int64_t GGML_BF16 = 30;

// Bytes of one GGUF block of `type` (an unsupported type is an error).
int64_t quant_block_bytes(int64_t type);

// A GGUF weight W [N, K] (uint8 [N, K / block weights * quant_block_bytes(type)], each row
// its blocks along K, as the file holds it) in quant_linear's layout: panels of 16 output
// columns, each panel its blocks along K, 16 columns' values then their scales (quant.cpp
// lays them out). About the file's bytes: Q4_K 4.625 bits a weight (its 6-bit sub-block
// scales a byte each), the others as many as the file's. Columns past N are zero. On huge
// pages (huge_page_empty).
torch::Tensor quant_pack(const torch::Tensor& weight, int64_t type);

// x [M, K] @ W.T (+ bias [N]) (+ residual [M, N]) -> [M, N], W packed by quant_pack with N
// its row count; K a multiple of the block's weights (256 for K-quants). x is quantized to
// int16 per 32 values on the way in.
torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t type,
                           int64_t n, const torch::Tensor& bias,
                           const std::optional<torch::Tensor>& residual);

// The same into y [m, n] from rows x [m, k] (contiguous): bias [n] and residual [m, n] may be
// null, and residual may be y itself (each output adds its own element). `next`: the reads
// of the region the caller runs after this one (parallel_jobs).
void quant_linear_into(const float* x, int64_t m, int64_t k, const torch::Tensor& packed,
                       int64_t type, int64_t n, const float* bias, const float* residual,
                       float* y, const Reads& next = {});

// What quant_linear_into's region over `packed` reads first for `rows` rows (none for more
// rows than one job holds: such a step is bound by its FMAs, not its reads).
Reads quant_reads(const torch::Tensor& packed, int64_t type, int64_t rows);

// Whether quant_linear runs its AVX-512 VNNI kernels (by default where the CPU has them:
// the same integer totals, scaled in another order). `enable` switches them, for tests and
// side-by-side runs; never while serving, since a sequence's logits would change mid-way.
bool quant_vnni(std::optional<bool> enable);
