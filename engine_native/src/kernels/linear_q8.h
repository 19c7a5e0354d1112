#pragma once
// The packed linear layer's int8-activation mode ("q8"): each row of x is quantized per block of
// 32 to int8 with one fp32 scale (llama.cpp's Q8 activations), the block's dot product with the
// 4-bit or 8-bit weights is an exact integer sum, and only the per-block epilogue is floating point:
//
//   Q4_1 weights (w = d*q + m, q in 0..15):  acc = fma(fl(float(sum q*xq) * dx), d, acc)
//                                            acc = fma(sx, m, acc)   (sx = fl(float(sum xq) * dx))
//   Q8_0/Q4_0 weights (w = d*q):             acc = fma(fl(float(sum q*xq) * dx), d, acc)
//   Q6_K weights (w = d_h*q per 16):         the Q8_0 step once per half h of the block (sums over
//                                            its 16 weights, d_h its sub-block's scale)
//
// over blocks in order, from +0 (Q4_K runs as Q4_1 with fp32 scales, Q5_0 as Q8_0). The integer sum is exact on every ISA (AVX-512 VNNI, AVX2
// maddubs, scalar), float(sum) is exact (|sum| < 2^24), and the epilogue is the same three rounded
// operations everywhere, so a row's result is bit-identical whatever the batch, tile or ISA — the
// batch invariance of the fp32 mode, kept. It is not bit-identical to the fp32 mode: x is rounded
// to 8 bits per element (relative error <= 1/254 of the block's largest |x|).
//
// Packed layout in this mode (chosen at construction; differs from the fp32 mode's):
//   Q4 block: 16 scales d, 16 mins m, then 4 chunks of 64 bytes; in chunk p, lane c's 4 bytes hold
//             q[8p+i] (low nibble) and q[8p+4+i] (high nibble), i = 0..3.
//   Q8 block: 16 scales d, then 8 chunks of 64 bytes; chunk p, lane c: q[4p+i] + 128 as uint8.
//   Q6 block: 16 scales of k 0..15, 16 of k 16..31, then the Q8 block's chunks.
// A 64-byte chunk is one AVX-512 vector whose 32-bit lane c is column c's next 4 (or 8) weights:
// the operand shape of vpdpbusd (u8 x s8, 4 products summed per lane).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/linear_tiles.h"

namespace agent_infer {
namespace {

// x quantized for one call: xq [m, K] int8, and per (row, block): dx (scale), sx (sum of x, Q4)
// and corr (128 * sum of xq, which the VNNI Q8 kernel subtracts for its +128 weight offset), and
// per (row, half block) corr16, the same over each 16 values, for the Q6 kernel.
struct QAct {
  const int8_t* xq;
  const float* dx;
  const float* sx;
  const int32_t* corr;
  const int32_t* corr16;
  size_t k;
  size_t nb;  // blocks per row (K / 32)
};

// Per block: amax, dx = amax / 127, q = nearbyint(x * (127 / amax)) (default rounding mode,
// clamped to +-127), sx = fl(float(sum q) * dx) — the Q4_1 min term uses the quantized sum, as
// llama.cpp's Q8_1 does, so every quantity is order-independent and the AVX-512 and scalar
// versions below agree bit for bit.
struct QBlockOut {
  float dx, sx;
  int32_t corr, corr_lo, corr_hi;
};

inline QBlockOut finish_block(float amax, int32_t qsum_lo, int32_t qsum_hi) {
  const float dx = amax / 127.0f;
  const int32_t qsum = qsum_lo + qsum_hi;
  return {dx, static_cast<float>(qsum) * dx, 128 * qsum, 128 * qsum_lo, 128 * qsum_hi};
}

inline QBlockOut quantize_block_scalar(const float* xb, int8_t* qb) {
  float amax = 0.0f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  int32_t qsum[2] = {0, 0};
  for (int i = 0; i < 32; ++i) {
    // Clamp first, exactly as the AVX-512 version's max_ps/min_ps do (a NaN product, from an
    // infinite activation times a zero scale, becomes -127 there and here, never a cast of NaN).
    float v = xb[i] * inv;
    v = v > -127.0f ? v : -127.0f;
    v = v < 127.0f ? v : 127.0f;
    const int q = static_cast<int>(std::nearbyint(v));
    qb[i] = static_cast<int8_t>(q);
    qsum[i / 16] += q;
  }
  return finish_block(amax, qsum[0], qsum[1]);
}

__attribute__((target("avx512f,avx512bw"))) inline QBlockOut quantize_block_avx512(const float* xb, int8_t* qb) {
  const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
  const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  const __m512 lim = _mm512_set1_ps(127.0f), nlim = _mm512_set1_ps(-127.0f);
  // cvtps_epi32 rounds in the default mode (nearest-even), as nearbyint does
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(x0, inv), nlim), lim));
  const __m512i q1 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(x1, inv), nlim), lim));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtepi32_epi8(q1));
  return finish_block(amax, _mm512_reduce_add_epi32(q0), _mm512_reduce_add_epi32(q1));
}

inline void quantize_rows(const float* x, size_t m, size_t k, bool avx512, int8_t* xq, float* dx, float* sx,
                          int32_t* corr, int32_t* corr16) {
  const size_t nb = k / 32;
  for (size_t r = 0; r < m; ++r)
    for (size_t b = 0; b < nb; ++b) {
      const QBlockOut o = avx512 ? quantize_block_avx512(x + r * k + b * 32, xq + r * k + b * 32)
                                 : quantize_block_scalar(x + r * k + b * 32, xq + r * k + b * 32);
      dx[r * nb + b] = o.dx;
      sx[r * nb + b] = o.sx;
      corr[r * nb + b] = o.corr;
      corr16[2 * (r * nb + b)] = o.corr_lo;
      corr16[2 * (r * nb + b) + 1] = o.corr_hi;
    }
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#define AI_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))

template <int F, int R, int G>
AI_VNNI void q8_tile_vnni(const View& w, size_t g0, const QAct& a, size_t r0, float* y, size_t ldy) {
  __m512 acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  const uint8_t* base[G];
  for (int g = 0; g < G; ++g) base[g] = w.data + (g0 + g) * w.gstride;
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (size_t b = 0; b < a.nb; ++b) {
    __m512i s[R][G];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) s[r][g] = _mm512_setzero_si512();
    __m512 d[G], mn[G];
    const uint8_t* p[G];
    if constexpr (F == kQ4) {
      for (int g = 0; g < G; ++g) {
        p[g] = base[g] + b * kQ4Block;
        d[g] = _mm512_loadu_ps(p[g]);
        mn[g] = _mm512_loadu_ps(p[g] + 64);
      }
      for (int c = 0; c < 4; ++c) {
        for (int g = 0; g < G; ++g) {
          const __m512i v = _mm512_loadu_si512(p[g] + 128 + c * 64);
          const __m512i lo = _mm512_and_si512(v, low);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
          for (int r = 0; r < R; ++r) {
            const int8_t* xr = a.xq + (r0 + r) * a.k + b * 32 + c * 8;
            s[r][g] = _mm512_dpbusd_epi32(s[r][g], lo, _mm512_set1_epi32(load_i32(xr)));
            s[r][g] = _mm512_dpbusd_epi32(s[r][g], hi, _mm512_set1_epi32(load_i32(xr + 4)));
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m512 dxv = _mm512_set1_ps(a.dx[(r0 + r) * a.nb + b]);
        const __m512 sxv = _mm512_set1_ps(a.sx[(r0 + r) * a.nb + b]);
        for (int g = 0; g < G; ++g) {
          const __m512 pf = _mm512_mul_ps(_mm512_cvtepi32_ps(s[r][g]), dxv);
          acc[r][g] = _mm512_fmadd_ps(pf, d[g], acc[r][g]);
          acc[r][g] = _mm512_fmadd_ps(sxv, mn[g], acc[r][g]);
        }
      }
    } else if constexpr (F == kQ6) {
      for (int g = 0; g < G; ++g) p[g] = base[g] + b * kQ6Block;
      for (int h = 0; h < 2; ++h) {
        for (int r = 0; r < R; ++r)
          for (int g = 0; g < G; ++g) s[r][g] = _mm512_setzero_si512();
        for (int c = 4 * h; c < 4 * h + 4; ++c) {
          for (int g = 0; g < G; ++g) {
            const __m512i v = _mm512_loadu_si512(p[g] + 128 + c * 64);
            for (int r = 0; r < R; ++r) {
              const int8_t* xr = a.xq + (r0 + r) * a.k + b * 32 + c * 4;
              s[r][g] = _mm512_dpbusd_epi32(s[r][g], v, _mm512_set1_epi32(load_i32(xr)));
            }
          }
        }
        for (int g = 0; g < G; ++g) d[g] = _mm512_loadu_ps(p[g] + 64 * h);
        for (int r = 0; r < R; ++r) {
          const __m512 dxv = _mm512_set1_ps(a.dx[(r0 + r) * a.nb + b]);
          const __m512i cv = _mm512_set1_epi32(a.corr16[2 * ((r0 + r) * a.nb + b) + h]);
          for (int g = 0; g < G; ++g) {
            const __m512 pf = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s[r][g], cv)), dxv);
            acc[r][g] = _mm512_fmadd_ps(pf, d[g], acc[r][g]);
          }
        }
      }
    } else {
      for (int g = 0; g < G; ++g) {
        p[g] = base[g] + b * kQ8Block;
        d[g] = _mm512_loadu_ps(p[g]);
      }
      for (int c = 0; c < 8; ++c) {
        for (int g = 0; g < G; ++g) {
          const __m512i v = _mm512_loadu_si512(p[g] + 64 + c * 64);
          for (int r = 0; r < R; ++r) {
            const int8_t* xr = a.xq + (r0 + r) * a.k + b * 32 + c * 4;
            s[r][g] = _mm512_dpbusd_epi32(s[r][g], v, _mm512_set1_epi32(load_i32(xr)));
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m512 dxv = _mm512_set1_ps(a.dx[(r0 + r) * a.nb + b]);
        const __m512i cv = _mm512_set1_epi32(a.corr[(r0 + r) * a.nb + b]);
        for (int g = 0; g < G; ++g) {
          const __m512 pf = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s[r][g], cv)), dxv);
          acc[r][g] = _mm512_fmadd_ps(pf, d[g], acc[r][g]);
        }
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const size_t col = (g0 + g) * kLanes;
    const size_t valid = std::min<size_t>(kLanes, w.n - col);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + (r0 + r) * ldy + col, mask, acc[r][g]);
  }
}

// AVX2 without VNNI: maddubs (u8 x s8 pairs into int16) then madd with ones (pairs into int32).
// Q4: q <= 15, so a pair is at most 2*15*127 and never saturates. Q8: the weight's sign moves
// onto x (|q| <= 128, |xq| <= 127: a pair is at most 32512), which yields sum q*xq directly.
template <int F, int R>
AI_AVX2 void q8_tile_avx2(const View& w, size_t g0, const QAct& a, size_t r0, float* y, size_t ldy) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const uint8_t* base = w.data + g0 * w.gstride;
  const __m256i low = _mm256_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (size_t b = 0; b < a.nb; ++b) {
    __m256i s[R][2];
    for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm256_setzero_si256();
    if constexpr (F == kQ4) {
      const uint8_t* p = base + b * kQ4Block;
      for (int c = 0; c < 4; ++c)
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + c * 64 + h * 32));
          const __m256i lo = _mm256_and_si256(v, low);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          for (int r = 0; r < R; ++r) {
            const int8_t* xr = a.xq + (r0 + r) * a.k + b * 32 + c * 8;
            const __m256i t0 = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_i32(xr)));
            const __m256i t1 = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_i32(xr + 4)));
            s[r][h] = _mm256_add_epi32(s[r][h], _mm256_madd_epi16(t0, ones));
            s[r][h] = _mm256_add_epi32(s[r][h], _mm256_madd_epi16(t1, ones));
          }
        }
      const float* pf = reinterpret_cast<const float*>(p);
      for (int r = 0; r < R; ++r) {
        const __m256 dxv = _mm256_set1_ps(a.dx[(r0 + r) * a.nb + b]);
        const __m256 sxv = _mm256_set1_ps(a.sx[(r0 + r) * a.nb + b]);
        for (int h = 0; h < 2; ++h) {
          const __m256 prod = _mm256_mul_ps(_mm256_cvtepi32_ps(s[r][h]), dxv);
          acc[r][h] = _mm256_fmadd_ps(prod, _mm256_loadu_ps(pf + 8 * h), acc[r][h]);
          acc[r][h] = _mm256_fmadd_ps(sxv, _mm256_loadu_ps(pf + 16 + 8 * h), acc[r][h]);
        }
      }
    } else if constexpr (F == kQ6) {
      // kh: which 16 of the block's 32 weights (one Q6_K sub-block); h: which 8 of the 16 columns
      const uint8_t* p = base + b * kQ6Block;
      const float* pf = reinterpret_cast<const float*>(p);
      for (int kh = 0; kh < 2; ++kh) {
        for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm256_setzero_si256();
        for (int c = 4 * kh; c < 4 * kh + 4; ++c)
          for (int h = 0; h < 2; ++h) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + c * 64 + h * 32));
            const __m256i ws = _mm256_xor_si256(v, flip);
            const __m256i aw = _mm256_abs_epi8(ws);
            for (int r = 0; r < R; ++r) {
              const int8_t* xr = a.xq + (r0 + r) * a.k + b * 32 + c * 4;
              const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(xr)), ws);
              s[r][h] = _mm256_add_epi32(s[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xs), ones));
            }
          }
        for (int r = 0; r < R; ++r) {
          const __m256 dxv = _mm256_set1_ps(a.dx[(r0 + r) * a.nb + b]);
          for (int h = 0; h < 2; ++h) {
            const __m256 prod = _mm256_mul_ps(_mm256_cvtepi32_ps(s[r][h]), dxv);
            acc[r][h] = _mm256_fmadd_ps(prod, _mm256_loadu_ps(pf + 16 * kh + 8 * h), acc[r][h]);
          }
        }
      }
    } else {
      const uint8_t* p = base + b * kQ8Block;
      for (int c = 0; c < 8; ++c)
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 + c * 64 + h * 32));
          const __m256i ws = _mm256_xor_si256(v, flip);
          const __m256i aw = _mm256_abs_epi8(ws);
          for (int r = 0; r < R; ++r) {
            const int8_t* xr = a.xq + (r0 + r) * a.k + b * 32 + c * 4;
            const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(xr)), ws);
            s[r][h] = _mm256_add_epi32(s[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xs), ones));
          }
        }
      const float* pf = reinterpret_cast<const float*>(p);
      for (int r = 0; r < R; ++r) {
        const __m256 dxv = _mm256_set1_ps(a.dx[(r0 + r) * a.nb + b]);
        for (int h = 0; h < 2; ++h) {
          const __m256 prod = _mm256_mul_ps(_mm256_cvtepi32_ps(s[r][h]), dxv);
          acc[r][h] = _mm256_fmadd_ps(prod, _mm256_loadu_ps(pf + 8 * h), acc[r][h]);
        }
      }
    }
  }
  const size_t col = g0 * kLanes;
  const size_t valid = std::min<size_t>(kLanes, w.n - col);
  for (int r = 0; r < R; ++r) {
    alignas(32) float tmp[kLanes];
    _mm256_store_ps(tmp, acc[r][0]);
    _mm256_store_ps(tmp + 8, acc[r][1]);
    std::memcpy(y + (r0 + r) * ldy + col, tmp, valid * sizeof(float));
  }
}

// Portable path: one row, one group; the same integer sums and the same three rounded operations.
template <int F>
void q8_tile_scalar(const View& w, size_t g, const QAct& a, size_t r, float* y, size_t ldy) {
  float acc[kLanes] = {};
  const uint8_t* base = w.data + g * w.gstride;
  for (size_t b = 0; b < a.nb; ++b) {
    const int8_t* xb = a.xq + r * a.k + b * 32;
    const float dx = a.dx[r * a.nb + b];
    if constexpr (F == kQ4) {
      const uint8_t* p = base + b * kQ4Block;
      for (int c = 0; c < kLanes; ++c) {
        int32_t sum = 0;
        for (int ch = 0; ch < 4; ++ch)
          for (int i = 0; i < 4; ++i) {
            const uint8_t byte = p[128 + ch * 64 + c * 4 + i];
            sum += (byte & 15) * xb[ch * 8 + i] + (byte >> 4) * xb[ch * 8 + 4 + i];
          }
        float d, mn;
        std::memcpy(&d, p + 4 * c, 4);
        std::memcpy(&mn, p + 64 + 4 * c, 4);
        const float prod = static_cast<float>(sum) * dx;
        acc[c] = std::fma(prod, d, acc[c]);
        acc[c] = std::fma(a.sx[r * a.nb + b], mn, acc[c]);
      }
    } else if constexpr (F == kQ6) {
      const uint8_t* p = base + b * kQ6Block;
      for (int c = 0; c < kLanes; ++c)
        for (int kh = 0; kh < 2; ++kh) {
          int32_t sum = 0;
          for (int ch = 4 * kh; ch < 4 * kh + 4; ++ch)
            for (int i = 0; i < 4; ++i)
              sum += (static_cast<int>(p[128 + ch * 64 + c * 4 + i]) - 128) * xb[ch * 4 + i];
          float d;
          std::memcpy(&d, p + 64 * kh + 4 * c, 4);
          acc[c] = std::fma(static_cast<float>(sum) * dx, d, acc[c]);
        }
    } else {
      const uint8_t* p = base + b * kQ8Block;
      for (int c = 0; c < kLanes; ++c) {
        int32_t sum = 0;
        for (int ch = 0; ch < 8; ++ch)
          for (int i = 0; i < 4; ++i) sum += (static_cast<int>(p[64 + ch * 64 + c * 4 + i]) - 128) * xb[ch * 4 + i];
        float d;
        std::memcpy(&d, p + 4 * c, 4);
        const float prod = static_cast<float>(sum) * dx;
        acc[c] = std::fma(prod, d, acc[c]);
      }
    }
  }
  const size_t col = g * kLanes;
  std::memcpy(y + r * ldy + col, acc, std::min<size_t>(kLanes, w.n - col) * sizeof(float));
}

template <int F, int G>
void q8_rows_vnni(int rt, const View& w, size_t g, const QAct& a, size_t r0, float* y, size_t ldy) {
  switch (rt) {
    case 1: q8_tile_vnni<F, 1, G>(w, g, a, r0, y, ldy); break;
    case 2: q8_tile_vnni<F, 2, G>(w, g, a, r0, y, ldy); break;
    case 3: q8_tile_vnni<F, 3, G>(w, g, a, r0, y, ldy); break;
    default: q8_tile_vnni<F, 4, G>(w, g, a, r0, y, ldy); break;
  }
}

// One thread's column-group range [g_begin, g_end) over all m rows. `vnni` selects the AVX-512
// kernel; otherwise isa picks AVX2 or scalar. Every path yields the same bits.
template <int F>
void q8_run_range(int isa, bool vnni, const View& w, size_t g_begin, size_t g_end, const QAct& a, size_t m,
                  float* y, size_t ldy) {
  for (size_t gc = g_begin; gc < g_end; gc += kGroupChunk) {
    const size_t gn = std::min(kGroupChunk, g_end - gc);
    if (vnni) {
      size_t r = 0;
      for (; r + 8 <= m; r += 8)
        for (size_t g = gc; g < gc + gn; ++g) q8_tile_vnni<F, 8, 1>(w, g, a, r, y, ldy);
      for (; r < m; r += 4) {
        const int rt = static_cast<int>(std::min<size_t>(4, m - r));
        size_t g = gc;
        if (rt <= 2 && gn == 4) {
          q8_rows_vnni<F, 4>(rt, w, g, a, r, y, ldy);
          g += 4;
        }
        for (; g + 2 <= gc + gn; g += 2) q8_rows_vnni<F, 2>(rt, w, g, a, r, y, ldy);
        for (; g < gc + gn; ++g) q8_rows_vnni<F, 1>(rt, w, g, a, r, y, ldy);
      }
    } else if (isa >= kAvx2) {
      size_t r = 0;
      for (; r + 2 <= m; r += 2)
        for (size_t g = gc; g < gc + gn; ++g) q8_tile_avx2<F, 2>(w, g, a, r, y, ldy);
      for (; r < m; ++r)
        for (size_t g = gc; g < gc + gn; ++g) q8_tile_avx2<F, 1>(w, g, a, r, y, ldy);
    } else {
      for (size_t r = 0; r < m; ++r)
        for (size_t g = gc; g < gc + gn; ++g) q8_tile_scalar<F>(w, g, a, r, y, ldy);
    }
  }
}

}  // namespace
}  // namespace agent_infer
