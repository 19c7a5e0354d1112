// DeepSeek V4's manifold-constrained hyper-connections (layers/hyper_connections.py) one row at a
// time: the collapse of a token's hc_mult residual streams before a block (mixing weights from an
// RMS-normed projection, Sinkhorn-normalized stream mixing), the expansion of the block's output
// back into the streams, and the model's final collapse.
//
// Every value of a row comes from that row alone, in a fixed order (16-lane dot products reduced by
// one fixed tree, streams added in index order), so a token's bits never depend on its batch; the
// torch path gets the same property only by running its GEMMs and vectorized sigmoids on 4-row
// chunks. Built with -ffp-contract=off so the vectorized body and the scalar tail of a loop round
// alike.
#include <nanobind/nanobind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "bindings/bindings.h"
#include "kernels/parallel.h"

namespace nb = nanobind;

namespace agent_infer {
namespace {

constexpr size_t kLanesHc = 16;

// The same lanes and order on every clone (no contraction): only the speed differs.
#define AI_HC_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

AI_HC_CLONES float dot_lanes(const float* a, const float* b, size_t n) {
  float acc[kLanesHc] = {};
  size_t i = 0;
  for (; i + kLanesHc <= n; i += kLanesHc)
    for (size_t l = 0; l < kLanesHc; ++l) acc[l] += a[i + l] * b[i + l];
  for (size_t l = 0; i + l < n; ++l) acc[l] += a[i + l] * b[i + l];
  for (size_t w = kLanesHc / 2; w; w /= 2)
    for (size_t l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// 1 / sqrt(mean(x^2) + eps) of one row.
float inv_rms(const float* x, size_t n, float eps) {
  return 1.0f / std::sqrt(dot_lanes(x, x, n) / static_cast<float>(n) + eps);
}

// mixes[o] = unit_rms(x) . fn[o] for `outs` rows of fn [outs, n]; `xn` is scratch of n floats.
void mixes_of(const float* x, size_t n, const float* fn, size_t outs, float eps, float* xn, float* mixes) {
  const float inv = inv_rms(x, n, eps);
  for (size_t i = 0; i < n; ++i) xn[i] = x[i] * inv;
  for (size_t o = 0; o < outs; ++o) mixes[o] = dot_lanes(xn, fn + o * n, n);
}

// y[h] = sum over streams i (ascending) of w[i] * s[i][h]; each product rounds before its sum.
AI_HC_CLONES void weighted_sum(const float* w, const float* s, size_t hc, size_t h, float* y) {
  for (size_t c = 0; c < h; ++c) y[c] = w[0] * s[c];
  for (size_t i = 1; i < hc; ++i)
    for (size_t c = 0; c < h; ++c) y[c] = y[c] + w[i] * s[i * h + c];
}

struct Collapse {
  const float* streams;  // [R, hc, H]
  const float* fn;       // [(2 + hc) hc, hc H]
  const float* base;     // [(2 + hc) hc]
  const float* scale;    // [3]
  float* post;           // [R, hc]
  float* comb;           // [R, hc, hc]
  float* collapsed;      // [R, H]
  size_t hc, h, iters;
  float hc_eps, norm_eps;
};

void collapse_row(const Collapse& a, size_t r, std::vector<float>& buf) {
  const size_t hc = a.hc, n = hc * a.h, outs = (2 + hc) * hc;
  buf.resize(n + outs + hc);
  float* xn = buf.data();
  float* mixes = xn + n;
  float* pre = mixes + outs;
  const float* s = a.streams + r * n;
  mixes_of(s, n, a.fn, outs, a.norm_eps, xn, mixes);
  float* post = a.post + r * hc;
  float* comb = a.comb + r * hc * hc;
  for (size_t i = 0; i < hc; ++i) {
    pre[i] = sigmoid(mixes[i] * a.scale[0] + a.base[i]) + a.hc_eps;
    post[i] = 2.0f * sigmoid(mixes[hc + i] * a.scale[1] + a.base[hc + i]);
  }
  for (size_t i = 0; i < hc; ++i) {  // softmax over each row of the hc x hc logits
    float* row = comb + i * hc;
    float mx = -INFINITY;
    for (size_t j = 0; j < hc; ++j) {
      row[j] = mixes[2 * hc + i * hc + j] * a.scale[2] + a.base[2 * hc + i * hc + j];
      mx = std::max(mx, row[j]);
    }
    float sum = 0.0f;
    for (size_t j = 0; j < hc; ++j) sum += row[j] = std::exp(row[j] - mx);
    for (size_t j = 0; j < hc; ++j) row[j] = row[j] / sum + a.hc_eps;
  }
  // Sinkhorn-Knopp: columns, then (rows, columns) iters - 1 times; each sum plus eps.
  auto columns = [&] {
    for (size_t j = 0; j < hc; ++j) {
      float sum = 0.0f;
      for (size_t i = 0; i < hc; ++i) sum += comb[i * hc + j];
      sum += a.hc_eps;
      for (size_t i = 0; i < hc; ++i) comb[i * hc + j] /= sum;
    }
  };
  columns();
  for (size_t it = 1; it < a.iters; ++it) {
    for (size_t i = 0; i < hc; ++i) {
      float sum = 0.0f;
      for (size_t j = 0; j < hc; ++j) sum += comb[i * hc + j];
      sum += a.hc_eps;
      for (size_t j = 0; j < hc; ++j) comb[i * hc + j] /= sum;
    }
    columns();
  }
  weighted_sum(pre, s, hc, a.h, a.collapsed + r * a.h);
}

const float* f32(uintptr_t a) {
  if (a == 0) throw std::invalid_argument("hyper_connections: null address");
  return reinterpret_cast<const float*>(a);
}

float* f32_out(uintptr_t a) { return const_cast<float*>(f32(a)); }

// post [R, hc], comb [R, hc, hc] and collapsed [R, H] of streams [R, hc, H]; fn [(2 + hc) hc, hc H],
// base [(2 + hc) hc], scale [3]. Raw float32 C-contiguous addresses the caller checked.
void hc_collapse(uintptr_t streams, size_t rows, size_t hc, size_t h, uintptr_t fn, uintptr_t base, uintptr_t scale,
                 int64_t iters, double hc_eps, double norm_eps, uintptr_t post, uintptr_t comb, uintptr_t collapsed,
                 int num_threads) {
  if (rows == 0) return;
  if (iters < 1 || hc < 1 || h < 1)
    throw std::invalid_argument("hyper_connections: need hc, hidden and sinkhorn iterations >= 1");
  Collapse a{f32(streams), f32(fn), f32(base), f32(scale), f32_out(post), f32_out(comb), f32_out(collapsed),
             hc, h, static_cast<size_t>(iters), static_cast<float>(hc_eps), static_cast<float>(norm_eps)};
  nb::gil_scoped_release release;
  parallel_for(num_threads, rows, [&](size_t r) {
    thread_local std::vector<float> buf;
    collapse_row(a, r, buf);
  });
}

// out [R, hc, H]: out[r, j] = post[r, j] * output[r] + sum_i comb[r, i, j] * streams[r, i].
void hc_expand(uintptr_t post, uintptr_t comb, uintptr_t output, uintptr_t streams, uintptr_t out, size_t rows,
               size_t hc, size_t h, int num_threads) {
  if (rows == 0) return;
  const float* s = f32(streams);
  const float* p = f32(post);
  const float* c = f32(comb);
  const float* o = f32(output);
  float* y = f32_out(out);
  nb::gil_scoped_release release;
  parallel_for(num_threads, rows, [&](size_t r) {
    thread_local std::vector<float> w;
    w.resize(hc);
    const float* sr = s + r * hc * h;
    for (size_t j = 0; j < hc; ++j) {
      for (size_t i = 0; i < hc; ++i) w[i] = c[(r * hc + i) * hc + j];
      float* yr = y + (r * hc + j) * h;
      weighted_sum(w.data(), sr, hc, h, yr);
      const float pj = p[r * hc + j];
      for (size_t k = 0; k < h; ++k) yr[k] = pj * o[r * h + k] + yr[k];
    }
  });
}

// out [R, H]: the final collapse, sum_i (sigmoid(mixes_i * scale + base_i) + hc_eps) * streams[r, i];
// fn [hc, hc H], base [hc], scale [1].
void hc_head(uintptr_t streams, size_t rows, size_t hc, size_t h, uintptr_t fn, uintptr_t base, uintptr_t scale,
             double hc_eps, double norm_eps, uintptr_t out, int num_threads) {
  if (rows == 0) return;
  const float* s = f32(streams);
  const float* f = f32(fn);
  const float* b = f32(base);
  const float* sc = f32(scale);
  float* y = f32_out(out);
  const float eps = static_cast<float>(hc_eps), neps = static_cast<float>(norm_eps);
  nb::gil_scoped_release release;
  parallel_for(num_threads, rows, [&](size_t r) {
    thread_local std::vector<float> buf;
    buf.resize(hc * h + 2 * hc);
    float* mixes = buf.data() + hc * h;
    float* pre = mixes + hc;
    mixes_of(s + r * hc * h, hc * h, f, hc, neps, buf.data(), mixes);
    for (size_t i = 0; i < hc; ++i) pre[i] = sigmoid(mixes[i] * sc[0] + b[i]) + eps;
    weighted_sum(pre, s + r * hc * h, hc, h, y + r * h);
  });
}

}  // namespace

void register_hyper(nb::module_& m) {
  m.def("hc_collapse", &hc_collapse, nb::arg("streams"), nb::arg("rows"), nb::arg("hc"), nb::arg("hidden"),
        nb::arg("fn"), nb::arg("base"), nb::arg("scale"), nb::arg("iters"), nb::arg("hc_eps"), nb::arg("norm_eps"),
        nb::arg("post"), nb::arg("comb"), nb::arg("collapsed"), nb::arg("num_threads") = 1,
        "Hyper-connection collapse per row of float32 streams [R, hc, H] (raw C-contiguous addresses the caller "
        "checked): writes post [R, hc], the Sinkhorn-normalized comb [R, hc, hc] and the collapsed input [R, H]; "
        "the GIL is released.");
  m.def("hc_expand", &hc_expand, nb::arg("post"), nb::arg("comb"), nb::arg("output"), nb::arg("streams"),
        nb::arg("out"), nb::arg("rows"), nb::arg("hc"), nb::arg("hidden"), nb::arg("num_threads") = 1,
        "New streams out [R, hc, H] = post * output + comb^T @ streams per row (raw float32 addresses); the GIL "
        "is released.");
  m.def("hc_head", &hc_head, nb::arg("streams"), nb::arg("rows"), nb::arg("hc"), nb::arg("hidden"), nb::arg("fn"),
        nb::arg("base"), nb::arg("scale"), nb::arg("hc_eps"), nb::arg("norm_eps"), nb::arg("out"),
        nb::arg("num_threads") = 1,
        "The final collapse of float32 streams [R, hc, H] into out [R, H] (raw addresses); the GIL is released.");
}

}  // namespace agent_infer
