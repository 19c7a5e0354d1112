// Per-state token classification: for an automaton state, every token is accepted (consumed
// inside the rule's automaton), rejected (dies before the rule could hand over control), or
// uncertain (the rule may complete or call another rule mid-token, so the context decides).
// mask_for picks the walk (plain, pushdown, loop region, short tokens) and the cache key.
#include <algorithm>
#include <cstring>
#include <mutex>

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
// Per-thread state -> row index scratch, reset entry by entry after each walk: clearing a vector
// of every grammar state per first-seen state cost ~0.1 ms on grammars with 10^5 states.
struct RowIndex {
  std::vector<int32_t> row_of;
  std::vector<int32_t> touched;
  explicit RowIndex(size_t n) : row_of(tls_rows()) {
    if (row_of.size() < n) row_of.resize(n, -1);
  }
  ~RowIndex() {
    for (int32_t q : touched) row_of[static_cast<size_t>(q)] = -1;
    tls_rows().swap(row_of);
  }
  static std::vector<int32_t>& tls_rows() {
    struct Rows {
      std::vector<int32_t> v;
    };
    return thread_slot<Rows>().v;
  }
};
}  // namespace

MaskStrategies::RangeCarry::RangeCarry(const std::vector<WalkRange>& ranges)
    : ranges_(ranges), group_(ranges.size()), limit_(ranges.size()) {
  for (size_t r = 0; r < ranges.size(); ++r) {
    const WalkRange& a = ranges[r];
    const bool joins = r > 0 && a.depth == 0 && a.flag == 0 && ranges[r - 1].depth == 0 && ranges[r - 1].flag == 0 &&
                       ranges[r - 1].state == a.state && ranges[r - 1].end <= a.begin;
    group_[r] = joins ? group_[r - 1] : r;
  }
  for (size_t r = ranges.size(); r-- > 0;) {
    limit_[r] = r + 1 < ranges.size() && group_[r + 1] == group_[r] ? limit_[r + 1] : ranges[r].end;
  }
}

std::shared_ptr<const StateMask> MaskStrategies::compute_mask(const std::vector<WalkRange>& ranges,
                                                               const StateMask* base) const {
  std::shared_ptr<const StateMask> split;
  if (split_walk(ranges, base, false, &split)) return split;
  return compute_mask_part(ranges, base, false);
}

std::shared_ptr<const StateMask> MaskStrategies::compute_mask_part(const std::vector<WalkRange>& ranges,
                                                                    const StateMask* base, bool resume) const {
  const TokenizerInfo& t = *g_.tok;
  auto out = std::make_shared<StateMask>();
  AcceptedSet accepted(static_cast<size_t>(t.words), base, live_tokens(ranges));
  // Dense 256-entry transition rows for the states this walk meets (the walk is the hot loop).
  RowIndex index(g_.states.size());
  std::vector<int32_t>& row_of = index.row_of;
  std::vector<int32_t> rows;
  std::vector<const ByteSet*> row_escape;
  // Bytes after which a token is not simply rejected here: live edges and the escape set.
  std::vector<ByteSet> row_stop;
  std::vector<ByteSet> row_live;  // the bytes it has edges for
  // Rows of states where a run-time check may end (RuntimeChecks::end): a token ending there is
  // uncertain, not accepted. Empty when the grammar has no checks.
  const std::vector<uint8_t>& check_end = g_.checks.end;
  std::vector<uint8_t> row_check_end;
  auto row = [&](int32_t q) -> int32_t {
    if (row_of[q] >= 0) return row_of[q];
    int32_t r = static_cast<int32_t>(row_escape.size());
    row_of[q] = r;
    index.touched.push_back(q);
    if (!check_end.empty()) row_check_end.push_back(check_end[static_cast<size_t>(q)]);
    rows.resize(rows.size() + 256, -1);
    row_live.push_back(ByteSet{});
    ByteSet& live = row_live.back();
    const State& st = g_.states[q];
    for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
      const ByteEdge& be = g_.byte_edges[e];
      for (int b = be.lo; b <= be.hi; ++b) {
        rows[static_cast<size_t>(r) * 256 + b] = be.target;
        live[static_cast<size_t>(b) >> 5] |= 1u << (b & 31);
      }
    }
    row_stop.push_back(live);
    for (size_t w = 0; w < 8; ++w) row_stop.back()[w] |= g_.escape[q][w];
    row_escape.push_back(&g_.escape[q]);
    return r;
  };
  // stack[d]: row of the automaton state after d bytes of the current token. flag[d]: at some
  // position j in [1, d) control could have left the rule to read byte j elsewhere (call a rule
  // or finish it, with byte j in the escape set); a token dying after such a point is only
  // "uncertain". Both depend on the first d bytes alone, so they are shared along the trie.
  std::vector<int32_t> stack(t.max_token_len + 1);
  std::vector<uint8_t> flag(t.max_token_len + 1);
  RangeCarry carry(ranges);
  for (size_t r = 0; r < ranges.size(); ++r) {
    const WalkRange& range = ranges[r];
    const size_t depth0 = range.depth;
    const size_t begin = carry.begin(r);
    if (begin >= range.end) continue;
    stack[depth0] = row(range.state);
    flag[depth0] = range.flag;
    size_t valid = depth0;  // stack entries valid for the previous token
    for (size_t i = begin; i < range.end; ++i) {
      size_t l = i == begin ? depth0 : t.lcp[i];
      long dead_at = -1;  // the token died reading byte dead_at
      const uint8_t* tokb = reinterpret_cast<const uint8_t*>(t.sorted_ptr(i));
      const size_t len = t.sorted_len(i);
      if (len <= range.min_len) {  // the base's; only its prefix is shared with what follows
        valid = std::min(valid, l);
        continue;
      }
      size_t d = std::min(l, valid);
      while (d < len) {
        int32_t nx = rows[static_cast<size_t>(stack[d]) * 256 + tokb[d]];
        if (nx < 0) {
          dead_at = static_cast<long>(d);
          break;
        }
        stack[d + 1] = row(nx);
        flag[d + 1] = flag[d] | static_cast<uint8_t>(d > 0 && has(*row_escape[stack[d]], tokb[d]));
        ++d;
      }
      valid = d;
      if (dead_at < 0) {
        if (!row_check_end.empty() && row_check_end[static_cast<size_t>(stack[len])]) {
          out->uncertain.push_back(static_cast<int32_t>(i));
        } else {
          accepted.add(t.sorted[i]);
        }
        continue;
      }
      // Every token sharing the dead prefix shares this token's fate: classify the run at once.
      size_t end = t.run_end(i, static_cast<size_t>(dead_at) + 1);
      const bool continued = resume && i == range.begin && r == 0 && t.lcp[i] > dead_at;
      if (!continued && (flag[d] || (d > 0 && has(*row_escape[stack[d]], tokb[d])))) {
        for (size_t j = i; j < end; ++j) {
          if (t.sorted_len(j) > range.min_len) out->uncertain.push_back(static_cast<int32_t>(j));
        }
      }
      // The siblings that die here too, rejected, are passed over in one search (at byte 0
      // every death is a rejection).
      if (d == 0) {
        end = t.skip_dead(i, 0, end, carry.limit(r), row_live[static_cast<size_t>(stack[0])]);
      } else if (!flag[d]) {
        end = t.skip_dead(i, d, end, carry.limit(r), row_stop[static_cast<size_t>(stack[d])]);
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


bool MaskStrategies::dense_start(int32_t s) const {
  constexpr size_t kMinDense = 4096;
  size_t live = 0;
  const State& st = g_.states[s];
  for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
    const ByteEdge& be = g_.byte_edges[e];
    live += g_.tok->first_byte_end[be.hi] - (be.lo == 0 ? 0 : g_.tok->first_byte_end[be.lo - 1u]);
  }
  return live >= kMinDense;
}

// The pushdown walk of a dense state refines the plain walk: a token the plain walk accepts is
// consumed inside the rule, which the pushdown walk follows too (accepted); one it rejects dies
// before control could leave the rule, where the pushdown walk has no other configuration
// (rejected). Only the plain walk's uncertain tokens need the pushdown walk, and they come in
// runs that share the prefix where the rule could be left; the plain walk's rows cost less per
// byte than the pushdown walk's configuration sets, so the dense part of the vocabulary is
// cheaper there.
std::shared_ptr<const StateMask> MaskStrategies::refine_with_calls(int32_t s) const {
  std::shared_ptr<const StateMask> plain = compute_mask({{0, g_.tok->sorted.size(), 0, s, 0}}, nullptr);
  if (plain->uncertain.empty()) return plain;
  std::vector<WalkRange> ranges;
  for (size_t i = 0; i < plain->uncertain.size();) {
    size_t j = i + 1;
    while (j < plain->uncertain.size() && plain->uncertain[j] == plain->uncertain[j - 1] + 1) ++j;
    ranges.push_back({static_cast<size_t>(plain->uncertain[i]), static_cast<size_t>(plain->uncertain[j - 1]) + 1, 0, s, 0});
    i = j;
  }
  StateMask accepted;
  accepted.accepted_bits = plain->accepted_bits;
  accepted.accepted_ids = plain->accepted_ids;
  std::shared_ptr<const StateMask> refined = compute_mask_with_calls(ranges, &accepted);
  return refined ? refined : plain;  // a pushdown walk that gives up leaves the coarser answer
}

void MaskStrategies::reset(size_t num_states) {
  state_masks_.reset(new std::atomic<const StateMask*>[num_states]);
  for (size_t i = 0; i < num_states; ++i) state_masks_[i].store(nullptr, std::memory_order_relaxed);
}

const StateMask& MaskStrategies::mask_for(int32_t s) const {
  const StateMask* p = state_masks_[s].load(std::memory_order_acquire);
  if (p) return *p;
  const bool calls = calls_within_reach(s);
  if (!g_.checks.affected.empty() && g_.checks.affected[static_cast<size_t>(g_.states[s].rule)]) {
    return keep(s, checked_walk(s, calls));
  }
  // The shared cache pays off across grammars; within one grammar a state's key is its own.
  // A pushdown key is the Merkle digest of the whole rule call graph below the state's rule:
  // milliseconds on a large schema the first time (the root state of the first mask paid for
  // the whole grammar). A plain key serializes the state's rule: half a millisecond for a long
  // counted chain (a `maxLength` of 1 024). States whose key would cost that much are
  // classified for this grammar alone, until their key exists anyway.
  const bool keyed = calls ? pushdown_keys_ready(g_.states[s].rule) : plain_key_cheap(g_.states[s].rule);
  std::string key;
  std::shared_ptr<const StateMask> m;
  if (keyed) {
    profile::Scope scope(profile::kStateKey);
    key = structure_key(s);
    m = g_.tok->cache_get(key);
  }
  if (!m) {
    // A state inside a loop region reuses the region's shared walk and classifies only the
    // tokens that leave the region; any other state walks every token.
    std::string region_key;
    std::vector<int32_t> exit_states;
    std::shared_ptr<const StateMask> region;
    if (region_of(s, &region_key, &exit_states)) {
      region_key = digest(region_key, 'R');
      region = g_.tok->cache_get(region_key);
      if (!region) {
        // A dense region's walk from its first bytes' targets (shared by its neighbours'),
        // else the region walk itself.
        {
          profile::Scope scope(profile::kPieces);
          region = region_by_first_byte(s, exit_states);
        }
        profile::Scope scope(profile::kRegionWalk);
        region = g_.tok->cache_put(region_key, region ? region : compute_region(s, exit_states));
      }
    }
    std::vector<WalkRange> ranges;
    if (region) {
      for (const RegionExit& e : region->exits) {
        ranges.push_back({static_cast<size_t>(e.begin), static_cast<size_t>(e.end), static_cast<size_t>(e.depth),
                          exit_states[static_cast<size_t>(e.exit)], static_cast<uint8_t>(e.flag)});
      }
    } else {
      ranges.push_back({0, g_.tok->sorted.size(), 0, s, 0});
    }
    // A dense state outside a loop region reuses the short-token mask of a state alike within
    // a short token's reach (counted repeats), or assembles its mask from cached first-byte pieces.
    std::shared_ptr<const StateMask> fresh;
    // A dense state inside a string takes the content tokens whole (grammar/mask/content.cpp). Else it
    // may repeat the neighbourhood of an earlier one (grammar/mask/twin.cpp), which needs no key.
    // A twin as deep as the longest token is a copy; otherwise first-byte pieces whose main
    // target's piece is cached (a key automaton's prefix states after the first: a twin's walk
    // of the longer tokens costs ~2 ms there) come before a twin's partial walk.
    const bool twin_kind = !region && dense_start(s);
    bool from_twin = false, from_pieces = false, from_content = false;
    bool whole = false;
    if (twin_kind) {
      // Inside a string (grammar/mask/content.cpp): all content tokens at once, a walk of the rest.
      // Before the twins: comparing neighbourhoods as deep as the longest token costs more
      // (0.2-0.6 ms at a `maxLength` position, plain or inside an object) than the content
      // mask's walk (0.1-0.2 ms).
      {
        profile::Scope scope(profile::kContent);
        fresh = compute_from_content(s);
        from_content = fresh != nullptr;
      }
      if (!fresh) {
        profile::Scope scope(profile::kTwin);
        fresh = compute_from_twin(s, &whole, true);
      }
      if (!fresh) {
        profile::Scope scope(profile::kPieces);
        fresh = compute_by_first_byte(s, true);
        from_pieces = fresh != nullptr;
      }
      if (!fresh) {
        profile::Scope scope(profile::kTwin);
        fresh = compute_from_twin(s, &whole);
      }
      from_twin = fresh != nullptr && !from_pieces && !from_content;
    }
    if (!fresh && !region) {
      profile::Scope scope(profile::kShortFill);
      fresh = compute_from_short(s, calls);
    }
    const bool from_short = fresh != nullptr && !from_twin && !from_pieces && !from_content;
    if (!fresh && !region) {
      profile::Scope scope(profile::kPieces);
      fresh = compute_by_first_byte(s);
      from_pieces = fresh != nullptr;
    }
    const profile::Kind walk_kind =
        region ? profile::kRegionExits : (calls ? profile::kFullCalls : profile::kFullPlain);
    if (!fresh && calls && !region && dense_start(s)) {
      profile::Scope scope(walk_kind);
      fresh = refine_with_calls(s);
    } else if (!fresh && calls) {
      profile::Scope scope(walk_kind);
      fresh = compute_mask_with_calls(ranges, region.get());
    }
    if (!fresh) {
      profile::Scope scope(region ? profile::kRegionExits : profile::kFullPlain);
      fresh = compute_mask(ranges, region.get());
    }
    // Only a walk's result is worth a short-token entry: pieces and twins are cheap already.
    if (!region && !from_short && !from_twin && !from_pieces && !from_content) {
      profile::Scope scope(profile::kPutShort);
      put_short(s, *fresh);
    }
    m = keyed ? g_.tok->cache_put(key, fresh) : fresh;
    if (twin_kind && !from_twin) remember_twin(s, m);
  }
  return keep(s, std::move(m));
}

const StateMask& MaskStrategies::keep(int32_t s, std::shared_ptr<const StateMask> m) const {
  std::lock_guard<std::mutex> lock(mu_);
  const StateMask* p = state_masks_[s].load(std::memory_order_acquire);
  if (p) return *p;
  owned_.push_back(m);
  state_masks_[s].store(m.get(), std::memory_order_release);
  return *m;
}

std::shared_ptr<const StateMask> MaskStrategies::checked_walk(int32_t s, bool calls) const {
  // A state whose walks may meet a run-time check (grammar/runtime_checks.h): the plain and
  // pushdown walks leave a token uncertain where a check may decide it, and nothing else does, so
  // they alone classify it, for this grammar alone.
  if (calls && dense_start(s)) return refine_with_calls(s);
  const std::vector<WalkRange> whole{{0, g_.tok->sorted.size(), 0, s, 0}};
  if (calls) {
    std::shared_ptr<const StateMask> m = compute_mask_with_calls(whole, nullptr);
    if (m) return m;
  }
  return compute_mask(whole, nullptr);
}

std::shared_ptr<const StateMask> MaskStrategies::checked_get(const std::string& key) const {
  std::lock_guard<std::mutex> lock(checked_mu_);
  auto it = checked_.find(key);
  return it == checked_.end() ? nullptr : it->second;
}

void MaskStrategies::checked_put(const std::string& key, std::shared_ptr<const StateMask> allowed) const {
  // Bounded per grammar (and left out of memory_bytes(), which the compiler's LRU cache reads
  // once at insertion): past the budget new outcomes are simply recomputed each time.
  constexpr size_t kMaxCheckedBytes = size_t{8} << 20;
  const size_t bytes = key.size() + allowed->bytes() + 64;
  std::lock_guard<std::mutex> lock(checked_mu_);
  if (checked_bytes_ + bytes > kMaxCheckedBytes) return;
  if (checked_.emplace(key, std::move(allowed)).second) checked_bytes_ += bytes;
}

}  // namespace grammar
}  // namespace agent_infer
