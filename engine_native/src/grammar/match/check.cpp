// Run-time check of uncertain tokens as a pushdown walk over the parse context.
//
// The Earley check (Matcher::check_uncertain) builds one Earley set per byte of every uncertain
// token. Inside a counted repeat (a maxLength string split into `pow` rules) tens of thousands of
// tokens are uncertain on one step, and most of their bytes lead to the same few parser
// configurations. Here the current Earley set is the start of a pushdown automaton whose
// configurations are (state, stack): a stack is either an origin in the Earley history (finishing
// the rule resumes every item of that set waiting on it, exactly as an Earley completion does)
// or a return node pushed by a call made inside the token. Configuration sets are interned and
// their byte transitions memoized, so once warm a byte costs one table lookup, as in the
// state-mask walks. The answer equals the Earley check's: the same items, represented as stacks.
// Past its limits (deep recursion inside one token, very large sets) it gives up and the caller
// runs the Earley check for the tokens still undecided.
#include <algorithm>
#include <cstring>

#include "grammar/automaton.h"
#include "grammar/compiled_grammar.h"
#include "grammar/item_map.h"
#include "grammar/mask/profile.h"
#include "grammar/mask/tokenizer_info.h"
#include "grammar/match/matcher.h"
#include "grammar/thread_slot.h"

namespace agent_infer {
namespace grammar {

namespace {
constexpr int32_t kMaxDepth = 64;
constexpr size_t kMaxConfigs = 1 << 14;
constexpr size_t kMaxSets = 1 << 14;

// The check's working storage, kept per thread and cleared per call: it runs on most steps of
// a constrained decode, and allocating its tables each time cost more than the walk itself (and
// contended the allocator when a batch fill runs rows on several threads).
struct CheckScratch {
  struct Node {
    int32_t ret, parent, depth;
  };
  std::vector<Node> nodes;
  ItemMap node_ids;
  std::vector<Item> cfg;  // (state, stack)
  ItemMap seen;
  std::vector<Item> pool;
  std::vector<std::pair<size_t, size_t>> sets;
  ItemMap set_ids;  // hash -> first set with it (chained by set_next)
  std::vector<int32_t> set_next;
  std::vector<int32_t> trans;  // sets.size() * 256; -2 unknown, -1 dead
  std::vector<int32_t> set_at;
  void clear() {
    nodes.clear();
    node_ids.clear();
    cfg.clear();
    seen.clear();
    pool.clear();
    sets.clear();
    set_ids.clear();
    set_next.clear();
    trans.clear();
  }
};

CheckScratch& check_scratch() {
  CheckScratch& sc = thread_slot<CheckScratch>();
  sc.clear();
  return sc;
}
}  // namespace

bool Matcher::check_uncertain_walk(uint32_t* mask) {
  profile::Scope scope(profile::kCheckWalk);
  const CompiledGrammar& g = *g_;
  const TokenizerInfo& t = *g.tok;
  CheckScratch& sc = check_scratch();
  // Stacks: v >= 0 is a return node, v < 0 the Earley history set -1 - v.
  std::vector<CheckScratch::Node>& nodes = sc.nodes;
  ItemMap& node_ids = sc.node_ids;
  bool gave_up = false;
  auto push = [&](int32_t ret, int32_t parent) -> int32_t {
    // A tail call: returning to `ret` (accepting, no edges) only returns further, to `parent`'s
    // frame, so the callee can return there directly. Right-linear chains (a bounded `pattern`,
    // one rule per position) otherwise stack a frame per byte and hit kMaxDepth inside a token,
    // sending the whole check back to Earley sets. Not at the bottom: finishing at a history set
    // completes the items waiting on the finishing rule, which must stay the caller's.
    if (parent >= 0) {
      const State& rs = g.states[static_cast<size_t>(ret)];
      if (rs.final && rs.byte_begin == rs.byte_end && rs.ref_begin == rs.ref_end) return parent;
    }
    const uint64_t k = (static_cast<uint64_t>(static_cast<uint32_t>(ret)) << 32) | static_cast<uint32_t>(parent);
    if (const int32_t* found = node_ids.find(k)) return *found;
    const int32_t depth = parent >= 0 ? nodes[static_cast<size_t>(parent)].depth + 1 : 1;
    if (depth > kMaxDepth) gave_up = true;
    const int32_t id = static_cast<int32_t>(nodes.size());
    nodes.push_back({ret, parent, depth});
    node_ids.put(k, id);
    return id;
  };
  std::vector<Item>& cfg = sc.cfg;  // (state, stack)
  ItemMap& seen = sc.seen;
  auto add = [&](int32_t q, int32_t st) {
    if (seen.insert((static_cast<uint64_t>(static_cast<uint32_t>(q)) << 32) | static_cast<uint32_t>(st))) {
      cfg.push_back({q, st});
    }
  };
  const size_t n_sets = set_begin_.size();
  auto closure = [&]() {
    for (size_t k = 0; k < cfg.size() && !gave_up; ++k) {
      if (cfg.size() > kMaxConfigs) {
        gave_up = true;
        break;
      }
      const Item c = cfg[k];
      const State& st = g.states[c.state];
      for (uint32_t e = st.ref_begin; e < st.ref_end; ++e) {
        const RefEdge& re = g.ref_edges[e];
        add(g.rule_start[re.rule], push(re.target, c.origin));
      }
      if (!st.final) continue;
      if (c.origin >= 0) {
        const CheckScratch::Node& n = nodes[static_cast<size_t>(c.origin)];
        add(n.ret, n.parent);
        continue;
      }
      // Finishing at a history set: advance the items of that set waiting on the rule.
      const size_t o = static_cast<size_t>(-1 - c.origin);
      const uint32_t end = o + 1 < n_sets ? set_begin_[o + 1] : static_cast<uint32_t>(items_.size());
      spend(static_cast<int64_t>(end - set_begin_[o]));
      for (uint32_t j = set_begin_[o]; j < end; ++j) {
        const Item w = items_[j];
        const State& ws = g.states[w.state];
        for (uint32_t e = ws.ref_begin; e < ws.ref_end; ++e) {
          if (g.ref_edges[e].rule == st.rule) add(g.ref_edges[e].target, -1 - w.origin);
        }
      }
    }
  };
  std::vector<Item>& pool = sc.pool;
  std::vector<std::pair<size_t, size_t>>& sets = sc.sets;
  ItemMap& set_ids = sc.set_ids;
  std::vector<int32_t>& set_next = sc.set_next;
  std::vector<int32_t>& trans = sc.trans;
  auto intern_set = [&]() {
    const uint64_t h = sort_and_digest(cfg, cfg.size());
    const int32_t* found = set_ids.find(h);
    const int32_t head = found ? *found : -1;
    for (int32_t k = head; k >= 0; k = set_next[static_cast<size_t>(k)]) {
      const auto& range = sets[static_cast<size_t>(k)];
      if (range.second - range.first == cfg.size() &&
          std::equal(cfg.begin(), cfg.end(), pool.begin() + static_cast<long>(range.first),
                     [](const Item& x, const Item& y) { return x.state == y.state && x.origin == y.origin; })) {
        return k;
      }
    }
    const int32_t id = static_cast<int32_t>(sets.size());
    sets.push_back({pool.size(), pool.size() + cfg.size()});
    pool.insert(pool.end(), cfg.begin(), cfg.end());
    trans.resize(trans.size() + 256, -2);
    set_next.push_back(head);
    set_ids.put(h, id);
    return id;
  };
  auto transition = [&](int32_t a, uint8_t b) -> int32_t {
    cfg.clear();
    seen.clear();
    for (size_t k = sets[static_cast<size_t>(a)].first; k < sets[static_cast<size_t>(a)].second; ++k) {
      const int32_t nx = g.step(pool[k].state, b);
      if (nx >= 0) add(nx, pool[k].origin);
    }
    if (cfg.empty()) return -1;
    closure();
    if (gave_up) return -1;
    return intern_set();
  };

  // The current set is closed already: its items are the start configurations as they are.
  cfg.clear();
  seen.clear();
  for (uint32_t k = set_begin_.back(); k < items_.size(); ++k) add(items_[k].state, -1 - items_[k].origin);
  std::vector<int32_t>& set_at = sc.set_at;
  set_at.resize(t.max_token_len + 1);
  set_at[0] = intern_set();
  size_t valid = 0;
  const char* prev = nullptr;
  size_t prev_len = 0;
  for (size_t k = 0; k < scratch_.size();) {
    const int32_t pos = scratch_[k];
    const int32_t id = t.sorted[pos];
    if (mask[id >> 5] & (1u << (id & 31))) {
      ++k;
      continue;
    }
    const uint8_t* tokb = reinterpret_cast<const uint8_t*>(t.sorted_ptr(pos));
    const size_t len = t.sorted_len(pos);
    size_t cp = 0;
    {
      const size_t n = std::min(prev_len, len);
      while (cp < n && static_cast<uint8_t>(prev[cp]) == tokb[cp]) ++cp;
    }
    prev = reinterpret_cast<const char*>(tokb);
    prev_len = len;
    size_t d = std::min(cp, valid);
    long dead_at = -1;
    while (d < len) {
      const size_t slot = static_cast<size_t>(set_at[d]) * 256 + tokb[d];
      int32_t next = trans[slot];
      if (next == -2) {
        next = transition(set_at[d], tokb[d]);
        if (gave_up || sets.size() > kMaxSets) return false;
        trans[slot] = next;
      }
      if (next < 0) {
        dead_at = static_cast<long>(d);
        break;
      }
      set_at[++d] = next;
    }
    valid = d;
    if (dead_at < 0) {
      mask[id >> 5] |= 1u << (id & 31);
      ++k;
      continue;
    }
    // Every token starting with the dead prefix dies too; skip past them.
    const size_t lo = t.run_end(static_cast<size_t>(pos), static_cast<size_t>(dead_at) + 1);
    k = static_cast<size_t>(std::lower_bound(scratch_.begin() + static_cast<long>(k) + 1, scratch_.end(),
                                             static_cast<int32_t>(lo)) -
                            scratch_.begin());
  }
  return true;
}

}  // namespace grammar
}  // namespace agent_infer
