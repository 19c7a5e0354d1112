#pragma once
// A MoE layer's routed SwiGLU experts (and its shared ones) over packed weights, in one call.
//
// Pairs (token, expert) are grouped per expert (tokens ascending within each), every expert runs
// its gate/up projection, SwiGLU and down projection over exactly the rows that chose it, and a
// token's output is the sum, in ascending expert order, of weight * expert output, plus the shared
// experts' output last: the order the torch MoE adds them in. The projections are PackedLinear's
// fixed FMA chains, SwiGLU is computed one scalar element at a time, and the sums run in that
// fixed order, so a token's bits never depend on the other tokens of the batch. Included by
// kernels/linear.cpp only (built with -ffp-contract=off: the weight products round before the sums).
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/linear_packed.h"
#include "kernels/linear_router.h"
#include "kernels/parallel.h"

namespace agent_infer {
namespace {

// silu(g) * u after DeepSeek V4's clamp (gate from above, up on both sides) when `clamp`.
inline float swiglu_one(float g, float u, bool clamp, float limit) {
  if (clamp) {
    g = std::min(g, limit);
    u = std::min(std::max(u, -limit), limit);
  }
  return g / (1.0f + std::exp(-g)) * u;
}

// a[r, i] = swiglu(h[r, i], h[r, inter + i]) for `rows` rows of h [rows, 2 * inter].
inline void swiglu_rows(const float* h, size_t rows, size_t inter, bool clamp, float limit, float* a) {
  for (size_t r = 0; r < rows; ++r)
    for (size_t i = 0; i < inter; ++i)
      a[r * inter + i] = swiglu_one(h[r * 2 * inter + i], h[r * 2 * inter + inter + i], clamp, limit);
}

class PackedExperts {
 public:
  // gate_up[e]: [2 I_e, H] (gate rows, then up rows); down[e]: [H, I_e]; the shared pair optional.
  PackedExperts(std::vector<const PackedLinear*> gate_up, std::vector<const PackedLinear*> down,
                const PackedLinear* shared_gate_up, const PackedLinear* shared_down)
      : gate_up_(std::move(gate_up)), down_(std::move(down)), sgu_(shared_gate_up), sdown_(shared_down) {
    if (gate_up_.empty() || gate_up_.size() != down_.size())
      throw std::invalid_argument("PackedExperts: need one gate_up and one down layer per expert (got " +
                                  std::to_string(gate_up_.size()) + " and " + std::to_string(down_.size()) + ")");
    if ((sgu_ == nullptr) != (sdown_ == nullptr))
      throw std::invalid_argument("PackedExperts: the shared experts need both gate_up and down");
    h_ = gate_up_[0]->k();
    for (size_t e = 0; e <= gate_up_.size(); ++e) {
      const bool shared = e == gate_up_.size();
      if (shared && sgu_ == nullptr) break;
      const PackedLinear* gu = shared ? sgu_ : gate_up_[e];
      const PackedLinear* dn = shared ? sdown_ : down_[e];
      const std::string who = shared ? "shared experts" : "expert " + std::to_string(e);
      if (gu == nullptr || dn == nullptr) throw std::invalid_argument("PackedExperts: " + who + " is None");
      if (gu->q8_activations() || dn->q8_activations())
        throw std::invalid_argument("PackedExperts: " + who + " takes int8 activations; float ones only");
      if (gu->k() != h_ || dn->n() != h_ || gu->n() != 2 * dn->k())
        throw std::invalid_argument("PackedExperts: " + who + " has gate_up [" + std::to_string(gu->n()) + ", " +
                                    std::to_string(gu->k()) + "] and down [" + std::to_string(dn->n()) + ", " +
                                    std::to_string(dn->k()) + "]; expected [2I, " + std::to_string(h_) +
                                    "] and [" + std::to_string(h_) + ", I]");
    }
  }

  // out[T, H] for x [T, H], each token's experts [T, k] (int64) and weights [T, k] (float32);
  // limit: DeepSeek V4's swiglu_limit, NaN for none. Raw addresses: the caller checks shapes,
  // dtypes and contiguity; expert ids are checked here.
  void forward(uintptr_t xa, size_t t, uintptr_t ea, uintptr_t wa, size_t k, uintptr_t oa, float limit,
               int num_threads) const {
    if (t == 0) return;
    if (xa == 0 || ea == 0 || wa == 0 || oa == 0) throw std::invalid_argument("PackedExperts.forward: null address");
    const float* x = reinterpret_cast<const float*>(xa);
    const int64_t* experts = reinterpret_cast<const int64_t*>(ea);
    const float* weights = reinterpret_cast<const float*>(wa);
    float* out = reinterpret_cast<float*>(oa);
    const size_t ne = gate_up_.size(), pairs = t * k, h = h_;
    std::vector<size_t> start(ne + 1, 0);
    for (size_t p = 0; p < pairs; ++p) {
      const int64_t e = experts[p];
      if (e < 0 || static_cast<size_t>(e) >= ne)
        throw std::out_of_range("PackedExperts.forward: token " + std::to_string(p / k) + " routes to expert " +
                                std::to_string(e) + "; the layer has " + std::to_string(ne));
      ++start[e + 1];
    }
    for (size_t e = 0; e < ne; ++e) start[e + 1] += start[e];
    // Rows of every buffer are pair slots, grouped per expert; an expert's inner buffers start at
    // its first pair times the widest inner width, so slices never overlap.
    size_t wide = 0;
    for (size_t e = 0; e < ne; ++e) wide = std::max(wide, down_[e]->k());
    const size_t sin = sgu_ ? sdown_->k() : 0;
    thread_local std::vector<size_t> token;
    thread_local std::vector<float> weight, xs, hs, as, ys;
    token.resize(pairs);
    weight.resize(pairs);
    xs.resize(pairs * h);
    hs.resize(std::max(pairs * 2 * wide, t * 2 * sin));
    as.resize(std::max(pairs * wide, t * sin));
    ys.resize((pairs + (sgu_ ? t : 0)) * h);
    {
      std::vector<size_t> fill(start.begin(), start.end() - 1);
      for (size_t p = 0; p < pairs; ++p) {
        const size_t slot = fill[experts[p]]++;
        token[slot] = p / k;
        weight[slot] = weights[p];
        std::memcpy(xs.data() + slot * h, x + (p / k) * h, h * sizeof(float));
      }
    }
    // The pool's workers must see this thread's buffers (naming a thread_local inside the tasks
    // would give each worker its own): plain pointers.
    const float* xsp = xs.data();
    float *hsp = hs.data(), *asp = as.data(), *ysp = ys.data();
    std::vector<size_t> active;
    for (size_t e = 0; e < ne; ++e)
      if (start[e + 1] > start[e]) active.push_back(e);
    const size_t shared_tasks = sgu_ ? (t + kSharedRows - 1) / kSharedRows : 0;
    const bool clamp = !std::isnan(limit);
    nb::gil_scoped_release release;
    // Routed experts first, then the shared experts' row chunks: each task writes its own rows.
    // The shared pass reuses hs/as after every routed task is done, hence two rounds.
    auto routed = [&](size_t i) {
      const size_t e = active[i], r0 = start[e], rows = start[e + 1] - r0, inter = down_[e]->k();
      float* he = hsp + r0 * 2 * wide;
      float* ae = asp + r0 * wide;
      gate_up_[e]->run_serial(xsp + r0 * h, rows, he);
      swiglu_rows(he, rows, inter, clamp, limit, ae);
      down_[e]->run_serial(ae, rows, ysp + r0 * h);
    };
    parallel_for(num_threads, active.size(), routed);
    if (sgu_) {
      auto shared = [&](size_t c) {
        const size_t r0 = c * kSharedRows, rows = std::min(t, r0 + kSharedRows) - r0;
        sgu_->run_serial(x + r0 * h, rows, hsp + r0 * 2 * sin);
        swiglu_rows(hsp + r0 * 2 * sin, rows, sin, clamp, limit, asp + r0 * sin);
        sdown_->run_serial(asp + r0 * sin, rows, ysp + (pairs + r0) * h);
      };
      parallel_for(num_threads, shared_tasks, shared);
    }
    std::fill(out, out + t * h, 0.0f);
    for (size_t slot = 0; slot < pairs; ++slot) {  // expert by expert: each token's sum in expert order
      float* o = out + token[slot] * h;
      const float* y = ys.data() + slot * h;
      const float w = weight[slot];
      for (size_t c = 0; c < h; ++c) o[c] += y[c] * w;
    }
    if (sgu_)
      for (size_t i = 0; i < t * h; ++i) out[i] += ys[pairs * h + i];
  }

  // forward() of the experts and weights `router` picks for x (`fixed`: a hash-routed layer's
  // experts [t, k] int64, or 0); with `norm` (the address of H float32 weights, or 0) x's rows are
  // first RMS-normalized and scaled by them (rms_norm_rows: a fixed order per row), and x's rows
  // may then lie `ldx` floats apart (0: H).
  void forward_routed(const PackedRouter* router, uintptr_t xa, size_t t, uintptr_t fixed, uintptr_t oa,
                      float limit, int num_threads, uintptr_t norm, float eps, size_t ldx) const {
    if (router == nullptr) throw std::invalid_argument("PackedExperts.forward_routed: the router is None");
    if (router->hidden() != h_ || router->num_experts() != gate_up_.size())
      throw std::invalid_argument("PackedExperts.forward_routed: the router scores " +
                                  std::to_string(router->num_experts()) + " experts of width " +
                                  std::to_string(router->hidden()) + "; the layer has " +
                                  std::to_string(gate_up_.size()) + " of width " + std::to_string(h_));
    if (t == 0) return;
    if (xa == 0) throw std::invalid_argument("PackedExperts.forward_routed: null address");
    if (norm) {
      thread_local std::vector<float> normed;
      normed.resize(t * h_);
      rms_norm_rows(reinterpret_cast<const float*>(xa), t, h_, ldx ? ldx : h_, reinterpret_cast<const float*>(norm),
                    eps, normed.data());
      xa = reinterpret_cast<uintptr_t>(normed.data());
    } else if (ldx && ldx != h_) {
      throw std::invalid_argument("PackedExperts.forward_routed: strided rows need the norm");
    }
    const size_t k = router->top_k();
    thread_local std::vector<int64_t> experts;
    thread_local std::vector<float> weights;
    experts.resize(t * k);
    weights.resize(t * k);
    router->route(reinterpret_cast<const float*>(xa), t, reinterpret_cast<const int64_t*>(fixed), experts.data(),
                  weights.data());
    forward(xa, t, reinterpret_cast<uintptr_t>(experts.data()), reinterpret_cast<uintptr_t>(weights.data()), k, oa,
            limit, num_threads);
  }

  size_t num_experts() const { return gate_up_.size(); }
  size_t hidden() const { return h_; }

 private:
  static constexpr size_t kSharedRows = 8;
  std::vector<const PackedLinear*> gate_up_, down_;
  const PackedLinear* sgu_;
  const PackedLinear* sdown_;
  size_t h_ = 0;
};

}  // namespace
}  // namespace agent_infer
