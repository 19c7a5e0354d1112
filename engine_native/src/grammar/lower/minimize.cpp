// Lowering, step 3: merging equivalent DFA states of a rule that lead to no cycle.
//
// Subset construction does not minimize: the alternatives of an inlined JSON string character
// (escapes, \uXXXX, each UTF-8 length) end in distinct NFA states, so every position of a counted
// string repeat and every node of a "key except these names" trie carries tens of states where
// a handful would do. A state from which no cycle is reachable is equivalent to another exactly
// when both are final alike and their edges (byte ranges, rule references) lead to equivalent
// targets; visiting states targets-first (Tarjan's completion order) makes that a hash lookup
// per state (Revuz's minimization of acyclic automata), linear in the rule's size. States on
// cycles (string loops) keep their identity; states before them still merge.
#include <algorithm>

#include "grammar/automaton.h"
#include "grammar/lower/automata.h"
#include "grammar/lower/determinizer.h"

namespace agent_infer {
namespace grammar {

void StateMerger::run(const DfaPool& pool, uint32_t b, uint32_t n, const std::vector<uint8_t>& live,
                      const std::vector<uint8_t>& rule_live, std::vector<int32_t>* rep) {
  rep->assign(n, -1);
  cls_.assign(n, -1);
  index_.assign(n, kUnseen);
  low_.assign(n, 0);
  sig_data_.clear();
  sig_off_.assign(1, 0);
  sig_hash_.clear();
  class_min_.clear();
  if (table_.size() < 2 * static_cast<size_t>(n) + 16) {
    size_t size = 64;
    while (size < 2 * static_cast<size_t>(n) + 16) size *= 2;
    table_.assign(size, -1);
    table_gen_.assign(size, 0);
    gen_ = 0;
  }
  if (++gen_ == 0) {
    std::fill(table_gen_.begin(), table_gen_.end(), 0);
    gen_ = 1;
  }
  // Successors of local state x that survive trimming, in edge order.
  auto for_each_target = [&](uint32_t x, auto&& fn) {
    for (uint32_t e = pool.byte_begin[b + x]; e < pool.byte_begin[b + x + 1]; ++e) {
      const uint32_t t = static_cast<uint32_t>(pool.bytes[e].target) - b;
      if (live[t]) fn(t);
    }
    for (uint32_t e = pool.ref_begin[b + x]; e < pool.ref_begin[b + x + 1]; ++e) {
      const uint32_t t = static_cast<uint32_t>(pool.refs[e].target) - b;
      if (rule_live[pool.refs[e].rule] && live[t]) fn(t);
    }
  };
  auto edge_count = [&](uint32_t x) {
    return (pool.byte_begin[b + x + 1] - pool.byte_begin[b + x]) + (pool.ref_begin[b + x + 1] - pool.ref_begin[b + x]);
  };
  uint32_t counter = 0;
  for (uint32_t root = 0; root < n; ++root) {
    if (!live[root] || index_[root] != kUnseen) continue;
    calls_.assign(1, {root, 0});
    index_[root] = low_[root] = counter++;
    stack_.assign(1, root);
    while (!calls_.empty()) {
      const uint32_t u = calls_.back().first;
      uint32_t& k = calls_.back().second;
      // The next surviving successor of u: edges k, k+1, ... (byte edges, then references).
      int64_t v = -1;
      const uint32_t nb = pool.byte_begin[b + u + 1] - pool.byte_begin[b + u];
      while (v < 0 && k < edge_count(u)) {
        const uint32_t e = k++;
        if (e < nb) {
          const uint32_t t = static_cast<uint32_t>(pool.bytes[pool.byte_begin[b + u] + e].target) - b;
          if (live[t]) v = t;
        } else {
          const RefEdge& re = pool.refs[pool.ref_begin[b + u] + e - nb];
          const uint32_t t = static_cast<uint32_t>(re.target) - b;
          if (rule_live[re.rule] && live[t]) v = t;
        }
      }
      if (v >= 0) {
        const uint32_t w = static_cast<uint32_t>(v);
        if (index_[w] == kUnseen) {
          index_[w] = low_[w] = counter++;
          stack_.push_back(w);
          calls_.push_back({w, 0});
        } else if (index_[w] != kDone) {
          low_[u] = std::min(low_[u], index_[w]);
        }
        continue;
      }
      calls_.pop_back();
      if (!calls_.empty()) low_[calls_.back().first] = std::min(low_[calls_.back().first], low_[u]);
      if (low_[u] != index_[u]) continue;
      size_t bottom = stack_.size();
      while (stack_[bottom - 1] != u) --bottom;
      --bottom;
      const bool cyclic = stack_.size() - bottom > 1 || [&] {
        bool self = false;
        for_each_target(u, [&](uint32_t t) { self |= t == u; });
        return self;
      }();
      for (size_t m = bottom; m < stack_.size(); ++m) index_[stack_[m]] = kDone;
      if (cyclic) {
        for (size_t m = bottom; m < stack_.size(); ++m) {
          cls_[stack_[m]] = static_cast<int32_t>(class_min_.size());
          class_min_.push_back(static_cast<int32_t>(stack_[m]));
          sig_off_.push_back(static_cast<uint32_t>(sig_data_.size()));  // empty: never matched
          sig_hash_.push_back(0);
        }
      } else {
        assign_class(pool, b, u, live, rule_live);
      }
      stack_.resize(bottom);
    }
  }
  for (uint32_t x = 0; x < n; ++x) {
    if (live[x]) (*rep)[x] = class_min_[cls_[x]];
  }
}

void StateMerger::assign_class(const DfaPool& pool, uint32_t b, uint32_t x, const std::vector<uint8_t>& live,
                               const std::vector<uint8_t>& rule_live) {
  // Signature: final flag, byte ranges by target class (adjacent ranges to one class joined),
  // then (rule, target class) per reference. A leading tag keeps it non-empty.
  sig_.assign(1, pool.final[b + x] ? 2u : 1u);
  size_t range_start = sig_.size();
  for (uint32_t e = pool.byte_begin[b + x]; e < pool.byte_begin[b + x + 1]; ++e) {
    const ByteEdge& be = pool.bytes[e];
    const uint32_t t = static_cast<uint32_t>(be.target) - b;
    if (!live[t]) continue;
    const uint32_t c = static_cast<uint32_t>(cls_[t]);
    if (sig_.size() > range_start && sig_.back() == c && (sig_[sig_.size() - 2] & 0xFF) + 1 == be.lo) {
      sig_[sig_.size() - 2] = (sig_[sig_.size() - 2] & ~0xFFu) | be.hi;
      continue;
    }
    sig_.push_back((static_cast<uint32_t>(be.lo) << 8) | be.hi);
    sig_.push_back(c);
  }
  sig_.push_back(~0u);  // separates the byte ranges from the references
  for (uint32_t e = pool.ref_begin[b + x]; e < pool.ref_begin[b + x + 1]; ++e) {
    const RefEdge& re = pool.refs[e];
    const uint32_t t = static_cast<uint32_t>(re.target) - b;
    if (!rule_live[re.rule] || !live[t]) continue;
    sig_.push_back(static_cast<uint32_t>(re.rule));
    sig_.push_back(static_cast<uint32_t>(cls_[t]));
  }
  uint64_t h = 1469598103934665603ull ^ sig_.size();
  for (uint32_t w : sig_) h = (h ^ w) * 1099511628211ull;
  h ^= h >> 31;
  const size_t mask = table_.size() - 1;
  size_t i = static_cast<size_t>(h) & mask;
  for (; table_gen_[i] == gen_; i = (i + 1) & mask) {
    const int32_t c = table_[i];
    if (sig_hash_[c] != h) continue;
    const uint32_t s = sig_off_[c], e = sig_off_[c + 1];
    if (e - s == sig_.size() && std::equal(sig_.begin(), sig_.end(), sig_data_.begin() + s)) {
      cls_[x] = c;
      class_min_[c] = std::min(class_min_[c], static_cast<int32_t>(x));
      return;
    }
  }
  const int32_t c = static_cast<int32_t>(class_min_.size());
  cls_[x] = c;
  class_min_.push_back(static_cast<int32_t>(x));
  sig_data_.insert(sig_data_.end(), sig_.begin(), sig_.end());
  sig_off_.push_back(static_cast<uint32_t>(sig_data_.size()));
  sig_hash_.push_back(h);
  table_[i] = c;
  table_gen_[i] = gen_;
}

}  // namespace grammar
}  // namespace agent_infer
