#pragma once
// Multi-head latent attention (DeepSeek V2/V3) decode in the weight-absorbed form, over the paged
// latent cache (layers/mla.py): per decode row and head,
//
//   q_c = W_UK[h]^T q_nope           (kv_lora_rank values)
//   s_j = scale * ([q_c, q_rope] . cache_j)    for the row's context positions j (cache_j = [c_j, k_r,j])
//   o   = W_UV[h] (sum_j softmax(s)_j c_j)
//
// where kv_b_proj stacks W_UK[h] (qk_nope rows) and W_UV[h] (v_head_dim rows) per head. A work
// item is one head over every row of the batch (its weights are read once per step); each row's
// arithmetic is a fixed sequence (16-lane FMA chains reduced by one fixed tree, positions
// ascending) that depends on nothing but that row, so rows are batch invariant by construction;
// the softmax's exp is the 16-lane polynomial of kernels/vexp.h on AVX-512 machines and std::exp
// elsewhere (chosen once per process). Included by kernels/attention.cpp (decode rows) and
// kernels/attention_mla_rows.cpp (chunks of rows, the same per-row arithmetic tile by tile).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/vexp.h"

namespace agent_infer {
namespace {

struct MlaArgs {
  const float* q_nope;  // row r, head h at q_nope + r * qn_row + h * qn_head (nope contiguous floats)
  const float* q_rope;  // likewise with qr_row, qr_head (rope floats, rotated)
  const float* cache;   // [num_slots, lora + rope]
  const float* w;       // kv_b_proj [heads * (nope + v), lora]
  float* out;           // [num_rows, heads * v]
  const int64_t* rows;
  const int64_t* tables;
  const int64_t* ctx;
  size_t batch, max_blocks, block_size, heads, nope, rope, lora, v;
  size_t qn_row, qn_head, qr_row, qr_head;
  float scale;
};

// The operands both entry points take (decode rows, chunks of rows), checked: q_nope and q_rope
// rows and heads at the given strides (in floats; each head's nope or rope values contiguous),
// cache [num_slots, lora + rope], kv_b [heads * (nope + v), lora], out [num_rows, heads * v];
// float32, kept alive by the caller, who sets the rows, tables and context. `who` names the entry
// point in errors.
[[maybe_unused]] inline MlaArgs mla_args(const char* who, uintptr_t q_nope, uintptr_t q_rope, uintptr_t cache,
                                         uintptr_t kv_b, uintptr_t out, int64_t heads, int64_t nope, int64_t rope,
                                         int64_t lora, int64_t v, double scale, int64_t qn_row, int64_t qn_head,
                                         int64_t qr_row, int64_t qr_head) {
  const std::string name(who);
  if (!q_nope || !q_rope || !cache || !kv_b || !out) throw std::invalid_argument(name + ": null address");
  if (heads < 1 || nope < 1 || rope < 0 || lora < 1 || v < 1)
    throw std::invalid_argument(name + ": heads, nope, lora and v must be positive (rope >= 0)");
  if (qn_head < nope || qn_row < heads * qn_head || qr_head < rope || qr_row < heads * qr_head)
    throw std::invalid_argument(name + ": q strides overlap their heads");
  MlaArgs a{};
  a.q_nope = reinterpret_cast<const float*>(q_nope);
  a.q_rope = reinterpret_cast<const float*>(q_rope);
  a.cache = reinterpret_cast<const float*>(cache);
  a.w = reinterpret_cast<const float*>(kv_b);
  a.out = reinterpret_cast<float*>(out);
  a.heads = static_cast<size_t>(heads);
  a.nope = static_cast<size_t>(nope);
  a.rope = static_cast<size_t>(rope);
  a.lora = static_cast<size_t>(lora);
  a.v = static_cast<size_t>(v);
  a.scale = static_cast<float>(scale);
  a.qn_row = static_cast<size_t>(qn_row);
  a.qn_head = static_cast<size_t>(qn_head);
  a.qr_row = static_cast<size_t>(qr_row);
  a.qr_head = static_cast<size_t>(qr_head);
  return a;
}

constexpr size_t kMlaLanes = 16;

// Sum of a[i] * b[i] over 16 lane chains (lane i % 16, i ascending), then a fixed halving tree.
__attribute__((always_inline)) inline float mla_dot(const float* a, const float* b, size_t n) {
  float acc[kMlaLanes] = {};
  size_t i = 0;
  for (; i + kMlaLanes <= n; i += kMlaLanes)
    for (size_t l = 0; l < kMlaLanes; ++l) acc[l] = std::fma(a[i + l], b[i + l], acc[l]);
  for (size_t l = 0; i + l < n; ++l) acc[l] = std::fma(a[i + l], b[i + l], acc[l]);
  for (size_t width = kMlaLanes / 2; width; width /= 2)
    for (size_t l = 0; l < width; ++l) acc[l] += acc[l + width];
  return acc[0];
}

// y[i] = fma(a, x[i], y[i]): one rounding per element, whatever the vector width.
__attribute__((always_inline)) inline void mla_axpy(float* y, float a, const float* x, size_t n) {
  for (size_t i = 0; i < n; ++i) y[i] = std::fma(a, x[i], y[i]);
}

template <bool kSimdExp>
__attribute__((always_inline)) inline void mla_head_impl(const MlaArgs& a, size_t h, std::vector<float>& buf) {
  const size_t dim = a.lora + a.rope;
  const float* wk = a.w + h * (a.nope + a.v) * a.lora;
  const float* wv = wk + a.nope * a.lora;
  size_t longest = 0;
  for (size_t b = 0; b < a.batch; ++b) longest = std::max(longest, static_cast<size_t>(a.ctx[b]));
  buf.resize(dim + a.lora + longest);
  float* q = buf.data();
  float* o = q + dim;
  float* s = o + a.lora;
  for (size_t b = 0; b < a.batch; ++b) {
    const size_t row = static_cast<size_t>(a.rows[b]), ctx = static_cast<size_t>(a.ctx[b]);
    const int64_t* table = a.tables + b * a.max_blocks;
    const float* qn = a.q_nope + row * a.qn_row + h * a.qn_head;
    const float* qr = a.q_rope + row * a.qr_row + h * a.qr_head;
    std::fill(q, q + a.lora, 0.0f);
    for (size_t i = 0; i < a.nope; ++i) mla_axpy(q, qn[i], wk + i * a.lora, a.lora);
    std::copy(qr, qr + a.rope, q + a.lora);
    for (size_t i = 0; i < dim; ++i) q[i] *= a.scale;
    float mx = -INFINITY;
    for (size_t j = 0; j < ctx; ++j) {
      const size_t slot = static_cast<size_t>(table[j / a.block_size]) * a.block_size + j % a.block_size;
      s[j] = mla_dot(q, a.cache + slot * dim, dim);
      mx = std::max(mx, s[j]);
    }
    exp_shift(s, ctx, mx, kSimdExp);
    float sum = 0.0f;
    for (size_t j = 0; j < ctx; ++j) sum += s[j];
    std::fill(o, o + a.lora, 0.0f);
    for (size_t j = 0; j < ctx; ++j) {
      const size_t slot = static_cast<size_t>(table[j / a.block_size]) * a.block_size + j % a.block_size;
      mla_axpy(o, s[j], a.cache + slot * dim, a.lora);
    }
    const float inv = 1.0f / sum;
    for (size_t i = 0; i < a.lora; ++i) o[i] *= inv;
    float* out = a.out + (row * a.heads + h) * a.v;
    for (size_t t = 0; t < a.v; ++t) out[t] = mla_dot(wv + t * a.lora, o, a.lora);
  }
}

[[maybe_unused]] __attribute__((target("avx512f,fma"))) void mla_head_avx512(const MlaArgs& a, size_t h, std::vector<float>& buf) {
  mla_head_impl<true>(a, h, buf);
}

[[maybe_unused]] __attribute__((target("avx2,fma"))) void mla_head_avx2(const MlaArgs& a, size_t h, std::vector<float>& buf) {
  mla_head_impl<false>(a, h, buf);
}

[[maybe_unused]] void mla_head_portable(const MlaArgs& a, size_t h, std::vector<float>& buf) { mla_head_impl<false>(a, h, buf); }

}  // namespace
}  // namespace agent_infer
