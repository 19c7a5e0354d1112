// Lowering, step 2: subset construction of a rule's NFA into its DFA (see grammar_lower.h).
//
// The alphabet is byte ranges plus rule references. A DFA state is the sorted set of the NFA
// states of an epsilon closure that carry information (byte or reference edges, or acceptance).
// Sets are numbered in the order they are first reached, expanding states in number order and,
// within a state, byte ranges in ascending order before references by ascending rule index.
#include <algorithm>
#include <string>

#include "grammar.h"
#include "grammar_lower.h"

namespace agent_infer {
namespace grammar {

namespace {

uint64_t hash_set(const int32_t* data, size_t n) {
  uint64_t h = 1469598103934665603ull ^ n;
  for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<uint32_t>(data[i])) * 1099511628211ull;
  return h ^ (h >> 29);
}

}  // namespace

void Determinizer::closure(const Nfa& nfa, std::vector<int32_t>& seed) {
  closure_.clear();
  if (seed.size() == 1 && nfa.eps_begin[seed[0]] == nfa.eps_begin[seed[0] + 1]) {
    // Most targets (inside literals and byte sequences) have no epsilon edges.
    const int32_t x = seed[0];
    seed.clear();
    if (nfa.byte_begin[x] < nfa.byte_begin[x + 1] || nfa.ref_begin[x] < nfa.ref_begin[x + 1] || x == nfa.accept) {
      closure_.push_back(x);
    }
    return;
  }
  if (mark_.size() < nfa.size()) mark_.resize(nfa.size(), 0);
  if (++stamp_ == 0) {
    std::fill(mark_.begin(), mark_.end(), 0);
    stamp_ = 1;
  }
  stack_.swap(seed);
  while (!stack_.empty()) {
    const int32_t x = stack_.back();
    stack_.pop_back();
    if (mark_[x] == stamp_) continue;
    mark_[x] = stamp_;
    if (nfa.byte_begin[x] < nfa.byte_begin[x + 1] || nfa.ref_begin[x] < nfa.ref_begin[x + 1] || x == nfa.accept) {
      closure_.push_back(x);
    }
    for (uint32_t e = nfa.eps_begin[x]; e < nfa.eps_begin[x + 1]; ++e) stack_.push_back(nfa.eps[e]);
  }
  stack_.swap(seed);  // hand the (now empty) buffer back for reuse
  std::sort(closure_.begin(), closure_.end());
}

int32_t Determinizer::intern(const Nfa& nfa, DfaPool* pool) {
  const uint64_t h = hash_set(closure_.data(), closure_.size());
  size_t mask = table_.size() - 1;
  size_t i = static_cast<size_t>(h) & mask;
  for (; table_gen_[i] == gen_; i = (i + 1) & mask) {
    const int32_t id = table_[i];
    if (set_hash_[id] != h) continue;
    const uint32_t b = set_off_[id], e = set_off_[id + 1];
    if (e - b == closure_.size() && std::equal(closure_.begin(), closure_.end(), set_data_.begin() + b)) return id;
  }
  if (++total_ > max_states_) {
    throw LimitError("grammar is too large: more than " + std::to_string(max_states_) + " automaton states");
  }
  deadline_.check();
  const int32_t id = count_++;
  set_data_.insert(set_data_.end(), closure_.begin(), closure_.end());
  set_off_.push_back(static_cast<uint32_t>(set_data_.size()));
  set_hash_.push_back(h);
  table_[i] = id;
  table_gen_[i] = gen_;
  pool->final.push_back(0);
  if (static_cast<size_t>(count_) * 2 > table_.size()) {
    // Grow and rehash the sets of this rule (entries of earlier rules are stale by generation).
    std::vector<int32_t> table(table_.size() * 2, -1);
    std::vector<uint32_t> gen(table.size(), 0);
    mask = table.size() - 1;
    for (int32_t s = 0; s < count_; ++s) {
      size_t j = static_cast<size_t>(set_hash_[s]) & mask;
      while (gen[j] == gen_) j = (j + 1) & mask;
      table[j] = s;
      gen[j] = gen_;
    }
    table_.swap(table);
    table_gen_.swap(gen);
  }
  return id;
}

void Determinizer::expand(const Nfa& nfa, int32_t d, DfaPool* pool) {
  // Copied out: interning new sets may reallocate set_data_.
  current_.assign(set_data_.begin() + set_off_[d], set_data_.begin() + set_off_[d + 1]);
  edges_.clear();
  ref_pairs_.clear();
  uint8_t final = 0;
  for (int32_t x : current_) {
    if (x == nfa.accept) final = 1;
    edges_.insert(edges_.end(), nfa.bytes.begin() + nfa.byte_begin[x], nfa.bytes.begin() + nfa.byte_begin[x + 1]);
    ref_pairs_.insert(ref_pairs_.end(), nfa.refs.begin() + nfa.ref_begin[x], nfa.refs.begin() + nfa.ref_begin[x + 1]);
  }
  pool->final[base_ + d] = final;
  const size_t first_edge = pool->bytes.size();
  if (edges_.size() == 1) {
    targets_.assign(1, edges_[0].target);
    closure(nfa, targets_);
    pool->bytes.push_back({edges_[0].lo, edges_[0].hi, base_ + intern(nfa, pool)});
  } else if (!edges_.empty()) {
    points_.clear();
    for (const ByteEdge& e : edges_) {
      points_.push_back(e.lo);
      points_.push_back(e.hi + 1);
    }
    std::sort(points_.begin(), points_.end());
    points_.erase(std::unique(points_.begin(), points_.end()), points_.end());
    for (size_t k = 0; k + 1 < points_.size(); ++k) {
      const int32_t a = points_[k], b = points_[k + 1] - 1;
      targets_.clear();
      for (const ByteEdge& e : edges_) {
        if (e.lo <= a && b <= e.hi) targets_.push_back(e.target);
      }
      if (targets_.empty()) continue;
      closure(nfa, targets_);
      const int32_t t = base_ + intern(nfa, pool);
      if (pool->bytes.size() > first_edge && pool->bytes.back().target == t && pool->bytes.back().hi + 1 == a) {
        pool->bytes.back().hi = static_cast<uint8_t>(b);
      } else {
        pool->bytes.push_back({static_cast<uint8_t>(a), static_cast<uint8_t>(b), t});
      }
    }
  }
  pool->byte_begin.push_back(static_cast<uint32_t>(pool->bytes.size()));
  std::sort(ref_pairs_.begin(), ref_pairs_.end(),
            [](const RefEdge& x, const RefEdge& y) { return x.rule != y.rule ? x.rule < y.rule : x.target < y.target; });
  for (size_t i = 0; i < ref_pairs_.size();) {
    size_t j = i;
    targets_.clear();
    while (j < ref_pairs_.size() && ref_pairs_[j].rule == ref_pairs_[i].rule) targets_.push_back(ref_pairs_[j++].target);
    closure(nfa, targets_);
    pool->refs.push_back({ref_pairs_[i].rule, base_ + intern(nfa, pool)});
    i = j;
  }
  pool->ref_begin.push_back(static_cast<uint32_t>(pool->refs.size()));
}

int32_t Determinizer::run(const Nfa& nfa, DfaPool* pool) {
  base_ = static_cast<int32_t>(pool->size());
  count_ = 0;
  set_data_.clear();
  set_off_.assign(1, 0);
  set_hash_.clear();
  if (table_.empty()) {
    table_.assign(64, -1);
    table_gen_.assign(64, 0);
  }
  if (++gen_ == 0) {
    std::fill(table_gen_.begin(), table_gen_.end(), 0);
    gen_ = 1;
  }
  targets_.assign(1, nfa.start);
  closure(nfa, targets_);
  intern(nfa, pool);
  for (int32_t d = 0; d < count_; ++d) expand(nfa, d, pool);
  return base_;
}

}  // namespace grammar
}  // namespace agent_infer
