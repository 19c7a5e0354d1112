// A rule's program to its Thompson NFA (nfa.cpp, nfa_alt.cpp), inlined rules spliced in from the
// fragment store.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

#include "grammar/lower/automata.h"
#include "grammar/lower/fragment_store.h"

namespace agent_infer {
namespace grammar {

// Builds rules' NFAs, reusing its buffers from rule to rule.
class NfaBuilder {
 public:
  NfaBuilder(const std::vector<std::vector<int32_t>>& rules, const std::vector<uint8_t>& inline_rule,
             int64_t max_states, Deadline& deadline)
      : rules_(&rules),
        inline_rule_(&inline_rule),
        max_states_(max_states),
        deadline_(&deadline),
        own_shared_(std::make_unique<Shared>()),
        shared_(own_shared_.get()) {}
  struct Shared;
  // A builder whose shared state is kept elsewhere (a LoweringScratch), reset here for this grammar.
  NfaBuilder(const std::vector<std::vector<int32_t>>& rules, const std::vector<uint8_t>& inline_rule,
             int64_t max_states, Deadline& deadline, Shared* shared)
      : rules_(&rules), inline_rule_(&inline_rule), max_states_(max_states), deadline_(&deadline), shared_(shared) {
    size_t words = 0;
    for (const std::vector<int32_t>& code : rules) words += code.size();
    shared_->reset(deadline, words);
    lends_buffers_ = true;
    eps_.swap(shared_->spare_eps);
    bytes_.swap(shared_->spare_bytes);
    refs_.swap(shared_->spare_refs);
  }
  ~NfaBuilder();
  NfaBuilder(const NfaBuilder&) = delete;
  NfaBuilder& operator=(const NfaBuilder&) = delete;
  void build_rule(int32_t r, Nfa* out);
  // Appends rule r's minimal DFA to `pool` straight from its program through the fragment store,
  // for finite programs (references are edges); returns its start's pool index, or -1 where the
  // rule is left to build_rule() and subset construction (grammar/lower/fragment.cpp).
  int32_t lower_in_store(int32_t r, DfaPool* pool);

  // An inlined rule's trimmed, minimized automaton (byte edges only: inlined rules call only
  // inlined rules), spliced into callers instead of re-expanding its program each time.
  struct Fragment {
    bool usable = false;  // false: the program is expanded instead (automaton too large)
    std::vector<uint8_t> final;
    std::vector<uint32_t> begin;  // per state, size states + 1
    std::vector<ByteEdge> bytes;
  };

 private:
  const Fragment& fragment(int32_t r);  // grammar/lower/fragment.cpp
  // The store state of inlined rule r's automaton; -2 where the store cannot hold it (too
  // large, or a program the NFA path must report on).
  int32_t fragment_state(int32_t r);
  // The expression at pc followed by `cont`, in the store (may throw FragmentStore::Overflow).
  int32_t store_eval(const std::vector<int32_t>& code, size_t& pc, int32_t cont);
  // store_eval over a whole program with at most `budget` new store states; -2 when it overflows
  // (depth_ is then reset to `depth_after_overflow`) or stops short.
  int32_t eval_program(const std::vector<int32_t>& code, int64_t budget, int depth_after_overflow);
  std::vector<size_t> seq_pcs_;  // store_eval's Seq children, a stack shared by its recursion
  bool store_refs_ = false;      // store_eval may write references (a rule's own automaton)
  int store_nesting_ = 0;        // fragment_state() calls in progress
  struct ByteSeq {
    int n = 0;
    std::array<std::pair<uint8_t, uint8_t>, 4> r{};
  };
  int32_t fresh();
  // [begin, end) in shared_->seqs: the UTF-8 byte sequences of the class at pc (split once).
  std::pair<uint32_t, uint32_t> class_span(const std::vector<int32_t>& code, size_t pc);
  int32_t build(const std::vector<int32_t>& code, size_t& pc, int32_t from, bool tail);
  int32_t build_node(const std::vector<int32_t>& code, size_t& pc, int32_t from, bool tail);
  // An Alt at pc whose branches share a large last (and first) element, built with one copy of
  // it; false (nothing built, pc unchanged) for any other Alt (grammar/lower/nfa_alt.cpp).
  bool build_factored_alt(const std::vector<int32_t>& code, size_t& pc, int32_t from, bool tail, int32_t* end);
  struct AltBranch {
    size_t begin, end;  // the branch's program words
    uint32_t first, n;  // its n elements start at alt_elems_[first...], alt_elems_[first + n] ends them
    int32_t group;      // branches with the same last element share a group (-1: none)
  };
  std::vector<AltBranch> alt_branches_;  // build_factored_alt's stacks (it nests through build())
  std::vector<size_t> alt_elems_;
  static void utf8_split(uint32_t lo, uint32_t hi, std::vector<ByteSeq>& out);

  // Pointers: a kept nested builder is rebound to the next grammar (fragment()).
  const std::vector<std::vector<int32_t>>* rules_;
  const std::vector<uint8_t>* inline_rule_;
  int64_t max_states_;
  Deadline* deadline_;
  bool lends_buffers_ = false;  // its edge buffers go back to shared_ (spare_*) when it is done
  int64_t total_ = 0;  // states created across all rules (the grammar-size limit)
  int depth_ = 0;      // expression nesting, bounded so deep input cannot overflow the C++ stack
  // A reference to the rule being built in tail position jumps back to its start
  // (R ::= x R | "" is x*), so right recursion costs no parser items.
  int32_t self_rule_ = -1, self_start_ = -1;
  int32_t count_ = 0;
  std::vector<std::pair<int32_t, int32_t>> eps_;
  std::vector<std::pair<int32_t, ByteEdge>> bytes_;
  std::vector<std::pair<int32_t, RefEdge>> refs_;

 public:
  // Shared by a grammar's builders: the top one and those of the fragments themselves (inlined
  // rules inline others), so each class is split and each fragment lowered once per grammar, and
  // fragments reuse one set of work buffers instead of allocating their own.
  struct Shared {
    // Forgets the previous grammar (its programs' addresses and fragments); keeps buffers and
    // builders. program_words (the grammar's total program length) sizes the store's tables.
    void reset(Deadline& deadline, size_t program_words = 0);
    size_t retained_bytes() const;  // approximate
    std::vector<ByteSeq> seqs;  // the byte sequences of every class met, back to back
    // [begin, end) in seqs, by the class's ranges (programs do not change while lowering, so a
    // class's first occurrence keys it): open addressing in flat arrays, one lookup per class
    // expanded. Equal classes in different rules (a JSON string character in every string
    // rule) are split once and share one span.
    std::vector<const int32_t*> class_key;
    std::vector<std::pair<uint32_t, uint32_t>> class_span;
    std::vector<uint64_t> class_hash;
    size_t class_count = 0;
    // The span of the class at `key` (its opcode; the range count and ranges follow, all within
    // the program); *fresh: just added (its span is to be filled in).
    std::pair<uint32_t, uint32_t>& class_seqs(const int32_t* key, bool* fresh);
    // store_eval's automaton of a class (by its span's start) followed by a continuation state:
    // the same class before the same continuation recurs across rules.
    PairMemo class_then;
    std::unordered_map<int32_t, Fragment> fragments;
    FragmentStore store;
    std::vector<int32_t> rule_state;  // fragment_state() per rule: -3 unknown
    std::vector<ByteEdge> class_edges;
    // nested[d]: the builder of fragments met at inlining depth d + 1 (its caller is mid-build).
    std::vector<std::unique_ptr<NfaBuilder>> nested;
    // Determinizing and merging a fragment start once its NFA is complete, nested fragments
    // included, so all depths share these.
    std::unique_ptr<Determinizer> determinizer;
    StateMerger merger;
    Nfa nfa;
    DfaPool pool;
    std::vector<uint32_t> rev_begin, rev, fill, stack;
    std::vector<uint8_t> live;
    std::vector<int32_t> rep, remap;
    // The edge buffers of the grammar's own builder between grammars.
    std::vector<std::pair<int32_t, int32_t>> spare_eps;
    std::vector<std::pair<int32_t, ByteEdge>> spare_bytes;
    std::vector<std::pair<int32_t, RefEdge>> spare_refs;
  };

 private:
  size_t level_ = 0;  // inlining depth: 0 for the grammar's own builder
  std::unique_ptr<Shared> own_shared_;  // set in the grammar's own builder only
  Shared* shared_ = nullptr;
};

}  // namespace grammar
}  // namespace agent_infer
