// Shortest completions: the fewest bytes that turn the text matched so far into a complete
// string of the grammar. Used by budget-aware closing (a constrained request that would run out
// of max_tokens ends with the shortest valid completion instead of a truncated document).
//
// Per grammar, once: a shortest-path fixpoint over the rule automata, where a byte edge costs 1
// and a rule reference costs its rule's shortest string (the distance of the rule's start state),
// so rules and states are solved together by one worklist (costs only decrease; no negative
// edges). Per call: Dijkstra over (Earley set, rule) pairs from the items of the current set up
// to the root rule finishing at set 0: finishing rule r begun at set o continues every item of
// set o that waits on r, at the cost of the rest of that item's rule.
#include <algorithm>
#include <limits>
#include <queue>
#include <unordered_map>

#include "grammar/automaton.h"
#include "grammar/compiled_grammar.h"
#include "grammar/errors.h"
#include "grammar/item_map.h"
#include "grammar/match/matcher.h"

namespace agent_infer {
namespace grammar {

namespace {
constexpr int64_t kInf = std::numeric_limits<int64_t>::max() / 4;
constexpr int kMaxDepth = 10000;
constexpr size_t kMaxBytes = size_t{1} << 22;

// A readable byte from [lo, hi] and its rank (lower is better): completions are shown to users
// and fed back to the model, so letters and digits beat punctuation, which beats the rest.
std::pair<int, uint8_t> pick(uint8_t lo, uint8_t hi) {
  int rank = 0;
  for (uint8_t b : {uint8_t('a'), uint8_t('0'), uint8_t('A')}) {
    if (lo <= b && b <= hi) return {rank, b};
    ++rank;
  }
  if (hi >= 0x21 && lo <= 0x7E) return {3, std::max<uint8_t>(lo, 0x21)};
  return {4, lo};
}
}  // namespace

const CompiledGrammar::Completion& CompiledGrammar::completion() const {
  std::call_once(completion_once_, [this] {
    auto c = std::make_unique<Completion>();
    const size_t n = states.size();
    c->dist.assign(n, kInf);
    c->kind.assign(n, 0);
    c->edge.assign(n, 0);
    // Reverse adjacency: edges into each state, and the reference edges calling each rule.
    std::vector<uint32_t> in_begin(n + 1, 0), call_begin(rule_start.size() + 1, 0);
    for (const ByteEdge& be : byte_edges) ++in_begin[be.target + 1];
    for (const RefEdge& re : ref_edges) {
      ++in_begin[re.target + 1];
      ++call_begin[re.rule + 1];
    }
    for (size_t i = 0; i < n; ++i) in_begin[i + 1] += in_begin[i];
    for (size_t r = 0; r < rule_start.size(); ++r) call_begin[r + 1] += call_begin[r];
    // Entries: source state << 1 | is_ref, and the edge index.
    std::vector<std::pair<uint32_t, uint32_t>> in(in_begin[n]);
    std::vector<std::pair<uint32_t, uint32_t>> calls(call_begin[rule_start.size()]);
    {
      std::vector<uint32_t> fill(in_begin.begin(), in_begin.end() - 1);
      std::vector<uint32_t> cfill(call_begin.begin(), call_begin.end() - 1);
      for (size_t s = 0; s < n; ++s) {
        const State& st = states[s];
        for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
          in[fill[byte_edges[e].target]++] = {static_cast<uint32_t>(s << 1), e};
        }
        for (uint32_t e = st.ref_begin; e < st.ref_end; ++e) {
          in[fill[ref_edges[e].target]++] = {static_cast<uint32_t>(s << 1 | 1), e};
          calls[cfill[ref_edges[e].rule]++] = {static_cast<uint32_t>(s), e};
        }
      }
    }
    auto rule_len = [&](int32_t r) { return rule_start[r] < 0 ? kInf : c->dist[rule_start[r]]; };
    std::vector<int32_t> work;
    std::vector<uint8_t> queued(n, 0);
    for (size_t s = 0; s < n; ++s) {
      if (states[s].final) {
        c->dist[s] = 0;
        work.push_back(static_cast<int32_t>(s));
        queued[s] = 1;
      }
    }
    auto relax = [&](uint32_t src, bool is_ref, uint32_t e) {
      int64_t cost;
      if (is_ref) {
        const RefEdge& re = ref_edges[e];
        int64_t len = rule_len(re.rule);
        if (len >= kInf || c->dist[re.target] >= kInf) return;
        cost = len + c->dist[re.target];
      } else {
        if (c->dist[byte_edges[e].target] >= kInf) return;
        cost = 1 + c->dist[byte_edges[e].target];
      }
      if (cost < c->dist[src]) {
        c->dist[src] = cost;
        c->kind[src] = is_ref ? 2 : 1;
        c->edge[src] = e;
        if (!queued[src]) {
          queued[src] = 1;
          work.push_back(static_cast<int32_t>(src));
        }
      }
    };
    while (!work.empty()) {
      int32_t x = work.back();
      work.pop_back();
      queued[x] = 0;
      for (uint32_t i = in_begin[x]; i < in_begin[x + 1]; ++i) relax(in[i].first >> 1, in[i].first & 1, in[i].second);
      int32_t r = states[x].rule;
      if (r >= 0 && static_cast<size_t>(r) < rule_start.size() && rule_start[r] == x) {
        for (uint32_t i = call_begin[r]; i < call_begin[r + 1]; ++i) relax(calls[i].first, true, calls[i].second);
      }
    }
    completion_ = std::move(c);
  });
  return *completion_;
}

void CompiledGrammar::append_shortest(int32_t s, std::string& out, int depth) const {
  const Completion& c = completion();
  if (depth > kMaxDepth) throw LimitError("shortest completion nests rules too deeply");
  while (c.kind[s] != 0) {
    if (out.size() > kMaxBytes) throw LimitError("shortest completion is longer than 4 MiB");
    if (c.kind[s] == 1) {
      // Any byte edge on a shortest path will do: take the most readable byte among them.
      const State& st = states[s];
      std::pair<int, uint8_t> chosen{5, 0};
      int32_t next = -1;
      for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
        const ByteEdge& be = byte_edges[e];
        if (c.dist[be.target] + 1 != c.dist[s]) continue;
        auto cand = pick(be.lo, be.hi);
        if (cand.first < chosen.first) {
          chosen = cand;
          next = be.target;
        }
      }
      out.push_back(static_cast<char>(chosen.second));
      s = next;
    } else {
      const RefEdge& re = ref_edges[c.edge[s]];
      append_shortest(rule_start[re.rule], out, depth + 1);
      s = re.target;
    }
  }
}

bool Matcher::shortest_completion(std::string* out) {
  if (is_terminated() || items_.size() == set_begin_.back()) return false;
  // Under run-time checks the search steps the matcher byte by byte, which also applies unique
  // array items and max-length strings.
  if (g_->checks.any()) return checked_completion(out);
  int64_t cost = 0;
  std::string text;
  if (!unchecked_completion(&text, &cost)) return false;
  // The shortest completion is the grammar's, blind to earlier unique array items and to the
  // count of a max-length string (fewest bytes are not always fewest code points): where the
  // matcher refuses it, there is no completion to offer.
  if ((unique_on_ || bounded_on_) && !completes(text)) return false;
  *out = std::move(text);
  return true;
}

bool Matcher::unchecked_completion(std::string* out, int64_t* cost_out) const {
  const CompiledGrammar& g = *g_;
  const CompiledGrammar::Completion& c = g.completion();
  const int32_t current = static_cast<int32_t>(set_begin_.size()) - 1;
  auto node = [](int32_t set, int32_t rule) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(set)) << 32) | static_cast<uint32_t>(rule);
  };
  // pred[node]: the node it continues (or ~0 for a start) and the state whose shortest string
  // runs from there (the item's state for a start, the reference's target otherwise).
  struct Pred {
    uint64_t from;
    int32_t state;
  };
  std::unordered_map<uint64_t, int64_t> best;
  std::unordered_map<uint64_t, Pred> pred;
  using Entry = std::pair<int64_t, uint64_t>;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  auto push = [&](uint64_t to, int64_t cost, Pred p) {
    auto it = best.find(to);
    if (it != best.end() && it->second <= cost) return;
    best[to] = cost;
    pred[to] = p;
    heap.push({cost, to});
  };
  const uint64_t kStart = ~uint64_t{0};
  for (uint32_t k = set_begin_[current]; k < items_.size(); ++k) {
    const Item& it = items_[k];
    if (c.dist[it.state] >= kInf || g.shadow_state(it.state)) continue;
    push(node(it.origin, g.states[it.state].rule), c.dist[it.state], {kStart, it.state});
  }
  const uint64_t goal = node(0, g.root);
  bool found = false;
  // Each popped node scans a whole Earley set: ambiguous grammars make that quadratic in the
  // input, so the search shares the mask fill's budget.
  int64_t work_left = g.max_work_per_mask;
  while (!heap.empty()) {
    auto [cost, at] = heap.top();
    heap.pop();
    if (best[at] != cost) continue;
    if (at == goal) {
      found = true;
      *cost_out = cost;
      break;
    }
    const int32_t set = static_cast<int32_t>(at >> 32);
    const int32_t rule = static_cast<int32_t>(at & 0xFFFFFFFFu);
    const uint32_t end = set + 1 < static_cast<int32_t>(set_begin_.size()) ? set_begin_[set + 1]
                                                                           : static_cast<uint32_t>(items_.size());
    work_left -= static_cast<int64_t>(end - set_begin_[set]);
    if (work_left < 0) {
      throw LimitError("shortest completion exceeded its work budget of " + std::to_string(g.max_work_per_mask) +
                       " parser steps (max_work_per_mask); the grammar is too ambiguous");
    }
    for (uint32_t k = set_begin_[set]; k < end; ++k) {
      const Item& it = items_[k];
      const State& st = g.states[it.state];
      for (uint32_t e = st.ref_begin; e < st.ref_end; ++e) {
        const RefEdge& re = g.ref_edges[e];
        if (re.rule != rule || c.dist[re.target] >= kInf) continue;
        push(node(it.origin, st.rule), cost + c.dist[re.target], {at, re.target});
      }
    }
  }
  if (!found) return false;
  if (out == nullptr) return true;
  std::vector<int32_t> chain;
  for (uint64_t at = goal;;) {
    const Pred& p = pred[at];
    chain.push_back(p.state);
    if (p.from == kStart) break;
    at = p.from;
  }
  std::string text;
  for (auto it = chain.rbegin(); it != chain.rend(); ++it) g.append_shortest(*it, text, 0);
  *out = std::move(text);
  return true;
}

bool Matcher::completes(const std::string& data) {
  const uint32_t base = static_cast<uint32_t>(set_begin_.size());
  bool ok = true;
  try {
    for (char c : data) {
      budget(false);
      if (!advance(static_cast<uint8_t>(c))) {
        ok = false;
        break;
      }
    }
    ok = ok && last_set_can_end();
  } catch (...) {
    pop_to(base);
    throw;
  }
  pop_to(base);
  return ok;
}

bool Matcher::next_bytes_after(const std::string& data, std::array<uint32_t, 8>* out) {
  out->fill(0);
  if (is_terminated()) return false;
  const uint32_t base = static_cast<uint32_t>(set_begin_.size());
  bool ok = true;
  try {
    for (char c : data) {
      budget(false);
      if (!advance(static_cast<uint8_t>(c))) {
        ok = false;
        break;
      }
    }
  } catch (...) {
    pop_to(base);
    throw;
  }
  if (ok) {
    const CompiledGrammar& g = *g_;
    for (uint32_t k = set_begin_.back(); k < items_.size(); ++k) {
      if (g.shadow_state(items_[k].state)) continue;
      const State& st = g.states[items_[k].state];
      for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
        for (int b = g.byte_edges[e].lo; b <= g.byte_edges[e].hi; ++b) (*out)[b >> 5] |= 1u << (b & 31);
      }
    }
    if (bounded_on_) {
      // An edge's byte may still be refused (a max-length string at its bound): each is tried.
      try {
        for (int b = 0; b < 256; ++b) {
          if (!((*out)[b >> 5] >> (b & 31) & 1u)) continue;
          budget(false);
          if (advance(static_cast<uint8_t>(b))) {
            pop_set();
          } else {
            (*out)[b >> 5] &= ~(1u << (b & 31));
          }
        }
      } catch (...) {
        pop_to(base);
        throw;
      }
    }
  }
  pop_to(base);
  return ok;
}

}  // namespace grammar
}  // namespace agent_infer
