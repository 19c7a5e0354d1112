// Grammar matcher bindings: owned by the grammar core (see docs/grammar_engine.md).
#include "bindings.h"

namespace agent_infer {
void register_grammar(nanobind::module_& m) {}
}  // namespace agent_infer
