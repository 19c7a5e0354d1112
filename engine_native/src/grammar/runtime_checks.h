// Run-time checks (ir.nodes.Check, the CHECK instruction of grammar/ir/program.h): a span that
// its carrier rules scan, kept only when the set of its item rules whose language holds the span
// is one of the accepted sets. `oneOf` with overlapping branches, `not` without a written
// complement and `allOf` products too large to multiply out are such checks.
//
// The lowering (grammar/lower/runtime_checks.cpp) gives a check rule the automaton
// start -> carrier -> final, copies the rules its other items (shadows) reach, so that their
// Earley items never make a byte viable, and fills the tables below. The matcher
// (grammar/match/verdicts.cpp) predicts a check's shadows with it, records which item rules
// finish over which spans, and completes a check only when, the Earley set closed, its span's
// membership is accepted. The token walks leave a token "uncertain" where a check may end inside
// it (grammar/mask/state_mask.cpp, pushdown_walk.cpp), and the run-time check of such tokens
// runs real Earley steps.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace agent_infer {
namespace grammar {

struct RuntimeCheck {
  int32_t rule = -1;
  int32_t carriers = 0;
  std::vector<int32_t> items;    // carrier rules, then shadow rules (copies in the shadow parse)
  std::vector<uint32_t> accept;  // sorted membership sets: bit i for items[i]
  // Nesting at one origin: a check whose item begins with another check ranks above it, and the
  // matcher decides checks of one origin lowest rank first.
  int32_t rank = 0;
  bool accepts(uint32_t members) const { return std::binary_search(accept.begin(), accept.end(), members); }
};

// The checks of one compiled grammar; every vector is empty when it has none.
struct RuntimeChecks {
  std::vector<RuntimeCheck> list;
  std::vector<int32_t> of_rule;   // per rule: its index in `list`, or -1
  std::vector<uint8_t> item;      // per rule: an item of some check (its finishes are recorded)
  std::vector<uint8_t> shadow;    // per state: in a shadow copy (never makes a byte viable)
  // Per state: final with nothing to read or call, in a rule that may be the last part of a
  // check's item. A token ending here has a viable parse only if the check passes, which its
  // classification cannot know: it is left uncertain.
  std::vector<uint8_t> end;
  // Per rule: a check rule, a rule that may end a check's item, or one that may call a check.
  // Its states' masks come from the check-aware plain and pushdown walks alone, and are kept per
  // grammar (no shared cache, no region, piece, twin or short-token reuse).
  std::vector<uint8_t> affected;
  int32_t first_shadow_rule = 0;  // rules from here on are shadow copies
  bool any() const { return !list.empty(); }
};

}  // namespace grammar
}  // namespace agent_infer
