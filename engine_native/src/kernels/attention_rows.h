#pragma once
// The per-row arithmetic of paged attention (kernels/attention.cpp), in two forms that give the same
// bits: one query row at a time (decode), and a tile of consecutive query rows of one sequence that
// share a block table (prefill, chunked prefill, forced runs, drafts), where row t of the tile sees
// the first c0 + t positions. The tile form loads each key and value once for all of its rows; every
// row's scores, max, exp, sum and weighted sum of values still run in the single-row order
// (positions ascending, the same reduction trees), which is what makes a prompt's logits equal
// however it is chunked, cached or batched.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/vexp.h"

namespace agent_infer {
namespace {

// dot(a, b) over d floats; d is a multiple of 16 on this path.
__attribute__((target("avx512f"))) float dot_avx512(const float* a, const float* b, size_t d) {
  __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
  for (size_t i = 16; i < d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  alignas(64) float t[16];
  _mm512_store_ps(t, acc);
  float lo = 0.0f, hi = 0.0f;  // two independent chains, fixed order
  for (int i = 0; i < 8; ++i) {
    lo += t[i];
    hi += t[i + 8];
  }
  return lo + hi;
}

// out += p * v over d floats.
__attribute__((target("avx512f"))) void axpy_avx512(float* out, float p, const float* v, size_t d) {
  const __m512 pv = _mm512_set1_ps(p);
  for (size_t i = 0; i < d; i += 16)
    _mm512_storeu_ps(out + i, _mm512_fmadd_ps(pv, _mm512_loadu_ps(v + i), _mm512_loadu_ps(out + i)));
}

float dot_scalar(const float* a, const float* b, size_t d) {
  float acc = 0.0f;
  for (size_t i = 0; i < d; ++i) acc = std::fma(a[i], b[i], acc);
  return acc;
}

void axpy_scalar(float* out, float p, const float* v, size_t d) {
  for (size_t i = 0; i < d; ++i) out[i] = std::fma(p, v[i], out[i]);
}

struct Args {
  const float* q;
  const float* k;
  const float* v;
  float* out;
  const int64_t* rows;
  const int64_t* tables;
  const int64_t* ctx;
  size_t max_blocks, block_size, heads, kv_heads, dim, num_slots;
  float scale;
  bool simd;
};

// s[j] = exp(s[j] - max) for j < n, 16 positions at a time; returns 1 / sum.
__attribute__((target("avx512f"))) inline float softmax_avx512(float* s, size_t n) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  size_t j = 0;
  for (; j + 16 <= n; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + j));
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - j)) - 1u);
  mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, s + j));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (j = 0; j + 16 <= n; j += 16) {
    const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(s + j), m));
    _mm512_storeu_ps(s + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (j < n) {
    const __m512 e = _mm512_maskz_mov_ps(tail, exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + j), m)));
    _mm512_mask_storeu_ps(s + j, tail, e);
    sum = _mm512_add_ps(sum, e);
  }
  return 1.0f / _mm512_reduce_add_ps(sum);
}

// The AVX-512 path for head dims of 16*NV, T rows at once: entries first .. first+T-1 of the batch,
// row t attending to the first c0 + t positions of the last entry's table. Each head's T queries and
// output accumulators stay in registers (T * NV <= 16); T = 1 is decode.
template <int NV, int T>
__attribute__((target("avx512f"))) void attend_avx512(const Args& a, size_t first, size_t g,
                                                     std::vector<float>& scores) {
  const size_t group = a.heads / a.kv_heads;
  const size_t c0 = static_cast<size_t>(a.ctx[first]);
  const size_t ctx = c0 + T - 1;  // the last row's context: every row's keys are a prefix of it
  const int64_t* table = a.tables + (first + T - 1) * a.max_blocks;
  const size_t stride = a.kv_heads * a.dim;
  scores.resize(T * ctx);
  for (size_t h = 0; h < group; ++h) {
    __m512 q[T][NV];
    for (int t = 0; t < T; ++t) {
      const float* qp = a.q + (static_cast<size_t>(a.rows[first + t]) * a.heads + g * group + h) * a.dim;
      for (int i = 0; i < NV; ++i) q[t][i] = _mm512_mul_ps(_mm512_loadu_ps(qp + 16 * i), _mm512_set1_ps(a.scale));
    }
    float* s = scores.data();
    for (size_t b = 0; b * a.block_size < ctx; ++b) {
      const float* kb = a.k + static_cast<size_t>(table[b]) * a.block_size * stride + g * a.dim;
      const size_t end = std::min(ctx, (b + 1) * a.block_size);
      for (size_t j = b * a.block_size; j < end; ++j) {
        const float* kp = kb + (j - b * a.block_size) * stride;
        __m512 kv[NV];
        for (int i = 0; i < NV; ++i) kv[i] = _mm512_loadu_ps(kp + 16 * i);
        for (int t = 0; t < T; ++t) {
          if (j >= c0 + t) continue;  // only the last T - 1 positions are outside some rows
          __m512 acc = _mm512_mul_ps(q[t][0], kv[0]);
          for (int i = 1; i < NV; ++i) acc = _mm512_fmadd_ps(q[t][i], kv[i], acc);
          s[t * ctx + j] = _mm512_reduce_add_ps(acc);
        }
      }
    }
    float inv[T];
    for (int t = 0; t < T; ++t) inv[t] = softmax_avx512(s + t * ctx, c0 + t);
    __m512 o[T][NV];
    for (int t = 0; t < T; ++t)
      for (int i = 0; i < NV; ++i) o[t][i] = _mm512_setzero_ps();
    for (size_t b = 0; b * a.block_size < ctx; ++b) {
      const float* vb = a.v + static_cast<size_t>(table[b]) * a.block_size * stride + g * a.dim;
      const size_t end = std::min(ctx, (b + 1) * a.block_size);
      for (size_t j = b * a.block_size; j < end; ++j) {
        const float* vp = vb + (j - b * a.block_size) * stride;
        __m512 vv[NV];
        for (int i = 0; i < NV; ++i) vv[i] = _mm512_loadu_ps(vp + 16 * i);
        for (int t = 0; t < T; ++t) {
          if (j >= c0 + t) continue;
          const __m512 p = _mm512_set1_ps(s[t * ctx + j]);
          for (int i = 0; i < NV; ++i) o[t][i] = _mm512_fmadd_ps(p, vv[i], o[t][i]);
        }
      }
    }
    for (int t = 0; t < T; ++t) {
      float* out = a.out + (static_cast<size_t>(a.rows[first + t]) * a.heads + g * group + h) * a.dim;
      for (int i = 0; i < NV; ++i) _mm512_storeu_ps(out + 16 * i, _mm512_mul_ps(o[t][i], _mm512_set1_ps(inv[t])));
    }
  }
}

// Any head dim (AVX-512 dot products when it is a multiple of 16, scalar otherwise), n rows at once
// laid out as in attend_avx512. Scores are [n, group, ctx]; outputs accumulate in place.
void attend_rows(const Args& a, size_t first, size_t n, size_t g, std::vector<float>& scores) {
  const size_t group = a.heads / a.kv_heads;
  const size_t c0 = static_cast<size_t>(a.ctx[first]);
  const size_t ctx = c0 + n - 1;
  const int64_t* table = a.tables + (first + n - 1) * a.max_blocks;
  const size_t d = a.dim;
  scores.resize(n * group * ctx + n * group);
  float* inv = scores.data() + n * group * ctx;
  auto head = [&](size_t t, size_t h) { return (static_cast<size_t>(a.rows[first + t]) * a.heads + g * group + h) * d; };
  for (size_t j = 0; j < ctx; ++j) {
    const size_t slot = static_cast<size_t>(table[j / a.block_size]) * a.block_size + j % a.block_size;
    const float* kp = a.k + (slot * a.kv_heads + g) * d;
    for (size_t t = 0; t < n; ++t) {
      if (j >= c0 + t) continue;
      for (size_t h = 0; h < group; ++h) {
        const float* qp = a.q + head(t, h);
        scores[(t * group + h) * ctx + j] = (a.simd ? dot_avx512(qp, kp, d) : dot_scalar(qp, kp, d)) * a.scale;
      }
    }
  }
  for (size_t t = 0; t < n; ++t) {
    const size_t len = c0 + t;
    for (size_t h = 0; h < group; ++h) {
      float* s = scores.data() + (t * group + h) * ctx;
      float mx = s[0];
      for (size_t j = 1; j < len; ++j) mx = std::max(mx, s[j]);
      float sum = 0.0f;
      for (size_t j = 0; j < len; ++j) {
        s[j] = std::exp(s[j] - mx);
        sum += s[j];
      }
      inv[t * group + h] = 1.0f / sum;
      float* o = a.out + head(t, h);
      std::fill(o, o + d, 0.0f);
    }
  }
  for (size_t j = 0; j < ctx; ++j) {
    const size_t slot = static_cast<size_t>(table[j / a.block_size]) * a.block_size + j % a.block_size;
    const float* vp = a.v + (slot * a.kv_heads + g) * d;
    for (size_t t = 0; t < n; ++t) {
      if (j >= c0 + t) continue;
      for (size_t h = 0; h < group; ++h) {
        float* o = a.out + head(t, h);
        const float p = scores[(t * group + h) * ctx + j];
        if (a.simd)
          axpy_avx512(o, p, vp, d);
        else
          axpy_scalar(o, p, vp, d);
      }
    }
  }
  for (size_t t = 0; t < n; ++t)
    for (size_t h = 0; h < group; ++h) {
      float* o = a.out + head(t, h);
      for (size_t i = 0; i < d; ++i) o[i] *= inv[t * group + h];
    }
}

// T rows at a time through the register-tiled form, what is left one by one (the same bits).
template <int NV, int T>
void attend_tile_avx512(const Args& a, size_t first, size_t n, size_t g, std::vector<float>& scores) {
  size_t r = 0;
  for (; r + T <= n; r += T) attend_avx512<NV, T>(a, first + r, g, scores);
  for (; r < n; ++r) attend_avx512<NV, 1>(a, first + r, g, scores);
}

// Entries first .. first+n-1 of the batch: consecutive query rows of one sequence sharing a block
// table, with context lengths c0, c0 + 1, ... (n = 1 for a decode row).
void attend_tile(const Args& a, size_t first, size_t n, size_t g, std::vector<float>& scores) {
  if (a.simd) {
    switch (a.dim / 16) {
      case 2: return attend_tile_avx512<2, 8>(a, first, n, g, scores);
      case 4: return attend_tile_avx512<4, 4>(a, first, n, g, scores);
      case 8: return attend_tile_avx512<8, 2>(a, first, n, g, scores);
      default: break;
    }
  }
  attend_rows(a, first, n, g, scores);
}

}  // namespace
}  // namespace agent_infer
