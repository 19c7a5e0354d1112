// State keys: canonical names of automaton states for the tokenizer-level mask cache, and the
// policy for when a key is worth its cost (within one grammar a state's key is its own; the
// cache pays off across grammars).
#include <algorithm>
#include <cstring>

#include "grammar/automaton.h"
#include "grammar/compiled_grammar.h"
#include "grammar/mask/mask_strategies.h"
#include "grammar/mask/state_mask.h"

namespace agent_infer {
namespace grammar {

// The classification of a state depends on its rule's automaton and escape sets (plain walk),
// or on the automata of every rule reachable through calls plus the rule's follow set (pushdown
// walk). Rules are laid out contiguously, so "rule key + local state index" names the state
// canonically: identical rules in different grammars share their masks.
//
// The pushdown key is a Merkle digest over the rule call graph's strongly connected components:
// a component is serialized once, naming callees outside it by their own digest, so every key
// of a grammar costs O(grammar size) in total. (Serializing everything reachable per rule would be
// quadratic: hundreds of milliseconds for large schemas, paid on first-seen states mid-decode.)
const std::string& MaskStrategies::rule_key(int32_t r, bool calls) const {
  std::lock_guard<std::mutex> lock(key_mu_);
  const int c = calls ? 1 : 0;
  if (rule_key_done_[c].empty()) {
    rule_key_done_[c].assign(g_.rule_start.size(), 0);
    rule_keys_[c].assign(g_.rule_start.size(), std::string());
  }
  if (rule_key_done_[c][r]) return rule_keys_[c][r];
  const size_t S = g_.states.size();
  auto rule_end = [&](int32_t rr) {
    size_t last = static_cast<size_t>(g_.rule_start[rr]);
    while (last < S && g_.states[last].rule == rr) ++last;
    return last;
  };
  auto put = [](std::string& out, int32_t v) { out.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
  if (!calls) {
    rule_key_done_[0][r] = 1;
    std::string ser = "F";
    const int32_t first = g_.rule_start[r];
    const size_t last = rule_end(r);
    put(ser, static_cast<int32_t>(last - static_cast<size_t>(first)));
    for (size_t q = static_cast<size_t>(first); q < last; ++q) {
      const State& st = g_.states[q];
      put(ser, st.final ? 1 : 0);
      for (uint32_t w : g_.escape[q]) put(ser, static_cast<int32_t>(w));
      put(ser, static_cast<int32_t>(st.byte_end - st.byte_begin));
      for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
        put(ser, (g_.byte_edges[e].lo << 8) | g_.byte_edges[e].hi);
        put(ser, g_.byte_edges[e].target - first);
      }
    }
    rule_keys_[0][r] = digest(ser, 'F');
    return rule_keys_[0][r];
  }
  // Iterative Tarjan over the rules reachable from r whose keys are not known yet; components
  // complete callees-first, so an outside callee's digest is always ready when it is named.
  const size_t R = g_.rule_start.size();
  std::vector<int32_t> order(R, -1), low(R, 0), comp_stack;
  std::vector<uint8_t> on_stack(R, 0);
  struct Frame {
    int32_t rule;
    uint32_t edge, end;
  };
  std::vector<Frame> frames;
  int32_t counter = 0;
  auto open = [&](int32_t rr) {
    order[rr] = low[rr] = counter++;
    comp_stack.push_back(rr);
    on_stack[rr] = 1;
    const int32_t first = g_.rule_start[rr];
    const size_t last = rule_end(rr);
    frames.push_back({rr, g_.states[first].ref_begin, g_.states[last - 1].ref_end});
  };
  open(r);
  while (!frames.empty()) {
    Frame& f = frames.back();
    if (f.edge < f.end) {
      const int32_t callee = g_.ref_edges[f.edge++].rule;
      if (rule_key_done_[1][callee]) continue;
      if (order[callee] < 0) {
        open(callee);
      } else if (on_stack[callee]) {
        low[f.rule] = std::min(low[f.rule], order[callee]);
      }
      continue;
    }
    const int32_t rr = f.rule;
    frames.pop_back();
    if (!frames.empty()) low[frames.back().rule] = std::min(low[frames.back().rule], low[rr]);
    if (low[rr] != order[rr]) continue;
    std::vector<int32_t> members;
    int32_t m;
    do {
      m = comp_stack.back();
      comp_stack.pop_back();
      on_stack[m] = 0;
      members.push_back(m);
    } while (m != rr);
    std::sort(members.begin(), members.end());
    std::unordered_map<int32_t, int32_t> ordinal;
    for (size_t i = 0; i < members.size(); ++i) ordinal[members[i]] = static_cast<int32_t>(i);
    std::string ser;
    for (int32_t mr : members) {
      const int32_t first = g_.rule_start[mr];
      const size_t last = rule_end(mr);
      put(ser, static_cast<int32_t>(last - static_cast<size_t>(first)));
      for (size_t q = static_cast<size_t>(first); q < last; ++q) {
        const State& st = g_.states[q];
        put(ser, st.final ? 1 : 0);
        put(ser, static_cast<int32_t>(st.byte_end - st.byte_begin));
        for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
          put(ser, (g_.byte_edges[e].lo << 8) | g_.byte_edges[e].hi);
          put(ser, g_.byte_edges[e].target - first);
        }
        put(ser, static_cast<int32_t>(st.ref_end - st.ref_begin));
        for (uint32_t e = st.ref_begin; e < st.ref_end; ++e) {
          const RefEdge& re = g_.ref_edges[e];
          auto it = ordinal.find(re.rule);
          if (it != ordinal.end()) {
            put(ser, -1 - it->second);  // a member of this component
          } else {
            ser += rule_keys_[1][re.rule];  // fixed-size digest of an outside callee
          }
          put(ser, re.target - first);
        }
      }
    }
    const std::string comp = digest(ser, 'C');
    for (size_t i = 0; i < members.size(); ++i) {
      std::string named = comp;
      put(named, static_cast<int32_t>(i));
      rule_keys_[1][members[i]] = digest(named, 'G');
      rule_key_done_[1][members[i]] = 1;
    }
  }
  return rule_keys_[1][r];
}

bool MaskStrategies::plain_key_cheap(int32_t r) const {
  constexpr size_t kMaxKeyedStates = 2048;
  std::lock_guard<std::mutex> lock(key_mu_);
  if (!rule_key_done_[0].empty() && rule_key_done_[0][static_cast<size_t>(r)]) return true;
  const size_t first = static_cast<size_t>(g_.rule_start[static_cast<size_t>(r)]);
  size_t last = first;
  while (last < g_.states.size() && g_.states[last].rule == r && last - first <= kMaxKeyedStates) ++last;
  return last - first <= kMaxKeyedStates;
}

bool MaskStrategies::pushdown_keys_ready(int32_t r) const {
  // Digests of up to this many states (about 0.1 ms) are built on demand.
  constexpr size_t kMaxDigestStates = 1024;
  std::lock_guard<std::mutex> lock(key_mu_);
  const bool any = !rule_key_done_[1].empty();
  auto done = [&](int32_t rr) { return any && rule_key_done_[1][static_cast<size_t>(rr)] != 0; };
  if (done(r)) return true;
  // A rule found over the budget is not counted again (digests computed since might bring it
  // under; re-counting on every first visit would cost more than the sharing it could win).
  if (digest_too_large_.empty()) digest_too_large_.assign(g_.rule_start.size(), 0);
  if (digest_too_large_[static_cast<size_t>(r)]) return false;
  // The states of the rules reachable through calls whose digests are missing, counted until
  // the budget runs out.
  std::vector<int32_t> work{r}, seen{r};
  size_t n = 0;
  while (!work.empty()) {
    const int32_t rr = work.back();
    work.pop_back();
    for (size_t q = static_cast<size_t>(g_.rule_start[static_cast<size_t>(rr)]); q < g_.states.size() && g_.states[q].rule == rr;
         ++q) {
      if (++n > kMaxDigestStates) {
        digest_too_large_[static_cast<size_t>(r)] = 1;
        return false;
      }
      for (uint32_t e = g_.states[q].ref_begin; e < g_.states[q].ref_end; ++e) {
        const int32_t callee = g_.ref_edges[e].rule;
        if (done(callee) || std::find(seen.begin(), seen.end(), callee) != seen.end()) continue;
        seen.push_back(callee);
        work.push_back(callee);
      }
    }
  }
  return true;
}

std::string MaskStrategies::callee_name(int32_t r) const {
  if (pushdown_keys_ready(r)) return rule_key(r, true);
  std::string name(1, 'u');
  name.append(reinterpret_cast<const char*>(&g_.uid), sizeof(g_.uid));
  name.append(reinterpret_cast<const char*>(&r), sizeof(r));
  name.append(4, '\0');  // 17 bytes, as a digest: serializations stay aligned
  return name;
}

std::string MaskStrategies::structure_key(int32_t s) const {
  const bool calls = calls_within_reach(s);
  const int32_t r = g_.states[s].rule;
  std::string key = rule_key(r, calls);
  // The pushdown walk reads the follow set of the item's own rule only, so it joins the state's
  // key here rather than the rule digests that callers embed.
  if (calls) key.append(reinterpret_cast<const char*>(g_.follow[r].data()), sizeof(ByteSet));
  int32_t local = s - g_.rule_start[r];
  key.append(reinterpret_cast<const char*>(&local), sizeof(local));
  return key;
}

}  // namespace grammar
}  // namespace agent_infer
