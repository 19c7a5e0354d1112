// Multi-head latent attention (DeepSeek V2/V3) for chunks of consecutive query rows of one sequence
// in the weight-absorbed form (layers/mla.py), bit-identical to the single-row decode kernel of
// kernels/attention_mla.h.
//
// A chunk's row t attends to the first ctx0 + t positions of its sequence, exactly what decoding
// that token alone computes; so a prompt's bits do not depend on how it was chunked, on what the
// prefix cache held, or on whether a row was prefilled or decoded. A work item is one head over a
// tile of up to kMlaTile consecutive rows: each latent key (and each kv_b row) is loaded once and
// used by every row of the tile (keys outer, rows inner), while each row's scores, running max,
// exp, sum, weighted sum and output projection are the single-row kernel's calls (mla_dot,
// mla_axpy, exp_shift) on that row's data, in that kernel's order. The ISA (and with it the exp) is
// chosen as kernels/attention.cpp chooses it, once per process.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "bindings/bindings.h"
#include "kernels/attention_mla.h"
#include "kernels/parallel.h"
#include "kernels/vexp.h"

namespace nb = nanobind;

namespace agent_infer {
namespace {

// Rows per work item: a tile's queries (16 * (lora + rope) floats) stay in L1/L2 while its keys stream.
constexpr size_t kMlaTile = 16;

struct MlaTile {
  size_t first_row;  // the tile's first query row
  size_t rows;       // rows in the tile (1..kMlaTile)
  size_t ctx0;       // context length of the first row; row t sees ctx0 + t positions
  const int64_t* slots;  // the sequence's cache slots in position order
  size_t block0;         // the sequence's first block of 16 transposed keys (MlaRows::key_blocks_)
};

// 16 consecutive keys of one sequence (fewer at its end).
struct MlaKeyBlock {
  const int64_t* slots;
  size_t keys;
};

// Each row's absorbed query [W_UK[h]^T q_nope, q_rope] * scale into q (row t at q + t * dim), in the
// decode kernel's order.
__attribute__((always_inline)) inline void mla_tile_queries(const MlaArgs& a, const MlaTile& tile, size_t h,
                                                            const float* wk, float* q) {
  const size_t dim = a.lora + a.rope, n = tile.rows;
  const float* qn[kMlaTile];
  for (size_t t = 0; t < n; ++t) {
    qn[t] = a.q_nope + (tile.first_row + t) * a.qn_row + h * a.qn_head;
    std::fill(q + t * dim, q + t * dim + a.lora, 0.0f);
  }
  for (size_t i = 0; i < a.nope; ++i)
    for (size_t t = 0; t < n; ++t) mla_axpy(q + t * dim, qn[t][i], wk + i * a.lora, a.lora);
  for (size_t t = 0; t < n; ++t) {
    const float* qr = a.q_rope + (tile.first_row + t) * a.qr_row + h * a.qr_head;
    float* qt = q + t * dim;
    std::copy(qr, qr + a.rope, qt + a.lora);
    for (size_t i = 0; i < dim; ++i) qt[i] *= a.scale;
  }
}

// Each row's weighted latent sum (row t at o + t * lora) divided by its softmax total, then
// projected through W_UV[h] (wv) into the output.
__attribute__((always_inline)) inline void mla_tile_finish(const MlaArgs& a, const MlaTile& tile, size_t h,
                                                           const float* wv, float* o, const float* sums) {
  const size_t n = tile.rows;
  for (size_t t = 0; t < n; ++t) {
    const float inv = 1.0f / sums[t];
    for (size_t i = 0; i < a.lora; ++i) o[t * a.lora + i] *= inv;
  }
  for (size_t k = 0; k < a.v; ++k)
    for (size_t t = 0; t < n; ++t)
      a.out[((tile.first_row + t) * a.heads + h) * a.v + k] = mla_dot(wv + k * a.lora, o + t * a.lora, a.lora);
}

template <bool kSimdExp>
__attribute__((always_inline)) inline void mla_tile_impl(const MlaArgs& a, const MlaTile& tile, size_t h,
                                                         std::vector<float>& buf) {
  const size_t dim = a.lora + a.rope, n = tile.rows, ctx0 = tile.ctx0, keys = ctx0 + n - 1;
  const float* wk = a.w + h * (a.nope + a.v) * a.lora;
  const float* wv = wk + a.nope * a.lora;
  buf.resize(n * (dim + a.lora + keys));
  float* q = buf.data();     // row t at q + t * dim
  float* o = q + n * dim;    // row t at o + t * lora
  float* s = o + n * a.lora;  // row t at s + t * keys
  float mx[kMlaTile], sum[kMlaTile];
  mla_tile_queries(a, tile, h, wk, q);
  std::fill(mx, mx + n, -INFINITY);
  for (size_t j = 0; j < keys; ++j) {
    const float* key = a.cache + static_cast<size_t>(tile.slots[j]) * dim;
    for (size_t t = j < ctx0 ? 0 : j - ctx0 + 1; t < n; ++t) {
      float* st = s + t * keys;
      st[j] = mla_dot(q + t * dim, key, dim);
      mx[t] = std::max(mx[t], st[j]);
    }
  }
  for (size_t t = 0; t < n; ++t) {
    float* st = s + t * keys;
    const size_t ctx = ctx0 + t;
    exp_shift(st, ctx, mx[t], kSimdExp);
    float total = 0.0f;
    for (size_t j = 0; j < ctx; ++j) total += st[j];
    sum[t] = total;
    std::fill(o + t * a.lora, o + (t + 1) * a.lora, 0.0f);
  }
  for (size_t j = 0; j < keys; ++j) {
    const float* key = a.cache + static_cast<size_t>(tile.slots[j]) * dim;
    for (size_t t = j < ctx0 ? 0 : j - ctx0 + 1; t < n; ++t) mla_axpy(o + t * a.lora, s[t * keys + j], key, a.lora);
  }
  mla_tile_finish(a, tile, h, wv, o, sum);
}

__attribute__((target("avx512f,fma"))) void mla_tile_avx512_generic(const MlaArgs& a, const MlaTile& tile, size_t h,
                                                                    std::vector<float>& buf) {
  mla_tile_impl<true>(a, tile, h, buf);
}

// Key block b of the cache, transposed: out[i * 16 + k] = element i of key k (zeros past its keys).
void mla_transpose_keys(const float* cache, size_t dim, const MlaKeyBlock& b, float* out) {
  for (size_t k = 0; k < kMlaLanes; ++k) {
    const float* key = k < b.keys ? cache + static_cast<size_t>(b.slots[k]) * dim : nullptr;
    for (size_t i = 0; i < dim; ++i) out[i * kMlaLanes + k] = key ? key[i] : 0.0f;
  }
}

// Weighted sums of one or two rows (kRows) over positions [j0, end) (the second row: [j0, end1),
// end1 >= end), kR vectors each: o += p_j * key_j[c0..] in position order per element.
constexpr size_t kRegs = 8;
template <size_t kRows, size_t kR>
__attribute__((target("avx512f,fma"))) void mla_wsum(float* o0, float* o1, const float* s0, const float* s1,
                                                     const float* keys0, size_t dim, const int64_t* slots, size_t j0,
                                                     size_t end, size_t end1) {
  __m512 a0[kR], a1[kR];
  for (size_t r = 0; r < kR; ++r) a0[r] = _mm512_loadu_ps(o0 + r * kMlaLanes);
  if (kRows == 2)
    for (size_t r = 0; r < kR; ++r) a1[r] = _mm512_loadu_ps(o1 + r * kMlaLanes);
  size_t j = j0;
  for (; j < end; ++j) {
    const float* key = keys0 + static_cast<size_t>(slots[j]) * dim;
    const __m512 p0 = _mm512_set1_ps(s0[j]);
    if (kRows == 2) {
      const __m512 p1 = _mm512_set1_ps(s1[j]);
      for (size_t r = 0; r < kR; ++r) {
        const __m512 k = _mm512_loadu_ps(key + r * kMlaLanes);
        a0[r] = _mm512_fmadd_ps(p0, k, a0[r]);
        a1[r] = _mm512_fmadd_ps(p1, k, a1[r]);
      }
    } else {
      for (size_t r = 0; r < kR; ++r) a0[r] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(key + r * kMlaLanes), a0[r]);
    }
  }
  if (kRows == 2)
    for (; j < end1; ++j) {
      const float* key = keys0 + static_cast<size_t>(slots[j]) * dim;
      const __m512 p1 = _mm512_set1_ps(s1[j]);
      for (size_t r = 0; r < kR; ++r) a1[r] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(key + r * kMlaLanes), a1[r]);
    }
  for (size_t r = 0; r < kR; ++r) _mm512_storeu_ps(o0 + r * kMlaLanes, a0[r]);
  if (kRows == 2)
    for (size_t r = 0; r < kR; ++r) _mm512_storeu_ps(o1 + r * kMlaLanes, a1[r]);
}

using MlaWsum = void (*)(float*, float*, const float*, const float*, const float*, size_t, const int64_t*, size_t,
                         size_t, size_t);
// [rows - 1][vectors - 1]
constexpr MlaWsum kMlaWsum[2][kRegs] = {
    {mla_wsum<1, 1>, mla_wsum<1, 2>, mla_wsum<1, 3>, mla_wsum<1, 4>, mla_wsum<1, 5>, mla_wsum<1, 6>, mla_wsum<1, 7>,
     mla_wsum<1, 8>},
    {mla_wsum<2, 1>, mla_wsum<2, 2>, mla_wsum<2, 3>, mla_wsum<2, 4>, mla_wsum<2, 5>, mla_wsum<2, 6>, mla_wsum<2, 7>,
     mla_wsum<2, 8>}};

// mla_tile_impl<true> with AVX-512 across keys (kv_lora_rank a multiple of 16): each block of 16
// keys is transposed once per call (`kt_all`, mla_transpose_keys, shared by every head and tile)
// and a row's scores for the block come out of 16 accumulators, accumulator l holding lane l of
// mla_dot's chains for the 16 keys side by side, then mla_dot's halving tree as vector adds; the
// row sums add each row's weights in position order 16 rows at a time, and the weighted sums add
// positions in order per latent element. Every value goes through the single-row kernel's roundings.
__attribute__((target("avx512f,fma"))) void mla_tile_avx512(const MlaArgs& a, const MlaTile& tile, size_t h,
                                                            const float* kt_all, std::vector<float>& buf) {
  const size_t dim = a.lora + a.rope, n = tile.rows, ctx0 = tile.ctx0, keys = ctx0 + n - 1;
  const size_t stride = (keys + kMlaLanes - 1) / kMlaLanes * kMlaLanes;  // a row's scores, padded
  const float* wk = a.w + h * (a.nope + a.v) * a.lora;
  const float* wv = wk + a.nope * a.lora;
  buf.resize(n * (dim + a.lora + stride));
  float* q = buf.data();
  float* o = q + n * dim;
  float* s = o + n * a.lora;
  float mx[kMlaTile];
  mla_tile_queries(a, tile, h, wk, q);
  // Scores, 16 keys at a time, 8 rows at a time: lane chain l of 8 rows runs side by side (one key
  // load feeds 8 multiply-adds), then each row's halving tree. Rows past the tile read a zero row
  // and write scratch.
  constexpr size_t kGroup = 8;
  alignas(64) float zero_row[1] = {0.0f};
  alignas(64) float scratch[kMlaLanes];
  const size_t main = dim / kMlaLanes * kMlaLanes;
  for (size_t j0 = 0; j0 < keys; j0 += kMlaLanes) {
    const float* kt = kt_all + (tile.block0 + j0 / kMlaLanes) * dim * kMlaLanes;
    for (size_t g = j0 < ctx0 ? 0 : j0 - ctx0 + 1; g < n; g += kGroup) {
      const float* qg[kGroup];
      size_t qstep[kGroup];
      for (size_t r = 0; r < kGroup; ++r) {
        qg[r] = g + r < n ? q + (g + r) * dim : zero_row;
        qstep[r] = g + r < n ? 1 : 0;
      }
      __m512 lanes[kGroup][kMlaLanes];
      for (size_t l = 0; l < kMlaLanes; ++l) {
        __m512 acc[kGroup];
        for (size_t r = 0; r < kGroup; ++r) acc[r] = _mm512_setzero_ps();
        size_t i = l;
        for (; i < main; i += kMlaLanes) {
          const __m512 k = _mm512_loadu_ps(kt + i * kMlaLanes);
          for (size_t r = 0; r < kGroup; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(qg[r][i * qstep[r]]), k, acc[r]);
        }
        if (i < dim) {
          const __m512 k = _mm512_loadu_ps(kt + i * kMlaLanes);
          for (size_t r = 0; r < kGroup; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(qg[r][i * qstep[r]]), k, acc[r]);
        }
        for (size_t r = 0; r < kGroup; ++r) lanes[r][l] = acc[r];
      }
      for (size_t r = 0; r < kGroup; ++r) {
        __m512* acc = lanes[r];
        for (size_t width = kMlaLanes / 2; width; width /= 2)
          for (size_t l = 0; l < width; ++l) acc[l] = _mm512_add_ps(acc[l], acc[l + width]);
        _mm512_storeu_ps(g + r < n ? s + (g + r) * stride + j0 : scratch, acc[0]);
      }
    }
  }
  // Row maxima (the maximum is exact in any order), then mla_head_impl's exp.
  for (size_t t = 0; t < n; ++t) {
    const float* st = s + t * stride;
    const size_t ctx = ctx0 + t;
    __m512 m = _mm512_set1_ps(-INFINITY);
    size_t j = 0;
    for (; j + kMlaLanes <= ctx; j += kMlaLanes) m = _mm512_max_ps(_mm512_loadu_ps(st + j), m);
    if (j < ctx) {
      const __mmask16 tail = static_cast<__mmask16>((1u << (ctx - j)) - 1u);
      m = _mm512_max_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail, st + j), m);
    }
    mx[t] = _mm512_reduce_max_ps(m);
    exp_shift(s + t * stride, ctx, mx[t], true);
  }
  // Row sums: lane t adds row t's weights in position order.
  alignas(64) float sums[kMlaLanes];
  {
    int32_t offs[kMlaLanes];
    for (size_t t = 0; t < kMlaLanes; ++t) offs[t] = static_cast<int32_t>(t < n ? t * stride : 0);
    const __m512i idx = _mm512_loadu_si512(offs);
    __m512 total = _mm512_setzero_ps();
    for (size_t j = 0; j < keys; ++j) {
      const size_t first = j < ctx0 ? 0 : j - ctx0 + 1;
      const __mmask16 rows = static_cast<__mmask16>(((1u << n) - 1u) & ~((1u << first) - 1u));
      const __m512 w = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), rows, idx, s + j, 4);
      total = _mm512_mask_add_ps(total, rows, total, w);
    }
    _mm512_store_ps(sums, total);
  }
  // Weighted latent sums: 16 keys at a time, kRegs vectors of two rows' sums in registers (one key
  // load feeds both rows); each element adds positions in order.
  for (size_t c0 = 0; c0 < a.lora; c0 += kRegs * kMlaLanes) {
    const size_t regs = std::min(kRegs, (a.lora - c0) / kMlaLanes);
    for (size_t t = 0; t < n; ++t)
      for (size_t r = 0; r < regs; ++r) _mm512_storeu_ps(o + t * a.lora + c0 + r * kMlaLanes, _mm512_setzero_ps());
    const float* keys0 = a.cache + c0;
    for (size_t j0 = 0; j0 < keys; j0 += kMlaLanes) {
      const size_t j1 = std::min(keys, j0 + kMlaLanes);
      for (size_t t = j0 < ctx0 ? 0 : j0 - ctx0 + 1; t < n; t += 2) {
        float* ot = o + t * a.lora + c0;
        const float* st = s + t * stride;
        const size_t end = std::min(j1, ctx0 + t);
        if (t + 1 == n) {
          kMlaWsum[0][regs - 1](ot, nullptr, st, nullptr, keys0, dim, tile.slots, j0, end, end);
        } else {
          const size_t end1 = std::min(j1, ctx0 + t + 1);
          kMlaWsum[1][regs - 1](ot, ot + a.lora, st, st + stride, keys0, dim, tile.slots, j0, end, end1);
        }
      }
    }
  }
  mla_tile_finish(a, tile, h, wv, o, sums);
}

__attribute__((target("avx2,fma"))) void mla_tile_avx2(const MlaArgs& a, const MlaTile& tile, size_t h,
                                                       std::vector<float>& buf) {
  mla_tile_impl<false>(a, tile, h, buf);
}

void mla_tile_portable(const MlaArgs& a, const MlaTile& tile, size_t h, std::vector<float>& buf) {
  mla_tile_impl<false>(a, tile, h, buf);
}

bool cpu_has_avx2_fma() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}
const bool g_mla_avx512 = cpu_has_avx512f();
const bool g_mla_avx2 = cpu_has_avx2_fma();

using I64 = nb::ndarray<const int64_t, nb::c_contig, nb::device::cpu>;

// One step's chunks, checked once, then run per layer on raw addresses.
class MlaRows {
 public:
  // seqs [S, 3] int64: (first query row, rows, context length) per sequence, the rows being the
  // last `rows` positions of the context; slots: the sequences' cache slots in position order,
  // concatenated (sum of context lengths).
  MlaRows(I64 seqs, I64 slots, int64_t num_rows, int64_t num_slots) {
    if (seqs.ndim() != 2 || seqs.shape(1) != 3) throw std::invalid_argument("mla_rows: seqs must be [S, 3]");
    if (slots.ndim() != 1) throw std::invalid_argument("mla_rows: slots must be 1-D");
    if (num_rows < 0 || num_slots < 0) throw std::invalid_argument("mla_rows: negative row or slot count");
    const int64_t* sq = seqs.data();
    slots_.assign(slots.data(), slots.data() + slots.shape(0));
    size_t offset = 0;
    for (size_t i = 0; i < seqs.shape(0); ++i) {
      const int64_t start = sq[3 * i], n = sq[3 * i + 1], ctx = sq[3 * i + 2];
      const size_t block0 = block_offsets_.size();
      const std::string where = "mla_rows: sequence " + std::to_string(i);
      if (n < 1 || ctx < n) throw std::invalid_argument(where + " needs 1 <= rows <= context length");
      if (start < 0 || start + n > num_rows) throw std::out_of_range(where + " has rows outside q");
      if (offset + static_cast<size_t>(ctx) > slots_.size())
        throw std::invalid_argument(where + " runs past the end of slots");
      for (size_t j = offset; j < offset + static_cast<size_t>(ctx); ++j)
        if (slots_[j] < 0 || slots_[j] >= num_slots)
          throw std::out_of_range(where + " references a slot outside the cache");
      for (int64_t t = 0; t < n; t += static_cast<int64_t>(kMlaTile)) {
        const int64_t rows = std::min<int64_t>(static_cast<int64_t>(kMlaTile), n - t);
        tiles_.push_back({static_cast<size_t>(start + t), static_cast<size_t>(rows),
                          static_cast<size_t>(ctx - n + t + 1), nullptr, block0});
        offsets_.push_back(offset);
      }
      for (size_t j = 0; j < static_cast<size_t>(ctx); j += kMlaLanes) {
        block_offsets_.push_back(offset + j);
        block_keys_.push_back(std::min(kMlaLanes, static_cast<size_t>(ctx) - j));
      }
      offset += static_cast<size_t>(ctx);
    }
    if (offset != slots_.size()) throw std::invalid_argument("mla_rows: slots has entries no sequence uses");
    for (size_t i = 0; i < tiles_.size(); ++i) tiles_[i].slots = slots_.data() + offsets_[i];
  }

  // q_nope and q_rope rows and heads at the given strides (in floats; each head's nope or rope
  // values contiguous), cache [num_slots, lora + rope], kv_b [heads * (nope + v), lora], out
  // [num_rows, heads * v]; float32, checked and kept alive by the caller.
  void run(uintptr_t q_nope, uintptr_t q_rope, uintptr_t cache, uintptr_t kv_b, uintptr_t out, int64_t heads,
           int64_t nope, int64_t rope, int64_t lora, int64_t v, double scale, int num_threads, int64_t qn_row,
           int64_t qn_head, int64_t qr_row, int64_t qr_head) const {
    const MlaArgs a = mla_args("mla_rows", q_nope, q_rope, cache, kv_b, out, heads, nope, rope, lora, v, scale,
                               qn_row, qn_head, qr_row, qr_head);
    nb::gil_scoped_release release;
    const bool blocked = g_mla_avx512 && a.lora % kMlaLanes == 0;
    const size_t dim = a.lora + a.rope;
    std::vector<float> kt(blocked ? block_offsets_.size() * dim * kMlaLanes : 0);
    if (blocked)
      parallel_for(num_threads, block_offsets_.size(), [&](size_t b) {
        mla_transpose_keys(a.cache, dim, {slots_.data() + block_offsets_[b], block_keys_[b]},
                           kt.data() + b * dim * kMlaLanes);
      });
    parallel_for(num_threads, tiles_.size() * a.heads, [&](size_t item) {
      thread_local std::vector<float> buf;
      const MlaTile& tile = tiles_[item / a.heads];
      const size_t h = item % a.heads;
      if (blocked)
        mla_tile_avx512(a, tile, h, kt.data(), buf);
      else if (g_mla_avx512)
        mla_tile_avx512_generic(a, tile, h, buf);
      else if (g_mla_avx2)
        mla_tile_avx2(a, tile, h, buf);
      else
        mla_tile_portable(a, tile, h, buf);
    });
  }

  size_t num_tiles() const { return tiles_.size(); }

 private:
  std::vector<int64_t> slots_;
  std::vector<MlaTile> tiles_;
  std::vector<size_t> offsets_;
  std::vector<size_t> block_offsets_, block_keys_;  // each key block's first slot entry and key count
};

}  // namespace

void register_attention_mla_rows(nb::module_& m) {
  nb::class_<MlaRows>(m, "MlaRows",
                      "One step's multi-token chunks for absorbed multi-head latent attention, checked once "
                      "and run per layer on raw addresses; each row bit-identical to the decode kernel's.")
      .def(nb::init<I64, I64, int64_t, int64_t>(), nb::arg("seqs"), nb::arg("slots"), nb::arg("num_rows"),
           nb::arg("num_slots"))
      .def("run", &MlaRows::run, nb::arg("q_nope"), nb::arg("q_rope"), nb::arg("cache"), nb::arg("kv_b"),
           nb::arg("out"), nb::arg("heads"), nb::arg("nope"), nb::arg("rope"), nb::arg("lora"), nb::arg("v"),
           nb::arg("scale"), nb::arg("num_threads"), nb::arg("qn_row"), nb::arg("qn_head"), nb::arg("qr_row"),
           nb::arg("qr_head"),
           "Absorbed MLA for every chunk row (q_nope and q_rope rows and heads at the given float strides, "
           "latent cache [num_slots, lora + rope], kv_b_proj [heads * (nope + v), lora], out [num_rows, "
           "heads * v]; float32); the GIL is released.")
      .def_prop_ro("num_tiles", &MlaRows::num_tiles);
}

}  // namespace agent_infer
