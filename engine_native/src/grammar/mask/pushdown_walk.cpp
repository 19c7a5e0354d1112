// Token classification for states whose rule calls other rules within one token's reach.
//
// The fast walk (grammar/mask/state_mask.cpp) must call a token "uncertain" as soon as control could
// enter a sub-rule, e.g. `: "` after an object key, where whitespace is followed by a `value`.
// Entering sub-rules does not depend on context, though: only completing the item's own rule
// does. This walk therefore simulates a small pushdown automaton: configurations are
// (state, return stack); references push, finishing a callee pops, and only finishing with an
// empty stack (or an over-deep stack, e.g. left recursion) makes a dying token uncertain.
#include <algorithm>
#include <atomic>

#include "grammar/automaton.h"
#include "grammar/compiled_grammar.h"
#include "grammar/item_map.h"
#include "grammar/mask/mask_strategies.h"
#include "grammar/mask/state_mask.h"
#include "grammar/mask/tokenizer_info.h"
#include "grammar/thread_slot.h"

namespace agent_infer {
namespace grammar {

namespace {
constexpr int32_t kMaxStack = 24;
// Beyond this many live configurations the walk gives up; the caller then uses the plain walk,
// whose answer is coarser (more "uncertain") but equally exact.
constexpr size_t kMaxConfigs = 1 << 16;
constexpr size_t kMaxSets = 8192;
}  // namespace

bool MaskStrategies::calls_within_reach(int32_t s) const { return g_.reach_call[s] != 0; }

uint64_t CompiledGrammar::new_uid() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

namespace {
// The pushdown walks' DFA over configuration sets for one grammar (named by its uid, which is
// never reused, unlike an address), kept per thread between walks.
struct SetDfa {
  struct Node {
    int32_t ret, parent, depth;
  };
  struct CfgSet {
    size_t begin, end;
    uint8_t leave;
  };
  uint64_t grammar = 0;
  std::vector<Node> nodes;
  std::unordered_map<uint64_t, int32_t> node_ids;
  std::vector<Item> pool;
  std::vector<CfgSet> sets;
  // Sets by a 64-bit hash of their configurations and `leave`; equal hashes chain through
  // set_next (compared item by item), so interning allocates no key.
  std::unordered_map<uint64_t, int32_t> set_ids;
  std::vector<int32_t> set_next;
  // 16-bit set ids: the table is the walk's main memory traffic (one row per set, read at
  // random), and the sets of one DFA stay below kKeepSets + kMaxSets.
  std::vector<int16_t> trans;
  std::vector<std::array<uint32_t, 8>> live;  // per set: the bytes some configuration reads
  // The set a single configuration expands to (its closure, interned): transitions from many
  // sets step into the same one (every free character of a key-trie node leads to the same
  // state), and this spares each of them the closure and the interning.
  std::unordered_map<uint64_t, int32_t> single;
};
// Past this many sets (512 bytes of transitions each) the next walk starts afresh.
constexpr size_t kKeepSets = 4096;
SetDfa& set_dfa(uint64_t grammar) {
  SetDfa& dfa = thread_slot<SetDfa>();
  if (dfa.grammar != grammar || dfa.sets.size() > kKeepSets) {
    dfa = SetDfa();
    dfa.grammar = grammar;
  }
  return dfa;
}
}  // namespace

std::shared_ptr<const StateMask> MaskStrategies::compute_mask_with_calls(const std::vector<WalkRange>& ranges,
                                                                          const StateMask* base) const {
  std::shared_ptr<const StateMask> split;
  if (split_walk(ranges, base, true, &split)) return split;
  return compute_mask_with_calls_part(ranges, base, false);
}

std::shared_ptr<const StateMask> MaskStrategies::compute_mask_with_calls_part(const std::vector<WalkRange>& ranges,
                                                                               const StateMask* base,
                                                                               bool resume) const {
  const TokenizerInfo& t = *g_.tok;
  auto out = std::make_shared<StateMask>();
  AcceptedSet accepted(static_cast<size_t>(t.words), base, live_tokens(ranges));

  // The lazily built DFA over configuration sets depends on the grammar alone (each walk only
  // picks its start set), so consecutive walks on this thread over the same grammar share it.
  SetDfa& dfa = set_dfa(g_.uid);
  std::vector<SetDfa::Node>& nodes = dfa.nodes;
  std::unordered_map<uint64_t, int32_t>& node_ids = dfa.node_ids;
  const size_t sets_before = dfa.sets.size();
  auto intern = [&](int32_t ret, int32_t parent) {
    uint64_t k = (static_cast<uint64_t>(static_cast<uint32_t>(ret)) << 32) | static_cast<uint32_t>(parent + 1);
    auto it = node_ids.find(k);
    if (it != node_ids.end()) return it->second;
    int32_t id = static_cast<int32_t>(nodes.size());
    nodes.push_back({ret, parent, parent < 0 ? 1 : nodes[parent].depth + 1});
    node_ids.emplace(k, id);
    return id;
  };

  // Configuration sets are interned and their byte transitions memoized (a lazily built DFA
  // over sets), so the walk over the sorted tokens costs one table lookup per byte once warm.
  std::vector<Item> cfg;  // scratch: (state, stack node or -1)
  ItemMap seen;
  auto add = [&](int32_t q, int32_t st) {
    if (seen.insert((static_cast<uint64_t>(static_cast<uint32_t>(q)) << 32) | static_cast<uint32_t>(st + 1))) {
      cfg.push_back({q, st});
    }
  };
  // Expands the configurations in cfg; returns the bits: 1 the item's rule may finish here, 2 the
  // stack got too deep to follow (treated as "anything may happen"), 4 a run-time check may be
  // decided here (RuntimeChecks): a check finished, whose verdict decides whether anything
  // follows, or the item's own rule, which may end a check's item, finished with nothing to read.
  // With 4, a token dying later is uncertain (as with 2), and so is one ending where no
  // configuration reads a byte.
  bool overflow = false;
  const RuntimeChecks& checks = g_.checks;
  auto closure = [&]() {
    uint8_t leave = 0;
    for (size_t k = 0; k < cfg.size(); ++k) {
      if (cfg.size() > kMaxConfigs) {
        overflow = true;
        break;
      }
      const Item c = cfg[k];
      const State& st = g_.states[c.state];
      for (uint32_t e = st.ref_begin; e < st.ref_end; ++e) {
        if (c.origin >= 0 && nodes[c.origin].depth >= kMaxStack) {
          leave |= 2;
          continue;
        }
        const RefEdge& re = g_.ref_edges[e];
        // A call whose return state only finishes (final, no edges) returns straight to the
        // caller's own return: the frame is dropped, so calls in tail position (every free
        // branch of a key-trie node, say) lead to the same configurations from whichever
        // state made them, and their sets and transitions are shared across those states.
        const State& rt = g_.states[re.target];
        const bool tail = rt.final && rt.byte_end == rt.byte_begin && rt.ref_end == rt.ref_begin;
        add(g_.rule_start[re.rule], tail ? c.origin : intern(re.target, c.origin));
      }
      if (st.final) {
        if (!checks.of_rule.empty() && checks.of_rule[static_cast<size_t>(st.rule)] >= 0) {
          leave |= 4;  // the check's verdict is the Earley check's to give
        } else if (c.origin < 0) {
          leave |= 1;
          if (!checks.end.empty() && checks.end[static_cast<size_t>(c.state)]) leave |= 4;
        } else {
          add(nodes[c.origin].ret, nodes[c.origin].parent);
        }
      }
    }
    return leave;
  };
  std::vector<Item>& pool = dfa.pool;
  std::vector<SetDfa::CfgSet>& sets = dfa.sets;
  std::unordered_map<uint64_t, int32_t>& set_ids = dfa.set_ids;
  std::vector<int32_t>& set_next = dfa.set_next;
  std::vector<int16_t>& trans = dfa.trans;  // sets.size() * 256; -2 unknown, -1 dead
  static_assert(kKeepSets + kMaxSets < 32767, "set ids must fit the 16-bit transition table");
  auto intern_set = [&](uint8_t leave) {
    // After the closure a configuration that reads no byte has done all it can (its calls are
    // expanded, its finishing is in `leave`): sets differing only in such configurations (the
    // calling state of each key-trie node, say) behave alike and are stored as one.
    cfg.erase(std::remove_if(cfg.begin(), cfg.end(),
                             [&](const Item& c) { return g_.states[c.state].byte_end == g_.states[c.state].byte_begin; }),
              cfg.end());
    // `leave` joins the key: a walk's unexpanded start set ({(s, -1)}, leave 0) must not stand
    // for the same configurations reached by a byte, where s may be final (leave 1).
    const uint64_t h = sort_and_digest(cfg, leave);
    auto it = set_ids.find(h);
    const int32_t head = it == set_ids.end() ? -1 : it->second;
    for (int32_t k = head; k >= 0; k = set_next[static_cast<size_t>(k)]) {
      const SetDfa::CfgSet& cs = sets[static_cast<size_t>(k)];
      if (cs.leave == leave && cs.end - cs.begin == cfg.size() &&
          std::equal(cfg.begin(), cfg.end(), pool.begin() + static_cast<long>(cs.begin),
                     [](const Item& x, const Item& y) { return x.state == y.state && x.origin == y.origin; })) {
        return k;
      }
    }
    int32_t id = static_cast<int32_t>(sets.size());
    sets.push_back({pool.size(), pool.size() + cfg.size(), leave});
    ByteSet reads{};
    for (const Item& c : cfg) g_.add_live_bytes(c.state, reads);
    dfa.live.push_back(reads);
    pool.insert(pool.end(), cfg.begin(), cfg.end());
    trans.resize(trans.size() + 256, -2);
    set_next.push_back(head);
    set_ids[h] = id;
    return id;
  };
  auto transition = [&](int32_t a, uint8_t b) {
    cfg.clear();
    seen.clear();
    for (size_t k = sets[a].begin; k < sets[a].end; ++k) {
      int32_t nx = g_.step(pool[k].state, b);
      if (nx >= 0) add(nx, pool[k].origin);
    }
    if (cfg.empty()) return -1;
    if (cfg.size() == 1) {
      const uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(cfg[0].state)) << 32) |
                           static_cast<uint32_t>(cfg[0].origin + 1);
      auto hit = dfa.single.find(key);
      if (hit != dfa.single.end()) return hit->second;
      const uint8_t leave = closure();
      if (overflow) return -1;
      const int32_t id = intern_set(leave);
      dfa.single.emplace(key, id);
      return id;
    }
    uint8_t leave = closure();
    if (overflow) return -1;
    return intern_set(leave);
  };

  std::vector<int32_t> set_at(t.max_token_len + 1);
  // flag[d]: the item's rule could have finished at some position j in [1, d) with byte j able
  // to follow it (or the stack overflowed there). Ranges starting at depth > 0 come out of a
  // loop region, whose walk computed the flag up to there.
  std::vector<uint8_t> flag(t.max_token_len + 1, 0);
  // live0: the first bytes live0_state reads (ranges from one state share it).
  ByteSet live0{};
  int32_t live0_state = -1;
  RangeCarry carry(ranges);
  for (size_t r = 0; r < ranges.size(); ++r) {
    const WalkRange& range = ranges[r];
    const size_t depth0 = range.depth;
    const size_t begin = carry.begin(r);
    if (begin >= range.end) continue;
    // At byte 0 the start state is not expanded: the items it would predict are in the Earley
    // set with masks of their own. Deeper starts are reached by a byte, so they are expanded as
    // transition() would have.
    cfg.assign(1, Item{range.state, -1});
    seen.clear();
    const uint8_t leave0 = depth0 == 0 ? 0 : closure();
    if (overflow) return nullptr;
    set_at[depth0] = intern_set(leave0);
    flag[depth0] = range.flag;
    // Every range's state belongs to the item's rule (they are byte-edge targets within it).
    const ByteSet& fol = g_.follow[g_.states[range.state].rule];
    auto escapes = [&](size_t d, uint8_t b) {
      const uint8_t leave = sets[set_at[d]].leave;
      return d > 0 && ((leave & 6) != 0 || ((leave & 1) != 0 && has(fol, b)));
    };
    // From depth 0, a first byte the start state cannot read kills its whole run, and no walk
    // marks a token uncertain at byte 0: skip such runs without computing (and memoizing) the
    // start set's dead transitions, most of a sparse state's walk.
    if (depth0 == 0 && range.state != live0_state) {
      live0_state = range.state;
      live0.fill(0);
      g_.add_live_bytes(range.state, live0);
    }
    size_t valid = depth0;
    for (size_t i = begin; i < range.end; ++i) {
      size_t l = i == begin ? depth0 : t.lcp[i];
      long dead_at = -1;
      const uint8_t* tokb = reinterpret_cast<const uint8_t*>(t.sorted_ptr(i));
      const size_t len = t.sorted_len(i);
      if (depth0 == 0 && l == 0 && !has(live0, tokb[0])) {
        valid = 0;
        const size_t end = t.skip_dead(i, 0, i, carry.limit(r), live0);  // on to the next live first byte's run
        carry.dead(r, end);
        i = end - 1;
        continue;
      }
      if (len <= range.min_len) {  // the base's; only its prefix is shared with what follows
        valid = std::min(valid, l);
        continue;
      }
      size_t d = std::min(l, valid);
      while (d < len) {
        const size_t slot = static_cast<size_t>(set_at[d]) * 256 + tokb[d];
        int32_t next = trans[slot];
        if (next == -2) {
          next = transition(set_at[d], tokb[d]);
          if (overflow || sets.size() - sets_before > kMaxSets) return nullptr;
          trans[slot] = static_cast<int16_t>(next);
        }
        if (next < 0) {
          dead_at = static_cast<long>(d);
          break;
        }
        flag[d + 1] = flag[d] | static_cast<uint8_t>(escapes(d, tokb[d]));
        set_at[d + 1] = next;
        ++d;
      }
      valid = d;
      if (dead_at < 0) {
        const SetDfa::CfgSet& last = sets[static_cast<size_t>(set_at[d])];
        if ((last.leave & 4) != 0 && last.begin == last.end) {
          out->uncertain.push_back(static_cast<int32_t>(i));  // only a check's verdict keeps it
        } else {
          accepted.add(t.sorted[i]);
        }
        continue;
      }
      size_t end = t.run_end(i, static_cast<size_t>(dead_at) + 1);
      const bool continued = resume && i == range.begin && r == 0 && t.lcp[i] > dead_at;
      if (!continued && (flag[d] || escapes(d, tokb[d]))) {
        for (size_t j = i; j < end; ++j) {
          if (t.sorted_len(j) > range.min_len) out->uncertain.push_back(static_cast<int32_t>(j));
        }
      }
      // The siblings that die here too, rejected (no byte the rule could leave with), are passed
      // over in one search.
      const uint8_t leave = sets[static_cast<size_t>(set_at[d])].leave;
      if (d > 0 && !flag[d] && (leave & 6) == 0) {
        ByteSet stop = dfa.live[static_cast<size_t>(set_at[d])];
        if ((leave & 1) != 0) {
          for (size_t w = 0; w < stop.size(); ++w) stop[w] |= fol[w];
        }
        end = t.skip_dead(i, d, end, carry.limit(r), stop);
      }
      carry.dead(r, end);
      i = end - 1;
    }
  }
  merge_uncertain(*out, base);
  accepted.finish(*out);
  out->uncertain.shrink_to_fit();
  return out;
}

}  // namespace grammar
}  // namespace agent_infer
