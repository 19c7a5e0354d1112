// Entry point of the agent_infer._native extension. Each subsystem registers its bindings
// through a function declared in bindings/bindings.h, so files stay one concept each.
#include <nanobind/nanobind.h>

#include "bindings/bindings.h"

namespace nb = nanobind;

NB_MODULE(_native, m) {
  m.doc() = "agent-infer native core (grammar matcher, token bitmask kernels)";
  m.attr("ABI_VERSION") = 1;
  agent_infer::register_bitmask(m);
  agent_infer::register_grammar(m);
  agent_infer::register_grammar_profile(m);
  agent_infer::register_step_fill(m);
  agent_infer::register_grammar_serialize(m);
  agent_infer::register_linear(m);
  agent_infer::register_attention(m);
  agent_infer::register_rope(m);
  agent_infer::register_argmax(m);
  agent_infer::register_hyper(m);
  agent_infer::register_attention_v4(m);
  agent_infer::register_compressor(m);
  agent_infer::register_attention_mla_rows(m);
}
