#pragma once
// The packed linear layer's formats and tile kernels (see kernels/linear.cpp for the layout and why every
// output element is one fixed FMA chain). Included by kernels/linear.cpp only, which is built with
// -ffp-contract=off: the dequantization's separate roundings must not be fused.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

// GCC 12's AVX-512 headers pass _mm512_undefined_*() as the pass-through of unmasked conversions,
// which -Wmaybe-uninitialized reports at every inlined call site; the values are never read.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace agent_infer {
namespace {

// ggml type ids accepted as input (the GGUF tensor type field).
constexpr int kGgmlF32 = 0, kGgmlF16 = 1, kGgmlQ4_0 = 2, kGgmlQ4_1 = 3, kGgmlQ5_0 = 6, kGgmlQ8_0 = 8,
              kGgmlQ4_K = 12, kGgmlQ6_K = 14, kGgmlBF16 = 30;

// Packed formats. Q4_0 and Q5_0 become kQ8 (q-8 and q-16 fit int8 and fl(q*d) is what torch
// computes); Q4_K becomes kQ4 (one fp32 scale and min per sub-block of 32); Q6_K becomes kQ6, kQ8
// with a scale per 16 weights (its sub-block); F16/BF16 widen exactly to kF32.
enum Fmt : int { kF32 = 0, kQ8 = 1, kQ4 = 2, kQ6 = 3 };
constexpr int kLanes = 16;                    // columns per group
constexpr size_t kQ8Block = 64 + 32 * 16;     // 16 fp32 scales, then 32 k x 16 int8
constexpr size_t kQ4Block = 128 + 16 * 16;    // 16 scales, 16 mins, then 16 k-pairs x 16 bytes
constexpr size_t kQ6Block = 128 + 32 * 16;    // 16 scales of k 0..15, 16 of k 16..31, then as kQ8

// Offset of the codes in a kQ8 or kQ6 block, and the scale of k within it.
template <int F>
constexpr size_t codes_at() { return F == kQ6 ? 128 : 64; }
template <int F>
constexpr size_t block_bytes() { return F == kQ6 ? kQ6Block : F == kQ8 ? kQ8Block : kQ4Block; }

enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

int detect_isa() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
#endif
  return kScalar;
}
const int g_best_isa = detect_isa();
std::atomic<int> g_isa{g_best_isa};

// The int8-activation kernels' AVX-512 path needs VNNI (vpdpbusd) and BW; without them it takes AVX2.
bool detect_vnni() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
#else
  return false;
#endif
}
const bool g_has_vnni = detect_vnni();

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    const float f = std::ldexp(static_cast<float>(mant), -24);  // zero or subnormal, exact
    return sign ? -f : f;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t load_u16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

struct View {
  const uint8_t* data;
  size_t gstride;  // bytes per column group
  size_t k;
  size_t n;  // valid columns
};

// ---------------------------------------------------------------------------------------------
// Tile kernels: R rows x G column groups. The k loop is outermost inside a tile so each dequantized
// weight vector is reused by all R rows (the register blocking that makes batches cheap).

#define AI_AVX512 __attribute__((target("avx512f")))
#define AI_AVX2 __attribute__((target("avx2,fma")))

template <int F, int R, int G>
AI_AVX512 void tile_avx512(const View& w, size_t g0, const float* x, size_t ldx, float* y, size_t ldy) {
  __m512 acc[R][G];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  const uint8_t* base[G];
  for (int g = 0; g < G; ++g) base[g] = w.data + (g0 + g) * w.gstride;
  if constexpr (F == kF32) {
    for (size_t k = 0; k < w.k; ++k) {
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        const __m512 wv = _mm512_loadu_ps(reinterpret_cast<const float*>(base[g]) + k * kLanes);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r)
          acc[r][g] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), wv, acc[r][g]);
      }
    }
  } else if constexpr (F == kQ8 || F == kQ6) {
    for (size_t b = 0; b < w.k / 32; ++b) {
      const uint8_t* p[G];
      __m512 d[G];
      for (int g = 0; g < G; ++g) {
        p[g] = base[g] + b * block_bytes<F>();
        d[g] = _mm512_loadu_ps(reinterpret_cast<const float*>(p[g]));
      }
      const float* xb = x + b * 32;
      for (int k = 0; k < 32; ++k) {
        if constexpr (F == kQ6)
          if (k == 16)
            for (int g = 0; g < G; ++g) d[g] = _mm512_loadu_ps(reinterpret_cast<const float*>(p[g]) + kLanes);
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) {
          const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[g] + codes_at<F>() + k * kLanes));
          const __m512 wv = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d[g]);
#pragma GCC unroll 16
          for (int r = 0; r < R; ++r)
            acc[r][g] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * ldx + k]), wv, acc[r][g]);
        }
      }
    }
  } else {
    const __m512i low = _mm512_set1_epi32(15);
    for (size_t b = 0; b < w.k / 32; ++b) {
      const uint8_t* p[G];
      __m512 d[G], m[G];
      for (int g = 0; g < G; ++g) {
        p[g] = base[g] + b * kQ4Block;
        d[g] = _mm512_loadu_ps(reinterpret_cast<const float*>(p[g]));
        m[g] = _mm512_loadu_ps(reinterpret_cast<const float*>(p[g]) + kLanes);
      }
      const float* xb = x + b * 32;
      for (int j = 0; j < 16; ++j) {
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) {
          const __m512i q = _mm512_cvtepu8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[g] + 128 + j * kLanes)));
          const __m512 w0 =
              _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, low)), d[g]), m[g]);
          const __m512 w1 = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), d[g]), m[g]);
#pragma GCC unroll 16
          for (int r = 0; r < R; ++r)
            acc[r][g] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * ldx + 2 * j]), w0, acc[r][g]);
#pragma GCC unroll 16
          for (int r = 0; r < R; ++r)
            acc[r][g] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * ldx + 2 * j + 1]), w1, acc[r][g]);
        }
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const size_t col = (g0 + g) * kLanes;
    const size_t valid = std::min<size_t>(kLanes, w.n - col);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy + col, mask, acc[r][g]);
  }
}

// AVX2: a 16-column group is two 8-lane halves; the per-lane chain is the same as above.
template <int F, int R>
AI_AVX2 void tile_avx2(const View& w, size_t g0, const float* x, size_t ldx, float* y, size_t ldy) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const uint8_t* base = w.data + g0 * w.gstride;
  if constexpr (F == kF32) {
    const float* p = reinterpret_cast<const float*>(base);
    for (size_t k = 0; k < w.k; ++k) {
      for (int h = 0; h < 2; ++h) {
        const __m256 wv = _mm256_loadu_ps(p + k * kLanes + 8 * h);
        for (int r = 0; r < R; ++r) acc[r][h] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * ldx + k]), wv, acc[r][h]);
      }
    }
  } else if constexpr (F == kQ8 || F == kQ6) {
    for (size_t b = 0; b < w.k / 32; ++b) {
      const uint8_t* p = base + b * block_bytes<F>();
      const float* pd = reinterpret_cast<const float*>(p);
      __m256 d[2] = {_mm256_loadu_ps(pd), _mm256_loadu_ps(pd + 8)};
      const float* xb = x + b * 32;
      for (int k = 0; k < 32; ++k) {
        if constexpr (F == kQ6)
          if (k == 16) d[0] = _mm256_loadu_ps(pd + 16), d[1] = _mm256_loadu_ps(pd + 24);
        for (int h = 0; h < 2; ++h) {
          const __m128i q =
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + codes_at<F>() + k * kLanes + 8 * h));
          const __m256 wv = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d[h]);
          for (int r = 0; r < R; ++r)
            acc[r][h] = _mm256_fmadd_ps(_mm256_set1_ps(xb[r * ldx + k]), wv, acc[r][h]);
        }
      }
    }
  } else {
    const __m256i low = _mm256_set1_epi32(15);
    for (size_t b = 0; b < w.k / 32; ++b) {
      const uint8_t* p = base + b * kQ4Block;
      const float* pf = reinterpret_cast<const float*>(p);
      const __m256 d[2] = {_mm256_loadu_ps(pf), _mm256_loadu_ps(pf + 8)};
      const __m256 m[2] = {_mm256_loadu_ps(pf + 16), _mm256_loadu_ps(pf + 24)};
      const float* xb = x + b * 32;
      for (int j = 0; j < 16; ++j) {
        for (int h = 0; h < 2; ++h) {
          const __m256i q =
              _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 128 + j * kLanes + 8 * h)));
          const __m256 w0 =
              _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, low)), d[h]), m[h]);
          const __m256 w1 = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), d[h]), m[h]);
          for (int r = 0; r < R; ++r)
            acc[r][h] = _mm256_fmadd_ps(_mm256_set1_ps(xb[r * ldx + 2 * j]), w0, acc[r][h]);
          for (int r = 0; r < R; ++r)
            acc[r][h] = _mm256_fmadd_ps(_mm256_set1_ps(xb[r * ldx + 2 * j + 1]), w1, acc[r][h]);
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
    std::memcpy(y + r * ldy + col, tmp, valid * sizeof(float));
  }
}

// Portable path: one row, one group. std::fma keeps the chain identical to the SIMD paths.
template <int F>
void tile_scalar(const View& w, size_t g, const float* x, float* y) {
  float acc[kLanes] = {};
  const uint8_t* base = w.data + g * w.gstride;
  if constexpr (F == kF32) {
    const float* p = reinterpret_cast<const float*>(base);
    for (size_t k = 0; k < w.k; ++k)
      for (int c = 0; c < kLanes; ++c) acc[c] = std::fma(x[k], p[k * kLanes + c], acc[c]);
  } else if constexpr (F == kQ8 || F == kQ6) {
    for (size_t b = 0; b < w.k / 32; ++b) {
      const uint8_t* p = base + b * block_bytes<F>();
      float d[2 * kLanes];
      std::memcpy(d, p, sizeof d / (F == kQ6 ? 1 : 2));
      for (int k = 0; k < 32; ++k)
        for (int c = 0; c < kLanes; ++c) {
          const float dc = F == kQ6 && k >= 16 ? d[kLanes + c] : d[c];
          const float wv = static_cast<float>(static_cast<int8_t>(p[codes_at<F>() + k * kLanes + c])) * dc;
          acc[c] = std::fma(x[b * 32 + k], wv, acc[c]);
        }
    }
  } else {
    for (size_t b = 0; b < w.k / 32; ++b) {
      const uint8_t* p = base + b * kQ4Block;
      float d[kLanes], m[kLanes];
      std::memcpy(d, p, sizeof d);
      std::memcpy(m, p + 64, sizeof m);
      for (int j = 0; j < 16; ++j) {
        for (int c = 0; c < kLanes; ++c) {
          const uint8_t q = p[128 + j * kLanes + c];
          float w0 = static_cast<float>(q & 15) * d[c];
          w0 = w0 + m[c];
          float w1 = static_cast<float>(q >> 4) * d[c];
          w1 = w1 + m[c];
          acc[c] = std::fma(x[b * 32 + 2 * j], w0, acc[c]);
          acc[c] = std::fma(x[b * 32 + 2 * j + 1], w1, acc[c]);
        }
      }
    }
  }
  const size_t col = g * kLanes;
  std::memcpy(y + col, acc, std::min<size_t>(kLanes, w.n - col) * sizeof(float));
}

// ---------------------------------------------------------------------------------------------
// Dispatch over one thread's column-group range [g_begin, g_end).

constexpr int kRowTile512 = 8;
constexpr int kRowTile2 = 4;
constexpr size_t kGroupChunk = 4;  // column groups whose weights stay hot in L1 while all rows pass

template <int F, int G>
void rows_avx512(int r, const View& w, size_t g, const float* x, size_t ldx, float* y, size_t ldy) {
  switch (r) {
    case 1: tile_avx512<F, 1, G>(w, g, x, ldx, y, ldy); break;
    case 2: tile_avx512<F, 2, G>(w, g, x, ldx, y, ldy); break;
    case 3: tile_avx512<F, 3, G>(w, g, x, ldx, y, ldy); break;
    case 4: tile_avx512<F, 4, G>(w, g, x, ldx, y, ldy); break;
    case 5: tile_avx512<F, 5, G>(w, g, x, ldx, y, ldy); break;
    case 6: tile_avx512<F, 6, G>(w, g, x, ldx, y, ldy); break;
    case 7: tile_avx512<F, 7, G>(w, g, x, ldx, y, ldy); break;
    default: tile_avx512<F, 8, G>(w, g, x, ldx, y, ldy); break;
  }
}

template <int F>
void rows_avx2(int r, const View& w, size_t g, const float* x, size_t ldx, float* y, size_t ldy) {
  switch (r) {
    case 1: tile_avx2<F, 1>(w, g, x, ldx, y, ldy); break;
    case 2: tile_avx2<F, 2>(w, g, x, ldx, y, ldy); break;
    case 3: tile_avx2<F, 3>(w, g, x, ldx, y, ldy); break;
    default: tile_avx2<F, 4>(w, g, x, ldx, y, ldy); break;
  }
}

// Row r of x at x + r * ldx, of y at y + r * ldy (ldx >= K, ldy >= N).
template <int F>
void run_range(int isa, const View& w, size_t g_begin, size_t g_end, const float* x, size_t m, float* y, size_t ldx,
               size_t ldy) {
  for (size_t gc = g_begin; gc < g_end; gc += kGroupChunk) {
    const size_t gn = std::min(kGroupChunk, g_end - gc);
    if (isa == kAvx512) {
      size_t r = 0;
      // Full 16-row tiles, one group at a time: each dequantized vector feeds 16 FMAs, which keeps
      // the FP pipes on FMAs rather than on dequantization (batched decode is 16+ rows).
      for (; r + 16 <= m; r += 16)
        for (size_t g = gc; g < gc + gn; ++g) tile_avx512<F, 16, 1>(w, g, x + r * ldx, ldx, y + r * ldy, ldy);
      for (; r < m; r += kRowTile512) {
        const int rt = static_cast<int>(std::min<size_t>(kRowTile512, m - r));
        const float* xr = x + r * ldx;
        float* yr = y + r * ldy;
        size_t g = gc;
        // Few rows: more groups per tile give the FMA chains independent work; many rows: fewer
        // groups keep the accumulators in registers. Either way each element's chain is unchanged.
        if (rt <= 2 && gn == 4) {
          rows_avx512<F, 4>(rt, w, g, xr, ldx, yr, ldy);
          g += 4;
        }
        for (; g + 2 <= gc + gn; g += 2) rows_avx512<F, 2>(rt, w, g, xr, ldx, yr, ldy);
        for (; g < gc + gn; ++g) rows_avx512<F, 1>(rt, w, g, xr, ldx, yr, ldy);
      }
    } else if (isa == kAvx2) {
      for (size_t r = 0; r < m; r += kRowTile2) {
        const int rt = static_cast<int>(std::min<size_t>(kRowTile2, m - r));
        for (size_t g = gc; g < gc + gn; ++g) rows_avx2<F>(rt, w, g, x + r * ldx, ldx, y + r * ldy, ldy);
      }
    } else {
      for (size_t r = 0; r < m; ++r)
        for (size_t g = gc; g < gc + gn; ++g) tile_scalar<F>(w, g, x + r * ldx, y + r * ldy);
    }
  }
}

}  // namespace
}  // namespace agent_infer
