// Loop regions entered at depth 1: the first-byte pieces of a target inside a string.
//
// A dense state's first-byte pieces (grammar_pieces.cpp) classify the run of tokens starting
// with byte b by a walk entering t = step(s, b) at depth 1. When t lies in a loop region (the
// free string content a key automaton leads to after any byte that does not continue a property
// name), that walk mostly stays in the region, and the region depends only on its shape and
// follow set, not on the grammar around it. So the region is walked once per tokenizer "at depth
// 1" (every token with its first byte taken as read, t reached) and cached; each grammar then
// walks only the exit runs (tokens leaving the region, e.g. those containing the closing quote)
// from their exit states, as mask_for does for region states at depth 0.
#include <algorithm>

#include "grammar.h"
#include "grammar_profile.h"

namespace agent_infer {
namespace grammar {

std::shared_ptr<const StateMask> CompiledGrammar::region_at_depth1(int32_t t, std::vector<int32_t>* exits) const {
  std::string key;
  if (!region_of(t, &key, exits)) return nullptr;
  key = digest(key, 'Q');
  if (auto hit = tok->cache_get(key)) return hit;
  profile::Scope scope(profile::kRegionWalk);
  const TokenizerInfo& tk = *tok;
  std::unordered_map<int32_t, int32_t> exit_of;
  for (size_t k = 0; k < exits->size(); ++k) exit_of[(*exits)[k]] = static_cast<int32_t>(k);
  // Dense rows over the region's states (all resolved up front); an exit edge is -2 - exit.
  std::unordered_map<int32_t, int32_t> row_of{{t, 0}};
  std::vector<int32_t> order{t};
  for (size_t i = 0; i < order.size(); ++i) {
    const State& st = states[order[i]];
    for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
      const int32_t q = byte_edges[e].target;
      if (!exit_of.count(q) && row_of.emplace(q, static_cast<int32_t>(order.size())).second) order.push_back(q);
    }
  }
  std::vector<int32_t> rows(order.size() * 256, -1);
  std::vector<uint8_t> row_final(order.size());
  for (size_t r = 0; r < order.size(); ++r) {
    const State& st = states[order[r]];
    row_final[r] = st.final ? 1 : 0;
    for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
      const ByteEdge& be = byte_edges[e];
      auto ex = exit_of.find(be.target);
      const int32_t v = ex == exit_of.end() ? row_of.at(be.target) : -2 - ex->second;
      for (int b = be.lo; b <= be.hi; ++b) rows[r * 256 + static_cast<size_t>(b)] = v;
    }
  }
  const ByteSet& fol = follow[states[t].rule];
  // Region states call nothing: their only escape is finishing the rule (final, byte in follow).
  // Every byte here is at depth >= 1, where escapes count.
  auto escapes = [&](int32_t r, uint8_t b) { return row_final[static_cast<size_t>(r)] && has(fol, b); };
  auto out = std::make_shared<StateMask>();
  std::vector<uint32_t> bits(static_cast<size_t>(tk.words), 0);
  size_t n_accepted = 0;
  std::vector<int32_t> stack(tk.max_token_len + 1);
  std::vector<uint8_t> flag(tk.max_token_len + 1, 0);
  stack[1] = 0;
  size_t valid = 1;
  const size_t n = tk.sorted.size();
  for (size_t i = 0; i < n; ++i) {
    const uint8_t* tokb = reinterpret_cast<const uint8_t*>(tk.sorted_ptr(i));
    const size_t len = tk.sorted_len(i);
    // Byte 0 is taken as read (into t); deeper bytes share the walk along common prefixes.
    size_t d = std::max<size_t>(1, std::min<size_t>(i == 0 ? 1 : tk.lcp[i], valid));
    int32_t nx = 0;
    while (d < len) {
      nx = rows[static_cast<size_t>(stack[d]) * 256 + tokb[d]];
      if (nx < 0) break;
      flag[d + 1] = flag[d] | static_cast<uint8_t>(escapes(stack[d], tokb[d]));
      stack[d + 1] = nx;
      ++d;
    }
    valid = d;
    if (d >= len) {
      const int32_t id = tk.sorted[i];
      bits[static_cast<size_t>(id) >> 5] |= 1u << (id & 31);
      ++n_accepted;
      continue;
    }
    const size_t end = tk.run_end(i, d + 1);
    const bool escaped = flag[d] || escapes(stack[d], tokb[d]);
    if (nx <= -2) {
      out->exits.push_back({static_cast<int32_t>(i), static_cast<int32_t>(end), static_cast<int32_t>(d + 1), -2 - nx,
                            escaped ? 1 : 0});
    } else if (escaped) {
      for (size_t j = i; j < end; ++j) out->uncertain.push_back(static_cast<int32_t>(j));
    }
    i = end - 1;
  }
  finish_mask(*out, std::move(bits), n_accepted);
  out->exits.shrink_to_fit();
  out->uncertain.shrink_to_fit();
  return tok->cache_put(key, std::move(out));
}

}  // namespace grammar
}  // namespace agent_infer
