// Batch-invariant CPU linear layer over packed (quantized or fp32) weights: y[M, N] = x[M, K] @ W^T.
//
// Layout: output columns are packed in groups of 16 (one AVX-512 vector); inside a group the weights
// are stored k-major so a vector holds one k for 16 columns. Every output element is therefore a
// single fused-multiply-add chain over k = 0..K-1 in order, starting from +0. Nothing about M, the
// row tile, the column tile, the thread that runs it or even the ISA (AVX-512, AVX2+FMA, scalar
// std::fma) changes that chain, so a row's result is bit-identical in any batch — invariance holds
// by construction, not by measurement. Dequantization reproduces the torch loader's fp32 values
// exactly (Q4_1/Q4_K: fl(fl(q*d)+m); Q8_0/Q4_0/Q5_0/Q6_K: fl(q*d), see kernels/linear_blocks.h); this
// file is built with -ffp-contract=off so the compiler cannot fuse those two roundings into one.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <string>
#include <vector>

#include "bindings/bindings.h"
#include "kernels/linear_moe.h"
#include "kernels/linear_packed.h"

namespace nb = nanobind;

namespace agent_infer {
namespace {

const char* isa_name(int isa) { return isa == kAvx512 ? "avx512" : isa == kAvx2 ? "avx2" : "scalar"; }

}  // namespace

void register_linear(nb::module_& m) {
  nb::class_<PackedLinear>(m, "PackedLinear",
                           "Weights [N, K] repacked from GGUF bytes (F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q5_0/Q4_K/Q6_K) for a "
                           "batch-invariant CPU linear layer.")
      .def(nb::init<nb::ndarray<nb::ro>, int, int64_t, int64_t, bool>(), nb::arg("raw"), nb::arg("ggml_type"),
           nb::arg("n"), nb::arg("k"), nb::arg("q8_activations") = false,
           "Pack ``n`` rows of ``k`` weights given as the tensor's raw GGUF bytes (uint8, row-major). "
           "``q8_activations`` (quantized weights only): quantize x per block of 32 to int8 and take "
           "exact integer block dot products (see kernels/linear_q8.h); batch invariant, not equal to fp32.")
      .def("forward", &PackedLinear::forward, nb::arg("x"), nb::arg("out"), nb::arg("num_threads") = 1,
           "out[M, N] = x[M, K] @ W^T (float32, C-contiguous); the GIL is released.")
      .def("forward_raw", &PackedLinear::forward_raw, nb::arg("x"), nb::arg("m"), nb::arg("out"),
           nb::arg("num_threads") = 1, nb::arg("ldx") = 0, nb::arg("ldy") = 0,
           "forward() on raw addresses (x [m, K], out [m, N], float32, rows ``ldx`` and ``ldy`` floats apart, "
           "0 for contiguous; the caller checks and keeps both alive); the GIL is released.")
      .def("forward_raw_norm", &PackedLinear::forward_raw_norm, nb::arg("x"), nb::arg("m"), nb::arg("out"),
           nb::arg("weight"), nb::arg("eps"), nb::arg("num_threads") = 1, nb::arg("ldx") = 0,
           "forward_raw() of rms_norm(x) * weight (``weight``: K float32 at that address; row r of x at "
           "x + 4 * r * ldx, ``ldx`` 0 for K); the GIL is released.")
      .def("forward_allowed", &PackedLinear::forward_allowed, nb::arg("x"), nb::arg("out"), nb::arg("allowed"),
           nb::arg("num_threads") = 1,
           "forward() for the 16-column groups some row of the int32 token bitmask ``allowed`` [M, W] "
           "allows; the other groups' columns are set to -inf. Returns the number of groups computed.")
      .def("unpack_raw", &PackedLinear::unpack_raw, nb::arg("out"),
           "Write the weights [N, K] of a float layer (F32/F16/BF16 packed) as float32 rows at address ``out`` "
           "(the caller checks its size); ValueError for a quantized layer.")
      .def_prop_ro("n", &PackedLinear::n)
      .def_prop_ro("k", &PackedLinear::k)
      .def_prop_ro("ggml_type", &PackedLinear::ggml_type)
      .def_prop_ro("q8_activations", &PackedLinear::q8_activations)
      .def_prop_ro("nbytes", &PackedLinear::nbytes);
  nb::class_<PackedExperts>(m, "PackedExperts",
                            "A MoE layer's routed SwiGLU experts (and optional shared ones) over PackedLinear "
                            "weights, run in one batch-invariant call (see kernels/linear_moe.h).")
      .def(nb::init<std::vector<const PackedLinear*>, std::vector<const PackedLinear*>, const PackedLinear*,
                    const PackedLinear*>(),
           nb::arg("gate_up"), nb::arg("down"), nb::arg("shared_gate_up").none(), nb::arg("shared_down").none(),
           nb::keep_alive<1, 2>(), nb::keep_alive<1, 3>(), nb::keep_alive<1, 4>(), nb::keep_alive<1, 5>(),
           "Per expert e: gate_up[e] [2 I, H] (gate rows, then up rows) and down[e] [H, I], float activations; "
           "the shared experts' pair, or None for both.")
      .def("forward", &PackedExperts::forward, nb::arg("x"), nb::arg("t"), nb::arg("experts"), nb::arg("weights"),
           nb::arg("k"), nb::arg("out"), nb::arg("limit"), nb::arg("num_threads") = 1,
           "out [t, H] = per token, in ascending expert order, the sum of weight * expert(x), then plus the "
           "shared experts; raw addresses of x [t, H] float32, experts [t, k] int64, weights [t, k] float32 "
           "and out [t, H] float32, all C-contiguous (the caller checks them and keeps them alive). "
           "``limit``: the SwiGLU clamp, NaN for none. Raises IndexError for an expert id out of range.")
      .def("forward_routed", &PackedExperts::forward_routed, nb::arg("router"), nb::arg("x"), nb::arg("t"),
           nb::arg("fixed"), nb::arg("out"), nb::arg("limit"), nb::arg("num_threads") = 1, nb::arg("norm") = 0,
           nb::arg("eps") = 0.0f, nb::arg("ldx") = 0,
           "forward() over the experts and weights ``router`` picks for x [t, H] (``fixed``: the address of a "
           "hash-routed layer's experts [t, k] int64, or 0); with ``norm`` (the address of H float32 weights) "
           "x's rows (``ldx`` floats apart, 0 for H) are RMS-normalized first; raw addresses as for forward().")
      .def_prop_ro("num_experts", &PackedExperts::num_experts)
      .def_prop_ro("hidden", &PackedExperts::hidden);
  nb::class_<PackedRouter>(m, "PackedRouter",
                           "A MoE layer's router over a packed gate [E, H] (see kernels/linear_router.h).")
      .def(nb::init<const PackedLinear*, const std::string&, std::vector<float>, int64_t, int64_t, int64_t, bool,
                    double>(),
           nb::arg("gate"), nb::arg("scoring"), nb::arg("bias"), nb::arg("groups"), nb::arg("topk_groups"),
           nb::arg("top_k"), nb::arg("renormalize"), nb::arg("scaling"), nb::keep_alive<1, 2>(),
           "``scoring``: softmax, sigmoid or sqrtsoftplus; ``bias``: the correction bias per expert (empty: none).")
      .def(
          "route",
          [](const PackedRouter& r, uintptr_t x, size_t t, uintptr_t fixed, uintptr_t experts, uintptr_t weights) {
            if (t == 0) return;
            if (!x || !experts || !weights) throw std::invalid_argument("PackedRouter.route: null address");
            r.route(reinterpret_cast<const float*>(x), t, reinterpret_cast<const int64_t*>(fixed),
                    reinterpret_cast<int64_t*>(experts), reinterpret_cast<float*>(weights));
          },
          nb::arg("x"), nb::arg("t"), nb::arg("fixed"), nb::arg("experts"), nb::arg("weights"),
          "experts [t, k] int64 and weights [t, k] float32 of x [t, H] float32 (raw addresses, C-contiguous; "
          "``fixed``: hash-routed experts [t, k] int64, or 0).")
      .def_prop_ro("num_experts", &PackedRouter::num_experts)
      .def_prop_ro("top_k", &PackedRouter::top_k);
  m.def(
      "rms_norm_rows",
      [](uintptr_t x, size_t m, size_t k, size_t ldx, uintptr_t w, float eps, uintptr_t out) {
        if (m == 0) return;
        if (!x || !w || !out) throw std::invalid_argument("rms_norm_rows: null address");
        if (ldx == 0) ldx = k;
        if (ldx < k) throw std::invalid_argument("rms_norm_rows: row stride below K");
        rms_norm_rows(reinterpret_cast<const float*>(x), m, k, ldx, reinterpret_cast<const float*>(w), eps,
                      reinterpret_cast<float*>(out));
      },
      nb::arg("x"), nb::arg("m"), nb::arg("k"), nb::arg("ldx"), nb::arg("weight"), nb::arg("eps"), nb::arg("out"),
      "out [m, k] = rms_norm(x) * weight, the fused norm of forward_raw_norm and PackedExperts.forward_routed "
      "(raw float32 addresses; x's rows ``ldx`` floats apart, 0 for k): a rank that routes its tokens "
      "elsewhere normalizes them with the same bits.");
  m.def("linear_isa", [] { return std::string(isa_name(g_isa.load())); },
        "The instruction set PackedLinear uses now: 'avx512', 'avx2' or 'scalar'.");
  m.def(
      "linear_set_isa",
      [](const std::string& name) {
        int want;
        if (name == "avx512")
          want = kAvx512;
        else if (name == "avx2")
          want = kAvx2;
        else if (name == "scalar")
          want = kScalar;
        else if (name == "best")
          want = g_best_isa;
        else
          throw std::invalid_argument("linear_set_isa: unknown ISA '" + name + "' (avx512, avx2, scalar, best)");
        if (want > g_best_isa)
          throw std::invalid_argument("linear_set_isa: this CPU does not support " + name);
        g_isa.store(want);
      },
      nb::arg("name"), "Force an instruction set (for tests): results are identical on every ISA.");
}

}  // namespace agent_infer
