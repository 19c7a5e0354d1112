// DeepSeek V4 decode attention (layers/compressed_attention.py) for every single-token sequence of
// a step in one call per layer: each row's query heads attend to the row's sliding window of raw
// entries and, on compressed layers, to its compressed entries (on sparse layers only the
// index_topk the lightning indexer scores best among those complete), with a learned sink logit
// per head in the softmax's denominator. Keys are values (one shared head).
//
// A work item is one row; its arithmetic (16-lane dot products reduced by one fixed tree, keys in
// order: window oldest first, then entries by window) depends on nothing but that row, so rows are
// batch invariant by construction. The step's rows, window slots and entry slots are checked once
// (V4DecodeBatch) and reused by every layer of the rate.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "bindings/bindings.h"
#include "kernels/parallel.h"
#include "kernels/vexp.h"

namespace nb = nanobind;

namespace agent_infer {
namespace {

constexpr size_t kLanesV4 = 16;

// The softmax's exp: kernels/vexp.h's 16-lane polynomial where AVX-512 exists (once per process).
const bool g_v4_simd_exp = cpu_has_avx512f();

#define AI_V4_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

// Lane l sums a[i] * b[i] for i = l mod 16, i ascending; then a fixed halving tree. Built without
// contraction, so every clone rounds alike.
AI_V4_CLONES float dot_v4(const float* a, const float* b, size_t n) {
  float acc[kLanesV4] = {};
  size_t i = 0;
  for (; i + kLanesV4 <= n; i += kLanesV4)
    for (size_t l = 0; l < kLanesV4; ++l) acc[l] += a[i + l] * b[i + l];
  for (size_t l = 0; i + l < n; ++l) acc[l] += a[i + l] * b[i + l];
  for (size_t w = kLanesV4 / 2; w; w /= 2)
    for (size_t l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

// y[i] += p * x[i] (one product, one sum each).
AI_V4_CLONES void axpy_v4(float* y, float p, const float* x, size_t n) {
  for (size_t i = 0; i < n; ++i) y[i] += p * x[i];
}

template <typename T>
const T* array_of(const nb::ndarray<nb::ro>& a, const char* name, size_t ndim) {
  if (a.dtype() != nb::dtype<T>())
    throw nb::type_error((std::string("V4DecodeBatch: ") + name + " has the wrong dtype").c_str());
  if (a.device_type() != nb::device::cpu::value || a.ndim() != ndim)
    throw std::invalid_argument(std::string("V4DecodeBatch: ") + name + " must be a " + std::to_string(ndim) +
                                "-D CPU array");
  if (a.size() == 0) return static_cast<const T*>(a.data());  // an empty array has no layout to check
  int64_t expect = 1;
  for (size_t i = ndim; i-- > 0;) {
    if (a.shape(i) > 1 && a.stride(i) != expect)
      throw std::invalid_argument(std::string("V4DecodeBatch: ") + name + " must be C-contiguous");
    expect *= static_cast<int64_t>(a.shape(i));
  }
  return static_cast<const T*>(a.data());
}

class V4DecodeBatch {
 public:
  // rows [b]: query rows (< num_rows); tables [b, max_blocks]: block tables (block_size tokens each,
  // < num_slots / block_size where used); ctx [b]: context lengths after the step (the row's
  // position + 1). Each row's window is its last min(ctx, window) positions (oldest first) and,
  // with a rate, its entries those of windows 0 .. ctx / rate - 1, entry w at the slot of position
  // w * rate + rate - 1 divided by min(rate, block_size).
  V4DecodeBatch(nb::ndarray<nb::ro> rows, nb::ndarray<nb::ro> tables, nb::ndarray<nb::ro> ctx, int64_t block_size,
                int64_t window, int64_t rate, int64_t num_rows, int64_t num_slots) {
    const int64_t* r = array_of<int64_t>(rows, "rows", 1);
    const int64_t* t = array_of<int64_t>(tables, "tables", 2);
    const int64_t* c = array_of<int64_t>(ctx, "ctx", 1);
    b_ = rows.shape(0);
    if (tables.shape(0) != b_ || ctx.shape(0) != b_)
      throw std::invalid_argument("V4DecodeBatch: rows, tables and ctx disagree on the batch");
    if (block_size < 1 || window < 1 || rate < 0 || num_slots < 0)
      throw std::invalid_argument("V4DecodeBatch: block_size and window must be positive, rate >= 0");
    const size_t bs = static_cast<size_t>(block_size), mb = tables.shape(1);
    const size_t stride = rate ? std::min<size_t>(static_cast<size_t>(rate), bs) : 1;
    w_ = static_cast<size_t>(window);
    size_t most = 0;
    for (size_t i = 0; i < b_; ++i) most = std::max<size_t>(most, c[i] > 0 ? static_cast<size_t>(c[i]) : 0);
    e_ = rate ? most / static_cast<size_t>(rate) : 0;
    rows_.assign(r, r + b_);
    wslots_.assign(b_ * w_, 0);
    wlen_.assign(b_, 0);
    eslots_.assign(b_ * e_, 0);
    ecount_.assign(b_, 0);
    for (size_t i = 0; i < b_; ++i) {
      const std::string who = "V4DecodeBatch: row " + std::to_string(i);
      if (rows_[i] < 0 || rows_[i] >= num_rows) throw std::out_of_range(who + " is outside the batch's rows");
      if (c[i] < 1 || static_cast<size_t>(c[i]) > mb * bs) throw std::invalid_argument(who + ": bad context length");
      const size_t n = static_cast<size_t>(c[i]);
      for (size_t k = 0; k < (n + bs - 1) / bs; ++k)
        if (t[i * mb + k] < 0 || static_cast<size_t>(t[i * mb + k] + 1) * bs > static_cast<size_t>(num_slots))
          throw std::out_of_range(who + ": its block table references a block outside the cache");
      auto slot = [&](size_t pos) { return t[i * mb + pos / bs] * static_cast<int64_t>(bs) + static_cast<int64_t>(pos % bs); };
      const size_t len = std::min(n, w_);
      wlen_[i] = static_cast<int64_t>(len);
      for (size_t j = 0; j < len; ++j) wslots_[i * w_ + j] = slot(n - len + j);
      if (rate) {
        const size_t count = n / static_cast<size_t>(rate);
        ecount_[i] = static_cast<int64_t>(count);
        for (size_t w = 0; w < count; ++w)
          eslots_[i * e_ + w] = slot(w * static_cast<size_t>(rate) + static_cast<size_t>(rate) - 1) / static_cast<int64_t>(stride);
      }
    }
  }

  // out[rows[i]] ([heads, dim]) for every row, on raw addresses the caller checked: q [num_rows,
  // heads, dim], window [num_window_slots, dim], sinks [heads], out [num_rows, heads, dim]; with
  // entries: entries [num_entry_slots, entry_width] (its first dim values are the key); with an
  // indexer (index_topk > 0): iq rows at iq + r * iq_row ([index_heads, index_dim]), iw rows at
  // iw + r * iw_row ([index_heads]), and each entry's indexer key at entries + slot * entry_width + dim.
  void run(uintptr_t q, uintptr_t window, uintptr_t entries, uintptr_t sinks, uintptr_t out, int64_t heads,
           int64_t dim, int64_t entry_width, double scale, uintptr_t iq, int64_t iq_row, uintptr_t iw,
           int64_t iw_row, int64_t index_heads, int64_t index_dim, int64_t index_topk, double score_scale,
           double weight_scale, int num_threads) const {
    if (!q || !window || !sinks || !out) throw std::invalid_argument("V4DecodeBatch.run: null address");
    if (heads < 1 || dim < 1) throw std::invalid_argument("V4DecodeBatch.run: heads and dim must be positive");
    const bool with_entries = entries != 0 && e_ > 0;
    if (with_entries && entry_width < dim) throw std::invalid_argument("V4DecodeBatch.run: entries narrower than dim");
    const bool indexed = with_entries && index_topk > 0;
    if (indexed && (!iq || !iw || index_heads < 1 || index_dim < 1 || entry_width < dim + index_dim))
      throw std::invalid_argument("V4DecodeBatch.run: the indexer needs iq, iw and entries holding its keys");
    Args a{reinterpret_cast<const float*>(q), reinterpret_cast<const float*>(window),
           with_entries ? reinterpret_cast<const float*>(entries) : nullptr, reinterpret_cast<const float*>(sinks),
           reinterpret_cast<float*>(out), indexed ? reinterpret_cast<const float*>(iq) : nullptr,
           indexed ? reinterpret_cast<const float*>(iw) : nullptr, static_cast<size_t>(heads),
           static_cast<size_t>(dim), static_cast<size_t>(entry_width), static_cast<size_t>(iq_row),
           static_cast<size_t>(iw_row), static_cast<size_t>(index_heads), static_cast<size_t>(index_dim),
           static_cast<size_t>(index_topk), static_cast<float>(scale), static_cast<float>(score_scale),
           static_cast<float>(weight_scale)};
    nb::gil_scoped_release release;
    parallel_for(num_threads, b_, [&](size_t i) {
      thread_local std::vector<const float*> keys;
      thread_local std::vector<float> logits;
      attend_row(a, i, keys, logits);
    });
  }

  size_t size() const { return b_; }

 private:
  struct Args {
    const float *q, *window, *entries, *sinks;
    float* out;
    const float *iq, *iw;
    size_t heads, dim, entry_width, iq_row, iw_row, index_heads, index_dim, index_topk;
    float scale, score_scale, weight_scale;
  };

  void attend_row(const Args& a, size_t i, std::vector<const float*>& keys, std::vector<float>& logits) const {
    const size_t row = static_cast<size_t>(rows_[i]), wlen = static_cast<size_t>(wlen_[i]);
    const size_t count = a.entries ? static_cast<size_t>(ecount_[i]) : 0;
    const int64_t* ws = wslots_.data() + i * w_;
    const int64_t* es = eslots_.data() + i * e_;
    keys.resize(wlen + count);
    logits.resize(wlen + count);
    size_t nk = 0;
    for (size_t j = 0; j < wlen; ++j) keys[nk++] = a.window + static_cast<size_t>(ws[j]) * a.dim;
    if (count) {
      if (a.iq != nullptr && count > a.index_topk) {
        // The indexer's total per complete entry; keep the index_topk best (ties: lower window).
        thread_local std::vector<float> total;
        thread_local std::vector<size_t> order;
        total.resize(count);
        order.resize(count);
        const float* iq = a.iq + row * a.iq_row;
        const float* iw = a.iw + row * a.iw_row;
        for (size_t e = 0; e < count; ++e) {
          const float* ik = a.entries + static_cast<size_t>(es[e]) * a.entry_width + a.dim;
          float t = 0.0f;
          for (size_t h = 0; h < a.index_heads; ++h) {
            const float s = std::max(dot_v4(iq + h * a.index_dim, ik, a.index_dim), 0.0f) * a.score_scale;
            t += s * (iw[h] * a.weight_scale);
          }
          total[e] = t;
          order[e] = e;
        }
        std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(a.index_topk), order.end(),
                          [&](size_t x, size_t y) { return total[x] > total[y] || (total[x] == total[y] && x < y); });
        std::sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(a.index_topk));
        for (size_t j = 0; j < a.index_topk; ++j)
          keys[nk++] = a.entries + static_cast<size_t>(es[order[j]]) * a.entry_width;
      } else {
        for (size_t e = 0; e < count; ++e) keys[nk++] = a.entries + static_cast<size_t>(es[e]) * a.entry_width;
      }
    }
    for (size_t h = 0; h < a.heads; ++h) {
      const float* qh = a.q + (row * a.heads + h) * a.dim;
      const float sink = a.sinks[h];
      float mx = sink;
      for (size_t k = 0; k < nk; ++k) {
        logits[k] = dot_v4(qh, keys[k], a.dim) * a.scale;
        mx = std::max(mx, logits[k]);
      }
      exp_shift(logits.data(), nk, mx, g_v4_simd_exp);
      float sum = std::exp(sink - mx);
      for (size_t k = 0; k < nk; ++k) sum += logits[k];
      float* o = a.out + (row * a.heads + h) * a.dim;
      std::fill(o, o + a.dim, 0.0f);
      const float inv = 1.0f / sum;
      for (size_t k = 0; k < nk; ++k) axpy_v4(o, logits[k] * inv, keys[k], a.dim);
    }
  }

  std::vector<int64_t> rows_, wslots_, wlen_, eslots_, ecount_;
  size_t b_ = 0, w_ = 0, e_ = 0;
};

}  // namespace

void register_attention_v4(nb::module_& m) {
  nb::class_<V4DecodeBatch>(m, "V4DecodeBatch",
                            "A step's single-token rows for DeepSeek V4 decode attention at one compression rate, "
                            "checked once and run per layer on raw addresses (kernels/attention_v4.cpp).")
      .def(nb::init<nb::ndarray<nb::ro>, nb::ndarray<nb::ro>, nb::ndarray<nb::ro>, int64_t, int64_t, int64_t, int64_t,
                    int64_t>(),
           nb::arg("rows"), nb::arg("tables"), nb::arg("ctx"), nb::arg("block_size"), nb::arg("window"),
           nb::arg("rate"), nb::arg("num_rows"), nb::arg("num_slots"),
           "rows [b], block tables [b, max_blocks] and context lengths [b] (int64): each row's window and, with "
           "a rate, its compressed entries' slots, checked against the cache of num_slots token slots.")
      .def("run", &V4DecodeBatch::run, nb::arg("q"), nb::arg("window"), nb::arg("entries"), nb::arg("sinks"),
           nb::arg("out"), nb::arg("heads"), nb::arg("dim"), nb::arg("entry_width"), nb::arg("scale"), nb::arg("iq"),
           nb::arg("iq_row"), nb::arg("iw"), nb::arg("iw_row"), nb::arg("index_heads"), nb::arg("index_dim"),
           nb::arg("index_topk"), nb::arg("score_scale"), nb::arg("weight_scale"), nb::arg("num_threads") = 1,
           "Attend every row (float32 raw addresses, see the header comment of kernels/attention_v4.cpp); "
           "``entries`` 0 on sliding-only layers, ``index_topk`` 0 without an indexer; the GIL is released.")
      .def_prop_ro("size", &V4DecodeBatch::size);
}

}  // namespace agent_infer
