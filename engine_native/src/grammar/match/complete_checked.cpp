// Shortest completions under run-time checks (grammar/runtime_checks.h).
//
// The shortest-path search of complete.cpp follows automata and Earley origins: it cannot see a
// check's verdict, so its string may end a value two `oneOf` branches both accept. Its length is
// still a lower bound of the shortest completion whose checks pass (a verdict only removes
// completions), which makes it the heuristic of an iterative-deepening search over bytes on a
// copy of the matcher: depth-first with the bound raised to the least length that exceeded it,
// trying first the byte the unchecked completion starts with, then the others in the readable
// order complete.cpp prefers. Each step is an Earley step with the checks decided, so the first
// completion found is the shortest that passes. Paths that reach one parse context (the digest
// the mask fill memoizes by, Matcher::context_key: `1` and `2` inside a number lead to one) are
// searched once per round, from the shortest. The search is bounded (kMaxSteps Earley steps per
// call) and reports a GrammarLimitError past it.
#include <algorithm>
#include <array>
#include <limits>
#include <string>
#include <unordered_map>

#include "grammar/compiled_grammar.h"
#include "grammar/errors.h"
#include "grammar/match/matcher.h"

namespace agent_infer {
namespace grammar {

namespace {
constexpr int64_t kNone = std::numeric_limits<int64_t>::max();
constexpr int64_t kMaxSteps = 50000;
constexpr size_t kMaxLength = 4096;

// Bytes in the order complete.cpp's pick() prefers them: 'a', '0', 'A', printable ASCII, the rest.
const std::array<uint8_t, 256>& readable_order() {
  static const std::array<uint8_t, 256> order = [] {
    std::array<uint8_t, 256> o{};
    auto rank = [](int b) {
      if (b == 'a') return 0;
      if (b == '0') return 1;
      if (b == 'A') return 2;
      if (b >= 0x21 && b <= 0x7E) return 3;
      return 4;
    };
    for (int b = 0; b < 256; ++b) o[static_cast<size_t>(b)] = static_cast<uint8_t>(b);
    std::stable_sort(o.begin(), o.end(), [&](uint8_t x, uint8_t y) { return rank(x) < rank(y); });
    return o;
  }();
  return order;
}
}  // namespace

bool Matcher::checked_completion(std::string* out) const {
  Matcher m(*this);
  std::string path;
  int64_t steps = 0;
  // Per round: the shortest path length each parse context was reached at.
  std::unordered_map<std::string, size_t> reached;
  // Returns -1 when a completion is found (in `path`), else the least bound that would let the
  // search go further (kNone: no completion below this node).
  auto search = [&](auto&& self, int64_t bound) -> int64_t {
    std::string hint;
    int64_t h = 0;
    if (!m.unchecked_completion(&hint, &h)) return kNone;
    const int64_t f = static_cast<int64_t>(path.size()) + h;
    if (f > bound) return f;
    if (m.last_set_can_end()) return -1;
    {
      auto [at, fresh] = reached.emplace(m.context_key(), path.size());
      if (!fresh) {
        if (at->second <= path.size()) return kNone;  // searched already, from no further
        at->second = path.size();
      }
    }
    if (path.size() >= kMaxLength) {
      throw LimitError("shortest completion under run-time checks is longer than " + std::to_string(kMaxLength) +
                       " bytes");
    }
    std::array<uint32_t, 8> live{};
    const CompiledGrammar& g = *m.g_;
    for (uint32_t k = m.set_begin_.back(); k < m.items_.size(); ++k) {
      const int32_t s = m.items_[k].state;
      if (g.shadow_state(s)) continue;
      const State& st = g.states[static_cast<size_t>(s)];
      for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
        for (int b = g.byte_edges[e].lo; b <= g.byte_edges[e].hi; ++b) live[static_cast<size_t>(b) >> 5] |= 1u << (b & 31);
      }
    }
    int64_t least = kNone;
    auto try_byte = [&](uint8_t b) -> bool {
      if (!(live[b >> 5] & (1u << (b & 31)))) return false;
      live[b >> 5] &= ~(1u << (b & 31));
      if (++steps > kMaxSteps) {
        throw LimitError("shortest completion under run-time checks exceeded its budget of " +
                         std::to_string(kMaxSteps) + " parser steps");
      }
      m.budget(false);
      if (!m.advance(b)) return false;
      path.push_back(static_cast<char>(b));
      const int64_t t = self(self, bound);
      if (t < 0) return true;
      path.pop_back();
      m.pop_set();
      least = std::min(least, t);
      return false;
    };
    if (!hint.empty() && try_byte(static_cast<uint8_t>(hint[0]))) return -1;
    for (uint8_t b : readable_order()) {
      if (try_byte(b)) return -1;
    }
    return least;
  };
  std::string hint;
  int64_t bound = 0;
  if (!m.unchecked_completion(&hint, &bound)) return false;
  while (true) {
    reached.clear();
    const int64_t t = search(search, bound);
    if (t < 0) {
      *out = path;
      return true;
    }
    if (t == kNone) return false;
    bound = t;
  }
}

}  // namespace grammar
}  // namespace agent_infer
