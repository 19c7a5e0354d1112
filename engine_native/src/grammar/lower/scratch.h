// The per-thread work buffers of the lowering, lent to one lowering at a time (scratch.cpp).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "grammar/lower/automata.h"
#include "grammar/lower/determinizer.h"
#include "grammar/lower/nfa_builder.h"

namespace agent_infer {
namespace grammar {

// The work buffers of one thread's lowering, kept from grammar to grammar (allocating them
// afresh cost about a tenth of lowering a mid-size schema). Each user resets what it reads before reading
// it, so a grammar's automata never depend on the one lowered before (nor on one that failed).
struct LoweringScratch {
  Nfa nfa;
  DfaPool pool;
  Determinizer determinizer;
  StateMerger merger;
  NfaBuilder::Shared nfa_shared;
  std::vector<int32_t> base, order, work, stack, pending, remap, rep;
  std::vector<uint32_t> count, caller_begin, callers, fill, seen, rev_begin, rev, reached;
  std::vector<uint8_t> built, productive, queued, live, emit, stored;
  size_t retained_bytes() const;  // approximate
};

// Lends the calling thread's LoweringScratch for one lowering (a fresh one if the thread's is
// already lent), and drops the buffers afterwards if a huge grammar left them too large to keep.
class ScratchLease {
 public:
  ScratchLease();
  ~ScratchLease();
  ScratchLease(const ScratchLease&) = delete;
  ScratchLease& operator=(const ScratchLease&) = delete;
  LoweringScratch& operator*() const { return *scratch_; }

 private:
  LoweringScratch* scratch_;
  std::unique_ptr<LoweringScratch> own_;  // when the thread's scratch is in use
};

}  // namespace grammar
}  // namespace agent_infer
