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
  const int64_t* table_of;  // entry -> its row of tables (entries of one chunk share a row)
  const int64_t* ctx;
  size_t max_blocks, block_size, heads, kv_heads, dim, num_slots;
  float scale;
  bool simd;
};

// The sum of x's 16 lanes by a fixed tree: halves of 8, then 4, then 2, then 1 (the pairing of GCC's
// _mm512_reduce_add_ps, written out so that it does not depend on the compiler).
__attribute__((target("avx512f"))) inline float hsum_avx512(__m512 x) {
  const __m256 t3 = _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  const __m128 t6 = _mm_add_ps(_mm256_castps256_ps128(t3), _mm256_extractf128_ps(t3, 1));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(_mm_add_ss(t8, _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(1, 1, 1, 1))));
}

// Lane k of the result is hsum_avx512(x[k]), bit for bit: the same pairs added at every level, for
// 16 vectors at once (two shuffles and one add per pair of vectors per level).
__attribute__((target("avx512f"))) inline __m512 hsum16_avx512(const __m512 (&x)[16]) {
  __m512 l1[8], l2[4], l3[2];
  for (int m = 0; m < 8; ++m)  // lanes i and i+8: [x0 | x1] halves of 8
    l1[m] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * m], x[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_f32x4(x[2 * m], x[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int m = 0; m < 4; ++m)  // then i and i+4: quarter r holds vector 4m + r
    l2[m] = _mm512_add_ps(_mm512_shuffle_f32x4(l1[2 * m], l1[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(l1[2 * m], l1[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int m = 0; m < 2; ++m)  // then i and i+2
    l3[m] = _mm512_add_ps(_mm512_shuffle_ps(l2[2 * m], l2[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(l2[2 * m], l2[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // then i and i+1; element 4r + c now holds vector r + 4c
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(l3[0], l3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(l3[0], l3[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, r);
}

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
  return 1.0f / hsum_avx512(sum);
}

// One query row (entry e) for head dims of 16*NV: the query and output accumulator in registers, one
// hsum_avx512 per position. Decode steps take this form; chunks of more rows the tiled one below,
// which gives the same bits and is faster from three rows up.
template <int NV>
__attribute__((target("avx512f"))) void attend_row_avx512(const Args& a, size_t e, size_t g, std::vector<float>& scores) {
  const size_t group = a.heads / a.kv_heads;
  const size_t ctx = static_cast<size_t>(a.ctx[e]);
  const int64_t* table = a.tables + a.table_of[e] * a.max_blocks;
  const size_t stride = a.kv_heads * a.dim;
  scores.resize(ctx);
  float* s = scores.data();
  for (size_t h = 0; h < group; ++h) {
    const float* qp = a.q + (static_cast<size_t>(a.rows[e]) * a.heads + g * group + h) * a.dim;
    __m512 q[NV];
    for (int i = 0; i < NV; ++i) q[i] = _mm512_mul_ps(_mm512_loadu_ps(qp + 16 * i), _mm512_set1_ps(a.scale));
    for (size_t b = 0; b * a.block_size < ctx; ++b) {
      const float* kb = a.k + static_cast<size_t>(table[b]) * a.block_size * stride + g * a.dim;
      const size_t end = std::min(ctx, (b + 1) * a.block_size);
      for (size_t j = b * a.block_size; j < end; ++j) {
        const float* kp = kb + (j - b * a.block_size) * stride;
        __m512 acc = _mm512_mul_ps(q[0], _mm512_loadu_ps(kp));
        for (int i = 1; i < NV; ++i) acc = _mm512_fmadd_ps(q[i], _mm512_loadu_ps(kp + 16 * i), acc);
        s[j] = hsum_avx512(acc);
      }
    }
    const float inv = softmax_avx512(s, ctx);
    __m512 o[NV];
    for (int i = 0; i < NV; ++i) o[i] = _mm512_setzero_ps();
    for (size_t b = 0; b * a.block_size < ctx; ++b) {
      const float* vb = a.v + static_cast<size_t>(table[b]) * a.block_size * stride + g * a.dim;
      const size_t end = std::min(ctx, (b + 1) * a.block_size);
      for (size_t j = b * a.block_size; j < end; ++j) {
        const float* vp = vb + (j - b * a.block_size) * stride;
        const __m512 p = _mm512_set1_ps(s[j]);
        for (int i = 0; i < NV; ++i) o[i] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vp + 16 * i), o[i]);
      }
    }
    float* out = a.out + (static_cast<size_t>(a.rows[e]) * a.heads + g * group + h) * a.dim;
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(out + 16 * i, _mm512_mul_ps(o[i], _mm512_set1_ps(inv)));
  }
}

// o[t] += s_t[j] * v_j over positions j ascending for the T rows from r of a tile (row t sees the
// first c0 + t positions), accumulators in registers (T * NV <= 16), then out = o * inv.
template <int NV, int T>
__attribute__((target("avx512f"))) void weigh_values_avx512(const Args& a, size_t first, size_t r, size_t g,
                                                           size_t h, const float* s, size_t pitch, const float* inv) {
  const size_t group = a.heads / a.kv_heads;
  const size_t c0 = static_cast<size_t>(a.ctx[first]) + r;  // the first of these rows' context
  const size_t ctx = c0 + T - 1;
  const int64_t* table = a.tables + a.table_of[first + r + T - 1] * a.max_blocks;
  const size_t stride = a.kv_heads * a.dim;
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
        if (j >= c0 + t) continue;  // only the last T - 1 positions are outside some rows
        const __m512 p = _mm512_set1_ps(s[(r + t) * pitch + j]);
        for (int i = 0; i < NV; ++i) o[t][i] = _mm512_fmadd_ps(p, vv[i], o[t][i]);
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    float* out = a.out + (static_cast<size_t>(a.rows[first + r + t]) * a.heads + g * group + h) * a.dim;
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(out + 16 * i, _mm512_mul_ps(o[t][i], _mm512_set1_ps(inv[r + t])));
  }
}

// The AVX-512 path for head dims of 16*NV: n rows (entries first .. first+n-1, row t seeing the
// first c0 + t positions of the last entry's table). Scores go 16 positions at a
// time: the 16 keys stay in L1 while every row of the tile takes its dot products with them and
// reduces all 16 with one transposed tree. Per row the operations and their order depend only on
// that row's context length.
template <int NV>
__attribute__((target("avx512f"))) void attend_avx512(const Args& a, size_t first, size_t n, size_t g,
                                                     std::vector<float>& scores) {
  constexpr int T = 16 / NV;
  if (n < 3) {
    for (size_t r = 0; r < n; ++r) attend_row_avx512<NV>(a, first + r, g, scores);
    return;
  }
  const size_t group = a.heads / a.kv_heads;
  const size_t c0 = static_cast<size_t>(a.ctx[first]);
  const size_t ctx = c0 + n - 1;
  const size_t pitch = (ctx + 15) / 16 * 16;
  const int64_t* table = a.tables + a.table_of[first + n - 1] * a.max_blocks;
  const size_t stride = a.kv_heads * a.dim;
  scores.resize(n * pitch + n + n * NV * 16);
  float* s = scores.data();
  float* inv = s + n * pitch;
  float* qs = inv + n;  // the tile's queries for one head, scaled
  for (size_t h = 0; h < group; ++h) {
    for (size_t t = 0; t < n; ++t) {
      const float* qp = a.q + (static_cast<size_t>(a.rows[first + t]) * a.heads + g * group + h) * a.dim;
      for (int i = 0; i < NV; ++i)
        _mm512_storeu_ps(qs + t * NV * 16 + 16 * i, _mm512_mul_ps(_mm512_loadu_ps(qp + 16 * i), _mm512_set1_ps(a.scale)));
    }
    const float* key0 = a.k + static_cast<size_t>(table[0]) * a.block_size * stride + g * a.dim;
    size_t b = 0, off = 0;  // block and offset of position j0 + k, stepped without dividing
    for (size_t j0 = 0; j0 < ctx; j0 += 16) {
      const float* kp[16];
      for (size_t k = 0; k < 16; ++k) {
        // lanes past the context read key 0, then are dropped
        kp[k] = j0 + k < ctx ? a.k + (static_cast<size_t>(table[b]) * a.block_size + off) * stride + g * a.dim : key0;
        if (++off == a.block_size) {
          off = 0;
          ++b;
        }
      }
      for (size_t t = 0; t < n; ++t) {
        if (j0 >= c0 + t) continue;
        __m512 q[NV];
        for (int i = 0; i < NV; ++i) q[i] = _mm512_loadu_ps(qs + t * NV * 16 + 16 * i);
        __m512 acc[16];
        for (int k = 0; k < 16; ++k) {
          acc[k] = _mm512_mul_ps(q[0], _mm512_loadu_ps(kp[k]));
          for (int i = 1; i < NV; ++i) acc[k] = _mm512_fmadd_ps(q[i], _mm512_loadu_ps(kp[k] + 16 * i), acc[k]);
        }
        _mm512_storeu_ps(s + t * pitch + j0, hsum16_avx512(acc));
      }
    }
    for (size_t t = 0; t < n; ++t) inv[t] = softmax_avx512(s + t * pitch, c0 + t);
    size_t r = 0;
    for (; r + T <= n; r += T) weigh_values_avx512<NV, T>(a, first, r, g, h, s, pitch, inv);
    for (; r < n; ++r) weigh_values_avx512<NV, 1>(a, first, r, g, h, s, pitch, inv);
  }
}

// Any head dim (AVX-512 dot products when it is a multiple of 16, scalar otherwise), n rows at once
// laid out as in attend_avx512. Scores are [n, group, ctx]; outputs accumulate in place.
void attend_rows(const Args& a, size_t first, size_t n, size_t g, std::vector<float>& scores) {
  const size_t group = a.heads / a.kv_heads;
  const size_t c0 = static_cast<size_t>(a.ctx[first]);
  const size_t ctx = c0 + n - 1;
  const int64_t* table = a.tables + a.table_of[first + n - 1] * a.max_blocks;
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

// Entries first .. first+n-1 of the batch: consecutive query rows of one sequence sharing a block
// table, with context lengths c0, c0 + 1, ... (n = 1 for a decode row).
void attend_tile(const Args& a, size_t first, size_t n, size_t g, std::vector<float>& scores) {
  if (a.simd) {
    switch (a.dim / 16) {
      case 2: return attend_avx512<2>(a, first, n, g, scores);
      case 4: return attend_avx512<4>(a, first, n, g, scores);
      case 8: return attend_avx512<8>(a, first, n, g, scores);
      default: break;
    }
  }
  attend_rows(a, first, n, g, scores);
}

}  // namespace
}  // namespace agent_infer
