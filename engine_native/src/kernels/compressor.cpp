// DeepSeek V4's KV compressor (layers/compressor.py) for the windows a step's decode rows complete:
// per row, the window's per-token value and gate projections (the earlier tokens' from the state
// pool, the row's own from the layer's fresh projection) are pooled per channel by a softmax over
// the window's slots of gate + ape, RMS-normed with the norm weight, rotated at the window's
// position (cos/sin given per row) and written to the row's entry slot; on sparse layers the
// indexer's compressor does the same into the entry's trailing index_dim values.
//
// Overlapping compressors (two series, compressed sparse attention) pool the previous window's
// first series with this window's second over 2 * rate slots; at window 0 the previous slots weigh
// nothing. Each row's arithmetic is its own (slots in order, the sum of squares in double over a
// fixed tree), so entries do not depend on the batch.
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

struct Series {
  const float* ape;   // [rate, series * dim]
  const float* norm;  // [dim]
  size_t dim, offset;  // channels; first column of this compressor's state (and of its entry part)
  size_t entry_offset;
};

struct CloseArgs {
  const float* states;      // state pool [slots, state_width]
  const int64_t* earlier;   // [m, span] state slots of the tokens before each row's own (oldest first)
  const float* fresh;       // the layer's new states, row r at fresh + r * fresh_row
  const int64_t* rows;      // [m] query rows
  const uint8_t* lead;      // [m] 1: the previous window is pooled too (overlap past window 0)
  const float* cos;         // [m, rope_dim]
  const float* sin;
  const int64_t* targets;   // [m] entry slots
  float* entries;           // entry pool [slots, entry_width]
  size_t span, state_width, fresh_row, entry_width, rate, rope_dim;
  bool overlap;
  float eps;
};

// The state row of slot j (0 .. (1 + lead) * rate - 1) of member i's windows.
const float* state_row(const CloseArgs& a, size_t i, size_t j, size_t tokens) {
  if (j + 1 == tokens) return a.fresh + static_cast<size_t>(a.rows[i]) * a.fresh_row;
  return a.states + static_cast<size_t>(a.earlier[i * a.span + a.span - (tokens - 1) + j]) * a.state_width;
}

void pool_one(const CloseArgs& a, const Series& s, size_t i, std::vector<float>& buf) {
  const size_t r = a.rate, d = s.dim, width = (a.overlap ? 2 : 1) * d;
  const bool lead = a.overlap && a.lead[i];
  const size_t tokens = (lead ? 2 : 1) * r;
  buf.assign(3 * d, 0.0f);
  float* mx = buf.data();
  float* sum = mx + d;
  float* acc = sum + d;
  std::fill(mx, mx + d, -INFINITY);
  // Slot j of the pooled window: (state row, value column, gate column, ape row).
  auto slot = [&](size_t j, size_t c, float& kv, float& gate) {
    const float* row = state_row(a, i, j, tokens);
    const size_t o = j % r;
    // Overlap: the previous window's tokens give series A, this window's series B.
    const size_t col = a.overlap ? (lead && j < r ? c : d + c) : c;
    kv = row[s.offset + col];
    gate = row[s.offset + width + col] + s.ape[o * width + col];
  };
  float kv, gate;
  for (size_t j = 0; j < tokens; ++j)
    for (size_t c = 0; c < d; ++c) {
      slot(j, c, kv, gate);
      mx[c] = std::max(mx[c], gate);
    }
  for (size_t j = 0; j < tokens; ++j)
    for (size_t c = 0; c < d; ++c) {
      slot(j, c, kv, gate);
      sum[c] += std::exp(gate - mx[c]);
    }
  for (size_t j = 0; j < tokens; ++j)
    for (size_t c = 0; c < d; ++c) {
      slot(j, c, kv, gate);
      acc[c] += kv * (std::exp(gate - mx[c]) / sum[c]);
    }
  double sq[8] = {};
  for (size_t c = 0; c < d; ++c) sq[c % 8] += static_cast<double>(acc[c]) * static_cast<double>(acc[c]);
  const double total = ((sq[0] + sq[1]) + (sq[2] + sq[3])) + ((sq[4] + sq[5]) + (sq[6] + sq[7]));
  const float inv = static_cast<float>(1.0 / std::sqrt(total / static_cast<double>(d) + static_cast<double>(a.eps)));
  float* out = a.entries + static_cast<size_t>(a.targets[i]) * a.entry_width + s.entry_offset;
  for (size_t c = 0; c < d; ++c) out[c] = (acc[c] * inv) * s.norm[c];
  float* p = out + d - a.rope_dim;
  const float* cs = a.cos + i * a.rope_dim;
  const float* sn = a.sin + i * a.rope_dim;
  for (size_t c = 0; c < a.rope_dim; c += 2) {
    const float x0 = p[c], x1 = p[c + 1];
    p[c] = x0 * cs[c] + (-x1) * sn[c];
    p[c + 1] = x1 * cs[c + 1] + x0 * sn[c + 1];
  }
}

// Every member's entry; see the file comment. Raw addresses, checked by the caller
// (layers/compressed_native.py) except the slots, checked here against the pools.
void close_windows(uintptr_t states, size_t state_slots, size_t state_width, uintptr_t earlier, size_t m,
                   size_t span, uintptr_t fresh, size_t fresh_row, uintptr_t rows, uintptr_t lead, uintptr_t cos,
                   uintptr_t sin, size_t rope_dim, uintptr_t targets, uintptr_t entries, size_t entry_slots,
                   size_t entry_width, size_t rate, bool overlap, double eps, uintptr_t ape, uintptr_t norm,
                   size_t dim, uintptr_t index_ape, uintptr_t index_norm, size_t index_dim, int num_threads) {
  if (m == 0) return;
  if (!states || !earlier || !fresh || !rows || !lead || !cos || !sin || !targets || !entries || !ape || !norm)
    throw std::invalid_argument("close_windows: null address");
  const size_t series = overlap ? 2 : 1;
  const size_t width = 2 * series * dim + (index_dim ? 2 * 2 * index_dim : 0);
  if (rate < 1 || span < (overlap ? 2 * rate - 1 : rate - 1) || rope_dim % 2 || rope_dim > dim ||
      (index_dim && rope_dim > index_dim) || state_width < width || fresh_row < width ||
      entry_width < dim + index_dim)
    throw std::invalid_argument("close_windows: inconsistent widths (rate " + std::to_string(rate) + ", span " +
                                std::to_string(span) + ", state width " + std::to_string(state_width) + ")");
  if (index_dim && (!index_ape || !index_norm))
    throw std::invalid_argument("close_windows: the indexer's compressor needs its ape and norm");
  CloseArgs a{reinterpret_cast<const float*>(states), reinterpret_cast<const int64_t*>(earlier),
              reinterpret_cast<const float*>(fresh), reinterpret_cast<const int64_t*>(rows),
              reinterpret_cast<const uint8_t*>(lead), reinterpret_cast<const float*>(cos),
              reinterpret_cast<const float*>(sin), reinterpret_cast<const int64_t*>(targets),
              reinterpret_cast<float*>(entries), span, state_width, fresh_row, entry_width, rate, rope_dim,
              overlap, static_cast<float>(eps)};
  for (size_t i = 0; i < m; ++i) {
    if (a.targets[i] < 0 || static_cast<size_t>(a.targets[i]) >= entry_slots)
      throw std::out_of_range("close_windows: an entry slot outside the pool");
    const size_t used = overlap && a.lead[i] ? 2 * rate - 1 : rate - 1;
    for (size_t j = span - used; j < span; ++j)
      if (a.earlier[i * span + j] < 0 || static_cast<size_t>(a.earlier[i * span + j]) >= state_slots)
        throw std::out_of_range("close_windows: a state slot outside the pool");
  }
  const Series main{reinterpret_cast<const float*>(ape), reinterpret_cast<const float*>(norm), dim, 0, 0};
  const Series index{reinterpret_cast<const float*>(index_ape), reinterpret_cast<const float*>(index_norm),
                     index_dim, 2 * series * dim, dim};
  nb::gil_scoped_release release;
  parallel_for(num_threads, m, [&](size_t i) {
    thread_local std::vector<float> buf;
    pool_one(a, main, i, buf);
    if (index_dim) {
      // The indexer's compressor always overlaps (two series), like the sparse layer it serves.
      CloseArgs b = a;
      b.overlap = true;
      pool_one(b, index, i, buf);
    }
  });
}

}  // namespace

void register_compressor(nb::module_& m) {
  m.def("close_windows", &close_windows, nb::arg("states"), nb::arg("state_slots"), nb::arg("state_width"),
        nb::arg("earlier"), nb::arg("m"), nb::arg("span"), nb::arg("fresh"), nb::arg("fresh_row"), nb::arg("rows"),
        nb::arg("lead"), nb::arg("cos"), nb::arg("sin"), nb::arg("rope_dim"), nb::arg("targets"), nb::arg("entries"),
        nb::arg("entry_slots"), nb::arg("entry_width"), nb::arg("rate"), nb::arg("overlap"), nb::arg("eps"),
        nb::arg("ape"), nb::arg("norm"), nb::arg("dim"), nb::arg("index_ape"), nb::arg("index_norm"),
        nb::arg("index_dim"), nb::arg("num_threads") = 1,
        "DeepSeek V4: pool, norm, rotate and store the entry of the window each of m decode rows completes "
        "(raw float32/int64 addresses, see kernels/compressor.cpp); the GIL is released.");
}

}  // namespace agent_infer
