// CPU kernel for applying an int32 token bitmask to logits in place.
// Contract (shared with every backend): bit j of word w in row r allows token 32*w + j;
// a cleared bit sets that logit to -inf. Tokens past the bitmask's width are masked too,
// because the mask is the only source of truth about which ids are legal.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

#include "bindings/bindings.h"

namespace nb = nanobind;

namespace agent_infer {
namespace {

using Logits = nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Mask = nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Indices = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

void apply_row(float* row, int64_t vocab, const int32_t* words, int64_t n_words) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  int64_t covered = std::min<int64_t>(vocab, n_words * 32);
  for (int64_t w = 0; w * 32 < covered; ++w) {
    uint32_t bits = static_cast<uint32_t>(words[w]);
    if (bits == 0xFFFFFFFFu) continue;
    int64_t base = w * 32;
    int64_t end = std::min<int64_t>(covered, base + 32);
    if (bits == 0) {
      for (int64_t t = base; t < end; ++t) row[t] = neg_inf;
      continue;
    }
    for (int64_t t = base; t < end; ++t) {
      if (!((bits >> (t - base)) & 1u)) row[t] = neg_inf;
    }
  }
  for (int64_t t = covered; t < vocab; ++t) row[t] = neg_inf;
}

void apply_token_bitmask_inplace_cpu(Logits logits, Mask bitmask, nb::object indices_obj) {
  const int64_t batch = static_cast<int64_t>(logits.shape(0));
  const int64_t vocab = static_cast<int64_t>(logits.shape(1));
  const int64_t mask_rows = static_cast<int64_t>(bitmask.shape(0));
  const int64_t n_words = static_cast<int64_t>(bitmask.shape(1));
  float* data = logits.data();
  const int32_t* mask = bitmask.data();
  if (indices_obj.is_none()) {
    if (mask_rows != batch) {
      throw std::invalid_argument("bitmask has " + std::to_string(mask_rows) + " rows but logits have " +
                                  std::to_string(batch) + "; pass indices to select rows");
    }
    nb::gil_scoped_release release;
    for (int64_t r = 0; r < batch; ++r) apply_row(data + r * vocab, vocab, mask + r * n_words, n_words);
    return;
  }
  Indices indices = nb::cast<Indices>(indices_obj);
  const int64_t n = static_cast<int64_t>(indices.shape(0));
  const int64_t* idx = indices.data();
  for (int64_t i = 0; i < n; ++i) {
    if (idx[i] < 0 || idx[i] >= batch || idx[i] >= mask_rows) {
      throw std::out_of_range("indices[" + std::to_string(i) + "] = " + std::to_string(idx[i]) +
                              " is outside the logits/bitmask rows");
    }
  }
  nb::gil_scoped_release release;
  for (int64_t i = 0; i < n; ++i) {
    int64_t r = idx[i];
    apply_row(data + r * vocab, vocab, mask + r * n_words, n_words);
  }
}

}  // namespace

void register_bitmask(nb::module_& m) {
  m.def("apply_token_bitmask_inplace_cpu", &apply_token_bitmask_inplace_cpu, nb::arg("logits"),
        nb::arg("bitmask"), nb::arg("indices") = nb::none(),
        "Mask float32 logits [batch, vocab] in place with an int32 bitmask [rows, ceil(vocab/32)].");
}

}  // namespace agent_infer
