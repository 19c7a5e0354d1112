// Short-token masks: a cheap first visit for the positions of counted repeats.
//
// A walk classifying a token of n bytes from state s reads only the states within n - 1 bytes
// of s (their byte edges, final flags, escape sets, and in the pushdown walk their calls and the
// rule's follow set); the state it reaches after the last byte only has to exist. So the
// classification of every token of at most kShortTokenLen bytes is a function of that
// neighbourhood, and is cached in the tokenizer under a digest of it. The positions of a
// `maxLength` string are distinct states (the automaton counts), but all positions farther than
// kShortTokenLen bytes from the string's end have the same neighbourhood: the first of them
// walks every token, the others copy the cached short part and walk only the long tokens
// (under 1 % of a vocabulary). Near the end each position is unique and walks as before.
#include <algorithm>
#include <deque>

#include "grammar.h"

namespace agent_infer {
namespace grammar {

namespace {
// The neighbourhood reaches kShortTokenLen - 1 bytes from s.
constexpr int32_t kMaxDepth = static_cast<int32_t>(TokenizerInfo::kShortTokenLen) - 1;
// Larger neighbourhoods (wide alternations) cost more to key than a walk saves.
constexpr size_t kMaxShortStates = 4096;
// Sparse states walk few tokens; keying them would cost more than the walk.
constexpr size_t kMinShortTokens = 4096;
}  // namespace

const std::string& CompiledGrammar::short_key(int32_t s) const {
  {
    std::lock_guard<std::mutex> lock(local_mu_);
    auto it = short_keys_.find(s);
    if (it != short_keys_.end()) return it->second;
  }
  const bool calls = calls_within_reach(s);
  const int32_t r = states[s].rule;
  // Distances in bytes by a 0-1 BFS: returning from a call reads no byte of the caller's (the
  // callee may be nullable; callees are described whole by their digests).
  std::unordered_map<int32_t, int32_t> dist{{s, 0}};
  std::deque<std::pair<int32_t, int32_t>> queue{{s, 0}};
  bool overflow = false;
  auto relax = [&](int32_t q, int32_t d, bool front) {
    auto it = dist.find(q);
    if (it != dist.end() && it->second <= d) return;
    if (it == dist.end() && dist.size() >= kMaxShortStates) {
      overflow = true;
      return;
    }
    dist[q] = d;
    if (front) {
      queue.emplace_front(q, d);
    } else {
      queue.emplace_back(q, d);
    }
  };
  while (!queue.empty() && !overflow) {
    const auto [q, d] = queue.front();
    queue.pop_front();
    if (d != dist.at(q) || d > kMaxDepth) continue;
    const State& st = states[q];
    for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) relax(byte_edges[e].target, d + 1, false);
    if (calls) {
      for (uint32_t e = st.ref_begin; e < st.ref_end; ++e) relax(ref_edges[e].target, d, true);
    }
  }
  bool beyond = false;
  for (const auto& kv : dist) beyond |= kv.second > kMaxDepth;
  std::string key;
  if (!overflow && beyond) {
    // Canonical numbering: discovery order from s, expanding only the states within reach.
    auto inside = [&](int32_t q) { return dist.at(q) <= kMaxDepth; };
    std::unordered_map<int32_t, int32_t> num{{s, 0}};
    std::vector<int32_t> order{s};
    auto reach = [&](int32_t q) {
      if (num.emplace(q, static_cast<int32_t>(order.size())).second) order.push_back(q);
    };
    for (size_t i = 0; i < order.size(); ++i) {
      if (!inside(order[i])) continue;
      const State& st = states[order[i]];
      for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) reach(byte_edges[e].target);
      if (calls) {
        for (uint32_t e = st.ref_begin; e < st.ref_end; ++e) reach(ref_edges[e].target);
      }
    }
    std::string ser(1, calls ? 'c' : 'p');
    auto put = [&](int32_t v) { ser.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
    put(kMaxDepth);
    for (int32_t q : order) {
      if (!inside(q)) {
        put(-7);  // beyond reach: only its existence is read
        continue;
      }
      append_state_key(q, calls, true, num, ser);
    }
    ser.append(reinterpret_cast<const char*>(follow[r].data()), sizeof(ByteSet));
    key = digest(ser, 'S');
  }
  std::lock_guard<std::mutex> lock(local_mu_);
  return short_keys_.emplace(s, std::move(key)).first->second;
}

namespace {
bool dense(const CompiledGrammar& g, int32_t s) {
  const TokenizerInfo& tk = *g.tok;
  size_t live = 0;
  const State& st = g.states[s];
  for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
    const ByteEdge& be = g.byte_edges[e];
    live += tk.first_byte_end[be.hi] - (be.lo == 0 ? 0 : tk.first_byte_end[be.lo - 1u]);
  }
  return live >= kMinShortTokens;
}
}  // namespace

std::shared_ptr<const StateMask> CompiledGrammar::compute_from_short(int32_t s, bool calls) const {
  if (!dense(*this, s) || short_key(s).empty()) return nullptr;
  std::shared_ptr<const StateMask> part = tok->cache_get(short_key(s));
  if (!part) return nullptr;
  // The long tokens, in blocks of consecutive sorted positions (the walks reuse common
  // prefixes inside a range).
  const std::vector<int32_t>& longs = tok->long_sorted;
  std::vector<WalkRange> ranges;
  for (size_t i = 0; i < longs.size();) {
    size_t j = i + 1;
    while (j < longs.size() && longs[j] == longs[j - 1] + 1) ++j;
    ranges.push_back({static_cast<size_t>(longs[i]), static_cast<size_t>(longs[j - 1]) + 1, 0, s, 0});
    i = j;
  }
  std::shared_ptr<const StateMask> out = calls ? compute_mask_with_calls(ranges, part.get()) : nullptr;
  if (!out) out = compute_mask(ranges, part.get());
  return out;
}

void CompiledGrammar::put_short(int32_t s, const StateMask& full) const {
  if (!dense(*this, s) || short_key(s).empty() || tok->cache_get(short_key(s))) return;
  const TokenizerInfo& tk = *tok;
  auto is_short = [&](int32_t id) { return tk.tokens[static_cast<size_t>(id)].size() <= TokenizerInfo::kShortTokenLen; };
  std::vector<uint32_t> bits(static_cast<size_t>(tk.words), 0);
  size_t n = seed_bits(&full, bits);
  for (int32_t j : tk.long_sorted) {
    const int32_t id = tk.sorted[static_cast<size_t>(j)];
    uint32_t& w = bits[static_cast<size_t>(id) >> 5];
    const uint32_t bit = 1u << (id & 31);
    if (w & bit) {
      w &= ~bit;
      --n;
    }
  }
  auto part = std::make_shared<StateMask>();
  for (int32_t j : full.uncertain) {
    if (is_short(tk.sorted[static_cast<size_t>(j)])) part->uncertain.push_back(j);
  }
  finish_mask(*part, std::move(bits), n);
  part->uncertain.shrink_to_fit();
  tok->cache_put(short_key(s), std::move(part));
}

}  // namespace grammar
}  // namespace agent_infer
