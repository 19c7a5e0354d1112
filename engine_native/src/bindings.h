#pragma once
#include <nanobind/nanobind.h>

namespace agent_infer {
// Token bitmask kernels (apply a [batch, ceil(vocab/32)] int32 mask to logits).
void register_bitmask(nanobind::module_& m);
// Grammar compiler and matcher.
void register_grammar(nanobind::module_& m);
// Batch-invariant packed-weight CPU linear layer.
void register_linear(nanobind::module_& m);
// Paged decode attention over the KV cache.
void register_attention(nanobind::module_& m);
}  // namespace agent_infer
