// Decode attention over the paged KV cache: one call per layer for every sequence that adds a single
// token, instead of one SDPA call per sequence.
//
// Batch invariance by construction: the work item is (sequence, kv head); its scores, softmax and
// weighted sum run in a fixed order (positions ascending) with code that does not depend on the
// batch, on which thread runs it, or on the other sequences. The ISA is chosen once per process.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bindings/bindings.h"
#include "kernels/vexp.h"
#include "kernels/attention_mla.h"
#include "kernels/parallel.h"

namespace nb = nanobind;

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 AVX-512 headers, see kernels/linear.cpp
#endif

namespace agent_infer {
namespace {

bool has_avx512() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}
const bool g_avx512 = has_avx512();

bool has_avx2_fma() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}
const bool g_avx2 = has_avx2_fma();

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

// The AVX-512 path for head dims of 16*NV: each head's query and output accumulator stay in
// registers, scores are reduced with one fixed shuffle tree per position, and the softmax runs 16
// positions at a time. Per row the work and its order depend only on that row's context length.
template <int NV>
__attribute__((target("avx512f"))) void attend_avx512(const Args& a, size_t seq, size_t g,
                                                     std::vector<float>& scores) {
  const size_t group = a.heads / a.kv_heads;
  const size_t ctx = static_cast<size_t>(a.ctx[seq]);
  const size_t row = static_cast<size_t>(a.rows[seq]);
  const int64_t* table = a.tables + seq * a.max_blocks;
  const size_t stride = a.kv_heads * a.dim;
  scores.resize(ctx);
  float* s = scores.data();
  for (size_t h = 0; h < group; ++h) {
    const float* qp = a.q + (row * a.heads + g * group + h) * a.dim;
    __m512 q[NV];
    for (int i = 0; i < NV; ++i) q[i] = _mm512_mul_ps(_mm512_loadu_ps(qp + 16 * i), _mm512_set1_ps(a.scale));
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (size_t b = 0; b * a.block_size < ctx; ++b) {
      const float* kb = a.k + static_cast<size_t>(table[b]) * a.block_size * stride + g * a.dim;
      const size_t end = std::min(ctx, (b + 1) * a.block_size);
      for (size_t j = b * a.block_size; j < end; ++j) {
        const float* kp = kb + (j - b * a.block_size) * stride;
        __m512 acc = _mm512_mul_ps(q[0], _mm512_loadu_ps(kp));
        for (int i = 1; i < NV; ++i) acc = _mm512_fmadd_ps(q[i], _mm512_loadu_ps(kp + 16 * i), acc);
        s[j] = _mm512_reduce_add_ps(acc);
      }
    }
    size_t j = 0;
    for (; j + 16 <= ctx; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + j));
    const __mmask16 tail = static_cast<__mmask16>((1u << (ctx - j)) - 1u);
    mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, s + j));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (j = 0; j + 16 <= ctx; j += 16) {
      const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(s + j), m));
      _mm512_storeu_ps(s + j, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (j < ctx) {
      const __m512 e = _mm512_maskz_mov_ps(tail, exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + j), m)));
      _mm512_mask_storeu_ps(s + j, tail, e);
      sum = _mm512_add_ps(sum, e);
    }
    const float inv = 1.0f / _mm512_reduce_add_ps(sum);
    __m512 o[NV];
    for (int i = 0; i < NV; ++i) o[i] = _mm512_setzero_ps();
    for (size_t b = 0; b * a.block_size < ctx; ++b) {
      const float* vb = a.v + static_cast<size_t>(table[b]) * a.block_size * stride + g * a.dim;
      const size_t end = std::min(ctx, (b + 1) * a.block_size);
      for (size_t jj = b * a.block_size; jj < end; ++jj) {
        const float* vp = vb + (jj - b * a.block_size) * stride;
        const __m512 p = _mm512_set1_ps(s[jj]);
        for (int i = 0; i < NV; ++i) o[i] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vp + 16 * i), o[i]);
      }
    }
    float* out = a.out + (row * a.heads + g * group + h) * a.dim;
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(out + 16 * i, _mm512_mul_ps(o[i], _mm512_set1_ps(inv)));
  }
}

void attend(const Args& a, size_t seq, size_t g, std::vector<float>& scores) {
  if (a.simd) {
    switch (a.dim / 16) {
      case 2: return attend_avx512<2>(a, seq, g, scores);
      case 4: return attend_avx512<4>(a, seq, g, scores);
      case 8: return attend_avx512<8>(a, seq, g, scores);
      default: break;
    }
  }
  const size_t group = a.heads / a.kv_heads;
  const size_t ctx = static_cast<size_t>(a.ctx[seq]);
  const size_t row = static_cast<size_t>(a.rows[seq]);
  const int64_t* table = a.tables + seq * a.max_blocks;
  const size_t d = a.dim;
  scores.resize(group * ctx);
  for (size_t j = 0; j < ctx; ++j) {
    const size_t slot = static_cast<size_t>(table[j / a.block_size]) * a.block_size + j % a.block_size;
    const float* kp = a.k + (slot * a.kv_heads + g) * d;
    for (size_t h = 0; h < group; ++h) {
      const float* qp = a.q + (row * a.heads + g * group + h) * d;
      scores[h * ctx + j] = (a.simd ? dot_avx512(qp, kp, d) : dot_scalar(qp, kp, d)) * a.scale;
    }
  }
  for (size_t h = 0; h < group; ++h) {
    float* s = scores.data() + h * ctx;
    float mx = s[0];
    for (size_t j = 1; j < ctx; ++j) mx = std::max(mx, s[j]);
    float sum = 0.0f;
    for (size_t j = 0; j < ctx; ++j) {
      s[j] = std::exp(s[j] - mx);
      sum += s[j];
    }
    const float inv = 1.0f / sum;
    float* o = a.out + (row * a.heads + g * group + h) * d;
    std::fill(o, o + d, 0.0f);
    for (size_t j = 0; j < ctx; ++j) {
      const size_t slot = static_cast<size_t>(table[j / a.block_size]) * a.block_size + j % a.block_size;
      const float* vp = a.v + (slot * a.kv_heads + g) * d;
      if (a.simd)
        axpy_avx512(o, s[j], vp, d);
      else
        axpy_scalar(o, s[j], vp, d);
    }
    for (size_t i = 0; i < d; ++i) o[i] *= inv;
  }
}

template <typename T>
const T* checked(const nb::ndarray<nb::ro>& a, const char* name, size_t ndim) {
  if (a.dtype() != nb::dtype<T>())
    throw nb::type_error((std::string("decode_attention: ") + name + " has the wrong dtype").c_str());
  if (a.device_type() != nb::device::cpu::value || a.ndim() != ndim)
    throw std::invalid_argument(std::string("decode_attention: ") + name + " must be a " + std::to_string(ndim) +
                                "-D CPU array");
  int64_t expect = 1;
  for (size_t i = ndim; i-- > 0;) {
    if (a.shape(i) > 1 && a.stride(i) != expect)
      throw std::invalid_argument(std::string("decode_attention: ") + name + " must be C-contiguous");
    expect *= static_cast<int64_t>(a.shape(i));
  }
  return static_cast<const T*>(a.data());
}

// q [R, H, D]; k_cache/v_cache [slots, Hkv, D]; out [R, H*D]; rows/context_lens [B]; block_tables [B, max_blocks].
void decode_attention(nb::ndarray<nb::ro> q, nb::ndarray<nb::ro> k_cache, nb::ndarray<nb::ro> v_cache,
                      nb::ndarray<> out, nb::ndarray<nb::ro> rows, nb::ndarray<nb::ro> block_tables,
                      nb::ndarray<nb::ro> context_lens, int64_t block_size, double scale, int num_threads) {
  Args a{};
  a.q = checked<float>(q, "q", 3);
  a.k = checked<float>(k_cache, "k_cache", 3);
  a.v = checked<float>(v_cache, "v_cache", 3);
  a.rows = checked<int64_t>(rows, "rows", 1);
  a.tables = checked<int64_t>(block_tables, "block_tables", 2);
  a.ctx = checked<int64_t>(context_lens, "context_lens", 1);
  const nb::ndarray<nb::ro> out_ro(out);
  checked<float>(out_ro, "out", 2);
  a.out = static_cast<float*>(out.data());
  const size_t r = q.shape(0), batch = rows.shape(0);
  a.heads = q.shape(1);
  a.dim = q.shape(2);
  a.kv_heads = k_cache.shape(1);
  a.num_slots = k_cache.shape(0);
  a.max_blocks = block_tables.shape(1);
  if (block_size < 1) throw std::invalid_argument("decode_attention: block_size must be >= 1");
  a.block_size = static_cast<size_t>(block_size);
  a.scale = static_cast<float>(scale);
  if (a.kv_heads == 0 || a.heads % a.kv_heads)
    throw std::invalid_argument("decode_attention: query heads must be a multiple of kv heads");
  for (size_t i = 0; i < 3; ++i)
    if (v_cache.shape(i) != k_cache.shape(i)) throw std::invalid_argument("decode_attention: k/v caches differ in shape");
  if (k_cache.shape(2) != a.dim) throw std::invalid_argument("decode_attention: q and cache head dims differ");
  if (out.shape(0) != r || out.shape(1) != a.heads * a.dim)
    throw std::invalid_argument("decode_attention: out must be [rows, heads*dim]");
  if (context_lens.shape(0) != batch || block_tables.shape(0) != batch)
    throw std::invalid_argument("decode_attention: rows, block_tables and context_lens disagree on the batch");
  for (size_t s = 0; s < batch; ++s) {
    const int64_t ctx = a.ctx[s];
    if (a.rows[s] < 0 || static_cast<size_t>(a.rows[s]) >= r)
      throw std::out_of_range("decode_attention: rows[" + std::to_string(s) + "] is outside q");
    if (ctx < 1 || static_cast<size_t>(ctx) > a.max_blocks * a.block_size)
      throw std::invalid_argument("decode_attention: context_lens[" + std::to_string(s) + "] is out of range");
    for (size_t b = 0; b < (static_cast<size_t>(ctx) + a.block_size - 1) / a.block_size; ++b) {
      const int64_t blk = a.tables[s * a.max_blocks + b];
      if (blk < 0 || static_cast<size_t>(blk + 1) * a.block_size > a.num_slots)
        throw std::out_of_range("decode_attention: block table of sequence " + std::to_string(s) +
                                " references a block beyond the cache");
    }
  }
  a.simd = g_avx512 && a.dim % 16 == 0;
  const size_t items = batch * a.kv_heads;
  nb::gil_scoped_release release;
  parallel_for(num_threads, items, [&](size_t item) {
    thread_local std::vector<float> scores;
    attend(a, item / a.kv_heads, item % a.kv_heads, scores);
  });
}

// One step's single-token sequences, checked once and reused by every layer's call: a decode step
// calls the kernel once per layer, and converting and re-checking seven arrays each time cost
// several times the kernel's own work at short contexts.
class DecodeBatch {
 public:
  DecodeBatch(nb::ndarray<nb::ro> rows, nb::ndarray<nb::ro> block_tables, nb::ndarray<nb::ro> context_lens,
              int64_t block_size, int64_t num_rows, int64_t num_slots) {
    const int64_t* r = checked<int64_t>(rows, "rows", 1);
    const int64_t* t = checked<int64_t>(block_tables, "block_tables", 2);
    const int64_t* c = checked<int64_t>(context_lens, "context_lens", 1);
    if (block_size < 1) throw std::invalid_argument("decode_attention: block_size must be >= 1");
    if (num_rows < 0 || num_slots < 0) throw std::invalid_argument("decode_attention: negative row or slot count");
    const size_t batch = rows.shape(0);
    if (context_lens.shape(0) != batch || block_tables.shape(0) != batch)
      throw std::invalid_argument("decode_attention: rows, block_tables and context_lens disagree on the batch");
    block_size_ = static_cast<size_t>(block_size);
    max_blocks_ = block_tables.shape(1);
    num_rows_ = static_cast<size_t>(num_rows);
    num_slots_ = static_cast<size_t>(num_slots);
    rows_.assign(r, r + batch);
    tables_.assign(t, t + batch * max_blocks_);
    ctx_.assign(c, c + batch);
    for (size_t s = 0; s < batch; ++s) {
      const int64_t ctx = ctx_[s];
      if (rows_[s] < 0 || static_cast<size_t>(rows_[s]) >= num_rows_)
        throw std::out_of_range("decode_attention: rows[" + std::to_string(s) + "] is outside q");
      if (ctx < 1 || static_cast<size_t>(ctx) > max_blocks_ * block_size_)
        throw std::invalid_argument("decode_attention: context_lens[" + std::to_string(s) + "] is out of range");
      for (size_t b = 0; b < (static_cast<size_t>(ctx) + block_size_ - 1) / block_size_; ++b) {
        const int64_t blk = tables_[s * max_blocks_ + b];
        if (blk < 0 || static_cast<size_t>(blk + 1) * block_size_ > num_slots_)
          throw std::out_of_range("decode_attention: block table of sequence " + std::to_string(s) +
                                  " references a block beyond the cache");
      }
    }
  }

  // The kernel on raw addresses: q [num_rows, heads, dim], caches [num_slots, kv_heads, dim], out
  // [num_rows, heads*dim], float32, C-contiguous; the caller checks them and keeps them alive.
  void run(uintptr_t q, uintptr_t k_cache, uintptr_t v_cache, uintptr_t out, int64_t heads, int64_t kv_heads,
           int64_t dim, double scale, int num_threads) const {
    if (!q || !k_cache || !v_cache || !out) throw std::invalid_argument("decode_attention: null address");
    if (heads < 1 || kv_heads < 1 || dim < 1 || heads % kv_heads)
      throw std::invalid_argument("decode_attention: query heads must be a positive multiple of kv heads");
    Args a{};
    a.q = reinterpret_cast<const float*>(q);
    a.k = reinterpret_cast<const float*>(k_cache);
    a.v = reinterpret_cast<const float*>(v_cache);
    a.out = reinterpret_cast<float*>(out);
    a.rows = rows_.data();
    a.tables = tables_.data();
    a.ctx = ctx_.data();
    a.max_blocks = max_blocks_;
    a.block_size = block_size_;
    a.heads = static_cast<size_t>(heads);
    a.kv_heads = static_cast<size_t>(kv_heads);
    a.dim = static_cast<size_t>(dim);
    a.num_slots = num_slots_;
    a.scale = static_cast<float>(scale);
    a.simd = g_avx512 && a.dim % 16 == 0;
    const size_t items = rows_.size() * a.kv_heads;
    nb::gil_scoped_release release;
    parallel_for(num_threads, items, [&](size_t item) {
      thread_local std::vector<float> scores;
      attend(a, item / a.kv_heads, item % a.kv_heads, scores);
    });
  }

  // Multi-head latent attention decode, weight-absorbed (kernels/attention_mla.h), on raw addresses:
  // q_nope and q_rope rows and heads at the given strides (in floats; each head's nope or rope
  // values contiguous), cache [num_slots, lora + rope], kv_b [heads * (nope + v), lora], out
  // [num_rows, heads * v]; float32, checked and kept alive by the caller.
  void run_mla(uintptr_t q_nope, uintptr_t q_rope, uintptr_t cache, uintptr_t kv_b, uintptr_t out, int64_t heads,
               int64_t nope, int64_t rope, int64_t lora, int64_t v, double scale, int num_threads,
               int64_t qn_row, int64_t qn_head, int64_t qr_row, int64_t qr_head) const {
    if (!q_nope || !q_rope || !cache || !kv_b || !out) throw std::invalid_argument("mla_decode: null address");
    if (heads < 1 || nope < 1 || rope < 0 || lora < 1 || v < 1)
      throw std::invalid_argument("mla_decode: heads, nope, lora and v must be positive (rope >= 0)");
    if (qn_head < nope || qn_row < heads * qn_head || qr_head < rope || qr_row < heads * qr_head)
      throw std::invalid_argument("mla_decode: q strides overlap their heads");
    MlaArgs a{};
    a.q_nope = reinterpret_cast<const float*>(q_nope);
    a.q_rope = reinterpret_cast<const float*>(q_rope);
    a.cache = reinterpret_cast<const float*>(cache);
    a.w = reinterpret_cast<const float*>(kv_b);
    a.out = reinterpret_cast<float*>(out);
    a.rows = rows_.data();
    a.tables = tables_.data();
    a.ctx = ctx_.data();
    a.batch = rows_.size();
    a.max_blocks = max_blocks_;
    a.block_size = block_size_;
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
    nb::gil_scoped_release release;
    parallel_for(num_threads, a.heads, [&](size_t h) {
      thread_local std::vector<float> buf;
      if (g_avx512)
        mla_head_avx512(a, h, buf);
      else if (g_avx2)
        mla_head_avx2(a, h, buf);
      else
        mla_head_portable(a, h, buf);
    });
  }

 private:
  std::vector<int64_t> rows_, tables_, ctx_;
  size_t block_size_ = 1, max_blocks_ = 0, num_rows_ = 0, num_slots_ = 0;
};

}  // namespace

void register_attention(nb::module_& m) {
  nb::class_<DecodeBatch>(m, "DecodeBatch",
                          "One step's single-token sequences for decode_attention, checked once and run per "
                          "layer on raw addresses.")
      .def(nb::init<nb::ndarray<nb::ro>, nb::ndarray<nb::ro>, nb::ndarray<nb::ro>, int64_t, int64_t, int64_t>(),
           nb::arg("rows"), nb::arg("block_tables"), nb::arg("context_lens"), nb::arg("block_size"),
           nb::arg("num_rows"), nb::arg("num_slots"))
      .def("run", &DecodeBatch::run, nb::arg("q"), nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("out"),
           nb::arg("heads"), nb::arg("kv_heads"), nb::arg("dim"), nb::arg("scale"), nb::arg("num_threads") = 1,
           "decode_attention on raw addresses (q [num_rows, heads, dim], caches [num_slots, kv_heads, dim], "
           "out [num_rows, heads*dim], float32, C-contiguous); the GIL is released.")
      .def("run_mla", &DecodeBatch::run_mla, nb::arg("q_nope"), nb::arg("q_rope"), nb::arg("cache"), nb::arg("kv_b"),
           nb::arg("out"), nb::arg("heads"), nb::arg("nope"), nb::arg("rope"), nb::arg("lora"), nb::arg("v"),
           nb::arg("scale"), nb::arg("num_threads"), nb::arg("qn_row"), nb::arg("qn_head"), nb::arg("qr_row"),
           nb::arg("qr_head"),
           "Multi-head latent attention decode in the weight-absorbed form on raw addresses (q_nope and q_rope "
           "rows and heads at the given float strides, latent cache [num_slots, lora + rope], kv_b_proj "
           "[heads * (nope + v), lora], out [num_rows, heads * v]; float32); the GIL is released.");
  m.def("decode_attention", &decode_attention, nb::arg("q"), nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("out"),
        nb::arg("rows"), nb::arg("block_tables"), nb::arg("context_lens"), nb::arg("block_size"), nb::arg("scale"),
        nb::arg("num_threads") = 1,
        "Single-token attention for a batch of sequences over the paged KV cache (float32, GQA); writes "
        "out[rows[i]] for each sequence i. The GIL is released.");
}

}  // namespace agent_infer
