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
#include <array>

#include "grammar/automaton.h"
#include "grammar/compiled_grammar.h"
#include "grammar/mask/mask_strategies.h"
#include "grammar/mask/profile.h"
#include "grammar/mask/state_mask.h"
#include "grammar/mask/tokenizer_info.h"
#include "grammar/thread_slot.h"

namespace agent_infer {
namespace grammar {

namespace {
// The neighbourhood reaches kShortTokenLen - 1 bytes from s.
constexpr int32_t kMaxDepth = static_cast<int32_t>(TokenizerInfo::kShortTokenLen) - 1;
// Larger neighbourhoods (wide alternations) cost more to key than a walk saves.
constexpr size_t kMaxShortStates = 4096;
constexpr int32_t kUnseen = -1;
struct Scratch {
  std::vector<int32_t> dist;  // by state; kUnseen outside a key computation
  std::vector<int32_t> num;   // by state; -1 outside a key computation
  std::vector<int32_t> touched;
  std::array<std::vector<int32_t>, kMaxDepth + 2> bucket;
};
Scratch& scratch(size_t n_states) {
  Scratch& sc = thread_slot<Scratch>();
  if (sc.dist.size() < n_states) {
    sc.dist.resize(n_states, kUnseen);
    sc.num.resize(n_states, -1);
  }
  return sc;
}
}  // namespace

const std::string& MaskStrategies::short_key(int32_t s) const {
  profile::Scope scope(profile::kShortKey);
  {
    std::lock_guard<std::mutex> lock(local_mu_);
    auto it = short_keys_.find(s);
    if (it != short_keys_.end()) return it->second;
  }
  const bool calls = calls_within_reach(s);
  const int32_t r = g_.states[s].rule;
  // Per-thread flat arrays indexed by state (reset entry by entry): hash maps cost most of the
  // key on the positions of a counted repeat (hundreds of states per neighbourhood).
  Scratch& sc = scratch(g_.states.size());
  std::vector<int32_t>& dist = sc.dist;
  std::vector<int32_t> order;
  // Leaves the scratch clean however this returns (rule_key may throw on a grammar limit).
  struct Reset {
    Scratch& sc;
    std::vector<int32_t>& order;
    ~Reset() {
      for (int32_t q : order) sc.num[static_cast<size_t>(q)] = -1;
      for (int32_t q : sc.touched) sc.dist[static_cast<size_t>(q)] = kUnseen;
      sc.touched.clear();
    }
  } reset{sc, order};
  // Distances in bytes by a 0-1 BFS, one bucket per distance: returning from a call reads no
  // byte of the caller's (the callee may be nullable; callees are described whole by digests).
  bool overflow = false;
  size_t n_seen = 0;
  auto relax = [&](int32_t q, int32_t d) {
    int32_t& dq = dist[static_cast<size_t>(q)];
    if (dq != kUnseen && dq <= d) return;
    if (dq == kUnseen) {
      if (n_seen >= kMaxShortStates) {
        overflow = true;
        return;
      }
      ++n_seen;
      sc.touched.push_back(q);
    }
    dq = d;
    sc.bucket[static_cast<size_t>(d)].push_back(q);
  };
  for (auto& b : sc.bucket) b.clear();
  relax(s, 0);
  for (int32_t d = 0; d <= kMaxDepth && !overflow; ++d) {
    std::vector<int32_t>& bucket = sc.bucket[static_cast<size_t>(d)];
    for (size_t i = 0; i < bucket.size() && !overflow; ++i) {
      const int32_t q = bucket[i];
      if (dist[static_cast<size_t>(q)] != d) continue;
      const State& st = g_.states[q];
      for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) relax(g_.byte_edges[e].target, d + 1);
      if (calls) {
        for (uint32_t e = st.ref_begin; e < st.ref_end; ++e) relax(g_.ref_edges[e].target, d);
      }
    }
  }
  bool beyond = false;
  for (int32_t q : sc.touched) beyond |= dist[static_cast<size_t>(q)] > kMaxDepth;
  std::string key;
  if (!overflow && beyond) {
    // Canonical numbering: discovery order from s, expanding only the states within reach.
    auto inside = [&](int32_t q) { return dist[static_cast<size_t>(q)] <= kMaxDepth; };
    std::vector<int32_t>& num = sc.num;
    order.push_back(s);
    num[static_cast<size_t>(s)] = 0;
    auto reach = [&](int32_t q) {
      if (num[static_cast<size_t>(q)] >= 0) return;
      num[static_cast<size_t>(q)] = static_cast<int32_t>(order.size());
      order.push_back(q);
    };
    for (size_t i = 0; i < order.size(); ++i) {
      if (!inside(order[i])) continue;
      const State& st = g_.states[order[i]];
      for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) reach(g_.byte_edges[e].target);
      if (calls) {
        for (uint32_t e = st.ref_begin; e < st.ref_end; ++e) reach(g_.ref_edges[e].target);
      }
    }
    std::string ser(1, calls ? 'c' : 'p');
    ser.reserve(order.size() * 64);
    auto put = [&](int32_t v) { ser.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
    put(kMaxDepth);
    for (int32_t q : order) {
      if (!inside(q)) {
        put(-7);  // beyond reach: only its existence is read
        continue;
      }
      append_state_key(q, calls, true, num, ser);
    }
    ser.append(reinterpret_cast<const char*>(g_.follow[r].data()), sizeof(ByteSet));
    key = digest(ser, 'S');
  }
  std::lock_guard<std::mutex> lock(local_mu_);
  return short_keys_.emplace(s, std::move(key)).first->second;
}

// The plain walk (MaskStrategies::compute_mask) of some tokens from s, stepping through the
// edge lists instead of building a 256-entry row per state met: the long tokens of a counted
// repeat's position run deep into the chain, meeting hundreds of states a few times each.
// `longs` is sorted; a run found dead covers every listed position it reaches (and, with its
// rejected siblings, is passed over in one search), however the list is cut into blocks.
std::shared_ptr<const StateMask> walk_positions(const CompiledGrammar& g, int32_t s,
                                                const std::vector<int32_t>& longs, const StateMask* base) {
  const TokenizerInfo& t = *g.tok;
  auto out = std::make_shared<StateMask>();
  std::vector<uint32_t> bits(static_cast<size_t>(t.words), 0);
  size_t n_accepted = seed_bits(base, bits);
  std::vector<int32_t> stack(t.max_token_len + 1);
  std::vector<uint8_t> flag(t.max_token_len + 1);
  // escapes(q, d, b): control could leave the rule at byte d (>= 1) of the token, reading b.
  auto escapes = [&](int32_t q, size_t d, uint8_t b) { return d > 0 && has(g.escape[q], b); };
  // The bytes after which a token dying in q at depth d is not simply rejected: q's live bytes,
  // plus from depth 1 on its escape set.
  std::unordered_map<int64_t, ByteSet> stops;
  auto stop_of = [&](int32_t q, bool deep) -> const ByteSet& {
    auto [it, fresh] = stops.try_emplace((static_cast<int64_t>(q) << 1) | (deep ? 1 : 0));
    if (fresh) {
      ByteSet& set = it->second;
      set.fill(0);
      g.add_live_bytes(q, set);
      if (deep) {
        for (size_t w = 0; w < set.size(); ++w) set[w] |= g.escape[static_cast<size_t>(q)][w];
      }
    }
    return it->second;
  };
  const size_t limit = longs.empty() ? 0 : static_cast<size_t>(longs.back()) + 1;
  stack[0] = s;
  flag[0] = 0;
  size_t valid = 0;          // stack entries valid for the previous walked token...
  size_t prev = SIZE_MAX;    // ...at this sorted position
  for (size_t k = 0; k < longs.size();) {
    const size_t i = static_cast<size_t>(longs[k]);
    const uint8_t* tokb = reinterpret_cast<const uint8_t*>(t.sorted_ptr(i));
    const size_t len = t.sorted_len(i);
    size_t d = prev != SIZE_MAX && prev + 1 == i ? std::min<size_t>(t.lcp[i], valid) : 0;
    long dead_at = -1;
    while (d < len) {
      const int32_t nx = g.step(stack[d], tokb[d]);
      if (nx < 0) {
        dead_at = static_cast<long>(d);
        break;
      }
      flag[d + 1] = flag[d] | static_cast<uint8_t>(escapes(stack[d], d, tokb[d]));
      stack[d + 1] = nx;
      ++d;
    }
    valid = d;
    prev = i;
    if (dead_at < 0) {
      const int32_t id = t.sorted[i];
      bits[static_cast<size_t>(id) >> 5] |= 1u << (id & 31);
      ++n_accepted;
      ++k;
      continue;
    }
    // The run sharing the dead prefix: the listed positions in it share the token's fate (the
    // others `base` classifies alike, from a neighbourhood that agrees as far as they reach).
    size_t run = t.run_end(i, static_cast<size_t>(dead_at) + 1);
    const size_t k_run = static_cast<size_t>(std::lower_bound(longs.begin() + static_cast<long>(k), longs.end(),
                                                              static_cast<int32_t>(run)) -
                                             longs.begin());
    const bool uncertain = flag[d] || escapes(stack[d], d, tokb[d]);
    if (uncertain) {
      for (size_t j = k; j < k_run; ++j) out->uncertain.push_back(longs[j]);
    }
    // Siblings dying here with a byte the rule cannot leave with are rejected, as in the walk.
    if (!flag[d]) run = t.skip_dead(i, d, run, limit, stop_of(stack[d], d > 0));
    k = static_cast<size_t>(std::lower_bound(longs.begin() + static_cast<long>(k_run), longs.end(),
                                             static_cast<int32_t>(run)) -
                            longs.begin());
  }
  merge_uncertain(*out, base);
  finish_mask(*out, std::move(bits), n_accepted);
  out->uncertain.shrink_to_fit();
  return out;
}

std::shared_ptr<const StateMask> MaskStrategies::compute_from_short(int32_t s, bool calls) const {
  if (!dense_start(s) || short_key(s).empty()) return nullptr;
  std::shared_ptr<const StateMask> part = g_.tok->cache_get(short_key(s));
  if (!part) return nullptr;
  return walk_listed(s, g_.tok->long_sorted, part.get(), calls);
}

std::shared_ptr<const StateMask> MaskStrategies::walk_listed(int32_t s, const std::vector<int32_t>& listed,
                                                              const StateMask* base, bool calls) const {
  if (!calls) return walk_positions(g_, s, listed, base);
  // The pushdown walk takes them in blocks of consecutive sorted positions (the walks reuse
  // common prefixes inside a range).
  std::vector<WalkRange> ranges;
  for (size_t i = 0; i < listed.size();) {
    size_t j = i + 1;
    while (j < listed.size() && listed[j] == listed[j - 1] + 1) ++j;
    ranges.push_back({static_cast<size_t>(listed[i]), static_cast<size_t>(listed[j - 1]) + 1, 0, s, 0});
    i = j;
  }
  // A pushdown walk that gives up leaves the plain walk's coarser (equally exact) answer.
  std::shared_ptr<const StateMask> out = compute_mask_with_calls(ranges, base);
  return out ? out : compute_mask(ranges, base);
}

void MaskStrategies::put_short(int32_t s, const StateMask& full) const {
  if (!dense_start(s) || short_key(s).empty() || g_.tok->cache_get(short_key(s))) return;
  const TokenizerInfo& tk = *g_.tok;
  auto is_short = [&](int32_t id) { return tk.tokens[static_cast<size_t>(id)].size() <= TokenizerInfo::kShortTokenLen; };
  std::vector<uint32_t> bits(static_cast<size_t>(tk.words), 0);
  size_t n = seed_bits_except(&full, bits, tk.long_sorted, tk.sorted);
  auto part = std::make_shared<StateMask>();
  for (int32_t j : full.uncertain) {
    if (is_short(tk.sorted[static_cast<size_t>(j)])) part->uncertain.push_back(j);
  }
  finish_mask(*part, std::move(bits), n);
  part->uncertain.shrink_to_fit();
  g_.tok->cache_put(short_key(s), std::move(part));
}

}  // namespace grammar
}  // namespace agent_infer
