// CPU kernel for applying an int32 token bitmask to logits in place.
// Contract (shared with every backend): bit j of word w in row r allows token 32*w + j;
// a cleared bit sets that logit to -inf. Tokens past the bitmask's width are masked too,
// because the mask is the only source of truth about which ids are legal.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "bindings/bindings.h"
#include "kernels/bitmask.h"

namespace nb = nanobind;

namespace agent_infer {
namespace {

// Bit j of every word, for the branch-free select below (a shift by a lane-varying count has no
// SSE2 instruction; an AND with this table does, so the loop compiles to vector selects).
alignas(64) constexpr uint32_t kBit[32] = {
    1u << 0,  1u << 1,  1u << 2,  1u << 3,  1u << 4,  1u << 5,  1u << 6,  1u << 7,  1u << 8,  1u << 9,  1u << 10,
    1u << 11, 1u << 12, 1u << 13, 1u << 14, 1u << 15, 1u << 16, 1u << 17, 1u << 18, 1u << 19, 1u << 20, 1u << 21,
    1u << 22, 1u << 23, 1u << 24, 1u << 25, 1u << 26, 1u << 27, 1u << 28, 1u << 29, 1u << 30, 1u << 31};
constexpr uint32_t kNegInfBits = 0xFF800000u;

// The 32 logits of one word whose bits are mixed: a constrained row inside a JSON string allows
// most tokens, so most words are either all ones (skipped) or mixed, rarely all zeros.
inline void apply_word(float* out, uint32_t bits) {
  uint32_t v[32];
  std::memcpy(v, out, sizeof(v));
  for (int j = 0; j < 32; ++j) {
    const uint32_t keep = (bits & kBit[j]) ? 0xFFFFFFFFu : 0u;
    v[j] = (v[j] & keep) | (kNegInfBits & ~keep);
  }
  std::memcpy(out, v, sizeof(v));
}

}  // namespace

void apply_bitmask_row(float* row, int64_t vocab, const int32_t* words, int64_t n_words) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  int64_t covered = std::min<int64_t>(vocab, n_words * 32);
  const int64_t full = covered / 32;
  for (int64_t w = 0; w < full; ++w) {
    const uint32_t bits = static_cast<uint32_t>(words[w]);
    if (bits != 0xFFFFFFFFu) apply_word(row + w * 32, bits);
  }
  if (full * 32 < covered) {
    const uint32_t bits = static_cast<uint32_t>(words[full]);
    for (int64_t t = full * 32; t < covered; ++t) {
      if (!((bits >> (t - full * 32)) & 1u)) row[t] = neg_inf;
    }
  }
  for (int64_t t = covered; t < vocab; ++t) row[t] = neg_inf;
}

namespace {

using Logits = nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Mask = nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Indices = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

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
    for (int64_t r = 0; r < batch; ++r) apply_bitmask_row(data + r * vocab, vocab, mask + r * n_words, n_words);
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
    apply_bitmask_row(data + r * vocab, vocab, mask + r * n_words, n_words);
  }
}

// The engine's path: rows as a list (no index tensor to build), already known to be in both tensors
// only by the caller, so they are checked here.
void apply_token_bitmask_rows_cpu(Logits logits, Mask bitmask, const std::vector<int64_t>& rows) {
  const int64_t batch = static_cast<int64_t>(logits.shape(0));
  const int64_t vocab = static_cast<int64_t>(logits.shape(1));
  const int64_t mask_rows = static_cast<int64_t>(bitmask.shape(0));
  const int64_t n_words = static_cast<int64_t>(bitmask.shape(1));
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i] < 0 || rows[i] >= batch || rows[i] >= mask_rows) {
      throw std::out_of_range("rows[" + std::to_string(i) + "] = " + std::to_string(rows[i]) +
                              " is outside the logits/bitmask rows");
    }
  }
  float* data = logits.data();
  const int32_t* mask = bitmask.data();
  nb::gil_scoped_release release;
  for (int64_t r : rows) apply_bitmask_row(data + r * vocab, vocab, mask + r * n_words, n_words);
}

}  // namespace

void register_bitmask(nb::module_& m) {
  m.def("apply_token_bitmask_inplace_cpu", &apply_token_bitmask_inplace_cpu, nb::arg("logits"),
        nb::arg("bitmask"), nb::arg("indices") = nb::none(),
        "Mask float32 logits [batch, vocab] in place with an int32 bitmask [rows, ceil(vocab/32)].");
  m.def("apply_token_bitmask_rows_cpu", &apply_token_bitmask_rows_cpu, nb::arg("logits").noconvert(),
        nb::arg("bitmask").noconvert(), nb::arg("rows"),
        "Mask rows `rows` (a list; same row in logits and bitmask) of float32 logits in place.");
}

}  // namespace agent_infer
