// A Llama-family decoder's forward on CPU, for steps of any size.
//
// A step over few rows (decode, verification) is bound by reading the weights, a prefill
// chunk by the FMA units. The matmuls stream the weights' column blocks (matmul.cpp);
// everything between them (norms, RoPE, KV writes, paged attention reading the cache in
// place, SiLU, residuals) runs here in C++, so a step has no Python and no per-op
// dispatch between the layers' matmuls.
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <utility>
#include <vector>

#include "attention.h"
#include "matmul.h"
#include "pool.h"
#include "quant.h"
#include "simd.h"

namespace {

using torch::Tensor;

void rms_norm(const float* x, const float* weight, float eps, int64_t rows, int64_t dim,
              float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float scale = 1.f / std::sqrt(dot(xr, xr, dim) / dim + eps);
    for (int64_t i = 0; i < dim; ++i) out[r * dim + i] = xr[i] * scale * weight[i];
  }
}

// x * cos + roll(x, half) * sin per head; sin is negated in its first half (rope.py).
// tmp: scratch of `dim` floats.
void rope(float* heads, int64_t count, int64_t dim, const float* cos, const float* sin,
          float* tmp) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < count; ++h) {
    float* x = heads + h * dim;
    std::copy(x, x + dim, tmp);
    // the roll's two halves apart: no index modulo, so both loops vectorise
    for (int64_t i = 0; i < half; ++i) x[i] = tmp[i] * cos[i] + tmp[i + half] * sin[i];
    for (int64_t i = half; i < dim; ++i) x[i] = tmp[i] * cos[i] + tmp[i - half] * sin[i];
  }
}

// silu(gate) * up over `n` floats (n a multiple of 8 or not).
void silu_mul(const float* gate, const float* up, int64_t n, float* out) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 g = _mm256_loadu_ps(gate + j);
    const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e));
    _mm256_storeu_ps(out + j, _mm256_mul_ps(silu, _mm256_loadu_ps(up + j)));
  }
  for (; j < n; ++j) out[j] = gate[j] / (1.f + std::exp(-gate[j])) * up[j];
}

// Causal spans of at least this many new rows attend through attention.cpp's tiles.
constexpr int64_t TILED_MIN_ROWS = 8;
// Keys per job of a decode row's attention, about: a chunk's K and V rows of every KV head
// (48 KB each at 3 KV heads of dim 64) stay in L2 while every query head uses them.
constexpr int64_t DECODE_KEYS = 64;

// One of a layer's matmuls: its weight in block_weight's column blocks (type 0) or in
// quant_pack's layout of GGUF blocks (type: the GGML block type); bias may be empty.
struct Matmul {
  Tensor weight, bias;
  int64_t type, n;  // n: output columns

  // y [rows, n] = x [rows, k] @ W.T (+ bias) (+ residual, null or y itself); `next`: the
  // reads of the region after it (parallel_jobs).
  void operator()(const float* x, int64_t rows, int64_t k, const float* residual, float* y,
                  const Reads& next = {}) const {
    if (type)
      quant_linear_into(x, rows, k, weight, type, n, data_or_null(bias), residual, y, next);
    else
      blocked_linear_into(x, rows, k, weight, n, data_or_null(bias), residual, y, next);
  }

  // What this matmul reads first for `rows` rows (nothing where there is no weight).
  Reads reads(int64_t rows) const {
    if (!weight.numel()) return {};
    return type ? quant_reads(weight, type, rows) : blocked_reads(weight, rows);
  }
};

// One decoder layer's weights and its K/V caches.
struct Layer {
  Tensor input_norm, post_norm;
  Matmul qkv, o, gate_up, down;
  Tensor k_cache, v_cache;  // [slots, kv_heads, head_dim]
};

// One forward pass's sequences: each has `num_new` rows starting at `first_row`, sees
// `num_cached` cached tokens in full, and among its new tokens either causally
// (mask_offset < 0) or by a [num_new, num_new] mask stored at `masks[mask_offset]`.
struct Spans {
  const int64_t* table;  // [count, 5]: first_row, num_new, num_cached, slot_offset, mask_offset
  int64_t count;
  const int64_t* slots;  // each span's context slots (cached then new) from its slot_offset
  const bool* masks;
};

class Decoder {
 public:
  // layers: per layer its 10 weights (input norm, qkv and bias, o and bias, post norm,
  // gate_up and bias, down and bias) and 2 caches; types: per layer its 4 matmuls' types.
  // embedding [vocab, hidden]: the rows token ids look up.
  // feature_norm (empty: none) makes the one layer an EAGLE-3 head's: its attention reads
  // [input_norm(embedding); feature_norm(feature)] and its residual stream starts at the
  // feature.
  // rope_cos, rope_sin [positions, head_dim]: the tables rows are looked up in by position.
  // lm_head (weight empty: none): the LM head's packed weight, block type and vocabulary,
  // applied to the returned rows.
  Decoder(std::vector<std::vector<Tensor>> layers, std::vector<std::vector<int64_t>> types,
          Tensor embedding, Tensor final_norm, Tensor feature_norm, Tensor rope_cos,
          Tensor rope_sin, Tensor lm_head, int64_t lm_head_type, int64_t vocab, double eps,
          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate_size)
      : embedding_(embedding), norm_(final_norm), feature_norm_(feature_norm), cos_(rope_cos),
        sin_(rope_sin), lm_head_{lm_head, torch::empty(0), lm_head_type, vocab}, eps_(eps),
        heads_(num_heads), kv_heads_(num_kv_heads), dim_(head_dim), hidden_(final_norm.numel()),
        inter_(intermediate_size) {
    TORCH_CHECK(rope_cos.dim() == 2 && rope_cos.size(1) == head_dim && rope_cos.is_contiguous() &&
                    rope_sin.sizes() == rope_cos.sizes() && rope_sin.is_contiguous(),
                "rope tables [positions, head_dim], contiguous");
    TORCH_CHECK(layers.size() == types.size(), "a matmul type list per layer");
    TORCH_CHECK(embedding.dim() == 2 && embedding.size(1) == hidden_ && embedding.is_contiguous() &&
                    embedding.scalar_type() == torch::kFloat,
                "embedding [vocab, hidden] fp32, contiguous");
    TORCH_CHECK(head_dim % 8 == 0, "head_dim a multiple of 8 (attention's AVX rows)");
    TORCH_CHECK(!feature_norm.numel() || layers.size() == 1, "a feature norm takes one layer");
    const int64_t qkv_size = (heads_ + 2 * kv_heads_) * dim_;
    for (size_t i = 0; i < layers.size(); ++i) {
      const auto& l = layers[i];
      const auto& t = types[i];
      TORCH_CHECK(l.size() == 12 && t.size() == 4, "a layer is 10 weights, 2 caches, 4 types");
      layers_.push_back({l[0], l[5], {l[1], l[2], t[0], qkv_size}, {l[3], l[4], t[1], hidden_},
                         {l[6], l[7], t[2], 2 * inter_}, {l[8], l[9], t[3], hidden_}, l[10],
                         l[11]});
    }
  }

  // ids [rows] the tokens; features [rows, hidden] their features where the decoder has a
  // feature norm (else empty); positions [rows]; spans [count * 5] (per span: first row,
  // new rows, cached tokens, offset into block_ids, offset into masks or -1), each span's
  // block ids as many as its tokens fill from that offset. Returns the final-normed hidden
  // states (where the decoder holds an LM head, their logits) and the hidden states before
  // that norm, both at `out_rows`, then the residual stream after each layer in
  // `aux_layers` (all rows), in that order. Plain lists, not tensors: a decode step's
  // Python runs with the caches full of the last step's weights, where making a tensor
  // costs many times what passing its list does.
  std::vector<Tensor> forward(std::vector<int64_t> ids, Tensor features,
                              std::vector<int64_t> positions, std::vector<int64_t> spans,
                              std::vector<int64_t> block_ids, int64_t block_size, Tensor masks,
                              std::vector<int64_t> aux_layers, std::vector<int64_t> out_row_list) {
    const int64_t rows = static_cast<int64_t>(ids.size());
    const int64_t q_size = heads_ * dim_, kv_size = kv_heads_ * dim_;
    const int64_t qkv_size = q_size + 2 * kv_size;
    auto opts = embedding_.options();
    Tensor h = embed(ids);
    const Tensor out_rows = torch::tensor(out_row_list, opts.dtype(torch::kLong));
    // the layers' scratch, reused by each: no allocation between their parallel regions
    Tensor normed = torch::empty({rows, hidden_}, opts), qkv = torch::empty({rows, qkv_size}, opts);
    Tensor attn = torch::empty({rows, q_size}, opts), act = torch::empty({rows, inter_}, opts);
    Tensor gate_up = torch::empty({rows, 2 * inter_}, opts);
    check_positions(positions, rows);
    const SpanSlots slotted = span_slots(spans, block_ids, block_size, rows);
    const int64_t* slot_of_row = slotted.new_slots.data();
    Spans s{slotted.table.data(), static_cast<int64_t>(spans.size()) / 5, slotted.slots.data(),
            masks.numel() ? masks.data_ptr<bool>() : nullptr};
    // Every row's K and V are written at every layer, but past them the last layer is
    // needed only at the rows returned, unless its output is captured for all rows.
    const int64_t last = static_cast<int64_t>(layers_.size()) - 1;
    const bool trim = std::find(aux_layers.begin(), aux_layers.end(), last) == aux_layers.end();
    TORCH_CHECK(features.numel() == (feature_norm_.numel() ? h.numel() : 0),
                "features [rows, hidden] exactly where the decoder has a feature norm");
    std::vector<Tensor> out(2 + aux_layers.size());
    for (int64_t i = 0; i <= last; ++i) {
      const Layer& l = layers_[i];
      const Matmul& after = i < last ? layers_[i + 1].qkv : lm_head_;
      const Tensor in = attention_input(l, h, features, normed);
      float* qp = qkv.data_ptr<float>();
      l.qkv(in.data_ptr<float>(), rows, in.size(1), nullptr, qp);
      float* kc = l.k_cache.data_ptr<float>();
      float* vc = l.v_cache.data_ptr<float>();
      parallel_jobs(rows, [&](int64_t begin, int64_t end) {
        std::vector<float> rope_tmp(dim_);
        for (int64_t r = begin; r < end; ++r) {
          float* row = qp + r * qkv_size;
          const float* cp = cos_.data_ptr<float>() + positions[r] * dim_;
          const float* sp = sin_.data_ptr<float>() + positions[r] * dim_;
          rope(row, heads_ + kv_heads_, dim_, cp, sp, rope_tmp.data());
          std::copy(row + q_size, row + q_size + kv_size, kc + slot_of_row[r] * kv_size);
          std::copy(row + q_size + kv_size, row + qkv_size, vc + slot_of_row[r] * kv_size);
        }
      });
      if (trim && i == last) {
        const std::vector<int64_t> table = kept_spans(s, out_rows, rows);
        const Spans kept{table.data(), static_cast<int64_t>(table.size()) / 5, s.slots, s.masks};
        attention(qp, qkv_size, kc, vc, kept, attn.data_ptr<float>(), l.o.reads(out_rows.numel()));
        h = h.index_select(0, out_rows);
        finish_layer(l, attn.index_select(0, out_rows).data_ptr<float>(), h, normed, gate_up, act,
                     after);
      } else {
        attention(qp, qkv_size, kc, vc, s, attn.data_ptr<float>(), l.o.reads(rows));
        finish_layer(l, attn.data_ptr<float>(), h, normed, gate_up, act, after);
      }
      for (size_t a = 0; a < aux_layers.size(); ++a)
        if (aux_layers[a] == i) out[2 + a] = h.clone();  // h changes in place
    }
    if (!trim) h = h.index_select(0, out_rows);
    Tensor final_normed = torch::empty({h.size(0), hidden_}, opts);
    rms_norm(h.data_ptr<float>(), norm_.data_ptr<float>(), eps_, h.size(0), hidden_,
             final_normed.data_ptr<float>());
    out[0] = final_normed;
    if (lm_head_.weight.numel()) {
      out[0] = torch::empty({h.size(0), lm_head_.n}, opts);
      // the next step, one like this, starts with the first layer's qkv
      lm_head_(final_normed.data_ptr<float>(), h.size(0), hidden_, nullptr,
               out[0].data_ptr<float>(), layers_[0].qkv.reads(rows));
    }
    out[1] = h;
    return out;
  }

 private:
  // The token ids' embedding rows [rows, hidden].
  Tensor embed(const std::vector<int64_t>& ids) const {
    Tensor x = torch::empty({static_cast<int64_t>(ids.size()), hidden_}, embedding_.options());
    const float* table = embedding_.data_ptr<float>();
    float* rows = x.data_ptr<float>();
    for (size_t r = 0; r < ids.size(); ++r) {
      TORCH_CHECK(ids[r] >= 0 && ids[r] < embedding_.size(0), "token id ", ids[r],
                  " past the vocabulary");
      std::copy_n(table + ids[r] * hidden_, hidden_, rows + r * hidden_);
    }
    return x;
  }

  // A position per row, each within the rope tables.
  void check_positions(const std::vector<int64_t>& positions, int64_t rows) const {
    TORCH_CHECK(static_cast<int64_t>(positions.size()) == rows, "a position per row");
    for (const int64_t at : positions)
      TORCH_CHECK(at >= 0 && at < cos_.size(0), "position ", at, " past the rope tables");
  }

  // The spans' context slots (cached then new), from their block ids: `table` is the
  // spans' with column 3 their offset into `slots`; new_slots[row] the slot a new row's K
  // and V go to.
  struct SpanSlots {
    std::vector<int64_t> table, slots, new_slots;
  };
  static SpanSlots span_slots(const std::vector<int64_t>& spans,
                              const std::vector<int64_t>& block_ids, int64_t block_size,
                              int64_t rows) {
    TORCH_CHECK(spans.size() % 5 == 0 && block_size > 0, "spans [count * 5], block size > 0");
    const int64_t* ids = block_ids.data();
    const auto blocks = static_cast<int64_t>(block_ids.size());
    SpanSlots out{spans, {}, std::vector<int64_t>(rows, -1)};
    for (size_t i = 0; i < spans.size() / 5; ++i) {
      int64_t* span = out.table.data() + i * 5;
      const int64_t first = span[0], num_new = span[1], cached = span[2], total = cached + num_new;
      TORCH_CHECK(first >= 0 && num_new >= 0 && cached >= 0 && first + num_new <= rows,
                  "span ", i, " past the step's rows");
      TORCH_CHECK(span[3] >= 0 && span[3] + (total + block_size - 1) / block_size <= blocks,
                  "span ", i, " past the block ids");
      const int64_t at = static_cast<int64_t>(out.slots.size());
      for (int64_t k = 0; k < total; ++k)
        out.slots.push_back(ids[span[3] + k / block_size] * block_size + k % block_size);
      for (int64_t k = 0; k < num_new; ++k) out.new_slots[first + k] = out.slots[at + cached + k];
      span[3] = at;
    }
    for (const int64_t slot : out.new_slots) TORCH_CHECK(slot >= 0, "a row in no span");
    return out;
  }

  // A layer's attention input: its input norm of the residual stream h (into `normed`), or
  // in an EAGLE-3 head [input_norm(h); feature_norm(features)], h becoming a copy of the
  // features (the layer adds to it in place).
  Tensor attention_input(const Layer& l, Tensor& h, const Tensor& features, Tensor& normed) const {
    const int64_t rows = h.size(0);
    const float* w = l.input_norm.data_ptr<float>();
    if (!feature_norm_.numel()) {
      rms_norm(h.data_ptr<float>(), w, eps_, rows, hidden_, normed.data_ptr<float>());
      return normed;
    }
    Tensor both = torch::empty({rows, 2 * hidden_}, h.options());
    const Tensor embedded = h;
    h = features.clone(at::MemoryFormat::Contiguous);
    const float *hp = embedded.data_ptr<float>(), *fp = h.data_ptr<float>();
    const float* fw = feature_norm_.data_ptr<float>();
    float* bp = both.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
      rms_norm(hp + r * hidden_, w, eps_, 1, hidden_, bp + 2 * r * hidden_);
      rms_norm(fp + r * hidden_, fw, eps_, 1, hidden_, bp + (2 * r + 1) * hidden_);
    }
    return both;
  }

  // A layer past its attention at h's rows (attn [rows, heads * dim]), onto the residual
  // stream h in place: h += o(attn), then h += the MLP of its post-norm. normed, gate_up,
  // act: scratch of at least as many rows; `after`: the matmul that follows the layer.
  void finish_layer(const Layer& l, const float* attn, Tensor& h, const Tensor& normed,
                    const Tensor& gate_up, const Tensor& act, const Matmul& after) const {
    const int64_t rows = h.size(0), inter = inter_;
    float *hp = h.data_ptr<float>(), *np = normed.data_ptr<float>();
    float *gp = gate_up.data_ptr<float>(), *ap = act.data_ptr<float>();
    l.o(attn, rows, heads_ * dim_, hp, hp, l.gate_up.reads(rows));
    rms_norm(hp, l.post_norm.data_ptr<float>(), eps_, rows, hidden_, np);
    l.gate_up(np, rows, hidden_, nullptr, gp, l.down.reads(rows));
    parallel_jobs(rows, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        silu_mul(gp + r * 2 * inter, gp + r * 2 * inter + inter, inter, ap + r * inter);
    });
    l.down(ap, rows, inter, hp, hp, after.reads(rows));
  }

  // The spans attention needs for the `keep` rows only: a causal span with rows not kept
  // becomes a span of one row per kept row (seeing its context up to that row); the
  // others stay whole. Rows as in Spans' table.
  static std::vector<int64_t> kept_spans(const Spans& s, const Tensor& keep, int64_t rows) {
    std::vector<char> kept(rows, 0);
    const int64_t* kp = keep.data_ptr<int64_t>();
    for (int64_t k = 0; k < keep.numel(); ++k) {
      TORCH_CHECK(kp[k] >= 0 && kp[k] < rows, "out_rows: row ", kp[k], " of ", rows);
      kept[kp[k]] = 1;
    }
    std::vector<int64_t> table;
    for (int64_t i = 0; i < s.count; ++i) {
      const int64_t* span = s.table + i * 5;
      const int64_t first = span[0], num_new = span[1];
      const auto count = std::count(kept.begin() + first, kept.begin() + first + num_new, 1);
      if (span[4] >= 0 || count == num_new) {
        table.insert(table.end(), span, span + 5);
        continue;
      }
      for (int64_t r = first; r < first + num_new; ++r)
        if (kept[r]) table.insert(table.end(), {r, 1, span[2] + r - first, span[3], -1});
    }
    return table;
  }

  // Softmax attention of each query head over its span's visible context, reading K and V
  // in place from the paged caches. q rows have stride `ld`; out is [rows, heads * dim].
  // Causal spans of many rows (prefill chunks) take the tiled kernel; the others (decode
  // rows, draft trees with their masks) go row by row.
  void attention(const float* q, int64_t ld, const float* kc, const float* vc, const Spans& s,
                 float* out, const Reads& next) const {
    std::vector<const int64_t*> rowwise;
    for (int64_t i = 0; i < s.count; ++i) {
      const int64_t* span = s.table + i * 5;
      if (span[4] < 0 && span[1] >= TILED_MIN_ROWS)
        causal_attention(q + span[0] * ld, ld, kc, vc, s.slots + span[3], span[2], span[1],
                         heads_, kv_heads_, dim_, out + span[0] * heads_ * dim_);
      else
        rowwise.push_back(span);
    }
    if (!rowwise.empty()) row_attention(q, ld, kc, vc, s, rowwise, out, next);
  }

  // A query row of a rowwise span: its row, the keys it sees (those past `cached` only
  // where `mask` says), its context slots, and its chunks: `chunks` jobs from `first_job`,
  // `chunk_keys` keys each (the last fewer).
  struct QueryRow {
    int64_t row, visible, cached, first_job, chunks, chunk_keys;
    const bool* mask;
    const int64_t* slots;
  };

  // A row's chunks: at most DECODE_KEYS keys each, as many as a multiple of the threads
  // and of equal size (in whole 8-key groups), so that one row's chunks end together.
  static std::pair<int64_t, int64_t> split_keys(int64_t visible) {
    const int64_t threads = get_num_threads();
    const int64_t n = ((visible + DECODE_KEYS - 1) / DECODE_KEYS + threads - 1) / threads * threads;
    const int64_t keys = ((visible + n - 1) / n + 7) / 8 * 8;
    return {(visible + keys - 1) / keys, keys};
  }

  // A job per query row and chunk of its keys, over every head (one thread reads the
  // chunk's slots whole and in order, each K/V row once for all query heads). The job that
  // finishes a row's last chunk merges the row's chunks.
  void row_attention(const float* q, int64_t ld, const float* kc, const float* vc,
                     const Spans& s, const std::vector<const int64_t*>& spans, float* out,
                     const Reads& next) const {
    const int64_t part = partial_floats();
    std::vector<QueryRow> rows;
    std::vector<int64_t> job_row;  // each job's index into rows
    for (const int64_t* span : spans) {
      const int64_t first = span[0], num_new = span[1], cached = span[2];
      const bool* mask = span[4] < 0 ? nullptr : s.masks + span[4];
      for (int64_t i = 0; i < num_new; ++i) {
        const int64_t visible = cached + (mask ? num_new : i + 1);
        const auto [chunks, chunk_keys] = split_keys(visible);
        rows.push_back({first + i, visible, cached, static_cast<int64_t>(job_row.size()), chunks,
                        chunk_keys, mask ? mask + i * num_new : nullptr, s.slots + span[3]});
        job_row.resize(job_row.size() + chunks, rows.size() - 1);
      }
    }
    std::vector<float> partials(job_row.size() * part);
    const auto chunks_done = std::make_unique<std::atomic<int64_t>[]>(rows.size());
    parallel_jobs(job_row.size(), [&](int64_t begin, int64_t end) {
      std::vector<float> p(heads_ * (DECODE_KEYS + 8));  // split_keys' chunks are no longer
      for (int64_t job = begin; job < end; ++job) {
        const QueryRow& r = rows[job_row[job]];
        const int64_t from = (job - r.first_job) * r.chunk_keys;
        float* o = partials.data() + job * part;
        partial_attention(q + r.row * ld, heads_, {kc, vc, r.slots, kv_heads_, dim_}, from,
                          std::min(r.visible, from + r.chunk_keys), r.cached, r.mask, p.data(),
                          o, o + heads_ * dim_, o + heads_ * (dim_ + 1));
        // acq_rel: the merging job sees every chunk's partials
        if (chunks_done[job_row[job]].fetch_add(1, std::memory_order_acq_rel) == r.chunks - 1)
          merge_row(r, partials.data() + r.first_job * part, out);
      }
    }, next);
  }

  // One chunk's partial: every head's output, then their maxima, then their sums.
  int64_t partial_floats() const { return heads_ * (dim_ + 2); }

  // Every query head of row r from its chunks' partials.
  void merge_row(const QueryRow& r, const float* partials, float* out) const {
    const int64_t part = partial_floats();
    for (int64_t h = 0; h < heads_; ++h)
      merge_partials(partials, r.chunks, part, h * dim_, heads_ * dim_ + h,
                     heads_ * (dim_ + 1) + h, dim_, out + r.row * heads_ * dim_ + h * dim_);
  }

  std::vector<Layer> layers_;
  Tensor embedding_, norm_, feature_norm_, cos_, sin_;
  Matmul lm_head_;
  float eps_;
  int64_t heads_, kv_heads_, dim_, hidden_, inter_;
};

// attention.h's causal_attention over tensors: q [num_new, heads, dim], caches [slots,
// kv_heads, dim], ctx [num_cached + num_new] slots. Returns [num_new, heads * dim].
Tensor causal_attention_op(Tensor q, Tensor k_cache, Tensor v_cache, Tensor ctx,
                           int64_t num_cached) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "contiguous q and caches");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k_cache.scalar_type() == torch::kFloat &&
                  v_cache.scalar_type() == torch::kFloat && ctx.scalar_type() == torch::kLong,
              "fp32 q and caches, int64 slots");
  const int64_t num_new = q.size(0), heads = q.size(1), dim = q.size(2);
  TORCH_CHECK(ctx.numel() == num_cached + num_new, "a slot per context token");
  Tensor out = torch::empty({num_new, heads * dim}, q.options());
  causal_attention(q.data_ptr<float>(), heads * dim, k_cache.data_ptr<float>(),
                   v_cache.data_ptr<float>(), ctx.data_ptr<int64_t>(), num_cached, num_new,
                   heads, k_cache.size(1), dim, out.data_ptr<float>());
  return out;
}

// rms_norm over the rows of x [..., dim] (fp32) with weight [dim]: one op where torch's
// CPU rms_norm dispatches several, which dominates it for the few rows a drafter step has.
Tensor rms_norm_op(const Tensor& x, const Tensor& weight, double eps) {
  const int64_t dim = weight.numel();
  TORCH_CHECK(x.scalar_type() == torch::kFloat && weight.scalar_type() == torch::kFloat &&
                  x.is_contiguous() && weight.is_contiguous() && x.size(-1) == dim,
              "fp32 contiguous x [..., dim] and weight [dim]");
  Tensor out = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t rows = x.numel() / dim, per_job = 64;  // fewer rows are not worth a region
  parallel_jobs((rows + per_job - 1) / per_job, [&](int64_t begin, int64_t end) {
    const int64_t first = begin * per_job, last = std::min(rows, end * per_job);
    rms_norm(xp + first * dim, wp, eps, last - first, dim, op + first * dim);
  });
  return out;
}

// The index of the largest of x[0..n): the first of equal ones, and the first NaN where
// there is one (torch.argmax's answer). 8 lanes keep their best value and its index.
int64_t argmax_row(const float* x, int64_t n) {
  __m256 best = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
  __m256 at = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), index = at;  // exact below 2^24
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    const __m256 greater = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, v, greater);
    at = _mm256_blendv_ps(at, index, greater);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    index = _mm256_add_ps(index, _mm256_set1_ps(8.f));
  }
  alignas(32) float values[8], indexes[8];
  _mm256_store_ps(values, best);
  _mm256_store_ps(indexes, at);
  float top = -INFINITY;
  int64_t top_at = 0;
  for (int l = 0; l < 8; ++l) {
    const auto i = static_cast<int64_t>(indexes[l]);
    if (values[l] > top || (values[l] == top && i < top_at)) top = values[l], top_at = i;
  }
  const bool has_nan = _mm256_movemask_ps(nan);
  for (int64_t i = has_nan ? 0 : j; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > top) top = x[i], top_at = i;
  }
  return top_at;
}

// x [rows, n] (fp32) -> each row's argmax [rows], as torch.argmax(x, -1): a vectorised
// pass where torch's takes ~30 us a row of a 49k vocabulary (a verified tree has ~10).
Tensor argmax_op(const Tensor& x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.is_contiguous() &&
                  x.size(1) > 0,
              "fp32 contiguous x [rows, n > 0]");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(n <= (int64_t{1} << 24), "at most 2^24 columns (the lanes count them in fp32)");
  Tensor out = torch::empty({rows}, x.options().dtype(torch::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  parallel_jobs(rows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * n, n);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Decoder>(m, "Decoder")
      .def(pybind11::init<std::vector<std::vector<Tensor>>, std::vector<std::vector<int64_t>>,
                          Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, int64_t, int64_t, double,
                          int64_t, int64_t, int64_t, int64_t>())
      .def("forward", &Decoder::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("block_weight", &block_weight);
  m.def("huge_page_zeros", [](std::vector<int64_t> sizes, torch::ScalarType dtype) {
    return huge_page_empty(sizes, torch::TensorOptions().dtype(dtype)).zero_();
  });
  m.def("causal_attention", &causal_attention_op,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("blocked_linear", &blocked_linear, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("quant_linear", &quant_linear, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("quant_pack", &quant_pack);
  m.def("rms_norm", &rms_norm_op, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("argmax", &argmax_op, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("quant_block_bytes", &quant_block_bytes);
  m.def("quant_vnni", &quant_vnni, pybind11::arg("enable") = pybind11::none());
  m.def("set_num_threads", &set_num_threads);
  m.def("get_num_threads", &get_num_threads);
}
