// Batch-invariant CPU linear layer over packed (quantized or fp32) weights: y[M, N] = x[M, K] @ W^T.
//
// Layout: output columns are packed in groups of 16 (one AVX-512 vector); inside a group the weights
// are stored k-major so a vector holds one k for 16 columns. Every output element is therefore a
// single fused-multiply-add chain over k = 0..K-1 in order, starting from +0. Nothing about M, the
// row tile, the column tile, the thread that runs it or even the ISA (AVX-512, AVX2+FMA, scalar
// std::fma) changes that chain, so a row's result is bit-identical in any batch — invariance holds
// by construction, not by measurement. Dequantization reproduces the torch loader's fp32 values
// exactly (Q4_1: fl(fl(q*d)+m); Q8_0/Q4_0: fl(q*d)); this file is built with -ffp-contract=off so
// the compiler cannot fuse those two roundings into one.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bindings.h"
#include "parallel.h"

namespace nb = nanobind;

// GCC 12's AVX-512 headers pass _mm512_undefined_*() as the pass-through of unmasked conversions,
// which -Wmaybe-uninitialized reports at every inlined call site; the values are never read.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace agent_infer {
namespace {

// ggml type ids accepted as input (the GGUF tensor type field).
constexpr int kGgmlF32 = 0, kGgmlF16 = 1, kGgmlQ4_0 = 2, kGgmlQ4_1 = 3, kGgmlQ8_0 = 8, kGgmlBF16 = 30;

// Packed formats. Q4_0 becomes kQ8 (q-8 fits int8 and fl((q-8)*d) is what torch computes);
// F16/BF16 widen exactly to kF32.
enum Fmt : int { kF32 = 0, kQ8 = 1, kQ4 = 2 };
constexpr int kLanes = 16;                    // columns per group
constexpr size_t kQ8Block = 64 + 32 * 16;     // 16 fp32 scales, then 32 k x 16 int8
constexpr size_t kQ4Block = 128 + 16 * 16;    // 16 scales, 16 mins, then 16 k-pairs x 16 bytes

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
  } else if constexpr (F == kQ8) {
    for (size_t b = 0; b < w.k / 32; ++b) {
      const uint8_t* p[G];
      __m512 d[G];
      for (int g = 0; g < G; ++g) {
        p[g] = base[g] + b * kQ8Block;
        d[g] = _mm512_loadu_ps(reinterpret_cast<const float*>(p[g]));
      }
      const float* xb = x + b * 32;
      for (int k = 0; k < 32; ++k) {
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) {
          const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[g] + 64 + k * kLanes));
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
  } else if constexpr (F == kQ8) {
    for (size_t b = 0; b < w.k / 32; ++b) {
      const uint8_t* p = base + b * kQ8Block;
      const __m256 d[2] = {_mm256_loadu_ps(reinterpret_cast<const float*>(p)),
                           _mm256_loadu_ps(reinterpret_cast<const float*>(p) + 8)};
      const float* xb = x + b * 32;
      for (int k = 0; k < 32; ++k) {
        for (int h = 0; h < 2; ++h) {
          const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 64 + k * kLanes + 8 * h));
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
  } else if constexpr (F == kQ8) {
    for (size_t b = 0; b < w.k / 32; ++b) {
      const uint8_t* p = base + b * kQ8Block;
      float d[kLanes];
      std::memcpy(d, p, sizeof d);
      for (int k = 0; k < 32; ++k)
        for (int c = 0; c < kLanes; ++c) {
          const float wv = static_cast<float>(static_cast<int8_t>(p[64 + k * kLanes + c])) * d[c];
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

template <int F>
void run_range(int isa, const View& w, size_t g_begin, size_t g_end, const float* x, size_t m, float* y) {
  const size_t ldx = w.k, ldy = w.n;
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

// ---------------------------------------------------------------------------------------------
// A small persistent pool. Not OpenMP: torch's OpenMP workers would busy-wait against ours. Work is
// a list of chunks claimed from one atomic counter, so on a loaded machine a worker that is not
// scheduled in time costs nothing: the caller simply claims the remaining chunks itself. (Which
// thread computes a chunk never changes its bits.) The counter carries the job's generation in its
// high 32 bits so a late worker cannot claim a chunk of a newer job with a stale job pointer.

class Pool {
 public:
  ~Pool() { resize(0); }

  // Run fn(c) for c in [0, chunks) on up to `threads` threads (the caller included).
  void run(int threads, size_t chunks, const std::function<void(size_t)>& fn) {
    if (threads <= 1 || chunks <= 1) {
      for (size_t c = 0; c < chunks; ++c) fn(c);
      return;
    }
    std::lock_guard<std::mutex> call_guard(call_mu_);  // one parallel call at a time
    if (static_cast<int>(workers_.size()) < threads - 1) resize(threads - 1);
    const uint64_t gen = (counter_.load(std::memory_order_relaxed) >> 32) + 1;
    {
      // Workers read a job's fields under this lock together with its generation, so a late
      // worker never pairs one job's generation with another job's chunk count.
      std::lock_guard<std::mutex> lk(mu_);
      job_ = &fn;
      total_ = chunks;
      wanted_ = threads - 1;
      done_.store(0, std::memory_order_relaxed);
      counter_.store(gen << 32, std::memory_order_release);
    }
    cv_.notify_all();
    size_t mine = 0;
    for (size_t c; (c = claim(gen, chunks)) < chunks; ++mine) fn(c);
    done_.fetch_add(mine, std::memory_order_acq_rel);
    // Only chunks already claimed by running workers remain: a short wait.
    for (int spins = 0; done_.load(std::memory_order_acquire) != chunks; ++spins) {
      if (spins < 1000)
        _mm_pause();
      else
        std::this_thread::yield();
    }
  }

 private:
  // Next chunk of job `gen`, or `chunks` when none is left (or the job is no longer current).
  size_t claim(uint64_t gen, size_t chunks) {
    uint64_t v = counter_.load(std::memory_order_acquire);
    for (;;) {
      if ((v >> 32) != gen || (v & 0xffffffffu) >= chunks) return chunks;
      if (counter_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel, std::memory_order_acquire))
        return static_cast<size_t>(v & 0xffffffffu);
    }
  }

  void resize(int n) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
    stop_ = false;
    for (int i = 0; i < n; ++i) workers_.emplace_back([this, i] { loop(i); });
  }

  void loop(int index) {
    uint64_t seen = counter_.load(std::memory_order_acquire) >> 32;
    for (;;) {
      // Decode issues ~120 calls per step microseconds apart: spin a little before sleeping.
      for (int spins = 0; spins < 500 && (counter_.load(std::memory_order_acquire) >> 32) == seen; ++spins)
        _mm_pause();
      uint64_t gen;
      const std::function<void(size_t)>* job;
      size_t chunks;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || (counter_.load(std::memory_order_acquire) >> 32) != seen; });
        if (stop_) return;
        gen = counter_.load(std::memory_order_acquire) >> 32;
        job = job_;
        chunks = total_;
        if (index >= wanted_) chunks = 0;
      }
      seen = gen;
      // A claim of `gen` succeeds only while job `gen` is unfinished, so `job` is still alive.
      size_t mine = 0;
      for (size_t c; (c = claim(gen, chunks)) < chunks; ++mine) (*job)(c);
      if (mine) done_.fetch_add(mine, std::memory_order_acq_rel);
    }
  }

  std::mutex call_mu_, mu_;
  std::condition_variable cv_;
  std::vector<std::thread> workers_;
  bool stop_ = false;
  const std::function<void(size_t)>* job_ = nullptr;  // job_, total_, wanted_: guarded by mu_
  size_t total_ = 0;
  int wanted_ = 0;
  std::atomic<size_t> done_{0};
  std::atomic<uint64_t> counter_{0};  // generation << 32 | next chunk
};

Pool& pool() {
  static Pool p;
  return p;
}

// ---------------------------------------------------------------------------------------------

struct FreeDeleter {
  void operator()(uint8_t* p) const { std::free(p); }
};

class PackedLinear {
 public:
  PackedLinear(nb::ndarray<nb::ro> raw, int ggml_type, int64_t n, int64_t k) : ggml_type_(ggml_type) {
    if (n <= 0 || k <= 0) throw std::invalid_argument("PackedLinear: n and k must be positive");
    n_ = static_cast<size_t>(n);
    k_ = static_cast<size_t>(k);
    size_t row_bytes;
    switch (ggml_type) {
      case kGgmlF32: fmt_ = kF32; row_bytes = k_ * 4; break;
      case kGgmlF16: case kGgmlBF16: fmt_ = kF32; row_bytes = k_ * 2; break;
      case kGgmlQ8_0: fmt_ = kQ8; row_bytes = k_ / 32 * 34; break;
      case kGgmlQ4_0: fmt_ = kQ8; row_bytes = k_ / 32 * 18; break;
      case kGgmlQ4_1: fmt_ = kQ4; row_bytes = k_ / 32 * 20; break;
      default:
        throw std::invalid_argument("PackedLinear: unsupported ggml type " + std::to_string(ggml_type) +
                                    " (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1)");
    }
    if (fmt_ != kF32 && k_ % 32)
      throw std::invalid_argument("PackedLinear: k = " + std::to_string(k_) +
                                  " is not a multiple of the quantization block (32)");
    if (raw.dtype() != nb::dtype<uint8_t>()) throw nb::type_error("PackedLinear: raw weights must be a uint8 array");
    if (raw.device_type() != nb::device::cpu::value) throw std::invalid_argument("PackedLinear: raw weights must be on the CPU");
    if (raw.ndim() != 1 || (raw.shape(0) > 1 && raw.stride(0) != 1))
      throw std::invalid_argument("PackedLinear: raw weights must be a contiguous 1-D byte array");
    if (raw.shape(0) != n_ * row_bytes)
      throw std::invalid_argument("PackedLinear: raw weights have " + std::to_string(raw.shape(0)) +
                                  " bytes, expected " + std::to_string(n_ * row_bytes) + " for " +
                                  std::to_string(n_) + " rows of " + std::to_string(k_));
    groups_ = (n_ + kLanes - 1) / kLanes;
    gstride_ = fmt_ == kF32 ? k_ * kLanes * 4 : (k_ / 32) * (fmt_ == kQ8 ? kQ8Block : kQ4Block);
    const size_t bytes = (groups_ * gstride_ + 63) / 64 * 64;
    data_.reset(static_cast<uint8_t*>(std::aligned_alloc(64, bytes)));
    if (!data_) throw std::bad_alloc();
    std::memset(data_.get(), 0, bytes);  // padded columns: zero weights, never stored
    const uint8_t* src = static_cast<const uint8_t*>(raw.data());
    nb::gil_scoped_release release;
    for (size_t row = 0; row < n_; ++row) pack_row(src + row * row_bytes, row);
  }

  // y = x @ W^T into `out` ([M, N] float32, contiguous); num_threads <= 0 means one thread.
  void forward(nb::ndarray<nb::ro> x, nb::ndarray<> out, int num_threads) const {
    check_io(x, out);
    run(static_cast<const float*>(x.data()), x.shape(0), static_cast<float*>(out.data()), num_threads);
  }

  // forward() on raw addresses: the caller guarantees x is [m, K] and out [m, N], float32,
  // C-contiguous and alive for the call. A decode step makes ~120 of these calls; converting two
  // tensors per call costs more than a one-row Q4 group's compute.
  void forward_raw(uintptr_t x, size_t m, uintptr_t out, int num_threads) const {
    if (m == 0) return;
    if (x == 0 || out == 0) throw std::invalid_argument("PackedLinear.forward_raw: null address");
    run(reinterpret_cast<const float*>(x), m, reinterpret_cast<float*>(out), num_threads);
  }

  void run(const float* xp, size_t m, float* yp, int num_threads) const {
    if (m == 0) return;
    const View v{data_.get(), gstride_, k_, n_};
    const int isa = g_isa.load(std::memory_order_relaxed);
    const size_t ng = groups_;
    const size_t chunks = (ng + kGroupChunk - 1) / kGroupChunk;
    const int threads = static_cast<int>(std::clamp<size_t>(num_threads < 1 ? 1 : num_threads, 1, chunks));
    const int fmt = fmt_;
    nb::gil_scoped_release release;
    pool().run(threads, chunks, [&](size_t c) {
      const size_t gb = c * kGroupChunk;
      run_any(fmt, isa, v, gb, std::min(ng, gb + kGroupChunk), xp, m, yp);
    });
  }

  // forward() restricted to the column groups (16 columns each) in which some row of `allowed`
  // has a bit set; every column of the other groups becomes -inf. `allowed` is an int32 token
  // bitmask [M, W] (bit j of word w = column 32w + j; columns past 32W count as disallowed), so a
  // constrained step reads only the output-projection weights of tokens the grammar can take.
  // Each computed column has its own FMA chain, so its value is bit-identical to forward()'s.
  // Returns the number of groups computed.
  size_t forward_allowed(nb::ndarray<nb::ro> x, nb::ndarray<> out, nb::ndarray<nb::ro> allowed,
                         int num_threads) const {
    check_io(x, out);
    if (allowed.dtype() != nb::dtype<int32_t>() || allowed.device_type() != nb::device::cpu::value ||
        allowed.ndim() != 2)
      throw std::invalid_argument("PackedLinear: allowed must be a 2-D int32 CPU bitmask");
    if (allowed.shape(0) != x.shape(0))
      throw std::invalid_argument("PackedLinear: allowed has " + std::to_string(allowed.shape(0)) +
                                  " rows, x has " + std::to_string(x.shape(0)));
    if ((allowed.shape(0) > 1 && allowed.stride(0) != static_cast<int64_t>(allowed.shape(1))) ||
        (allowed.shape(1) > 1 && allowed.stride(1) != 1))
      throw std::invalid_argument("PackedLinear: allowed must be C-contiguous");
    const size_t m = x.shape(0), words = allowed.shape(1);
    if (m == 0) return 0;
    const float* xp = static_cast<const float*>(x.data());
    float* yp = static_cast<float*>(out.data());
    const uint32_t* bits = static_cast<const uint32_t*>(allowed.data());
    const View v{data_.get(), gstride_, k_, n_};
    const int isa = g_isa.load(std::memory_order_relaxed);
    const size_t ng = groups_;
    const int fmt = fmt_;
    nb::gil_scoped_release release;
    std::vector<uint32_t> any(words, 0);
    for (size_t r = 0; r < m; ++r)
      for (size_t w = 0; w < words; ++w) any[w] |= bits[r * words + w];
    // Runs of needed groups, cut into chunks of at most kGroupChunk for the pool.
    std::vector<std::pair<size_t, size_t>> chunks;
    size_t computed = 0;
    auto needed = [&](size_t g) { return g / 2 < words && ((any[g / 2] >> (16 * (g & 1))) & 0xffffu) != 0; };
    for (size_t g = 0; g < ng;) {
      if (!needed(g)) {
        size_t e = g + 1;
        while (e < ng && !needed(e)) ++e;
        const size_t c0 = g * kLanes, c1 = std::min(n_, e * kLanes);
        for (size_t r = 0; r < m; ++r) std::fill(yp + r * n_ + c0, yp + r * n_ + c1, -INFINITY);
        g = e;
        continue;
      }
      size_t e = g + 1;
      while (e < ng && needed(e)) ++e;
      computed += e - g;
      for (size_t b = g; b < e; b += kGroupChunk) chunks.emplace_back(b, std::min(e, b + kGroupChunk));
      g = e;
    }
    if (chunks.empty()) return 0;
    const int threads = static_cast<int>(std::clamp<size_t>(num_threads < 1 ? 1 : num_threads, 1, chunks.size()));
    pool().run(threads, chunks.size(), [&](size_t c) {
      run_any(fmt, isa, v, chunks[c].first, chunks[c].second, xp, m, yp);
    });
    return computed;
  }

  size_t n() const { return n_; }
  size_t k() const { return k_; }
  int ggml_type() const { return ggml_type_; }
  size_t nbytes() const { return groups_ * gstride_; }

 private:
  // x [M, K] and out [M, N]: float32, CPU, C-contiguous.
  void check_io(const nb::ndarray<nb::ro>& x, const nb::ndarray<>& out) const {
    check_f32(x, "x");
    check_f32(out, "out");
    if (x.shape(1) != k_)
      throw std::invalid_argument("PackedLinear: x has " + std::to_string(x.shape(1)) + " columns, expected " +
                                  std::to_string(k_));
    if (out.shape(0) != x.shape(0) || out.shape(1) != n_)
      throw std::invalid_argument("PackedLinear: out must be [" + std::to_string(x.shape(0)) + ", " +
                                  std::to_string(n_) + "]");
  }

  static void run_any(int fmt, int isa, const View& v, size_t gb, size_t ge, const float* xp, size_t m, float* yp) {
    if (fmt == kF32)
      run_range<kF32>(isa, v, gb, ge, xp, m, yp);
    else if (fmt == kQ8)
      run_range<kQ8>(isa, v, gb, ge, xp, m, yp);
    else
      run_range<kQ4>(isa, v, gb, ge, xp, m, yp);
  }

  template <typename Array>  // nb::ndarray<> or nb::ndarray<nb::ro>
  static void check_f32(const Array& a, const char* name) {
    if (a.dtype() != nb::dtype<float>())
      throw nb::type_error((std::string("PackedLinear: ") + name + " must be float32").c_str());
    if (a.device_type() != nb::device::cpu::value)
      throw std::invalid_argument(std::string("PackedLinear: ") + name + " must be on the CPU");
    if (a.ndim() != 2) throw std::invalid_argument(std::string("PackedLinear: ") + name + " must be 2-D");
    if ((a.shape(0) > 1 && a.stride(0) != static_cast<int64_t>(a.shape(1))) || (a.shape(1) > 1 && a.stride(1) != 1))
      throw std::invalid_argument(std::string("PackedLinear: ") + name + " must be C-contiguous");
  }

  void pack_row(const uint8_t* src, size_t row) {
    uint8_t* grp = data_.get() + (row / kLanes) * gstride_;
    const size_t c = row % kLanes;
    if (fmt_ == kF32) {
      float* dst = reinterpret_cast<float*>(grp);
      for (size_t k = 0; k < k_; ++k) {
        float v;
        if (ggml_type_ == kGgmlF32) {
          std::memcpy(&v, src + 4 * k, 4);
        } else if (ggml_type_ == kGgmlF16) {
          v = half_to_float(load_u16(src + 2 * k));
        } else {
          const uint32_t bits = static_cast<uint32_t>(load_u16(src + 2 * k)) << 16;
          std::memcpy(&v, &bits, 4);
        }
        dst[k * kLanes + c] = v;
      }
      return;
    }
    for (size_t b = 0; b < k_ / 32; ++b) {
      int q[32];
      float d, m = 0.0f;
      if (ggml_type_ == kGgmlQ8_0) {
        const uint8_t* s = src + b * 34;
        d = half_to_float(load_u16(s));
        for (int i = 0; i < 32; ++i) q[i] = static_cast<int8_t>(s[2 + i]);
      } else if (ggml_type_ == kGgmlQ4_0) {
        const uint8_t* s = src + b * 18;
        d = half_to_float(load_u16(s));
        // low nibbles are elements 0..15, high nibbles 16..31 (ggml's block layout)
        for (int i = 0; i < 16; ++i) {
          q[i] = (s[2 + i] & 15) - 8;
          q[i + 16] = (s[2 + i] >> 4) - 8;
        }
      } else {
        const uint8_t* s = src + b * 20;
        d = half_to_float(load_u16(s));
        m = half_to_float(load_u16(s + 2));
        for (int i = 0; i < 16; ++i) {
          q[i] = s[4 + i] & 15;
          q[i + 16] = s[4 + i] >> 4;
        }
      }
      if (fmt_ == kQ8) {
        uint8_t* blk = grp + b * kQ8Block;
        std::memcpy(blk + 4 * c, &d, 4);
        for (int k = 0; k < 32; ++k) blk[64 + k * kLanes + c] = static_cast<uint8_t>(static_cast<int8_t>(q[k]));
      } else {
        uint8_t* blk = grp + b * kQ4Block;
        std::memcpy(blk + 4 * c, &d, 4);
        std::memcpy(blk + 64 + 4 * c, &m, 4);
        for (int j = 0; j < 16; ++j) blk[128 + j * kLanes + c] = static_cast<uint8_t>(q[2 * j] | (q[2 * j + 1] << 4));
      }
    }
  }

  int ggml_type_;
  int fmt_ = kF32;
  size_t n_ = 0, k_ = 0, groups_ = 0, gstride_ = 0;
  std::unique_ptr<uint8_t, FreeDeleter> data_;
};

}  // namespace

void parallel_for(int threads, size_t n, const std::function<void(size_t)>& fn) { pool().run(threads, n, fn); }

namespace {

const char* isa_name(int isa) { return isa == kAvx512 ? "avx512" : isa == kAvx2 ? "avx2" : "scalar"; }

}  // namespace

void register_linear(nb::module_& m) {
  nb::class_<PackedLinear>(m, "PackedLinear",
                           "Weights [N, K] repacked from GGUF bytes (F32/F16/BF16/Q8_0/Q4_0/Q4_1) for a "
                           "batch-invariant CPU linear layer.")
      .def(nb::init<nb::ndarray<nb::ro>, int, int64_t, int64_t>(), nb::arg("raw"), nb::arg("ggml_type"),
           nb::arg("n"), nb::arg("k"),
           "Pack ``n`` rows of ``k`` weights given as the tensor's raw GGUF bytes (uint8, row-major).")
      .def("forward", &PackedLinear::forward, nb::arg("x"), nb::arg("out"), nb::arg("num_threads") = 1,
           "out[M, N] = x[M, K] @ W^T (float32, C-contiguous); the GIL is released.")
      .def("forward_raw", &PackedLinear::forward_raw, nb::arg("x"), nb::arg("m"), nb::arg("out"),
           nb::arg("num_threads") = 1,
           "forward() on raw addresses (x [m, K], out [m, N], float32, C-contiguous; the caller "
           "checks and keeps both alive); the GIL is released.")
      .def("forward_allowed", &PackedLinear::forward_allowed, nb::arg("x"), nb::arg("out"), nb::arg("allowed"),
           nb::arg("num_threads") = 1,
           "forward() for the 16-column groups some row of the int32 token bitmask ``allowed`` [M, W] "
           "allows; the other groups' columns are set to -inf. Returns the number of groups computed.")
      .def_prop_ro("n", &PackedLinear::n)
      .def_prop_ro("k", &PackedLinear::k)
      .def_prop_ro("ggml_type", &PackedLinear::ggml_type)
      .def_prop_ro("nbytes", &PackedLinear::nbytes);
  m.def("linear_isa", [] { return std::string(isa_name(g_isa.load())); },
        "The instruction set PackedLinear uses now: 'avx512', 'avx2' or 'scalar'.");
  m.def(
      "linear_set_isa",
      [](const std::string& name) {
        int want;
        if (name == "avx512")
          want = kAvx512;
        else if (name == "avx2")
          want = kAvx2;
        else if (name == "scalar")
          want = kScalar;
        else if (name == "best")
          want = g_best_isa;
        else
          throw std::invalid_argument("linear_set_isa: unknown ISA '" + name + "' (avx512, avx2, scalar, best)");
        if (want > g_best_isa)
          throw std::invalid_argument("linear_set_isa: this CPU does not support " + name);
        g_isa.store(want);
      },
      nb::arg("name"), "Force an instruction set (for tests): results are identical on every ISA.");
}

}  // namespace agent_infer
