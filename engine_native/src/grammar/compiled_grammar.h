// A compiled grammar: the program the lowering builds (grammar/lower/), one deterministic byte
// automaton per rule with the FOLLOW and escape sets the token walks test, and the mask component
// (grammar/mask/mask_strategies.h) that classifies the vocabulary per state. Design notes live in
// docs/grammar_engine.md.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "grammar/automaton.h"
#include "grammar/errors.h"
#include "grammar/mask/mask_strategies.h"
#include "grammar/mask/state_mask.h"
#include "grammar/mask/tokenizer_info.h"
#include "grammar/runtime_checks.h"

namespace agent_infer {
namespace grammar {

struct CheckSpec;
class BoundedTables;  // grammar/match/bounded.h

struct Limits {
  int64_t max_nfa_states = 2000000;
  int64_t max_dfa_states = 500000;
  double max_compile_seconds = 30.0;
  int64_t max_items_per_set = 200000;
  // Matching work (Earley items added plus items of origin sets scanned by completions) allowed
  // for one accepted byte, and for all the Earley steps of one token-mask fill. They bound the
  // cost of ambiguous grammars (`root ::= root root | "a"` is quadratic per byte), whose sets
  // stay small enough for max_items_per_set while completions rescan every earlier set.
  static constexpr int64_t kDefaultWorkPerByte = 1000000;
  static constexpr int64_t kDefaultWorkPerMask = 16000000;
  int64_t max_work_per_byte = kDefaultWorkPerByte;
  int64_t max_work_per_mask = kDefaultWorkPerMask;

  // The limits the Python compiler's arguments stand for (NFA states: 4x the DFA budget).
  static Limits from_args(int64_t max_states, double max_seconds, int64_t max_items,
                          int64_t max_work_byte = kDefaultWorkPerByte, int64_t max_work_mask = kDefaultWorkPerMask) {
    Limits lim;
    lim.max_nfa_states = max_states * 4;
    lim.max_dfa_states = max_states;
    // No budget (inf) is about three years: the deadlines convert seconds to integer microseconds
    // and add them to the clock, which inf or ~2^63 ns would overflow.
    lim.max_compile_seconds = std::min(max_seconds, 1e8);
    lim.max_items_per_set = max_items;
    lim.max_work_per_byte = max_work_byte;
    lim.max_work_per_mask = max_work_mask;
    return lim;
  }
};

class CompiledGrammar {
 public:
  CompiledGrammar(std::shared_ptr<TokenizerInfo> tok, const std::vector<std::vector<int32_t>>& rules,
                  int32_t root, const Limits& limits);
  // The same from programs it may rewrite in place (left in an unspecified state): merging equal
  // rules and outlining then copy no program.
  CompiledGrammar(std::shared_ptr<TokenizerInfo> tok, std::vector<std::vector<int32_t>>&& rules, int32_t root,
                  const Limits& limits);

  std::shared_ptr<TokenizerInfo> tok;
  // Unique per grammar for the process's lifetime: names it in per-thread caches (grammar/mask/pushdown_walk.cpp).
  static uint64_t new_uid();
  const uint64_t uid = new_uid();
  std::vector<State> states;
  std::vector<ByteEdge> byte_edges;
  std::vector<RefEdge> ref_edges;
  std::vector<int32_t> rule_start;  // -1 for rules never used
  std::vector<uint8_t> nullable;
  int32_t root = 0;
  int64_t max_items_per_set = 0;
  int64_t max_work_per_byte = Limits::kDefaultWorkPerByte;  // Limits::max_work_per_byte
  int64_t max_work_per_mask = Limits::kDefaultWorkPerMask;  // Limits::max_work_per_mask
  // Byte sets (256 bits): follow[r] = bytes that may come right after rule r finishes, in any
  // context; escape[q] = bytes that may be read next from state q by leaving its rule's own
  // automaton (calling a rule, or finishing the rule). Over-approximations are safe.
  std::vector<ByteSet> follow;
  std::vector<ByteSet> escape;
  // reach_call[q]: a state with rule references is reachable from q through >= 1 byte edge.
  std::vector<uint8_t> reach_call;
  // The grammar's run-time checks and their tables (grammar/runtime_checks.h); empty without any.
  RuntimeChecks checks;
  // Whether state q's Earley items are only a shadow parse of a run-time check's item.
  bool shadow_state(int32_t q) const { return !checks.shadow.empty() && checks.shadow[static_cast<size_t>(q)]; }
  // unique_rule[r]: rule r is an item of a JSON array whose items must be distinct (ir.UniqueItem):
  // the matcher rejects its completions whose value equals an earlier item's (grammar/match/unique.cpp).
  std::vector<uint8_t> unique_rule;
  bool has_unique = false;
  // max_length[r] >= 0: rule r is a JSON string of at most that many code points once decoded
  // (ir.BoundedString); the matcher counts them and drops the rule's items that cannot finish in
  // time (grammar/match/bounded.cpp, whose tables `bounded` holds). -1: no bound.
  std::vector<int32_t> max_length;
  bool has_bounded = false;
  std::shared_ptr<const BoundedTables> bounded;
  // ORs into `set` the bytes state q has byte edges for.
  void add_live_bytes(int32_t q, ByteSet& set) const {
    const State& st = states[static_cast<size_t>(q)];
    for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
      for (int x = byte_edges[e].lo; x <= byte_edges[e].hi; ++x) set[static_cast<size_t>(x) >> 5] |= 1u << (x & 31);
    }
  }

  int32_t step(int32_t s, uint8_t b) const {
    const State& st = states[s];
    for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
      const ByteEdge& be = byte_edges[e];
      if (b < be.lo) return -1;  // edges are sorted and disjoint
      if (b <= be.hi) return be.target;
    }
    return -1;
  }
  bool scans(int32_t s) const { return states[s].byte_end > states[s].byte_begin; }
  // The token classification of state s, computed on first use by the mask component and shared
  // through the tokenizer.
  const StateMask& mask_for(int32_t s) const { return masks_.mask_for(s); }
  // Whether mask_for(s) is computed already (a fill meeting s costs microseconds).
  bool mask_ready(int32_t s) const { return masks_.mask_ready(s); }
  // The mask component: its strategies, caches and test hooks.
  const MaskStrategies& masks() const { return masks_; }
  size_t memory_bytes() const;
  // Shortest completions (grammar/match/complete.cpp), built on first use: per state, the fewest bytes
  // that lead to a final state of its rule (rule references cost their rule's shortest string),
  // and the edge that starts such a string (kind: 0 stop here, 1 byte edge, 2 rule reference).
  struct Completion {
    std::vector<int64_t> dist;
    std::vector<uint8_t> kind;
    std::vector<uint32_t> edge;
  };
  const Completion& completion() const;
  // Appends the shortest string from state s to a final state of its rule (see completion()).
  void append_shortest(int32_t s, std::string& out, int depth) const;

 private:
  mutable std::once_flag completion_once_;
  mutable std::unique_ptr<Completion> completion_;
  void compute_follow_sets(const Limits& limits);
  // The run-time check tables (grammar/lower/runtime_checks.cpp), once the automata are laid out.
  void finish_runtime_checks(const std::vector<CheckSpec>& specs, int32_t first_shadow_rule);
  // The constructors' work; ``own`` holds rewritten programs (it may be ``&rules_in`` itself).
  void lower_rules(const std::vector<std::vector<int32_t>>& rules_in, std::vector<std::vector<int32_t>>* own,
                   const Limits& limits);
  MaskStrategies masks_{*this};
};

}  // namespace grammar
}  // namespace agent_infer
