// Attention over the paged KV cache: one call per layer for every query row of the step, whether it
// decodes one token or belongs to a prompt chunk (kernels/attention_rows.h has the row arithmetic).
//
// Batch invariance by construction: the work item is (tile of consecutive rows of one sequence, kv
// head); each row's scores, softmax and weighted sum run in a fixed order (positions ascending) with
// code that does not depend on the batch, on the tiling, on which thread runs it, or on the other
// sequences, so a row equals decoding that token alone. The ISA is chosen once per process.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bindings/bindings.h"
#include "kernels/attention_mla.h"
#include "kernels/attention_rows.h"
#include "kernels/parallel.h"

namespace nb = nanobind;

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 AVX-512 headers, see kernels/linear.cpp
#endif

namespace agent_infer {
namespace {

bool has_avx512() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}
const bool g_avx512 = has_avx512();

bool has_avx2_fma() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}
const bool g_avx2 = has_avx2_fma();

// Group a batch's entries into tiles: runs of up to kTileRows consecutive query rows of one
// sequence (context lengths ascending by one, the same blocks), which attend_tile runs together.
// Decode rows stay tiles of one. Grouping only changes which keys are loaded together, never a
// row's arithmetic, so results do not depend on how a batch is tiled.
constexpr size_t kTileRows = 16;

struct Tile {
  size_t first, count;
};

std::vector<Tile> make_tiles(const int64_t* rows, const int64_t* tables, const int64_t* table_of, const int64_t* ctx,
                             size_t batch, size_t max_blocks, size_t block_size) {
  auto same_blocks = [&](size_t s) {  // entry s sees the blocks entry s - 1 does, and its own after them
    const int64_t* t = tables + table_of[s] * max_blocks;
    const size_t used = (static_cast<size_t>(ctx[s]) + block_size - 1) / block_size;
    return table_of[s] == table_of[s - 1] || std::equal(t, t + used, tables + table_of[s - 1] * max_blocks);
  };
  std::vector<Tile> tiles;
  for (size_t s = 0; s < batch;) {
    size_t n = 1;
    while (s + n < batch && n < kTileRows && rows[s + n] == rows[s + n - 1] + 1 && ctx[s + n] == ctx[s + n - 1] + 1 &&
           same_blocks(s + n))
      ++n;
    tiles.push_back({s, n});
    s += n;
  }
  return tiles;
}

void run_tiles(const Args& a, const std::vector<Tile>& tiles, int num_threads) {
  nb::gil_scoped_release release;
  parallel_for(num_threads, tiles.size() * a.kv_heads, [&](size_t item) {
    thread_local std::vector<float> scores;
    const Tile& t = tiles[item / a.kv_heads];
    attend_tile(a, t.first, t.count, item % a.kv_heads, scores);
  });
}

template <typename T>
const T* checked(const nb::ndarray<nb::ro>& a, const char* name, size_t ndim) {
  if (a.dtype() != nb::dtype<T>())
    throw nb::type_error((std::string("decode_attention: ") + name + " has the wrong dtype").c_str());
  if (a.device_type() != nb::device::cpu::value || a.ndim() != ndim)
    throw std::invalid_argument(std::string("decode_attention: ") + name + " must be a " + std::to_string(ndim) +
                                "-D CPU array");
  int64_t expect = 1;
  for (size_t i = ndim; i-- > 0;) {
    if (a.shape(i) > 1 && a.stride(i) != expect)
      throw std::invalid_argument(std::string("decode_attention: ") + name + " must be C-contiguous");
    expect *= static_cast<int64_t>(a.shape(i));
  }
  return static_cast<const T*>(a.data());
}

// q [R, H, D]; k_cache/v_cache [slots, Hkv, D]; out [R, H*D]; rows/context_lens [B]; block_tables [B, max_blocks].
void decode_attention(nb::ndarray<nb::ro> q, nb::ndarray<nb::ro> k_cache, nb::ndarray<nb::ro> v_cache,
                      nb::ndarray<> out, nb::ndarray<nb::ro> rows, nb::ndarray<nb::ro> block_tables,
                      nb::ndarray<nb::ro> context_lens, int64_t block_size, double scale, int num_threads) {
  Args a{};
  a.q = checked<float>(q, "q", 3);
  a.k = checked<float>(k_cache, "k_cache", 3);
  a.v = checked<float>(v_cache, "v_cache", 3);
  a.rows = checked<int64_t>(rows, "rows", 1);
  a.tables = checked<int64_t>(block_tables, "block_tables", 2);
  a.ctx = checked<int64_t>(context_lens, "context_lens", 1);
  const nb::ndarray<nb::ro> out_ro(out);
  checked<float>(out_ro, "out", 2);
  a.out = static_cast<float*>(out.data());
  const size_t r = q.shape(0), batch = rows.shape(0);
  a.heads = q.shape(1);
  a.dim = q.shape(2);
  a.kv_heads = k_cache.shape(1);
  a.num_slots = k_cache.shape(0);
  a.max_blocks = block_tables.shape(1);
  if (block_size < 1) throw std::invalid_argument("decode_attention: block_size must be >= 1");
  a.block_size = static_cast<size_t>(block_size);
  a.scale = static_cast<float>(scale);
  if (a.kv_heads == 0 || a.heads % a.kv_heads)
    throw std::invalid_argument("decode_attention: query heads must be a multiple of kv heads");
  for (size_t i = 0; i < 3; ++i)
    if (v_cache.shape(i) != k_cache.shape(i)) throw std::invalid_argument("decode_attention: k/v caches differ in shape");
  if (k_cache.shape(2) != a.dim) throw std::invalid_argument("decode_attention: q and cache head dims differ");
  if (out.shape(0) != r || out.shape(1) != a.heads * a.dim)
    throw std::invalid_argument("decode_attention: out must be [rows, heads*dim]");
  if (context_lens.shape(0) != batch || block_tables.shape(0) != batch)
    throw std::invalid_argument("decode_attention: rows, block_tables and context_lens disagree on the batch");
  for (size_t s = 0; s < batch; ++s) {
    const int64_t ctx = a.ctx[s];
    if (a.rows[s] < 0 || static_cast<size_t>(a.rows[s]) >= r)
      throw std::out_of_range("decode_attention: rows[" + std::to_string(s) + "] is outside q");
    if (ctx < 1 || static_cast<size_t>(ctx) > a.max_blocks * a.block_size)
      throw std::invalid_argument("decode_attention: context_lens[" + std::to_string(s) + "] is out of range");
    for (size_t b = 0; b < (static_cast<size_t>(ctx) + a.block_size - 1) / a.block_size; ++b) {
      const int64_t blk = a.tables[s * a.max_blocks + b];
      if (blk < 0 || static_cast<size_t>(blk + 1) * a.block_size > a.num_slots)
        throw std::out_of_range("decode_attention: block table of sequence " + std::to_string(s) +
                                " references a block beyond the cache");
    }
  }
  a.simd = g_avx512 && a.dim % 16 == 0;
  std::vector<int64_t> table_of(batch);
  std::iota(table_of.begin(), table_of.end(), int64_t{0});
  a.table_of = table_of.data();
  run_tiles(a, make_tiles(a.rows, a.tables, a.table_of, a.ctx, batch, a.max_blocks, a.block_size), num_threads);
}

// One step's single-token sequences, checked once and reused by every layer's call: a decode step
// calls the kernel once per layer, and converting and re-checking seven arrays each time cost
// several times the kernel's own work at short contexts.
class DecodeBatch {
 public:
  // table_rows[s] names the row of block_tables that entry s uses (None: row s), so the rows of a
  // long chunk share one table instead of a copy each.
  DecodeBatch(nb::ndarray<nb::ro> rows, nb::ndarray<nb::ro> block_tables, nb::ndarray<nb::ro> context_lens,
              int64_t block_size, int64_t num_rows, int64_t num_slots,
              std::optional<nb::ndarray<nb::ro>> table_rows) {
    const int64_t* r = checked<int64_t>(rows, "rows", 1);
    const int64_t* t = checked<int64_t>(block_tables, "block_tables", 2);
    const int64_t* c = checked<int64_t>(context_lens, "context_lens", 1);
    if (block_size < 1) throw std::invalid_argument("decode_attention: block_size must be >= 1");
    if (num_rows < 0 || num_slots < 0) throw std::invalid_argument("decode_attention: negative row or slot count");
    const size_t batch = rows.shape(0);
    const size_t num_tables = block_tables.shape(0);
    if (context_lens.shape(0) != batch || (!table_rows && num_tables != batch))
      throw std::invalid_argument("decode_attention: rows, block_tables and context_lens disagree on the batch");
    table_of_.resize(batch);
    if (table_rows) {
      const int64_t* tr = checked<int64_t>(*table_rows, "table_rows", 1);
      if (table_rows->shape(0) != batch)
        throw std::invalid_argument("decode_attention: table_rows and rows disagree on the batch");
      for (size_t s = 0; s < batch; ++s) {
        if (tr[s] < 0 || static_cast<size_t>(tr[s]) >= num_tables)
          throw std::out_of_range("decode_attention: table_rows[" + std::to_string(s) + "] is outside block_tables");
        table_of_[s] = tr[s];
      }
      shared_tables_ = true;
    } else {
      std::iota(table_of_.begin(), table_of_.end(), int64_t{0});
    }
    block_size_ = static_cast<size_t>(block_size);
    max_blocks_ = block_tables.shape(1);
    num_rows_ = static_cast<size_t>(num_rows);
    num_slots_ = static_cast<size_t>(num_slots);
    rows_.assign(r, r + batch);
    tables_.assign(t, t + num_tables * max_blocks_);
    ctx_.assign(c, c + batch);
    for (size_t s = 0; s < batch; ++s) {
      const int64_t ctx = ctx_[s];
      if (rows_[s] < 0 || static_cast<size_t>(rows_[s]) >= num_rows_)
        throw std::out_of_range("decode_attention: rows[" + std::to_string(s) + "] is outside q");
      if (ctx < 1 || static_cast<size_t>(ctx) > max_blocks_ * block_size_)
        throw std::invalid_argument("decode_attention: context_lens[" + std::to_string(s) + "] is out of range");
      for (size_t b = 0; b < (static_cast<size_t>(ctx) + block_size_ - 1) / block_size_; ++b) {
        const int64_t blk = tables_[static_cast<size_t>(table_of_[s]) * max_blocks_ + b];
        if (blk < 0 || static_cast<size_t>(blk + 1) * block_size_ > num_slots_)
          throw std::out_of_range("decode_attention: block table of sequence " + std::to_string(s) +
                                  " references a block beyond the cache");
      }
    }
    tiles_ = make_tiles(rows_.data(), tables_.data(), table_of_.data(), ctx_.data(), batch, max_blocks_, block_size_);
  }

  // The kernel on raw addresses: q [num_rows, heads, dim], caches [num_slots, kv_heads, dim], out
  // [num_rows, heads*dim], float32, C-contiguous; the caller checks them and keeps them alive.
  void run(uintptr_t q, uintptr_t k_cache, uintptr_t v_cache, uintptr_t out, int64_t heads, int64_t kv_heads,
           int64_t dim, double scale, int num_threads) const {
    if (!q || !k_cache || !v_cache || !out) throw std::invalid_argument("decode_attention: null address");
    if (heads < 1 || kv_heads < 1 || dim < 1 || heads % kv_heads)
      throw std::invalid_argument("decode_attention: query heads must be a positive multiple of kv heads");
    Args a{};
    a.q = reinterpret_cast<const float*>(q);
    a.k = reinterpret_cast<const float*>(k_cache);
    a.v = reinterpret_cast<const float*>(v_cache);
    a.out = reinterpret_cast<float*>(out);
    a.rows = rows_.data();
    a.tables = tables_.data();
    a.table_of = table_of_.data();
    a.ctx = ctx_.data();
    a.max_blocks = max_blocks_;
    a.block_size = block_size_;
    a.heads = static_cast<size_t>(heads);
    a.kv_heads = static_cast<size_t>(kv_heads);
    a.dim = static_cast<size_t>(dim);
    a.num_slots = num_slots_;
    a.scale = static_cast<float>(scale);
    a.simd = g_avx512 && a.dim % 16 == 0;
    run_tiles(a, tiles_, num_threads);
  }

  // Multi-head latent attention decode, weight-absorbed (kernels/attention_mla.h), on raw addresses:
  // q_nope and q_rope rows and heads at the given strides (in floats; each head's nope or rope
  // values contiguous), cache [num_slots, lora + rope], kv_b [heads * (nope + v), lora], out
  // [num_rows, heads * v]; float32, checked and kept alive by the caller.
  void run_mla(uintptr_t q_nope, uintptr_t q_rope, uintptr_t cache, uintptr_t kv_b, uintptr_t out, int64_t heads,
               int64_t nope, int64_t rope, int64_t lora, int64_t v, double scale, int num_threads,
               int64_t qn_row, int64_t qn_head, int64_t qr_row, int64_t qr_head) const {
    MlaArgs a = mla_args("mla_decode", q_nope, q_rope, cache, kv_b, out, heads, nope, rope, lora, v, scale, qn_row,
                         qn_head, qr_row, qr_head);
    a.rows = rows_.data();
    a.tables = entry_tables().data();
    a.ctx = ctx_.data();
    a.batch = rows_.size();
    a.max_blocks = max_blocks_;
    a.block_size = block_size_;
    nb::gil_scoped_release release;
    parallel_for(num_threads, a.heads, [&](size_t h) {
      thread_local std::vector<float> buf;
      if (g_avx512)
        mla_head_avx512(a, h, buf);
      else if (g_avx2)
        mla_head_avx2(a, h, buf);
      else
        mla_head_portable(a, h, buf);
    });
  }

 private:
  // One table per entry, as the latent-attention kernel reads them (built on first use when entries share).
  const std::vector<int64_t>& entry_tables() const {
    if (!shared_tables_) return tables_;
    if (entry_tables_.empty()) {
      entry_tables_.resize(rows_.size() * max_blocks_);
      for (size_t s = 0; s < rows_.size(); ++s)
        std::copy_n(tables_.begin() + table_of_[s] * static_cast<int64_t>(max_blocks_), max_blocks_,
                    entry_tables_.begin() + s * max_blocks_);
    }
    return entry_tables_;
  }

  std::vector<int64_t> rows_, tables_, ctx_, table_of_;
  mutable std::vector<int64_t> entry_tables_;
  bool shared_tables_ = false;
  std::vector<Tile> tiles_;
  size_t block_size_ = 1, max_blocks_ = 0, num_rows_ = 0, num_slots_ = 0;
};

}  // namespace

void register_attention(nb::module_& m) {
  nb::class_<DecodeBatch>(m, "DecodeBatch",
                          "One step's single-token sequences for decode_attention, checked once and run per "
                          "layer on raw addresses.")
      .def(nb::init<nb::ndarray<nb::ro>, nb::ndarray<nb::ro>, nb::ndarray<nb::ro>, int64_t, int64_t, int64_t,
                    std::optional<nb::ndarray<nb::ro>>>(),
           nb::arg("rows"), nb::arg("block_tables"), nb::arg("context_lens"), nb::arg("block_size"),
           nb::arg("num_rows"), nb::arg("num_slots"), nb::arg("table_rows").none() = nb::none())
      .def("run", &DecodeBatch::run, nb::arg("q"), nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("out"),
           nb::arg("heads"), nb::arg("kv_heads"), nb::arg("dim"), nb::arg("scale"), nb::arg("num_threads") = 1,
           "decode_attention on raw addresses (q [num_rows, heads, dim], caches [num_slots, kv_heads, dim], "
           "out [num_rows, heads*dim], float32, C-contiguous); the GIL is released.")
      .def("run_mla", &DecodeBatch::run_mla, nb::arg("q_nope"), nb::arg("q_rope"), nb::arg("cache"), nb::arg("kv_b"),
           nb::arg("out"), nb::arg("heads"), nb::arg("nope"), nb::arg("rope"), nb::arg("lora"), nb::arg("v"),
           nb::arg("scale"), nb::arg("num_threads"), nb::arg("qn_row"), nb::arg("qn_head"), nb::arg("qr_row"),
           nb::arg("qr_head"),
           "Multi-head latent attention decode in the weight-absorbed form on raw addresses (q_nope and q_rope "
           "rows and heads at the given float strides, latent cache [num_slots, lora + rope], kv_b_proj "
           "[heads * (nope + v), lora], out [num_rows, heads * v]; float32); the GIL is released.");
  m.def("decode_attention", &decode_attention, nb::arg("q"), nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("out"),
        nb::arg("rows"), nb::arg("block_tables"), nb::arg("context_lens"), nb::arg("block_size"), nb::arg("scale"),
        nb::arg("num_threads") = 1,
        "Single-token attention for a batch of sequences over the paged KV cache (float32, GQA); writes "
        "out[rows[i]] for each sequence i. The GIL is released.");
}

}  // namespace agent_infer
