#pragma once
#include <nanobind/nanobind.h>

namespace agent_infer {
// Token bitmask kernels (apply a [batch, ceil(vocab/32)] int32 mask to logits).
void register_bitmask(nanobind::module_& m);
// Grammar compiler and matcher.
void register_grammar(nanobind::module_& m);
// The engine step's mask fill on a native thread (grammar/batch/step_fill.h).
void register_step_fill(nanobind::module_& m);
// Opt-in mask-time profile of the grammar core (grammar/mask/profile.cpp).
void register_grammar_profile(nanobind::module_& m);
// IR grammar -> flat rule programs, the fast path of compiler.serialize_grammar (bindings/serialize_bindings.cpp).
void register_grammar_serialize(nanobind::module_& m);
// Batch-invariant packed-weight CPU linear layer.
void register_linear(nanobind::module_& m);
// Paged decode attention over the KV cache.
void register_attention(nanobind::module_& m);
// Rotary position embedding in place on raw addresses (kernels/rope.cpp).
void register_rope(nanobind::module_& m);
// Row-wise argmax of float32 logits, torch.argmax's rule (kernels/argmax.cpp).
void register_argmax(nanobind::module_& m);
// DeepSeek V4 hyper-connections per row: collapse, expand, final head (kernels/hyper.cpp).
void register_hyper(nanobind::module_& m);
// DeepSeek V4 decode attention over the compressed paged layout (kernels/attention_v4.cpp).
void register_attention_v4(nanobind::module_& m);
// DeepSeek V4's KV compressor for the windows decode rows complete (kernels/compressor.cpp).
void register_compressor(nanobind::module_& m);
// DeepSeek V3 absorbed MLA for chunks of query rows, bit-identical to decode (kernels/attention_mla_rows.cpp).
void register_attention_mla_rows(nanobind::module_& m);
}  // namespace agent_infer
