// The minimized automata of inlined rules, hash-consed into one store (fragment_store.cpp,
// fragment.cpp).
#pragma once

#include <cstdint>
#include <deque>
#include <utility>
#include <vector>

#include "grammar/lower/automata.h"
#include "grammar/lower/determinizer.h"

namespace agent_infer {
namespace grammar {

// A map from 64-bit keys to state ids by open addressing in flat arrays: memoizes the store's
// unions and concatenations without a node allocation per entry.
class PairMemo {
 public:
  // Empty, with room for about `expected` entries before the table grows.
  void clear(size_t expected = 0);
  // The value for key, or -2 if absent.
  int32_t find(uint64_t key) const;
  void insert(uint64_t key, int32_t value);  // key absent
  size_t retained_bytes() const { return keys_.capacity() * 12; }

 private:
  std::vector<uint64_t> keys_;
  std::vector<int32_t> values_;  // -2 = empty slot
  size_t count_ = 0;
};

// The automata of a grammar's inlined rules (finite languages) as one store of acyclic DFA
// states interned by (final, edges), so equal states exist once and the store stays minimal
// (grammar/lower/fragment_store.cpp). States are ids; kDead is the empty language.
class FragmentStore {
 public:
  static constexpr int32_t kDead = -1;
  // Thrown when the state budget or the recursion bound runs out (the caller falls back).
  struct Overflow {};
  // Empty but for the accepting state; keeps the buffers. The hash tables start with room for
  // about `expected_states` states and `expected_unions` unions (rehashing a table as it doubles
  // from small cost a big grammar about a tenth of its store build).
  void reset(size_t expected_states = 0, size_t expected_unions = 0);
  void bind(Deadline* deadline) { deadline_ = deadline; }
  size_t size() const { return final_.size(); }
  size_t retained_bytes() const;  // approximate
  // New states may be created while size() < limit (else Overflow).
  int64_t limit() const { return limit_; }
  void set_limit(int64_t limit) { limit_ = limit; }
  int32_t accept() const { return accept_; }  // the empty string only
  void clear_depth() { depth_ = 0; }          // after an Overflow unwound unite/concat
  // The state with these edges (bytes sorted and disjoint, references by ascending rule, one
  // per rule; both rewritten in place to canonical form). A rule's own automaton may carry
  // references; fragments never do.
  int32_t make(bool final, std::vector<ByteEdge>& edges, std::vector<RefEdge>* refs);
  int32_t reference(int32_t rule, int32_t cont);  // a call of `rule`, then `cont`
  int32_t unite(int32_t a, int32_t b);        // L(a) | L(b)
  int32_t concat(int32_t s, int32_t cont);    // L(s) L(cont)
  // The byte ranges in sequence, then `cont`.
  int32_t chain(const std::pair<uint8_t, uint8_t>* ranges, int n, int32_t cont);
  // The states reachable from `start`, renumbered from 0 (start) in breadth-first order.
  void flatten(int32_t start, std::vector<uint8_t>* final, std::vector<uint32_t>* begin, std::vector<ByteEdge>* bytes);
  // The same, appended to `pool` as a rule's automaton; returns the pool index of its start.
  int32_t flatten_into(int32_t start, DfaPool* pool);

 private:
  static constexpr size_t kMaxDepth = 4000;  // recursion of unite/concat (the C++ stack)
  // At least `need` edges of scratch for recursion depth `depth` (valid until that depth is reused).
  ByteEdge* buffer(size_t depth, size_t need);
  // Drops dead targets and joins adjacent ranges with one target, in place; returns the count.
  static size_t canonical(ByteEdge* edges, size_t count);
  static size_t compact(std::vector<RefEdge>* refs);  // drops dead targets; returns the count
  // The state with these canonical edges (make() without the canonicalizing).
  int32_t intern(bool final, const ByteEdge* edges, size_t n, const RefEdge* refs, size_t m);
  std::vector<RefEdge>& ref_buffer(size_t depth);
  std::vector<uint8_t> final_;
  std::vector<uint32_t> begin_{0};
  std::vector<ByteEdge> edges_;
  std::vector<uint32_t> ref_begin_{0};
  std::vector<RefEdge> refs_;
  std::vector<uint64_t> hash_;
  // Open addressing by signature hash; an entry is the hash's high half above state id + 1 (0 =
  // empty), so a probe passing other states reads no state but the table.
  std::vector<uint64_t> table_;
  PairMemo unions_, concats_;
  std::deque<std::vector<ByteEdge>> bufs_;  // one per recursion depth (a deque: references stay valid)
  std::deque<std::vector<RefEdge>> ref_bufs_;
  std::vector<int32_t> local_, queue_;       // flatten(): local_ is all -1 between calls
  size_t depth_ = 0;
  int64_t limit_ = 0;
  int32_t accept_ = kDead;
  Deadline* deadline_ = nullptr;
};

}  // namespace grammar
}  // namespace agent_infer
