// The lowering's part of run-time checks (grammar/runtime_checks.h): a check rule's automaton, the
// shadow copies of the rules its non-carrier items reach, and the tables the matcher and the
// token walks read (grammar/lower/runtime_checks.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "grammar/lower/automata.h"

namespace agent_infer {
namespace grammar {

// A check as its CHECK instruction states it, with rule indices as the lowering knows them.
struct CheckSpec {
  int32_t rule = -1;
  int32_t carriers = 0;
  bool product = false;  // compiled to one automaton (build_check_product), never decided at run time
  std::vector<int32_t> items;
  std::vector<uint32_t> accept;
};

// Reads the CHECK instruction that is `code`'s whole body; throws DefinitionError when it is
// malformed or names a rule outside [0, num_rules).
CheckSpec read_check(const std::vector<int32_t>& code, int32_t rule, size_t num_rules);

// Appends the automaton of a check rule (start, a reference to each carrier, one final state)
// to `pool` and returns its start state.
int32_t lower_check(const CheckSpec& spec, DfaPool* pool);

// Appends to `pool` one automaton over bytes for the check `spec`: the product of its items'
// automata (the rules they call expanded, as a pushdown walk would), whose final states are the
// ends where the carriers' span is accepted, less the states from which no such end is reachable.
// Returns its start state, or -1 when an item recurses (calls past kMaxProductDepth) or reaches an
// undecided check, or the product passes kMaxProductStates (`why` says which; `blocked`: only
// because an item reaches a product not built yet, so it may be built once that one is). `base`/`count`:
// the rules' states in `pool`; `undecided[r]`: rule r is a check decided at run time (1), a
// product not built yet (2), or a unique array item or max-length string the matcher counts (3):
// such a rule stays a call, and the product fails where it would have to be expanded.
int32_t build_check_product(const CheckSpec& spec, const std::vector<int32_t>& base, const std::vector<uint32_t>& count,
                            const std::vector<uint8_t>& undecided, DfaPool* pool, Deadline* deadline,
                            std::string* why, bool* blocked);

// Copies, after the rules in [0, base.size()) are built, every rule the shadow items of `checks`
// reach (through references, and through the items of checks they reach) to a new rule past the
// others, its references renamed to the copies; the checks' shadow items (and those of copied
// checks, appended to `checks`) then name the copies. `base`/`count` give each rule's states in
// `pool` (base -1: not built) and grow with the copies; `copied_from` receives the rule each copy
// copies (in copy order); returns the index of the first copy.
int32_t copy_shadow_rules(std::vector<CheckSpec>* checks, DfaPool* pool, std::vector<int32_t>* base,
                          std::vector<uint32_t>* count, std::vector<int32_t>* copied_from);

}  // namespace grammar
}  // namespace agent_infer
