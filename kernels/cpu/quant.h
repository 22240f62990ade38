// Matmuls over weights in GGUF's quantized blocks, without expanding them to fp32.
#pragma once
#include <torch/extension.h>

#include <optional>

// GGML's ids of the block types served here: 32 weights a block, each block with an fp16
// scale d (and for Q4_1 an fp16 offset m): Q8_0 w = d q (int8 q); Q4_0 w = d (q - 8) and
// Q4_1 w = d q + m (4-bit q).
constexpr int64_t GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q8_0 = 8;

// Bytes of one GGUF block of `type` (an unsupported type is an error).
int64_t quant_block_bytes(int64_t type);

// A GGUF weight W [N, K] (uint8 [N, K / 32 * quant_block_bytes(type)], each row its blocks
// along K, as the file holds it) in quant_linear's layout: groups of 8 output columns, each
// group its blocks along K, each block the 8 columns' values then their scales (4-bit
// types: [4 x 32 bytes of nibbles, columns p and p + 4 in 32-byte row p][8 fp16 d][8 fp16
// m]; Q8_0: [8 x 32 int8][8 fp16 d]). Columns past N are zero.
torch::Tensor quant_pack(const torch::Tensor& weight, int64_t type);

// x [M, K] @ W.T (+ bias [N]) (+ residual [M, N]) -> [M, N], W packed by quant_pack with N
// its row count. x is quantized to int16 per 32 values on the way in.
torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t type,
                           int64_t n, const torch::Tensor& bias,
                           const std::optional<torch::Tensor>& residual);

