#pragma once
// PackedLinear: the packed weights and their batch-invariant forward (see kernels/linear.cpp for
// the layout and the invariance argument). Included by kernels/linear.cpp only, which is built
// with -ffp-contract=off.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernels/linear_blocks.h"
#include "kernels/linear_q8.h"
#include "kernels/linear_tiles.h"
#include "kernels/parallel.h"

namespace nb = nanobind;

namespace agent_infer {
namespace {

constexpr size_t kQ8SerialMacs = size_t{1} << 21;

// h = (x * r) * w per row, r = float(1 / sqrt(sum(x^2) / K + eps)) with the sum of squares in
// double over 8 interleaved partial sums combined in a fixed tree: one order whether or not the
// compiler vectorizes the loop, so every row's bits are its own.
void rms_norm_rows(const float* x, size_t m, size_t k, size_t ldx, const float* w, float eps, float* h) {
  for (size_t r = 0; r < m; ++r) {
    const float* xr = x + r * ldx;
    double acc[8] = {};
    size_t i = 0;
    for (; i + 8 <= k; i += 8)
      for (int j = 0; j < 8; ++j) acc[j] += static_cast<double>(xr[i + j]) * static_cast<double>(xr[i + j]);
    for (; i < k; ++i) acc[i % 8] += static_cast<double>(xr[i]) * static_cast<double>(xr[i]);
    const double total = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    const float inv = static_cast<float>(1.0 / std::sqrt(total / static_cast<double>(k) + static_cast<double>(eps)));
    float* hr = h + r * k;
    for (size_t c = 0; c < k; ++c) hr[c] = (xr[c] * inv) * w[c];
  }
}

struct FreeDeleter {
  void operator()(uint8_t* p) const { std::free(p); }
};

class PackedLinear {
 public:
  PackedLinear(nb::ndarray<nb::ro> raw, int ggml_type, int64_t n, int64_t k, bool q8_activations)
      : ggml_type_(ggml_type), q8_(q8_activations) {
    if (n <= 0 || k <= 0) throw std::invalid_argument("PackedLinear: n and k must be positive");
    n_ = static_cast<size_t>(n);
    k_ = static_cast<size_t>(k);
    switch (ggml_type) {
      case kGgmlF32: case kGgmlF16: case kGgmlBF16: fmt_ = kF32; break;
      case kGgmlQ8_0: case kGgmlQ4_0: case kGgmlQ5_0: fmt_ = kQ8; break;
      case kGgmlQ4_1: case kGgmlQ4_K: fmt_ = kQ4; break;
      case kGgmlQ6_K: fmt_ = kQ6; break;
      default:
        throw std::invalid_argument("PackedLinear: unsupported ggml type " + std::to_string(ggml_type) +
                                    " (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K)");
    }
    if (q8_ && fmt_ == kF32)
      throw std::invalid_argument(
          "PackedLinear: int8 activations need quantized weights (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K), not ggml type " +
          std::to_string(ggml_type));
    const size_t qblock = ggml_type == kGgmlQ4_K || ggml_type == kGgmlQ6_K ? 256 : 32;
    if (fmt_ != kF32 && k_ % qblock)
      throw std::invalid_argument("PackedLinear: k = " + std::to_string(k_) +
                                  " is not a multiple of the quantization block (" + std::to_string(qblock) + ")");
    const size_t row_bytes = row_bytes_of(ggml_type, k_);
    if (raw.dtype() != nb::dtype<uint8_t>()) throw nb::type_error("PackedLinear: raw weights must be a uint8 array");
    if (raw.device_type() != nb::device::cpu::value) throw std::invalid_argument("PackedLinear: raw weights must be on the CPU");
    if (raw.ndim() != 1 || (raw.shape(0) > 1 && raw.stride(0) != 1))
      throw std::invalid_argument("PackedLinear: raw weights must be a contiguous 1-D byte array");
    if (raw.shape(0) != n_ * row_bytes)
      throw std::invalid_argument("PackedLinear: raw weights have " + std::to_string(raw.shape(0)) +
                                  " bytes, expected " + std::to_string(n_ * row_bytes) + " for " +
                                  std::to_string(n_) + " rows of " + std::to_string(k_));
    groups_ = (n_ + kLanes - 1) / kLanes;
    gstride_ = fmt_ == kF32   ? k_ * kLanes * 4
               : fmt_ == kQ8 ? (k_ / 32) * kQ8Block
               : fmt_ == kQ6 ? (k_ / 32) * kQ6Block
                             : (k_ / 32) * kQ4Block;
    const size_t bytes = (groups_ * gstride_ + 63) / 64 * 64;
    data_.reset(static_cast<uint8_t*>(std::aligned_alloc(64, bytes)));
    if (!data_) throw std::bad_alloc();
    std::memset(data_.get(), 0, bytes);  // padded columns: zero weights, never stored
    const uint8_t* src = static_cast<const uint8_t*>(raw.data());
    nb::gil_scoped_release release;
    for (size_t row = 0; row < n_; ++row) pack_row(src + row * row_bytes, row);
  }

  // y = x @ W^T into `out` ([M, N] float32, contiguous); num_threads <= 0 means one thread.
  void forward(nb::ndarray<nb::ro> x, nb::ndarray<> out, int num_threads) const {
    check_io(x, out);
    run(static_cast<const float*>(x.data()), x.shape(0), static_cast<float*>(out.data()), num_threads);
  }

  // forward() on raw addresses: the caller guarantees x is [m, K] and out [m, N], float32,
  // C-contiguous and alive for the call. A decode step makes ~120 of these calls; converting two
  // tensors per call costs more than a one-row Q4 group's compute.
  void forward_raw(uintptr_t x, size_t m, uintptr_t out, int num_threads, size_t ldx, size_t ldy) const {
    if (m == 0) return;
    if (x == 0 || out == 0) throw std::invalid_argument("PackedLinear.forward_raw: null address");
    run(reinterpret_cast<const float*>(x), m, reinterpret_cast<float*>(out), num_threads, ldx, ldy);
  }

  // forward_raw() of rms_norm(x) * weight (weight: K float32 at `w`): the decoder's norm before
  // qkv and gate_up, fused so a decode step skips 60 torch calls. The normalized rows live in this
  // thread's buffer; see rms_norm_rows for the fixed arithmetic (batch and ISA invariant).
  // Row r of x starts `ldx` floats after row r - 1 (0: K, contiguous rows), so a slice of a wider
  // projection's output can be normalized without a copy.
  void forward_raw_norm(uintptr_t x, size_t m, uintptr_t out, uintptr_t w, float eps, int num_threads,
                        size_t ldx) const {
    if (m == 0) return;
    if (x == 0 || out == 0 || w == 0) throw std::invalid_argument("PackedLinear.forward_raw_norm: null address");
    if (ldx == 0) ldx = k_;
    if (ldx < k_) throw std::invalid_argument("PackedLinear.forward_raw_norm: row stride below K");
    thread_local std::vector<float> h;
    if (h.size() < m * k_) h.resize(m * k_);
    rms_norm_rows(reinterpret_cast<const float*>(x), m, k_, ldx, reinterpret_cast<const float*>(w), eps, h.data());
    run(h.data(), m, reinterpret_cast<float*>(out), num_threads);
  }

  // Rows of x `ldx` floats apart (0: K), of y `ldy` apart (0: N); strided rows need float activations.
  void run(const float* xp, size_t m, float* yp, int num_threads, size_t ldx = 0, size_t ldy = 0) const {
    if (m == 0) return;
    ldx = ldx ? ldx : k_;
    ldy = ldy ? ldy : n_;
    if (ldx < k_ || ldy < n_) throw std::invalid_argument("PackedLinear: row strides below K or N");
    if (q8_ && ldx != k_) throw std::invalid_argument("PackedLinear: int8 activations need contiguous rows of x");
    const View v{data_.get(), gstride_, k_, n_};
    const int isa = g_isa.load(std::memory_order_relaxed);
    const size_t ng = groups_;
    const size_t chunks = (ng + kGroupChunk - 1) / kGroupChunk;
    int threads = static_cast<int>(std::clamp<size_t>(num_threads < 1 ? 1 : num_threads, 1, chunks));
    // An int8-activation call this small is memory-bound and over in ~20 us: waking a worker
    // costs about what it saves (measured on 2 cores, decode steps neutral to 4% faster).
    if (q8_ && m * n_ * k_ < kQ8SerialMacs) threads = 1;
    const int fmt = fmt_;
    nb::gil_scoped_release release;
    const QAct* qa = q8_ ? quantize(xp, m) : nullptr;
    parallel_for(threads, chunks, [&](size_t c) {
      const size_t gb = c * kGroupChunk;
      run_any(fmt, isa, v, gb, std::min(ng, gb + kGroupChunk), xp, qa, m, yp, ldx, ldy);
    });
  }

  // y = x @ W^T on the calling thread only (no pool, the GIL untouched): for work already split
  // across the pool by its caller. Float activations only (the caller checks q8_activations()).
  void run_serial(const float* xp, size_t m, float* yp) const {
    if (m == 0) return;
    const View v{data_.get(), gstride_, k_, n_};
    run_any(fmt_, g_isa.load(std::memory_order_relaxed), v, 0, groups_, xp, nullptr, m, yp, k_, n_);
  }

  // forward() restricted to the column groups (16 columns each) in which some row of `allowed`
  // has a bit set; every column of the other groups becomes -inf. `allowed` is an int32 token
  // bitmask [M, W] (bit j of word w = column 32w + j; columns past 32W count as disallowed), so a
  // constrained step reads only the output-projection weights of tokens the grammar can take.
  // Each computed column has its own FMA chain, so its value is bit-identical to forward()'s.
  // Returns the number of groups computed.
  size_t forward_allowed(nb::ndarray<nb::ro> x, nb::ndarray<> out, nb::ndarray<nb::ro> allowed,
                         int num_threads) const {
    check_io(x, out);
    if (allowed.dtype() != nb::dtype<int32_t>() || allowed.device_type() != nb::device::cpu::value ||
        allowed.ndim() != 2)
      throw std::invalid_argument("PackedLinear: allowed must be a 2-D int32 CPU bitmask");
    if (allowed.shape(0) != x.shape(0))
      throw std::invalid_argument("PackedLinear: allowed has " + std::to_string(allowed.shape(0)) +
                                  " rows, x has " + std::to_string(x.shape(0)));
    if ((allowed.shape(0) > 1 && allowed.stride(0) != static_cast<int64_t>(allowed.shape(1))) ||
        (allowed.shape(1) > 1 && allowed.stride(1) != 1))
      throw std::invalid_argument("PackedLinear: allowed must be C-contiguous");
    const size_t m = x.shape(0), words = allowed.shape(1);
    if (m == 0) return 0;
    const float* xp = static_cast<const float*>(x.data());
    float* yp = static_cast<float*>(out.data());
    const uint32_t* bits = static_cast<const uint32_t*>(allowed.data());
    const View v{data_.get(), gstride_, k_, n_};
    const int isa = g_isa.load(std::memory_order_relaxed);
    const size_t ng = groups_;
    const int fmt = fmt_;
    nb::gil_scoped_release release;
    std::vector<uint32_t> any(words, 0);
    for (size_t r = 0; r < m; ++r)
      for (size_t w = 0; w < words; ++w) any[w] |= bits[r * words + w];
    // Runs of needed groups, cut into chunks of at most kGroupChunk for the pool.
    std::vector<std::pair<size_t, size_t>> chunks;
    size_t computed = 0;
    auto needed = [&](size_t g) { return g / 2 < words && ((any[g / 2] >> (16 * (g & 1))) & 0xffffu) != 0; };
    for (size_t g = 0; g < ng;) {
      if (!needed(g)) {
        size_t e = g + 1;
        while (e < ng && !needed(e)) ++e;
        const size_t c0 = g * kLanes, c1 = std::min(n_, e * kLanes);
        for (size_t r = 0; r < m; ++r) std::fill(yp + r * n_ + c0, yp + r * n_ + c1, -INFINITY);
        g = e;
        continue;
      }
      size_t e = g + 1;
      while (e < ng && needed(e)) ++e;
      computed += e - g;
      for (size_t b = g; b < e; b += kGroupChunk) chunks.emplace_back(b, std::min(e, b + kGroupChunk));
      g = e;
    }
    if (chunks.empty()) return 0;
    const QAct* qa = q8_ ? quantize(xp, m) : nullptr;
    const int threads = static_cast<int>(std::clamp<size_t>(num_threads < 1 ? 1 : num_threads, 1, chunks.size()));
    parallel_for(threads, chunks.size(), [&](size_t c) {
      run_any(fmt, isa, v, chunks[c].first, chunks[c].second, xp, qa, m, yp, k_, n_);
    });
    return computed;
  }

  // The float32 weights [N, K] back from an F32-format layer into `out` (row-major, the caller
  // checks its size): packing widened the stored values exactly, so these are the loaded values,
  // and a holder can drop its own copy.
  void unpack_raw(uintptr_t out) const {
    if (fmt_ != kF32) throw std::invalid_argument("PackedLinear.unpack_raw: only float layers unpack");
    if (out == 0) throw std::invalid_argument("PackedLinear.unpack_raw: null address");
    float* dst = reinterpret_cast<float*>(out);
    for (size_t row = 0; row < n_; ++row) {
      const float* grp = reinterpret_cast<const float*>(data_.get() + (row / kLanes) * gstride_);
      for (size_t k = 0; k < k_; ++k) dst[row * k_ + k] = grp[k * kLanes + row % kLanes];
    }
  }

  size_t n() const { return n_; }
  size_t k() const { return k_; }
  int ggml_type() const { return ggml_type_; }
  bool q8_activations() const { return q8_; }
  size_t nbytes() const { return groups_ * gstride_; }

 private:
  // x [M, K] and out [M, N]: float32, CPU, C-contiguous.
  void check_io(const nb::ndarray<nb::ro>& x, const nb::ndarray<>& out) const {
    check_f32(x, "x");
    check_f32(out, "out");
    if (x.shape(1) != k_)
      throw std::invalid_argument("PackedLinear: x has " + std::to_string(x.shape(1)) + " columns, expected " +
                                  std::to_string(k_));
    if (out.shape(0) != x.shape(0) || out.shape(1) != n_)
      throw std::invalid_argument("PackedLinear: out must be [" + std::to_string(x.shape(0)) + ", " +
                                  std::to_string(n_) + "]");
  }

  static void run_any(int fmt, int isa, const View& v, size_t gb, size_t ge, const float* xp, const QAct* qa,
                      size_t m, float* yp, size_t ldx, size_t ldy) {
    if (qa) {
      const bool vnni = isa == kAvx512 && g_has_vnni;
      if (fmt == kQ8)
        q8_run_range<kQ8>(isa, vnni, v, gb, ge, *qa, m, yp, ldy);
      else if (fmt == kQ6)
        q8_run_range<kQ6>(isa, vnni, v, gb, ge, *qa, m, yp, ldy);
      else
        q8_run_range<kQ4>(isa, vnni, v, gb, ge, *qa, m, yp, ldy);
    } else if (fmt == kF32)
      run_range<kF32>(isa, v, gb, ge, xp, m, yp, ldx, ldy);
    else if (fmt == kQ8)
      run_range<kQ8>(isa, v, gb, ge, xp, m, yp, ldx, ldy);
    else if (fmt == kQ6)
      run_range<kQ6>(isa, v, gb, ge, xp, m, yp, ldx, ldy);
    else
      run_range<kQ4>(isa, v, gb, ge, xp, m, yp, ldx, ldy);
  }

  template <typename Array>  // nb::ndarray<> or nb::ndarray<nb::ro>
  static void check_f32(const Array& a, const char* name) {
    if (a.dtype() != nb::dtype<float>())
      throw nb::type_error((std::string("PackedLinear: ") + name + " must be float32").c_str());
    if (a.device_type() != nb::device::cpu::value)
      throw std::invalid_argument(std::string("PackedLinear: ") + name + " must be on the CPU");
    if (a.ndim() != 2) throw std::invalid_argument(std::string("PackedLinear: ") + name + " must be 2-D");
    if ((a.shape(0) > 1 && a.stride(0) != static_cast<int64_t>(a.shape(1))) || (a.shape(1) > 1 && a.stride(1) != 1))
      throw std::invalid_argument(std::string("PackedLinear: ") + name + " must be C-contiguous");
  }

  // x quantized into this thread's buffers (valid until its next call); the pool only reads them.
  const QAct* quantize(const float* xp, size_t m) const {
    thread_local std::vector<int8_t> xq;
    thread_local std::vector<float> dx, sx;
    thread_local std::vector<int32_t> corr, corr16;
    thread_local QAct qa;
    const size_t nb = k_ / 32;
    if (xq.size() < m * k_) xq.resize(m * k_);
    if (dx.size() < m * nb) {
      dx.resize(m * nb);
      sx.resize(m * nb);
      corr.resize(m * nb);
      corr16.resize(2 * m * nb);
    }
    quantize_rows(xp, m, k_, g_isa.load(std::memory_order_relaxed) == kAvx512, xq.data(), dx.data(), sx.data(),
                  corr.data(), corr16.data());
    qa = QAct{xq.data(), dx.data(), sx.data(), corr.data(), corr16.data(), k_, nb};
    return &qa;
  }

  void pack_row(const uint8_t* src, size_t row) {
    uint8_t* grp = data_.get() + (row / kLanes) * gstride_;
    const size_t c = row % kLanes;
    if (fmt_ == kF32) {
      float* dst = reinterpret_cast<float*>(grp);
      for (size_t k = 0; k < k_; ++k) {
        float v;
        if (ggml_type_ == kGgmlF32) {
          std::memcpy(&v, src + 4 * k, 4);
        } else if (ggml_type_ == kGgmlF16) {
          v = half_to_float(load_u16(src + 2 * k));
        } else {
          const uint32_t bits = static_cast<uint32_t>(load_u16(src + 2 * k)) << 16;
          std::memcpy(&v, &bits, 4);
        }
        dst[k * kLanes + c] = v;
      }
      return;
    }
    for (size_t b = 0; b < k_ / 32; ++b) {
      const Block32 blk32 = decode_block(ggml_type_, src, b);
      const int* q = blk32.q;
      const float d = blk32.d0, m = blk32.m;
      if (fmt_ == kQ6) {  // two scales per block; codes as kQ8's (q8: chunked, +128; fp32: k-major int8)
        uint8_t* blk = grp + b * kQ6Block;
        std::memcpy(blk + 4 * c, &blk32.d0, 4);
        std::memcpy(blk + 64 + 4 * c, &blk32.d1, 4);
        for (int k = 0; k < 32; ++k)
          if (q8_)
            blk[128 + (k / 4) * 64 + c * 4 + k % 4] = static_cast<uint8_t>(q[k] + 128);
          else
            blk[128 + k * kLanes + c] = static_cast<uint8_t>(static_cast<int8_t>(q[k]));
      } else if (q8_ && fmt_ == kQ8) {  // kernels/linear_q8.h's layout: chunk p, lane c holds q[4p..4p+3] + 128
        uint8_t* blk = grp + b * kQ8Block;
        std::memcpy(blk + 4 * c, &d, 4);
        for (int k = 0; k < 32; ++k) blk[64 + (k / 4) * 64 + c * 4 + k % 4] = static_cast<uint8_t>(q[k] + 128);
      } else if (q8_) {  // chunk p, lane c: q[8p+i] in the low nibble, q[8p+4+i] in the high one
        uint8_t* blk = grp + b * kQ4Block;
        std::memcpy(blk + 4 * c, &d, 4);
        std::memcpy(blk + 64 + 4 * c, &m, 4);
        for (int p = 0; p < 4; ++p)
          for (int i = 0; i < 4; ++i)
            blk[128 + p * 64 + c * 4 + i] = static_cast<uint8_t>(q[8 * p + i] | (q[8 * p + 4 + i] << 4));
      } else if (fmt_ == kQ8) {
        uint8_t* blk = grp + b * kQ8Block;
        std::memcpy(blk + 4 * c, &d, 4);
        for (int k = 0; k < 32; ++k) blk[64 + k * kLanes + c] = static_cast<uint8_t>(static_cast<int8_t>(q[k]));
      } else {
        uint8_t* blk = grp + b * kQ4Block;
        std::memcpy(blk + 4 * c, &d, 4);
        std::memcpy(blk + 64 + 4 * c, &m, 4);
        for (int j = 0; j < 16; ++j) blk[128 + j * kLanes + c] = static_cast<uint8_t>(q[2 * j] | (q[2 * j + 1] << 4));
      }
    }
  }

  int ggml_type_;
  bool q8_;
  int fmt_ = kF32;
  size_t n_ = 0, k_ = 0, groups_ = 0, gstride_ = 0;
  std::unique_ptr<uint8_t, FreeDeleter> data_;
};

}  // namespace
}  // namespace agent_infer
