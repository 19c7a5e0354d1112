// Token classification for states whose rule calls other rules within one token's reach.
//
// The fast walk (grammar_tokenizer.cpp) must call a token "uncertain" as soon as control could
// enter a sub-rule, e.g. `: "` after an object key, where whitespace is followed by a `value`.
// Entering sub-rules does not depend on context, though: only completing the item's own rule
// does. This walk therefore simulates a small pushdown automaton: configurations are
// (state, return stack); references push, finishing a callee pops, and only finishing with an
// empty stack (or an over-deep stack, e.g. left recursion) makes a dying token uncertain.
#include <algorithm>

#include "grammar.h"

namespace agent_infer {
namespace grammar {

namespace {
constexpr int32_t kMaxStack = 24;
// Beyond this many live configurations the walk gives up; the caller then uses the plain walk,
// whose answer is coarser (more "uncertain") but equally exact.
constexpr size_t kMaxConfigs = 1 << 16;
}  // namespace

bool CompiledGrammar::calls_within_reach(int32_t s) const {
  std::vector<int32_t> stack;
  std::unordered_map<int32_t, bool> seen;
  const State& st0 = states[s];
  for (uint32_t e = st0.byte_begin; e < st0.byte_end; ++e) stack.push_back(byte_edges[e].target);
  while (!stack.empty()) {
    int32_t q = stack.back();
    stack.pop_back();
    if (!seen.emplace(q, true).second) continue;
    const State& st = states[q];
    if (st.ref_end > st.ref_begin) return true;
    for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) stack.push_back(byte_edges[e].target);
  }
  return false;
}

std::string CompiledGrammar::call_structure_key(int32_t s) const {
  std::vector<int32_t> order{s};
  std::unordered_map<int32_t, int32_t> canon{{s, 0}};
  std::string key = "G";
  auto put = [&](int32_t v) { key.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
  auto id = [&](int32_t q) {
    auto it = canon.find(q);
    if (it != canon.end()) return it->second;
    int32_t c = static_cast<int32_t>(order.size());
    canon.emplace(q, c);
    order.push_back(q);
    return c;
  };
  for (size_t i = 0; i < order.size(); ++i) {
    const State& st = states[order[i]];
    put(st.final ? 1 : 0);
    put(static_cast<int32_t>(st.byte_end - st.byte_begin));
    for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
      const ByteEdge& be = byte_edges[e];
      put((be.lo << 8) | be.hi);
      put(id(be.target));
    }
    put(static_cast<int32_t>(st.ref_end - st.ref_begin));
    for (uint32_t e = st.ref_begin; e < st.ref_end; ++e) {
      const RefEdge& re = ref_edges[e];
      put(id(rule_start[re.rule]));
      put(id(re.target));
    }
  }
  return key;
}

std::shared_ptr<const StateMask> CompiledGrammar::compute_mask_with_calls(int32_t s) const {
  const TokenizerInfo& t = *tok;
  const size_t n = t.sorted.size();
  auto out = std::make_shared<StateMask>();
  std::vector<int32_t> accepted;

  struct Node {
    int32_t ret, parent, depth;
  };
  std::vector<Node> nodes;
  std::unordered_map<uint64_t, int32_t> node_ids;
  auto intern = [&](int32_t ret, int32_t parent) {
    uint64_t k = (static_cast<uint64_t>(static_cast<uint32_t>(ret)) << 32) | static_cast<uint32_t>(parent + 1);
    auto it = node_ids.find(k);
    if (it != node_ids.end()) return it->second;
    int32_t id = static_cast<int32_t>(nodes.size());
    nodes.push_back({ret, parent, parent < 0 ? 1 : nodes[parent].depth + 1});
    node_ids.emplace(k, id);
    return id;
  };

  std::vector<Item> cfg;  // (state, stack node or -1)
  std::vector<uint32_t> level{0, 1};
  cfg.push_back({s, -1});
  std::vector<uint8_t> flag(t.max_token_len + 1, 0);
  ItemSet seen;
  auto add = [&](int32_t q, int32_t st) {
    if (seen.insert((static_cast<uint64_t>(static_cast<uint32_t>(q)) << 32) | static_cast<uint32_t>(st + 1))) {
      cfg.push_back({q, st});
    }
  };
  // Expands the configurations from index `begin`; returns whether the item's rule may finish
  // here (or the stack got too deep to follow).
  bool overflow = false;
  auto closure = [&](uint32_t begin) {
    bool leave = false;
    for (uint32_t k = begin; k < cfg.size(); ++k) {
      if (cfg.size() > kMaxConfigs) {
        overflow = true;
        break;
      }
      const Item c = cfg[k];
      const State& st = states[c.state];
      for (uint32_t e = st.ref_begin; e < st.ref_end; ++e) {
        if (c.origin >= 0 && nodes[c.origin].depth >= kMaxStack) {
          leave = true;
          continue;
        }
        const RefEdge& re = ref_edges[e];
        add(rule_start[re.rule], intern(re.target, c.origin));
      }
      if (st.final) {
        if (c.origin < 0) {
          leave = true;
        } else {
          add(nodes[c.origin].ret, nodes[c.origin].parent);
        }
      }
    }
    return leave;
  };

  size_t valid = 0;
  long dead_at = -1;
  int prev_class = 0;
  for (size_t i = 0; i < n; ++i) {
    size_t l = i == 0 ? 0 : t.lcp[i];
    if (dead_at >= 0 && static_cast<long>(l) > dead_at) {
      if (prev_class == 2) out->uncertain.push_back(static_cast<int32_t>(i));
      continue;
    }
    const uint8_t* tokb = reinterpret_cast<const uint8_t*>(t.sorted_ptr(i));
    const size_t len = t.sorted_len(i);
    size_t d = std::min(l, valid);
    cfg.resize(level[d + 1]);
    level.resize(d + 2);
    dead_at = -1;
    while (d < len) {
      const uint32_t begin = static_cast<uint32_t>(cfg.size());
      seen.clear();
      for (uint32_t k = level[d]; k < level[d + 1]; ++k) {
        int32_t nx = step(cfg[k].state, tokb[d]);
        if (nx >= 0) add(nx, cfg[k].origin);
      }
      if (cfg.size() == begin) {
        dead_at = static_cast<long>(d);
        break;
      }
      bool leave = closure(begin);
      if (overflow) return nullptr;
      level.push_back(static_cast<uint32_t>(cfg.size()));
      flag[d + 1] = flag[d] | static_cast<uint8_t>(leave);
      ++d;
    }
    valid = d;
    if (dead_at < 0) {
      accepted.push_back(t.sorted[i]);
      prev_class = 1;
    } else if (flag[d]) {
      out->uncertain.push_back(static_cast<int32_t>(i));
      prev_class = 2;
    } else {
      prev_class = 0;
    }
  }
  if (accepted.size() > static_cast<size_t>(t.words)) {
    out->accepted_bits.assign(t.words, 0);
    for (int32_t id : accepted) out->accepted_bits[id >> 5] |= 1u << (id & 31);
  } else {
    std::sort(accepted.begin(), accepted.end());
    out->accepted_ids = std::move(accepted);
  }
  out->uncertain.shrink_to_fit();
  return out;
}

}  // namespace grammar
}  // namespace agent_infer
