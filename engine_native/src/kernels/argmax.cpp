// Row-wise argmax of float32 logits, as torch.argmax(dim=-1) defines it: the first index of the
// largest value, the first NaN when a row has one. Greedy sampling reads a vocabulary-wide row per
// sequence every step; torch's reduction takes ~1 ns per element on one thread, this one a
// fraction of that (one AVX-512 compare per 16 values).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/vector.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "bindings/bindings.h"
#include "kernels/parallel.h"

namespace nb = nanobind;

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 AVX-512 headers, see kernels/linear.cpp
#endif

namespace agent_infer {
namespace {

bool argmax_avx512_usable() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}
const bool g_argmax_avx512 = argmax_avx512_usable();

int64_t first_nan(const float* x, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (std::isnan(x[i])) return static_cast<int64_t>(i);
  return -1;
}

int64_t argmax_scalar(const float* x, size_t n) {
  if (const int64_t nan = first_nan(x, n); nan >= 0) return nan;
  size_t best = 0;
  for (size_t i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return static_cast<int64_t>(best);
}

// Per lane: the largest value seen and the first index holding it (strict >); then the largest
// lane value, the smallest index among the lanes holding it. A lane that never updates keeps
// (-inf, 0), which is right exactly when the whole row is -inf.
__attribute__((target("avx512f"))) int64_t argmax_avx512(const float* x, size_t n) {
  __m512 best = _mm512_set1_ps(-INFINITY);
  __m512i where = _mm512_setzero_si512();
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = 0;
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __mmask16 up = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best = _mm512_mask_mov_ps(best, up, v);
    where = _mm512_mask_mov_epi32(where, up, idx);
    idx = _mm512_add_epi32(idx, step);
  }
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail, x + i);
    const __mmask16 up = _mm512_mask_cmp_ps_mask(tail, v, best, _CMP_GT_OQ);
    nan |= _mm512_mask_cmp_ps_mask(tail, v, v, _CMP_UNORD_Q);
    best = _mm512_mask_mov_ps(best, up, v);
    where = _mm512_mask_mov_epi32(where, up, idx);
  }
  if (nan) return first_nan(x, n);
  alignas(64) float value[16];
  alignas(64) int32_t index[16];
  _mm512_store_ps(value, best);
  _mm512_store_si512(reinterpret_cast<__m512i*>(index), where);
  float top = value[0];
  int64_t pick = index[0];
  for (int l = 1; l < 16; ++l)
    if (value[l] > top || (value[l] == top && index[l] < pick)) top = value[l], pick = index[l];
  return pick;
}

// Rows of x [M, N] (float32, C-contiguous); the GIL is released while scanning.
std::vector<int64_t> argmax_rows(nb::ndarray<nb::ro> x, int num_threads) {
  if (x.dtype() != nb::dtype<float>()) throw nb::type_error("argmax_rows: x must be float32");
  if (x.device_type() != nb::device::cpu::value || x.ndim() != 2)
    throw std::invalid_argument("argmax_rows: x must be a 2-D CPU array");
  const size_t m = x.shape(0), n = x.shape(1);
  if (n == 0 && m > 0) throw std::invalid_argument("argmax_rows: rows are empty");
  if ((m > 1 && x.stride(0) != static_cast<int64_t>(n)) || (n > 1 && x.stride(1) != 1))
    throw std::invalid_argument("argmax_rows: x must be C-contiguous");
  if (n > static_cast<size_t>(INT32_MAX)) throw std::invalid_argument("argmax_rows: rows longer than 2^31");
  std::vector<int64_t> out(m);
  const float* p = static_cast<const float*>(x.data());
  {
    nb::gil_scoped_release release;
    parallel_for(num_threads, m, [&](size_t r) {
      out[r] = g_argmax_avx512 ? argmax_avx512(p + r * n, n) : argmax_scalar(p + r * n, n);
    });
  }
  return out;
}

}  // namespace

void register_argmax(nb::module_& m) {
  m.def("argmax_rows", &argmax_rows, nb::arg("x"), nb::arg("num_threads") = 1,
        "Per row of float32 x [M, N] (C-contiguous): the first index of the largest value, or of the first "
        "NaN (torch.argmax's rule). Returns a list of M ints; the GIL is released.");
}

}  // namespace agent_infer
