// Causal attention over a long span (prefill), tiled, reading the paged caches in place.
#pragma once
#include <cstdint>

// Causal attention of one sequence's `num_new` new rows (positions num_cached ..
// num_cached + num_new - 1) over its context: `ctx` lists the cache slots of its
// num_cached + num_new tokens, caches are [slots, kv_heads, dim]. q rows are `ld` floats
// apart (query heads side by side); out rows are heads * dim. Runs on the pool.
void causal_attention(const float* q, int64_t ld, const float* k_cache, const float* v_cache,
                      const int64_t* ctx, int64_t num_cached, int64_t num_new, int64_t heads,
                      int64_t kv_heads, int64_t dim, float* out);
