#pragma once
// A MoE layer's router over a packed gate (layers/moe.py's MoE.route, one token at a time): the
// gate's logits, scores (softmax, sigmoid or sqrt(softplus)), the experts (the top_k of the scores
// plus the correction bias, limited to the topk_groups best groups when the experts are grouped,
// a group scored by its two best; or fixed by a hash table), and their weights (the unbiased
// scores, renormalized to sum to one when asked, times the routed scaling factor).
//
// Each token's arithmetic is its own, in a fixed order, so its experts and weights do not depend
// on the batch. Ties between equal values go to the lower expert or group index. Included by
// kernels/linear.cpp only.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/linear_packed.h"

namespace agent_infer {
namespace {

enum Scoring : int { kSoftmax = 0, kSigmoid = 1, kSqrtSoftplus = 2 };

class PackedRouter {
 public:
  PackedRouter(const PackedLinear* gate, const std::string& scoring, std::vector<float> bias, int64_t groups,
               int64_t topk_groups, int64_t top_k, bool renormalize, double scaling)
      : gate_(gate), bias_(std::move(bias)), renormalize_(renormalize), scaling_(static_cast<float>(scaling)) {
    if (gate_ == nullptr) throw std::invalid_argument("PackedRouter: the gate is None");
    if (gate_->q8_activations()) throw std::invalid_argument("PackedRouter: the gate must take float activations");
    if (scoring == "softmax")
      scoring_ = kSoftmax;
    else if (scoring == "sigmoid")
      scoring_ = kSigmoid;
    else if (scoring == "sqrtsoftplus")
      scoring_ = kSqrtSoftplus;
    else
      throw std::invalid_argument("PackedRouter: unknown scoring '" + scoring + "' (softmax, sigmoid, sqrtsoftplus)");
    e_ = gate_->n();
    if (!bias_.empty() && bias_.size() != e_)
      throw std::invalid_argument("PackedRouter: the bias has " + std::to_string(bias_.size()) + " values for " +
                                  std::to_string(e_) + " experts");
    if (top_k < 1 || static_cast<size_t>(top_k) > e_ || groups < 1 || e_ % static_cast<size_t>(groups) ||
        topk_groups < 1 || topk_groups > groups || (groups > 1 && e_ / static_cast<size_t>(groups) < 2))
      throw std::invalid_argument("PackedRouter: top_k " + std::to_string(top_k) + ", " + std::to_string(groups) +
                                  " groups and topk_groups " + std::to_string(topk_groups) + " do not fit " +
                                  std::to_string(e_) + " experts");
    groups_ = static_cast<size_t>(groups);
    topk_groups_ = static_cast<size_t>(topk_groups);
    k_ = static_cast<size_t>(top_k);
  }

  // experts [t, k] (int64) and weights [t, k] (float32) of x [t, H]; `fixed` (int64 [t, k], or
  // null) gives the experts of hash-routed layers, whose ids are checked here.
  void route(const float* x, size_t t, const int64_t* fixed, int64_t* experts, float* weights) const {
    thread_local std::vector<float> logits;
    logits.resize(t * e_);
    gate_->run_serial(x, t, logits.data());
    std::vector<float> scores(e_), choice(e_), group_score(groups_);
    std::vector<size_t> order(e_);
    for (size_t r = 0; r < t; ++r) {
      const float* l = logits.data() + r * e_;
      score_row(l, scores.data());
      int64_t* ex = experts + r * k_;
      if (fixed != nullptr) {
        for (size_t j = 0; j < k_; ++j) {
          const int64_t e = fixed[r * k_ + j];
          if (e < 0 || static_cast<size_t>(e) >= e_)
            throw std::out_of_range("PackedRouter: token " + std::to_string(r) + " is hashed to expert " +
                                    std::to_string(e) + "; the layer has " + std::to_string(e_));
          ex[j] = e;
        }
      } else {
        for (size_t e = 0; e < e_; ++e) choice[e] = bias_.empty() ? scores[e] : scores[e] + bias_[e];
        if (groups_ > 1) limit_groups(choice.data(), group_score.data());
        for (size_t e = 0; e < e_; ++e) order[e] = e;
        // Descending value, lower index first on ties: the first k after a partial sort.
        std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k_), order.end(),
                          [&](size_t a, size_t b) { return choice[a] > choice[b] || (choice[a] == choice[b] && a < b); });
        for (size_t j = 0; j < k_; ++j) ex[j] = static_cast<int64_t>(order[j]);
      }
      float* w = weights + r * k_;
      float sum = 0.0f;
      for (size_t j = 0; j < k_; ++j) {
        w[j] = scores[static_cast<size_t>(ex[j])];
        sum += w[j];
      }
      for (size_t j = 0; j < k_; ++j) w[j] = (renormalize_ ? w[j] / sum : w[j]) * scaling_;
    }
  }

  size_t num_experts() const { return e_; }
  size_t top_k() const { return k_; }
  size_t hidden() const { return gate_->k(); }

 private:
  void score_row(const float* l, float* s) const {
    if (scoring_ == kSoftmax) {
      float mx = -INFINITY, sum = 0.0f;
      for (size_t e = 0; e < e_; ++e) mx = std::max(mx, l[e]);
      for (size_t e = 0; e < e_; ++e) sum += s[e] = std::exp(l[e] - mx);
      for (size_t e = 0; e < e_; ++e) s[e] /= sum;
    } else if (scoring_ == kSigmoid) {
      for (size_t e = 0; e < e_; ++e) s[e] = 1.0f / (1.0f + std::exp(-l[e]));
    } else {
      for (size_t e = 0; e < e_; ++e) s[e] = std::sqrt(l[e] > 20.0f ? l[e] : std::log1p(std::exp(l[e])));
    }
  }

  // Experts outside the topk_groups best groups (a group scored by its two best) set to -inf.
  void limit_groups(float* choice, float* group_score) const {
    const size_t per = e_ / groups_;
    for (size_t g = 0; g < groups_; ++g) {
      float a = -INFINITY, b = -INFINITY;
      for (size_t e = g * per; e < (g + 1) * per; ++e) {
        if (choice[e] > a)
          b = a, a = choice[e];
        else if (choice[e] > b)
          b = choice[e];
      }
      group_score[g] = a + b;
    }
    std::vector<size_t> gorder(groups_);
    for (size_t g = 0; g < groups_; ++g) gorder[g] = g;
    std::partial_sort(gorder.begin(), gorder.begin() + static_cast<std::ptrdiff_t>(topk_groups_), gorder.end(),
                      [&](size_t x, size_t y) {
                        return group_score[x] > group_score[y] || (group_score[x] == group_score[y] && x < y);
                      });
    std::vector<char> keep(groups_, 0);
    for (size_t j = 0; j < topk_groups_; ++j) keep[gorder[j]] = 1;
    for (size_t e = 0; e < e_; ++e)
      if (!keep[e / per]) choice[e] = -INFINITY;
  }

  const PackedLinear* gate_;
  std::vector<float> bias_;
  bool renormalize_;
  float scaling_;
  int scoring_ = kSigmoid;
  size_t e_ = 0, groups_ = 1, topk_groups_ = 1, k_ = 1;
};

}  // namespace
}  // namespace agent_infer
