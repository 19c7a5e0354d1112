// First-visit walks split into parts for the threads of a batch fill (grammar/batch/pool.cpp runs them).
//
// A walk's ranges of sorted token positions are cut into parts in walk order, each with about
// its share of the live tokens, and every part is walked as the whole walk would walk it. The
// parts' results, put together in order, reproduce the whole walk's result exactly; the only
// seam is a run of tokens sharing a dead (or region-leaving) prefix that straddles a cut: the
// part before the cut classifies the whole run, the part after it skips the run's rest (the
// walks' `resume`).
#include <algorithm>
#include <atomic>

#include "grammar/batch/batch.h"
#include "grammar/batch/pool.h"
#include "grammar/compiled_grammar.h"
#include "grammar/mask/mask_strategies.h"
#include "grammar/mask/state_mask.h"
#include "grammar/mask/tokenizer_info.h"

namespace agent_infer {
namespace grammar {
namespace {

// Parts shrink as the walk is cut (guided self-scheduling): each takes 1 / (kGuide x threads) of
// the live tokens not yet cut, down to kMinPartTokens. Large parts first amortize their set-up
// (walk stack and transition rows; the pushdown walk re-interns its configuration sets in every
// part); small parts last bound how long the owner waits for the last one (with eight equal
// parts of a 129k-token region walk it waits up to a whole part, ~190 us, for the other thread).
constexpr size_t kGuide = 2;
constexpr size_t kMinPartTokens = 4096;
// Relative cost per token of the pushdown walk (split_walk).
constexpr size_t kCallsWeight = 4;

template <class Range>
struct Part {
  std::vector<Range> ranges;
  bool resume = false;  // the first range continues the previous part's last one
};

// Cuts a walk's ranges into parts in walk order, each with about its share of the live tokens;
// empty if the walk is too small to split. A walk from byte 0 skips a first byte without an
// edge in one lookup, so only tokens whose first byte is live count: a sparse state's walk over
// the whole vocabulary is cheap and stays whole.
template <class Range>
std::vector<Part<Range>> cut_parts(const CompiledGrammar& g, const std::vector<Range>& ranges, size_t threads,
                                   size_t min_split, size_t part_tokens, size_t min_part = kMinPartTokens) {
  const TokenizerInfo& tk = *g.tok;
  auto run_begin = [&](int b) -> size_t { return b == 0 ? 0 : tk.first_byte_end[static_cast<size_t>(b) - 1]; };
  struct Segment {
    size_t begin, end;
    bool live;
  };
  // Most walks are too small to split (about 19 in 20 of a JSON Schema batch's first visits):
  // their live count from the states' byte edges decides that before any segment is built.
  const size_t total = g.masks().live_tokens(ranges);
  if (total < min_split) return {};
  std::vector<Segment> segments;
  segments.reserve(ranges.size() + 256);
  std::vector<size_t> seg_end;  // per range: one past its last segment
  seg_end.reserve(ranges.size());
  for (const Range& r : ranges) {
    if (r.depth > 0) {
      seg_end.push_back(segments.size() + 1);
      segments.push_back({r.begin, r.end, true});
      continue;
    }
    if (r.begin >= r.end) {
      seg_end.push_back(segments.size());
      continue;
    }
    // Only the first bytes of the range's own tokens: a walk of region exits or of long tokens
    // has thousands of short ranges, and 256 lookups each cost more than the split saved.
    auto run_of = [&](size_t pos) {
      return static_cast<int>(std::upper_bound(tk.first_byte_end.begin(), tk.first_byte_end.end(), pos) -
                              tk.first_byte_end.begin());
    };
    const int b_lo = run_of(r.begin), b_hi = std::min(255, run_of(r.end - 1));
    for (int b = b_lo; b <= b_hi; ++b) {
      const size_t lo = std::max(r.begin, run_begin(b));
      const size_t hi = std::min(r.end, static_cast<size_t>(tk.first_byte_end[static_cast<size_t>(b)]));
      if (lo >= hi) continue;
      const bool live = g.step(r.state, static_cast<uint8_t>(b)) >= 0;
      segments.push_back({lo, hi, live});
    }
    seg_end.push_back(segments.size());
  }
  size_t left = total;  // live tokens not yet in a finished part
  auto next_target = [&] {
    const size_t share = kGuide * std::max<size_t>(threads, 1);
    return part_tokens > 0 ? part_tokens : std::max(min_part, (left + share - 1) / share);
  };
  size_t target = next_target();
  std::vector<Part<Range>> parts(1);
  size_t filled = 0, seg = 0;
  for (size_t ri = 0; ri < ranges.size(); ++ri) {
    const Range& r = ranges[ri];
    std::vector<size_t> cuts;  // positions where a new part starts
    for (; seg < seg_end[ri]; ++seg) {
      const Segment& sg = segments[seg];
      if (!sg.live) continue;
      for (size_t a = sg.begin; a < sg.end;) {
        if (filled >= target) {
          cuts.push_back(a);
          left -= filled;
          filled = 0;
          target = next_target();
        }
        const size_t take = std::min(sg.end - a, target - filled);
        filled += take;
        a += take;
      }
    }
    // An empty range walks nothing, but the pushdown walk still expands its start: keep it.
    auto piece = [&r](size_t b, size_t e) {
      Range p = r;  // the same walk (start, depth, flag, length filter) over [b, e)
      p.begin = b;
      p.end = e;
      return p;
    };
    size_t from = r.begin;
    for (size_t cut : cuts) {
      if (cut > from) parts.back().ranges.push_back(piece(from, cut));
      parts.emplace_back();
      parts.back().resume = cut > r.begin;
      from = cut;
    }
    parts.back().ranges.push_back(piece(from, r.end));
  }
  if (parts.size() < 2) return {};
  return parts;
}

template <class Range>
std::vector<Part<Range>> cut_parts(const CompiledGrammar& g, const std::vector<Range>& ranges, size_t threads,
                                   size_t weight = 1) {
  // `weight`: the walk's cost per token relative to the plain walk's; the thresholds are in
  // plain-walk tokens.
  auto parts = cut_parts(g, ranges, threads, split_min_tokens() / weight, split_part_tokens(),
                         std::max<size_t>(1, kMinPartTokens / weight));
  if (!parts.empty()) count_split();
  return parts;
}

bool same_mask(const StateMask* a, const StateMask* b) {
  if (!a || !b) return a == b;
  auto same_exits = [&] {
    return std::equal(a->exits.begin(), a->exits.end(), b->exits.begin(), b->exits.end(),
                      [](const RegionExit& x, const RegionExit& y) {
                        return x.begin == y.begin && x.end == y.end && x.depth == y.depth && x.exit == y.exit &&
                               x.flag == y.flag;
                      });
  };
  return a->accepted_bits == b->accepted_bits && a->accepted_ids == b->accepted_ids && a->uncertain == b->uncertain &&
         same_exits();
}

}  // namespace

// The parts' results put together as the unsplit walk builds its own: base's accepted tokens
// plus every part's, the parts' uncertain positions and region exits in walk order, then base's
// uncertain positions merged in.

std::shared_ptr<const StateMask> assemble_parts(const TokenizerInfo& tk,
                                                const std::vector<std::shared_ptr<const StateMask>>& done,
                                                const StateMask* base) {
  auto mask = std::make_shared<StateMask>();
  std::vector<uint32_t> bits(static_cast<size_t>(tk.words), 0);
  seed_bits(base, bits);
  size_t n_uncertain = 0, n_exits = 0;
  for (const auto& d : done) {
    n_uncertain += d->uncertain.size();
    n_exits += d->exits.size();
  }
  mask->uncertain.reserve(n_uncertain);
  mask->exits.reserve(n_exits);
  for (const auto& d : done) {
    if (!d->accepted_bits.empty()) {
      for (size_t w = 0; w < bits.size(); ++w) bits[w] |= d->accepted_bits[w];
    }
    or_ids(bits, d->accepted_ids);
    mask->uncertain.insert(mask->uncertain.end(), d->uncertain.begin(), d->uncertain.end());
    mask->exits.insert(mask->exits.end(), d->exits.begin(), d->exits.end());
  }
  merge_uncertain(*mask, base);
  // Counted once here: parts (KeepBits) hand over their bitsets uncounted.
  const size_t n_accepted = count_bits(bits.data(), bits.size());
  finish_mask(*mask, std::move(bits), n_accepted);
  mask->uncertain.shrink_to_fit();
  return mask;
}

bool MaskStrategies::split_walk(const std::vector<WalkRange>& ranges, const StateMask* base, bool calls,
                                 std::shared_ptr<const StateMask>* out) const {
  const size_t threads = batch_team_threads();
  if (threads < 2) return false;
  // A pushdown walk reads configuration sets (several items, interned per part) where the plain
  // walk reads one state: measured at 4-8x the plain walk's time per token, so a walk of a few
  // thousand tokens (a twin's long tokens from a position inside an object) already runs for
  // milliseconds.
  const std::vector<Part<WalkRange>> parts = cut_parts(g_, ranges, threads, calls ? kCallsWeight : 1);
  if (parts.empty()) return false;
  std::vector<std::shared_ptr<const StateMask>> done(parts.size());
  std::atomic<bool> gave_up{false};
  run_parts(parts.size(), [&](size_t i) {
    if (gave_up.load(std::memory_order_relaxed)) return;
    const Part<WalkRange>& p = parts[i];
    KeepBits keep;
    done[i] = calls ? compute_mask_with_calls_part(p.ranges, nullptr, p.resume)
                    : compute_mask_part(p.ranges, nullptr, p.resume);
    if (!done[i]) gave_up.store(true, std::memory_order_relaxed);
  });
  // A pushdown part that gives up makes the whole walk give up (the caller falls back to the
  // plain walk); the unsplit walk, which interns every part's configuration sets, would too.
  *out = gave_up.load() ? nullptr : assemble_parts(*g_.tok, done, base);
  return true;
}

bool MaskStrategies::split_region(int32_t s, const RegionRows& rr, std::shared_ptr<const StateMask>* out) const {
  const size_t threads = batch_team_threads();
  if (threads < 2) return false;
  const std::vector<WalkRange> whole{{0, g_.tok->sorted.size(), 0, s, 0}};
  const std::vector<Part<WalkRange>> parts = cut_parts(g_, whole, threads);
  if (parts.empty()) return false;
  std::vector<std::shared_ptr<const StateMask>> done(parts.size());
  run_parts(parts.size(), [&](size_t i) {
    const WalkRange& r = parts[i].ranges.front();  // one range per part: the walk has one
    KeepBits keep;
    done[i] = compute_region_part(rr, s, r.begin, r.end, parts[i].resume);
  });
  *out = assemble_parts(*g_.tok, done, nullptr);
  return true;
}

namespace {
// Runs entered at depth 1 as walk ranges from t, and back (Range: MaskStrategies::WalkRange).
template <class Range>
std::vector<Range> runs_as_ranges(const std::vector<std::pair<size_t, size_t>>& runs, int32_t t) {
  std::vector<Range> ranges;
  for (const auto& r : runs) ranges.push_back({r.first, r.second, 1, t, 0});
  return ranges;
}
template <class Range>
std::vector<std::pair<size_t, size_t>> ranges_as_runs(const std::vector<Range>& ranges) {
  std::vector<std::pair<size_t, size_t>> runs;
  for (const auto& r : ranges) runs.emplace_back(r.begin, r.end);
  return runs;
}
}  // namespace

bool MaskStrategies::split_region_depth1(const RegionRows& rr, int32_t t,
                                          const std::vector<std::pair<size_t, size_t>>& runs,
                                          std::shared_ptr<const StateMask>* out) const {
  const size_t threads = batch_team_threads();
  if (threads < 2) return false;
  // Ranges at depth 1: every token counts as live (its first byte is taken as read).
  const std::vector<Part<WalkRange>> parts = cut_parts(g_, runs_as_ranges<WalkRange>(runs, t), threads);
  if (parts.empty()) return false;
  std::vector<std::shared_ptr<const StateMask>> done(parts.size());
  run_parts(parts.size(), [&](size_t i) {
    KeepBits keep;
    done[i] = walk_region_depth1_part(rr, t, ranges_as_runs(parts[i].ranges), parts[i].resume);
  });
  *out = assemble_parts(*g_.tok, done, nullptr);
  return true;
}

bool MaskStrategies::split_matches_whole(int32_t s, size_t part_tokens) const {
  const size_t n = g_.tok->sorted.size();
  // Parts run one after another here: the seams, not the threads, are under test.
  auto check = [&](const std::vector<WalkRange>& ranges, auto&& walk) {
    const std::shared_ptr<const StateMask> whole = walk(ranges, false);
    const auto parts = cut_parts(g_, ranges, 1, 0, part_tokens);
    if (parts.empty()) return true;
    std::vector<std::shared_ptr<const StateMask>> done;
    for (const auto& p : parts) {
      done.push_back(walk(p.ranges, p.resume));
      if (!done.back()) return whole == nullptr;  // a pushdown part gave up: so must the whole
    }
    return same_mask(whole.get(), assemble_parts(*g_.tok, done, nullptr).get());
  };
  auto plain = [&](const std::vector<WalkRange>& r, bool resume) { return compute_mask_part(r, nullptr, resume); };
  auto calls = [&](const std::vector<WalkRange>& r, bool resume) {
    return compute_mask_with_calls_part(r, nullptr, resume);
  };
  std::string key;
  std::vector<int32_t> exits;
  const bool in_region = region_of(s, &key, &exits);
  const RegionRows rr = in_region ? region_rows(s, exits) : RegionRows();
  auto region = [&](const std::vector<WalkRange>& r, bool resume) {
    return compute_region_part(rr, s, r.front().begin, r.back().end, resume);
  };
  const std::vector<WalkRange> whole{{0, n, 0, s, 0}};
  // The first-byte runs, each entered at depth 1 (as the piece walks do).
  std::vector<WalkRange> runs;
  for (int b = 0; b < 256; ++b) {
    const size_t lo = b == 0 ? 0 : g_.tok->first_byte_end[static_cast<size_t>(b) - 1];
    const int32_t t = g_.step(s, static_cast<uint8_t>(b));
    if (t >= 0 && lo < g_.tok->first_byte_end[static_cast<size_t>(b)]) {
      runs.push_back({lo, g_.tok->first_byte_end[static_cast<size_t>(b)], 1, t, 0});
    }
  }
  bool ok = check(whole, plain) && check(runs, plain);
  if (calls_within_reach(s)) ok = ok && check(whole, calls);
  if (in_region) {
    ok = ok && check(whole, region);
    // The region entered at depth 1, over the whole vocabulary.
    auto region1 = [&](const std::vector<WalkRange>& r, bool resume) {
      return walk_region_depth1_part(rr, s, ranges_as_runs(r), resume);
    };
    ok = ok && check(runs_as_ranges<WalkRange>({{0, n}}, s), region1);
  }
  return ok;
}

int MaskStrategies::region_content_matches_walk(int32_t s, size_t first) const {
  std::string key;
  std::vector<int32_t> exits;
  if (!region_of(s, &key, &exits)) return -1;
  const RegionRows rr = region_rows(s, exits);
  const std::shared_ptr<const StateMask> content = compute_region_content(rr, s, first);
  if (!content) return -1;
  const std::vector<std::pair<size_t, size_t>> whole{{0, g_.tok->sorted.size()}};
  const std::shared_ptr<const StateMask> walked = first == 0 ? compute_region_part(rr, s, 0, g_.tok->sorted.size(), false)
                                                             : walk_region_depth1_part(rr, s, whole, false);
  return same_mask(content.get(), walked.get()) ? 1 : 0;
}

int MaskStrategies::region_classes_matches_walk(int32_t s, size_t first) const {
  std::string key;
  std::vector<int32_t> exits;
  if (!region_of(s, &key, &exits)) return -1;
  const RegionRows rr = region_rows(s, exits);
  const std::vector<std::pair<size_t, size_t>> whole{{0, g_.tok->sorted.size()}};
  const std::shared_ptr<const StateMask> classes = region_from_classes(rr, s, whole, first);
  if (!classes) return -1;
  const std::shared_ptr<const StateMask> walked = first == 0 ? compute_region_part(rr, s, 0, g_.tok->sorted.size(), false)
                                                             : walk_region_depth1_part(rr, s, whole, false);
  return same_mask(classes.get(), walked.get()) ? 1 : 0;
}

}  // namespace grammar
}  // namespace agent_infer
