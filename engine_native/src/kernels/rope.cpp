// Rotary position embedding applied in place to the q and k heads of a fused qkv projection, on
// raw addresses (the decoder's hot path; llama.py checks shapes and dtypes first). HF's
// "rotate_half" convention: pair i is (x[i], x[i + D/2]). Built with -ffp-contract=off so each
// output is fl(fl(a*c) -+ fl(b*s)): the same roundings as torch's elementwise x1*cos - x2*sin.
#include <nanobind/nanobind.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "bindings/bindings.h"

namespace nb = nanobind;

namespace agent_infer {
namespace {

void rope_rows(uintptr_t x, size_t rows, size_t row_stride, size_t heads, size_t dim, uintptr_t cos_table,
               uintptr_t sin_table, size_t table_rows, uintptr_t positions) {
  if (rows == 0) return;
  if (!x || !cos_table || !sin_table || !positions) throw std::invalid_argument("rope_rows: null address");
  if (dim == 0 || dim % 2 || heads * dim > row_stride)
    throw std::invalid_argument("rope_rows: need an even head dim and heads * dim <= row stride");
  const size_t half = dim / 2;
  float* base = reinterpret_cast<float*>(x);
  const float* ct = reinterpret_cast<const float*>(cos_table);
  const float* st = reinterpret_cast<const float*>(sin_table);
  const int64_t* pos = reinterpret_cast<const int64_t*>(positions);
  for (size_t r = 0; r < rows; ++r) {
    if (pos[r] < 0 || static_cast<size_t>(pos[r]) >= table_rows)
      throw std::out_of_range("rope_rows: position " + std::to_string(pos[r]) + " outside the table of " +
                              std::to_string(table_rows));
    const float* c = ct + static_cast<size_t>(pos[r]) * half;
    const float* s = st + static_cast<size_t>(pos[r]) * half;
    for (size_t h = 0; h < heads; ++h) {
      float* v = base + r * row_stride + h * dim;
      for (size_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i] + a * s[i];
      }
    }
  }
}

// DeepSeek V4's rotation (layers/interleaved_rotary.py) in place: each head's trailing rope_dim
// values rotate as interleaved pairs (x0, x1) -> (x0 c - x1 s, x1 c + x0 s) by the row's own cos/sin
// ([rows, rope_dim], each angle repeated for its pair; s negated when `inverse`), optionally after
// normalizing the head (norm 1: x / rms(x); norm 2: x / rms(x) * weight) with the sum of squares in
// double over 8 interleaved partial sums combined in a fixed tree. Row by row, so batch invariant.
void rope_pairs_rows(uintptr_t x, size_t rows, size_t row_stride, size_t heads, size_t head_stride, size_t dim,
                     size_t rope_dim, uintptr_t cos_rows, uintptr_t sin_rows, bool inverse, int norm, uintptr_t weight,
                     double eps) {
  if (rows == 0) return;
  if (!x || !cos_rows || !sin_rows || (norm == 2 && !weight)) throw std::invalid_argument("rope_pairs_rows: null address");
  if (rope_dim % 2 || rope_dim > dim || dim > head_stride || (heads - 1) * head_stride + dim > row_stride)
    throw std::invalid_argument("rope_pairs_rows: need an even rope_dim <= dim and heads inside the row");
  if (norm < 0 || norm > 2) throw std::invalid_argument("rope_pairs_rows: norm must be 0, 1 or 2");
  float* base = reinterpret_cast<float*>(x);
  const float* ct = reinterpret_cast<const float*>(cos_rows);
  const float* st = reinterpret_cast<const float*>(sin_rows);
  const float* w = reinterpret_cast<const float*>(weight);
  const size_t nope = dim - rope_dim;
  for (size_t r = 0; r < rows; ++r) {
    const float* c = ct + r * rope_dim;
    const float* sn = st + r * rope_dim;
    for (size_t h = 0; h < heads; ++h) {
      float* v = base + r * row_stride + h * head_stride;
      if (norm) {
        double acc[8] = {};
        for (size_t i = 0; i < dim; ++i) acc[i % 8] += static_cast<double>(v[i]) * static_cast<double>(v[i]);
        const double total = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        const float inv = static_cast<float>(1.0 / std::sqrt(total / static_cast<double>(dim) + eps));
        for (size_t i = 0; i < dim; ++i) v[i] = norm == 2 ? (v[i] * inv) * w[i] : v[i] * inv;
      }
      float* p = v + nope;
      for (size_t i = 0; i < rope_dim; i += 2) {
        const float a = p[i], b = p[i + 1];
        const float s0 = inverse ? -sn[i] : sn[i], s1 = inverse ? -sn[i + 1] : sn[i + 1];
        p[i] = a * c[i] + (-b) * s0;
        p[i + 1] = b * c[i + 1] + a * s1;
      }
    }
  }
}

// DeepSeek V3's MLA inputs of one layer (layers/mla.py), on raw float32 addresses: for every row
// r < rows, each head's rope part of q (rope values at q + r * q_row + h * q_head + nope) rotated
// into qr [rows, heads, rope]; for r < n, the latent cache row at slots[r] written as
// [rms_norm(latent) * weight, rotated k] (latent at h + r * h_row + lat_off, k right after it).
// Rotation: rotate-half with the cos/sin tables [table_rows, rope / 2] at positions[r], after
// reordering interleaved pairs (x0, x1), (x2, x3)... to (evens, odds) when `interleave`. The
// norm's sum of squares is in double over a fixed tree, so every row is its own.
void mla_prep(uintptr_t q, size_t q_row, size_t q_head, size_t heads, size_t nope, size_t rope, uintptr_t h,
              size_t h_row, size_t lat_off, size_t lora, uintptr_t norm_w, double eps, uintptr_t cos_table,
              uintptr_t sin_table, size_t table_rows, uintptr_t positions, bool interleave, uintptr_t cache,
              size_t cache_rows, uintptr_t slots, size_t rows, size_t n, uintptr_t qr) {
  if (rows == 0) return;
  if (!q || !h || !norm_w || !cos_table || !sin_table || !positions || !cache || !qr || (n && !slots))
    throw std::invalid_argument("mla_prep: null address");
  if (rope == 0 || rope % 2 || rope > 64 || n > rows || q_head < nope + rope || q_row < heads * q_head ||
      h_row < lat_off + lora + rope)
    throw std::invalid_argument("mla_prep: inconsistent widths");
  const size_t half = rope / 2;
  const float* qp = reinterpret_cast<const float*>(q);
  const float* hp = reinterpret_cast<const float*>(h);
  const float* w = reinterpret_cast<const float*>(norm_w);
  const float* ct = reinterpret_cast<const float*>(cos_table);
  const float* st = reinterpret_cast<const float*>(sin_table);
  const int64_t* pos = reinterpret_cast<const int64_t*>(positions);
  const int64_t* sl = reinterpret_cast<const int64_t*>(slots);
  float* cp = reinterpret_cast<float*>(cache);
  float* out = reinterpret_cast<float*>(qr);
  auto rotate = [&](const float* x, const float* c, const float* s, float* y) {
    float v[64];
    for (size_t i = 0; i < rope; ++i) v[i] = interleave ? x[i < half ? 2 * i : 2 * (i - half) + 1] : x[i];
    for (size_t i = 0; i < half; ++i) {
      const float a = v[i], b = v[i + half];
      y[i] = a * c[i] - b * s[i];
      y[i + half] = b * c[i] + a * s[i];
    }
  };
  for (size_t r = 0; r < rows; ++r) {
    if (pos[r] < 0 || static_cast<size_t>(pos[r]) >= table_rows)
      throw std::out_of_range("mla_prep: position " + std::to_string(pos[r]) + " outside the table of " +
                              std::to_string(table_rows));
    const float* c = ct + static_cast<size_t>(pos[r]) * half;
    const float* s = st + static_cast<size_t>(pos[r]) * half;
    for (size_t hd = 0; hd < heads; ++hd) rotate(qp + r * q_row + hd * q_head + nope, c, s, out + (r * heads + hd) * rope);
    if (r >= n) continue;
    if (sl[r] < 0 || static_cast<size_t>(sl[r]) >= cache_rows) throw std::out_of_range("mla_prep: a slot outside the cache");
    const float* lat = hp + r * h_row + lat_off;
    double acc[8] = {};
    for (size_t i = 0; i < lora; ++i) acc[i % 8] += static_cast<double>(lat[i]) * static_cast<double>(lat[i]);
    const double total = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    const float inv = static_cast<float>(1.0 / std::sqrt(total / static_cast<double>(lora) + eps));
    float* row = cp + static_cast<size_t>(sl[r]) * (lora + rope);
    for (size_t i = 0; i < lora; ++i) row[i] = (lat[i] * inv) * w[i];
    rotate(lat + lora, c, s, row + lora);
  }
}

}  // namespace

void register_rope(nb::module_& m) {
  m.def("mla_prep", &mla_prep, nb::arg("q"), nb::arg("q_row"), nb::arg("q_head"), nb::arg("heads"), nb::arg("nope"),
        nb::arg("rope"), nb::arg("h"), nb::arg("h_row"), nb::arg("lat_off"), nb::arg("lora"), nb::arg("norm_weight"),
        nb::arg("eps"), nb::arg("cos_table"), nb::arg("sin_table"), nb::arg("table_rows"), nb::arg("positions"),
        nb::arg("interleave"), nb::arg("cache"), nb::arg("cache_rows"), nb::arg("slots"), nb::arg("rows"),
        nb::arg("n"), nb::arg("qr"),
        "DeepSeek V3 MLA: rotate q's rope parts into qr and write the n new tokens' latent cache rows "
        "(normed latent, rotated key) on raw float32/int64 addresses (see kernels/rope.cpp).");
  m.def("rope_pairs_rows", &rope_pairs_rows, nb::arg("x"), nb::arg("rows"), nb::arg("row_stride"), nb::arg("heads"),
        nb::arg("head_stride"), nb::arg("dim"), nb::arg("rope_dim"), nb::arg("cos_rows"), nb::arg("sin_rows"),
        nb::arg("inverse"), nb::arg("norm"), nb::arg("weight"), nb::arg("eps"),
        "DeepSeek V4's interleaved-pair rotation of each head's trailing rope_dim values, in place on raw float32 "
        "addresses (row r, head h at x + 4 * (r * row_stride + h * head_stride)), by per-row cos/sin "
        "[rows, rope_dim]; optionally after an RMS norm of the head (norm 1: unweighted, 2: times weight).");
  m.def("rope_rows", &rope_rows, nb::arg("x"), nb::arg("rows"), nb::arg("row_stride"), nb::arg("heads"),
        nb::arg("dim"), nb::arg("cos_table"), nb::arg("sin_table"), nb::arg("table_rows"), nb::arg("positions"),
        "Rotate the first ``heads`` heads (``dim`` floats each) of every row of a float32 matrix in place "
        "(raw addresses; row r at x + 4 * r * row_stride) by the cos/sin tables ([table_rows, dim/2] "
        "float32) at int64 positions[r]; bit-identical to the torch rotate-half formula.");
}

}  // namespace agent_infer
