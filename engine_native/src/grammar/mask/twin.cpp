// Twin masks: a cheap first visit for states whose neighbourhood repeats one computed before.
//
// The plain walk classifies a token of n bytes from state s by reading the states along its
// path at depths 0 .. n-1 (their byte edges, and their escape sets from depth 1 on); the state
// after the last byte only has to exist. So if a lockstep search from s and from an earlier state
// a pairs their states consistently, with equal edges and escape sets, down to depth D, every
// token of at most D bytes is classified alike from both. The positions of a counted repeat (a
// `maxLength` string) are distinct states, but every position farther from the repeat's end than
// the longest token has a neighbourhood equal to its predecessor's: such a state takes its twin's
// mask as it is (no walk, no key). Nearer the end the neighbourhoods agree up to about the
// distance to the end: the tokens up to that length come from the twin, the longer ones are
// walked. States whose walk is the pushdown walk (a bounded string inlined into an object reaches
// the object's next key within a token) compare what it reads instead: final flags, the same
// callees, the targets of calls paired at the depth of the call, and the rule's follow set.
// Twins live per grammar; the short-token masks (grammar/mask/short_tokens.cpp) share across grammars.
#include <algorithm>
#include <cstring>

#include "grammar/automaton.h"
#include "grammar/compiled_grammar.h"
#include "grammar/mask/mask_strategies.h"
#include "grammar/mask/state_mask.h"
#include "grammar/mask/tokenizer_info.h"
#include "grammar/thread_slot.h"

namespace agent_infer {
namespace grammar {

namespace {
// Twins kept per local shape (a state's own edges and escape set).
constexpr size_t kMaxTwins = 4;
// Pairs visited per comparison at most (a counted string position meets ~10 states per byte).
constexpr size_t kMaxPairs = 8192;

struct PairScratch {
  std::vector<int32_t> fwd, rev;  // by state; -1 outside a comparison
  std::vector<int32_t> depth;     // by state: the depth it was paired at (valid while paired)
  std::vector<int32_t> touched_fwd, touched_rev;
  struct Pair {
    int32_t q, q2;
  };
  std::vector<Pair> cur, next;  // the pairs at the current depth and at the next one
};

PairScratch& pair_scratch(size_t n_states) {
  PairScratch& sc = thread_slot<PairScratch>();
  if (sc.fwd.size() < n_states) {
    sc.fwd.resize(n_states, -1);
    sc.rev.resize(n_states, -1);
    sc.depth.resize(n_states, 0);
  }
  return sc;
}

// What the walks read of a state: its byte edges, its escape set from depth 1 on (plain walk),
// and in the pushdown walk its final flag and its calls (callees named by rule: one grammar).
bool same_content(const CompiledGrammar& g, int32_t q, int32_t q2, bool with_escape, bool calls) {
  const State& a = g.states[static_cast<size_t>(q)];
  const State& b = g.states[static_cast<size_t>(q2)];
  if (a.byte_end - a.byte_begin != b.byte_end - b.byte_begin) return false;
  for (uint32_t i = 0; i < a.byte_end - a.byte_begin; ++i) {
    const ByteEdge& x = g.byte_edges[a.byte_begin + i];
    const ByteEdge& y = g.byte_edges[b.byte_begin + i];
    if (x.lo != y.lo || x.hi != y.hi) return false;
  }
  if (with_escape && g.escape[static_cast<size_t>(q)] != g.escape[static_cast<size_t>(q2)]) return false;
  if (!calls) return true;
  if (a.final != b.final || a.ref_end - a.ref_begin != b.ref_end - b.ref_begin) return false;
  for (uint32_t i = 0; i < a.ref_end - a.ref_begin; ++i) {
    if (g.ref_edges[a.ref_begin + i].rule != g.ref_edges[b.ref_begin + i].rule) return false;
  }
  return true;
}

// How many bytes a token may have and still be classified alike by the walks from s and from a
// (at most `limit`): the plain walks, or with `calls` the pushdown walks, which also enter
// callees (the same rules on both sides) and return to the targets of the calls, read at the
// depth of the call.
int32_t agreement(const CompiledGrammar& g, int32_t s, int32_t a, int32_t limit, bool calls) {
  // The pushdown walk finishes the item's rule by its follow set (from byte 1 on).
  if (calls && g.follow[static_cast<size_t>(g.states[static_cast<size_t>(s)].rule)] !=
                   g.follow[static_cast<size_t>(g.states[static_cast<size_t>(a)].rule)]) {
    return 1;
  }
  PairScratch& sc = pair_scratch(g.states.size());
  struct Reset {
    PairScratch& sc;
    ~Reset() {
      for (int32_t q : sc.touched_fwd) sc.fwd[static_cast<size_t>(q)] = -1;
      for (int32_t q : sc.touched_rev) sc.rev[static_cast<size_t>(q)] = -1;
      sc.touched_fwd.clear();
      sc.touched_rev.clear();
      sc.cur.clear();
      sc.next.clear();
    }
  } reset{sc};
  auto pair = [&](int32_t q, int32_t q2, int32_t d, std::vector<PairScratch::Pair>& into) {
    sc.depth[static_cast<size_t>(q)] = d;
    sc.fwd[static_cast<size_t>(q)] = q2;
    sc.rev[static_cast<size_t>(q2)] = q;
    sc.touched_fwd.push_back(q);
    sc.touched_rev.push_back(q2);
    into.push_back({q, q2});
  };
  // Whether t (on s's side) and t2 may be paired; false: they conflict with earlier pairs.
  auto consistent = [&](int32_t t, int32_t t2) {
    const int32_t f = sc.fwd[static_cast<size_t>(t)], r = sc.rev[static_cast<size_t>(t2)];
    return (f < 0 && r < 0) || (f == t2 && r == t);
  };
  pair(s, a, 0, sc.cur);
  int32_t agree = limit;
  size_t visited = 0;
  // Depth by depth: a pair at depth d with unequal contents (read by tokens longer than d bytes)
  // bounds the agreement at d; two paths that meet in one state on one side but not on the other
  // bound it at the depth of the state they meet in (a token ending there reads nothing of it).
  for (int32_t d = 0; d < agree && !sc.cur.empty(); ++d) {
    for (size_t i = 0; i < sc.cur.size(); ++i) {  // grows by the targets of calls (same depth)
      if (++visited > kMaxPairs) return d;
      const PairScratch::Pair p = sc.cur[i];
      // The escape set of the start state is never read (no token is uncertain at byte 0).
      if (!same_content(g, p.q, p.q2, d > 0, calls)) return d;
      const State& st = g.states[static_cast<size_t>(p.q)];
      const State& st2 = g.states[static_cast<size_t>(p.q2)];
      for (uint32_t e = 0; e < st.byte_end - st.byte_begin; ++e) {
        const int32_t t = g.byte_edges[st.byte_begin + e].target;
        const int32_t t2 = g.byte_edges[st2.byte_begin + e].target;
        if (!consistent(t, t2)) {
          agree = std::min(agree, d + 1);
        } else if (sc.fwd[static_cast<size_t>(t)] < 0 && d + 1 < limit) {
          pair(t, t2, d + 1, sc.next);  // deeper states are never read: pairing them would only add work
        }
      }
      if (!calls) continue;
      for (uint32_t e = 0; e < st.ref_end - st.ref_begin; ++e) {
        const int32_t t = g.ref_edges[st.ref_begin + e].target;
        const int32_t t2 = g.ref_edges[st2.ref_begin + e].target;
        if (!consistent(t, t2)) {
          agree = std::min(agree, d);
        } else if (sc.fwd[static_cast<size_t>(t)] < 0) {
          pair(t, t2, d, sc.cur);
        } else if (sc.depth[static_cast<size_t>(t)] > d) {
          // Paired one byte deeper earlier in this round: read at this depth too.
          sc.depth[static_cast<size_t>(t)] = d;
          sc.cur.push_back({t, t2});
        }
      }
    }
    sc.cur.swap(sc.next);
    sc.next.clear();
  }
  return agree;
}

uint64_t shape_of(const CompiledGrammar& g, int32_t s, bool calls) {
  const State& st = g.states[static_cast<size_t>(s)];
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (st.byte_end - st.byte_begin) ^ (calls ? 0x100000000ull : 0);
  auto mix = [&](uint64_t v) {
    h = (h ^ v) * 0xff51afd7ed558ccdull;
    h ^= h >> 29;
  };
  for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) mix((g.byte_edges[e].lo << 8) | g.byte_edges[e].hi);
  for (uint32_t w : g.escape[static_cast<size_t>(s)]) mix(w);
  if (calls) {
    mix(st.final ? 1 : 0);
    for (uint32_t e = st.ref_begin; e < st.ref_end; ++e) mix(static_cast<uint64_t>(g.ref_edges[e].rule) + 7);
  }
  return h;
}
}  // namespace

std::vector<MaskStrategies::WalkRange> MaskStrategies::longer_ranges(int32_t s, const std::vector<int32_t>& longer,
                                                                      size_t cut) const {
  // Only the runs of s's live first bytes can hold a token s does not reject at byte 0. In a run
  // where long tokens are common, one range over the run passes the short ones by (a block per
  // stretch of consecutive long tokens costs a start set each: ~0.3 ms for a hex-digit position,
  // where a third of the vocabulary is long and the walk dies within two bytes); where they are
  // rare (the long words of a string position's run), their blocks are walked alone.
  std::vector<WalkRange> ranges;
  const TokenizerInfo& tk = *g_.tok;
  const State& st = g_.states[static_cast<size_t>(s)];
  size_t run_lo = 0, run_hi = 0;
  auto emit = [&]() {
    if (run_hi <= run_lo) return;
    auto k0 = std::lower_bound(longer.begin(), longer.end(), static_cast<int32_t>(run_lo));
    auto k1 = std::lower_bound(k0, longer.end(), static_cast<int32_t>(run_hi));
    if (static_cast<size_t>(k1 - k0) * 4 >= run_hi - run_lo) {
      ranges.push_back({run_lo, run_hi, 0, s, 0, static_cast<uint16_t>(cut)});
      return;
    }
    for (auto k = k0; k != k1;) {
      auto j = k + 1;
      while (j != k1 && *j == *(j - 1) + 1) ++j;
      ranges.push_back({static_cast<size_t>(*k), static_cast<size_t>(*(j - 1)) + 1, 0, s, 0});
      k = j;
    }
  };
  std::vector<ByteEdge> edges(g_.byte_edges.begin() + st.byte_begin, g_.byte_edges.begin() + st.byte_end);
  std::sort(edges.begin(), edges.end(), [](const ByteEdge& x, const ByteEdge& y) { return x.lo < y.lo; });
  for (const ByteEdge& be : edges) {
    const size_t lo = be.lo == 0 ? 0 : tk.first_byte_end[be.lo - 1u], hi = tk.first_byte_end[be.hi];
    if (lo == run_hi) {
      run_hi = hi;  // adjacent edges: one run
      continue;
    }
    emit();
    run_lo = lo;
    run_hi = hi;
  }
  emit();
  return ranges;
}

std::shared_ptr<const StateMask> MaskStrategies::compute_from_twin(int32_t s, bool* twin_whole, bool whole_only) const {
  *twin_whole = false;
  const bool calls = calls_within_reach(s);
  std::vector<Twin> candidates;
  {
    std::lock_guard<std::mutex> lock(twin_mu_);
    auto it = twins_.find(shape_of(g_, s, calls));
    if (it == twins_.end()) return nullptr;
    candidates = it->second;
  }
  const TokenizerInfo& tk = *g_.tok;
  const int32_t full = static_cast<int32_t>(tk.max_token_len);
  int32_t best = -1;
  const Twin* twin = nullptr;
  for (const Twin& c : candidates) {
    const int32_t d = agreement(g_, s, c.state, full, calls);
    if (d > best) {
      best = d;
      twin = &c;
    }
    if (best >= full) break;
  }
  if (!twin) return nullptr;
  if (best >= full) {
    *twin_whole = true;
    return twin->mask;
  }
  if (whole_only) return nullptr;
  // The longest listed length class the neighbourhoods agree on.
  int k = static_cast<int>(TokenizerInfo::kTwinLens.size()) - 1;
  while (k >= 0 && static_cast<int32_t>(TokenizerInfo::kTwinLens[static_cast<size_t>(k)]) > best) --k;
  if (k < 0) return nullptr;
  const size_t cut = TokenizerInfo::kTwinLens[static_cast<size_t>(k)];
  const std::vector<int32_t>& longer = tk.longer_sorted[static_cast<size_t>(k)];
  // Walking most of the vocabulary token by token costs more than the other first visits.
  if (longer.size() * 2 > tk.sorted.size()) return nullptr;
  // The twin's classification of the tokens of at most `cut` bytes...
  const StateMask& tm = *twin->mask;
  auto base = std::make_shared<StateMask>();
  std::vector<uint32_t> bits(static_cast<size_t>(tk.words), 0);
  size_t n = seed_bits_masked(&tm, bits, tk.longer_bits[static_cast<size_t>(k)]);
  base->uncertain.reserve(tm.uncertain.size());
  for (int32_t j : tm.uncertain) {
    if (tk.sorted_len(static_cast<size_t>(j)) <= cut) base->uncertain.push_back(j);
  }
  finish_mask(*base, std::move(bits), n);
  // ...plus a walk of the longer ones: the plain walk steps through their list (deep chains meet
  // many states a few times each); the pushdown walk takes them in ranges (below).
  if (!calls) return walk_positions(g_, s, longer, base.get());
  const std::vector<WalkRange> ranges = longer_ranges(s, longer, cut);
  // A pushdown walk that gives up leaves the plain walk's coarser (equally exact) answer.
  std::shared_ptr<const StateMask> out = compute_mask_with_calls(ranges, base.get());
  return out ? out : compute_mask(ranges, base.get());
}

void MaskStrategies::remember_twin(int32_t s, const std::shared_ptr<const StateMask>& mask) const {
  std::lock_guard<std::mutex> lock(twin_mu_);
  std::vector<Twin>& list = twins_[shape_of(g_, s, calls_within_reach(s))];
  for (const Twin& t : list) {
    if (t.state == s) return;
  }
  // Newest first: a counted repeat is usually decoded forwards, so the latest position is the
  // likeliest to agree with the next one.
  list.insert(list.begin(), Twin{s, mask});
  if (list.size() > kMaxTwins) list.pop_back();
}

}  // namespace grammar
}  // namespace agent_infer
