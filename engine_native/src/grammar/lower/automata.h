// The lowering's automata: a rule's Thompson NFA, the pool of all rules' DFAs, and the compile-time
// budget every step checks.
#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

#include "grammar/automaton.h"
#include "grammar/errors.h"
#include "grammar/ir/program.h"

namespace agent_infer {
namespace grammar {

// The compile-time budget (Limits::max_compile_seconds), checked every 1024 calls.
struct Deadline {
  std::chrono::steady_clock::time_point end;
  int counter = 0;
  void check() {
    if ((++counter & 1023) == 0 && std::chrono::steady_clock::now() > end) {
      throw LimitError("grammar compilation exceeded its time budget");
    }
  }
};

// One rule's Thompson NFA over bytes with rule references, edges grouped by source state.
struct Nfa {
  int32_t start = 0, accept = 0;
  std::vector<uint32_t> eps_begin, byte_begin, ref_begin;  // per state, size states + 1
  std::vector<int32_t> eps;
  std::vector<ByteEdge> bytes;
  std::vector<RefEdge> refs;
  size_t size() const { return eps_begin.empty() ? 0 : eps_begin.size() - 1; }
};

// The automata of all lowered rules, back to back; a rule's states are contiguous, its start
// first, and edge targets are indices into the pool.
struct DfaPool {
  std::vector<uint8_t> final;
  std::vector<uint32_t> byte_begin{0}, ref_begin{0};  // per state, size states + 1
  std::vector<ByteEdge> bytes;
  std::vector<RefEdge> refs;
  size_t size() const { return final.size(); }
  // Empty, keeping the buffers' capacity (reused from rule to rule and grammar to grammar).
  void reset() {
    final.clear();
    byte_begin.assign(1, 0);
    ref_begin.assign(1, 0);
    bytes.clear();
    refs.clear();
  }
};

// Appends the automaton of a key-trie rule to `pool` (minimal, every state reaching acceptance
// once the two rules it calls do) and returns its start state; `num_rules` bounds its references.
// Throws DefinitionError for a malformed instruction (grammar/lower/key_set.cpp).
int32_t lower_key_trie(const std::vector<int32_t>& code, size_t num_rules, DfaPool* pool);

}  // namespace grammar
}  // namespace agent_infer
