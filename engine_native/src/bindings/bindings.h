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
}  // namespace agent_infer
