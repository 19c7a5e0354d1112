// NFA -> DFA: the subset construction (determinize.cpp) and the merging of a rule's equivalent
// acyclic states (minimize.cpp).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "grammar/lower/automata.h"
#include "grammar/lower/set_table.h"

namespace agent_infer {
namespace grammar {

// Working memory of one determinizer run's state sets (flat tables and trie) past which a rule's
// subset construction stops with LimitError.
constexpr size_t kMaxDeterminizeBytes = size_t{256} << 20;

// Subset construction with byte ranges and rule references as the alphabet. Sets of NFA states
// live back to back in one buffer, interned through an open-addressing table; every buffer is
// reused from rule to rule, so determinizing allocates only while its buffers grow.
class Determinizer {
 public:
  Determinizer() = default;
  Determinizer(int64_t max_states, Deadline& deadline) : max_states_(max_states), deadline_(&deadline) {}
  // A fresh state budget for the next runs (the buffers stay).
  void set_limit(int64_t max_states) {
    max_states_ = max_states;
    total_ = 0;
  }
  // Rebinds a kept determinizer to the next grammar's budget and deadline.
  void reset(int64_t max_states, Deadline& deadline) {
    set_limit(max_states);
    deadline_ = &deadline;
  }
  // Bytes its buffers hold (what a kept determinizer retains between grammars).
  size_t retained_bytes() const;
  // Counts states built elsewhere (the fragment store) against the same state budget.
  void charge(int64_t states);
  // Appends the DFA of `nfa` to `pool`; returns the pool index of its start state.
  int32_t run(const Nfa& nfa, DfaPool* pool);

 private:
  void closure(const Nfa& nfa, std::vector<int32_t>& seed);  // into closure_, sorted
  int32_t intern(const Nfa& nfa, DfaPool* pool);              // the set in closure_
  void expand(const Nfa& nfa, int32_t d, DfaPool* pool);
  // Closes targets_ into a set and adds the byte edge [a, b] to it.
  void emit_interval(const Nfa& nfa, int32_t a, int32_t b, size_t first_edge, DfaPool* pool);
  void sweep_edges(const Nfa& nfa, size_t first_edge, DfaPool* pool);
  // closure() + intern() of targets_, memoized per run by the target set: the same few NFA
  // targets (the end of a character class with its loop and exits) are reached from many states
  // and byte intervals, and each closure walks their epsilon edges again.
  int32_t close_intern(const Nfa& nfa, DfaPool* pool);

  int64_t max_states_ = 0;
  int64_t total_ = 0;
  Deadline* deadline_ = nullptr;
  // A sweep was cut short (its state budget ran out): count_in_ must be cleared before reuse.
  bool sweep_dirty_ = false;
  int32_t base_ = 0;
  // The DFA states of the current run: sets of up to kFlatMembers members in sets_, larger ones
  // in trie_. state_ref_[d]: state d's sets_ number, or ~its trie id; flat_state_ / trie_state_
  // map back (trie_state_ is indexed by trie id, -1 where no state).
  static constexpr size_t kFlatMembers = 64;
  SetTable sets_;
  SetTrie trie_;
  std::vector<int32_t> state_ref_, flat_state_, trie_state_, trie_seed_;
  int32_t new_state(DfaPool* pool, int32_t ref);
  uint32_t gen_ = 0;  // per run: one_gen_ entries of earlier runs are stale
  std::vector<uint32_t> mark_;
  std::vector<uint64_t> bits_;  // closure()'s members as bits (all zero between calls)
  uint32_t stamp_ = 0;
  std::vector<int32_t> stack_, closure_, current_, targets_, points_;
  std::vector<uint32_t> by_lo_, by_end_, active_, slot_;  // expand's sweep over byte boundaries
  std::vector<int32_t> count_in_;  // per NFA state: active edges leading to it (zero between sweeps)
  std::vector<ByteEdge> edges_;
  std::vector<RefEdge> ref_pairs_;
  // close_intern's memo: one target (by NFA state, valid where one_gen_ == gen_), and target
  // sets of two or more (seeds_, with the state each closed to in seed_id_; sets of more than
  // kFlatMembers by trie id in trie_seed_, -1 where none).
  std::vector<int32_t> one_id_;
  std::vector<uint32_t> one_gen_;
  SetTable seeds_;
  std::vector<int32_t> seed_id_;
};

// Merges the equivalent states of one rule's trimmed DFA that reach no cycle (see
// grammar/lower/minimize.cpp). Buffers are reused from rule to rule.
class StateMerger {
 public:
  // The rule's states are pool states [b, b + n); live[x]: local state x survived trimming;
  // rule_live[r]: references to rule r survive. rep[x] (local): the lowest-numbered state
  // equivalent to x, for live x; -1 otherwise.
  void run(const DfaPool& pool, uint32_t b, uint32_t n, const std::vector<uint8_t>& live,
           const std::vector<uint8_t>& rule_live, std::vector<int32_t>* rep);

 private:
  void assign_class(const DfaPool& pool, uint32_t b, uint32_t x, const std::vector<uint8_t>& live,
                    const std::vector<uint8_t>& rule_live);
  static constexpr uint32_t kUnseen = ~0u, kDone = ~0u - 1;
  std::vector<int32_t> cls_, class_min_;
  std::vector<uint32_t> index_, low_, stack_;
  std::vector<std::pair<uint32_t, uint32_t>> calls_;
  std::vector<uint32_t> sig_, sig_data_, sig_off_;
  std::vector<uint64_t> sig_hash_;
  std::vector<int32_t> table_;
  std::vector<uint32_t> table_gen_;
  uint32_t gen_ = 0;
};

}  // namespace grammar
}  // namespace agent_infer
