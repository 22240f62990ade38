// Attention reading the paged caches in place: tiled over a long causal span (prefill),
// one query row at a time otherwise (decode rows, draft trees).
#pragma once
#include <cstdint>

// Causal attention of one sequence's `num_new` new rows (positions num_cached ..
// num_cached + num_new - 1) over its context: `ctx` lists the cache slots of its
// num_cached + num_new tokens, caches are [slots, kv_heads, dim]. q rows are `ld` floats
// apart (query heads side by side); out rows are heads * dim. Runs on the pool.
void causal_attention(const float* q, int64_t ld, const float* k_cache, const float* v_cache,
                      const int64_t* ctx, int64_t num_cached, int64_t num_new, int64_t heads,
                      int64_t kv_heads, int64_t dim, float* out);

// Softmax attention of one query head's row `q` (dim floats, dim a multiple of 8) over
// keys 0..visible-1 of its context, at cache slots ctx[j] (caches [slots, kv_heads, dim],
// this head's KV head at `kv_off` floats into a slot's `stride`); key j >= `cached` is
// seen only where mask[j - cached] (no mask: all are). `p`: scratch of visible + 8 floats.
// Writes dim floats to out.
void row_attention(const float* q, float scale, const float* k_cache, const float* v_cache,
                   const int64_t* ctx, int64_t visible, int64_t cached, const bool* mask,
                   int64_t stride, int64_t kv_off, int64_t dim, float* p, float* out);
