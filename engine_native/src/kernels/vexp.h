#pragma once
// exp for softmax arguments (x <= 0), 16 lanes at a time: Cody-Waite range reduction and a degree-6
// polynomial (Cephes expf), ~1 ulp. The same instructions for every lane, so a value's result does
// not depend on where it sits in a vector (masked tails included). Kernels choose it or std::exp
// once per process (by ISA), so within a process every row rounds alike.
#include <immintrin.h>

#include <cmath>
#include <cstddef>

namespace agent_infer {
namespace {

__attribute__((target("avx512f"))) inline __m512 exp_avx512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, n);
}

// x[i] = exp(x[i] - m) for i < n, 16 lanes at a time (masked tail).
__attribute__((target("avx512f"))) inline void exp_shift_avx512(float* x, size_t n, float m) {
  const __m512 mv = _mm512_set1_ps(m);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv)));
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1u);
    _mm512_mask_storeu_ps(x + i, tail, exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, x + i), mv)));
  }
}

// exp_shift_avx512 where `simd`, else std::exp element by element.
inline void exp_shift(float* x, size_t n, float m, bool simd) {
  if (simd) {
    exp_shift_avx512(x, n, m);
    return;
  }
  for (size_t i = 0; i < n; ++i) x[i] = std::exp(x[i] - m);
}

inline bool cpu_has_avx512f() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

}  // namespace
}  // namespace agent_infer
