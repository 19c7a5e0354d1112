// Rotary position embedding applied in place to the q and k heads of a fused qkv projection, on
// raw addresses (the decoder's hot path; llama.py checks shapes and dtypes first). HF's
// "rotate_half" convention: pair i is (x[i], x[i + D/2]). Built with -ffp-contract=off so each
// output is fl(fl(a*c) -+ fl(b*s)): the same roundings as torch's elementwise x1*cos - x2*sin.
#include <nanobind/nanobind.h>

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

}  // namespace

void register_rope(nb::module_& m) {
  m.def("rope_rows", &rope_rows, nb::arg("x"), nb::arg("rows"), nb::arg("row_stride"), nb::arg("heads"),
        nb::arg("dim"), nb::arg("cos_table"), nb::arg("sin_table"), nb::arg("table_rows"), nb::arg("positions"),
        "Rotate the first ``heads`` heads (``dim`` floats each) of every row of a float32 matrix in place "
        "(raw addresses; row r at x + 4 * r * row_stride) by the cos/sin tables ([table_rows, dim/2] "
        "float32) at int64 positions[r]; bit-identical to the torch rotate-half formula.");
}

}  // namespace agent_infer
