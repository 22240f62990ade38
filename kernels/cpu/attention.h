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

// Where a sequence's keys and values live: caches [slots, kv_heads, dim], its keys at
// cache slots ctx[0..].
struct KVRows {
  const float *k, *v;
  const int64_t* ctx;
  int64_t kv_heads, dim;
};

// Decode attention of one query row, a chunk of keys at a time: its `heads` query heads
// (q: side by side, dim floats each, dim a multiple of 8; head h reads KV head
// h / (heads / kv_heads)) over keys [begin, end) of their context, each key's K and V
// rows (every KV head's, contiguous in a slot) read once, in order. Key j >= `cached` is
// seen only where mask[j - cached] (no mask: all are). Per head h, with
// s_j = q_h k_j / sqrt(dim) and m = max_j s_j over the seen keys:
//   out[h * dim ..] = sum_j e^(s_j - m) v_j,  max[h] = m,  sum[h] = sum_j e^(s_j - m)
// (m = -inf, sum 0 where no key of the chunk is seen). `p`: scratch of
// heads * (end - begin + 8) floats.
void partial_attention(const float* q, int64_t heads, const KVRows& kv, int64_t begin,
                       int64_t end, int64_t cached, const bool* mask, float* p, float* out,
                       float* max, float* sum);

// One head's attention from its chunks' partials: `count` partials `step` floats apart,
// the head's out, max and sum at `out_at`, `max_at`, `sum_at` floats into each:
//   o = sum_c e^(m_c - M) out_c / sum_c e^(m_c - M) sum_c,  M = max_c m_c.
void merge_partials(const float* parts, int64_t count, int64_t step, int64_t out_at,
                    int64_t max_at, int64_t sum_at, int64_t dim, float* out);
