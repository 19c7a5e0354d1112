// Loop regions entered at depth 1: the first-byte pieces of a target inside a string.
//
// A dense state's first-byte pieces (grammar/mask/pieces.cpp) classify the run of tokens starting
// with byte b by a walk entering t = step(s, b) at depth 1. When t lies in a loop region (the
// free string content a key automaton leads to after any byte that does not continue a property
// name), that walk mostly stays in the region, and the region depends only on its shape and
// follow set, not on the grammar around it. So the region is walked once per tokenizer "at depth
// 1" (every token with its first byte taken as read, t reached) and cached; each grammar then
// walks only the exit runs (tokens leaving the region, e.g. those containing the closing quote)
// from their exit states, as mask_for does for region states at depth 0.
#include <algorithm>
#include <stdexcept>

#include "grammar/automaton.h"
#include "grammar/batch/pool.h"
#include "grammar/compiled_grammar.h"
#include "grammar/mask/mask_strategies.h"
#include "grammar/mask/profile.h"
#include "grammar/mask/state_mask.h"
#include "grammar/mask/tokenizer_info.h"

namespace agent_infer {
namespace grammar {

std::shared_ptr<const StateMask> MaskStrategies::region_at_depth1(int32_t t, std::vector<int32_t>* exits,
                                                                   const std::vector<int>& bytes) const {
  std::string key;
  if (!region_of(t, &key, exits)) return nullptr;
  key = digest(key, 'Q');
  // The whole vocabulary's walk serves every set of first bytes.
  if (auto hit = g_.tok->cache_get(key)) return hit;
  const TokenizerInfo& tk = *g_.tok;
  std::vector<std::pair<size_t, size_t>> runs;
  size_t n_runs = 0;
  for (int b : bytes) {
    const size_t lo = b == 0 ? 0 : tk.first_byte_end[static_cast<size_t>(b) - 1];
    const size_t hi = tk.first_byte_end[static_cast<size_t>(b)];
    if (lo == hi) continue;
    if (!runs.empty() && runs.back().second == lo) {
      runs.back().second = hi;
    } else {
      runs.emplace_back(lo, hi);
    }
    n_runs += hi - lo;
  }
  profile::Scope scope(profile::kRegionWalk);
  // A class region such as `[a-z]+` is entered on its own bytes' runs only (a fifth of the
  // vocabulary): those runs alone are walked, cached for this byte set. Most of the vocabulary
  // is worth walking whole, for every later byte set.
  if (n_runs * 2 > tk.sorted.size()) {
    return g_.tok->cache_put(key, walk_region_depth1(t, *exits, {{0, tk.sorted.size()}}));
  }
  std::string bkey = key;
  for (int b : bytes) bkey.push_back(static_cast<char>(b));
  bkey = digest(bkey, 'B');
  if (auto hit = g_.tok->cache_get(bkey)) return hit;
  return g_.tok->cache_put(bkey, walk_region_depth1(t, *exits, runs));
}

std::shared_ptr<const StateMask> MaskStrategies::walk_region_depth1(
    int32_t t, const std::vector<int32_t>& exits, const std::vector<std::pair<size_t, size_t>>& runs) const {
  // Built once per walk: a split walk's parts share it.
  const RegionRows rr = region_rows(t, exits);
  const bool whole = runs.size() == 1 && runs[0].first == 0 && runs[0].second == g_.tok->sorted.size();
  if (whole) {
    if (auto content = compute_region_content(rr, t, 1)) return content;
  }
  if (auto classes = region_from_classes(rr, t, runs, 1)) return classes;
  std::shared_ptr<const StateMask> split;
  if (split_region_depth1(rr, t, runs, &split)) return split;
  return walk_region_depth1_part(rr, t, runs, false);
}

std::shared_ptr<const StateMask> MaskStrategies::walk_region_depth1_part(
    const RegionRows& rr, int32_t t, const std::vector<std::pair<size_t, size_t>>& runs, bool resume) const {
  const TokenizerInfo& tk = *g_.tok;
  auto out = std::make_shared<StateMask>();
  std::vector<uint32_t> bits(static_cast<size_t>(tk.words), 0);
  std::vector<int32_t> stack(tk.max_token_len + 1);
  std::vector<uint8_t> flag(tk.max_token_len + 1, 0);
  size_t n_accepted = 0;
  const ByteSet& fol = g_.follow[g_.states[t].rule];
  // Byte 0 is taken as read (into t); only the first run can continue one of a previous part.
  for (size_t k = 0; k < runs.size(); ++k) {
    n_accepted += walk_region_range(tk, rr.rows, rr.final, fol, runs[k].first, runs[k].second, resume && k == 0, 1,
                                    stack, flag, bits, *out);
  }
  finish_mask(*out, std::move(bits), n_accepted);
  out->exits.shrink_to_fit();
  out->uncertain.shrink_to_fit();
  return out;
}

namespace {
// As in grammar/mask/pieces.cpp: sparse states keep the direct walk; large byte groups use a union.
constexpr size_t kMinRegionPieceTokens = 4096;
constexpr size_t kMinRegionUnionTokens = 2048;
// Slices when a batch fill's threads share the work (grammar/batch/pool.h parallel_for).
constexpr size_t kPieceGrain = 8;
constexpr size_t kDigestGrain = 4;
}  // namespace

// A loop-region state's own region walk is unique to it (its key is rooted at it), but each
// state of a `pattern` search automaton sends most first bytes to the same few states (back to
// "nothing matched yet"). The walk of a run of tokens from s after its first byte b is the walk
// of that run entering t = step(s, b) at depth 1 inside t's region, which depends only on that
// region's shape and b: cached per (shape, b), and per shape as a dense union over the bytes
// first seen leading there, so the next state copies the union and walks only its other runs.
std::shared_ptr<const StateMask> MaskStrategies::region_by_first_byte(int32_t s,
                                                                       const std::vector<int32_t>& exits) const {
  const TokenizerInfo& tk = *g_.tok;
  auto run_begin = [&](int b) -> size_t { return b == 0 ? 0 : tk.first_byte_end[static_cast<size_t>(b) - 1]; };
  auto run_end = [&](int b) -> size_t { return tk.first_byte_end[static_cast<size_t>(b)]; };
  std::array<int32_t, 256> target{};
  size_t live = 0;
  for (int b = 0; b < 256; ++b) {
    target[static_cast<size_t>(b)] = g_.step(s, static_cast<uint8_t>(b));
    if (target[static_cast<size_t>(b)] >= 0) live += run_end(b) - run_begin(b);
  }
  if (live < kMinRegionPieceTokens) return nullptr;
  std::unordered_map<int32_t, int32_t> exit_of;
  for (size_t k = 0; k < exits.size(); ++k) exit_of[exits[k]] = static_cast<int32_t>(k);
  struct Target {
    bool exit = false;
    int32_t exit_id = 0;
    std::string key;             // digest of t's region shape ('Q')
    std::vector<int32_t> exits;  // t's region exits, in t's numbering
    ByteSet bytes{};
    size_t tokens = 0;
    std::shared_ptr<const StateMask> uni;
  };
  std::unordered_map<int32_t, Target> targets;
  std::vector<int32_t> order;  // targets in order of first byte, for a deterministic walk order
  {
    // Each target's region digest serializes the whole loop from there (tens of microseconds
    // each, for dozens of targets of a search pattern's states): memoized by a batch fill's
    // threads together first.
    std::vector<int32_t> inner;
    for (int b = 0; b < 256; ++b) {
      const int32_t t = target[static_cast<size_t>(b)];
      if (t >= 0 && run_begin(b) != run_end(b) && !exit_of.count(t) &&
          std::find(inner.begin(), inner.end(), t) == inner.end()) {
        inner.push_back(t);
      }
    }
    parallel_for(inner.size(), kDigestGrain, [&](size_t k0, size_t k1) {
      std::string key;
      std::vector<int32_t> ex;
      for (size_t k = k0; k < k1; ++k) region_digest_q(inner[k], &key, &ex);
    });
  }
  for (int b = 0; b < 256; ++b) {
    const int32_t t = target[static_cast<size_t>(b)];
    if (t < 0 || run_begin(b) == run_end(b)) continue;
    auto ins = targets.emplace(t, Target());
    Target& x = ins.first->second;
    if (ins.second) {
      order.push_back(t);
      auto ex = exit_of.find(t);
      if (ex != exit_of.end()) {
        x.exit = true;
        x.exit_id = ex->second;
      } else {
        // t is in s's region, hence in the same loop: its own region is the same states.
        if (!region_digest_q(t, &x.key, &x.exits)) return nullptr;
      }
    }
    x.bytes[static_cast<size_t>(b) >> 5] |= 1u << (b & 31);
    x.tokens += run_end(b) - run_begin(b);
  }

  std::array<std::shared_ptr<const StateMask>, 256> piece;
  std::vector<uint32_t> scratch(static_cast<size_t>(tk.words));
  auto first_byte = [&](int32_t pos) {
    return static_cast<uint8_t>(tk.sorted_data[tk.sorted_off[static_cast<size_t>(pos)]]);
  };
  std::unordered_map<int32_t, std::vector<int>> missing;  // target -> bytes without union or piece
  size_t missing_tokens = 0;
  for (int32_t t : order) {
    Target& x = targets[t];
    if (x.exit) continue;
    if (x.tokens >= kMinRegionUnionTokens) x.uni = g_.tok->cache_get(x.key + "UU");
    for (int b = 0; b < 256; ++b) {
      if (!has(x.bytes, static_cast<uint8_t>(b)) || (x.uni && has(x.uni->first_bytes, static_cast<uint8_t>(b)))) continue;
      piece[static_cast<size_t>(b)] = g_.tok->cache_get(x.key + static_cast<char>(b));
      if (!piece[static_cast<size_t>(b)]) {
        missing[t].push_back(b);
        missing_tokens += run_end(b) - run_begin(b);
      }
    }
  }
  auto exit_in_t = [&](const Target& x, RegionExit e) {
    for (size_t k = 0; k < x.exits.size(); ++k) {
      if (x.exits[k] == exits[static_cast<size_t>(e.exit)]) {
        e.exit = static_cast<int32_t>(k);
        return e;
      }
    }
    throw std::logic_error("region exit outside a neighbour's region");
  };
  if (2 * missing_tokens > live) {
    // Nothing shared yet: s's own region walk (one pass) is the cheapest first visit, and its runs
    // are exactly the pieces of its targets, which are cached from it for the states that follow.
    std::shared_ptr<const StateMask> whole;
    {
      profile::Scope scope(profile::kRegionWalk);
      whole = compute_region(s, exits);
    }
    std::fill(scratch.begin(), scratch.end(), 0u);
    seed_bits(whole.get(), scratch);
    // Targets are independent: a batch fill's threads cache their pieces together.
    std::vector<int32_t> todo;
    for (int32_t t : order) {
      if (!targets[t].exit && missing.count(t)) todo.push_back(t);
    }
    parallel_for(todo.size(), 1, [&](size_t k0, size_t k1) {
      for (size_t k = k0; k < k1; ++k) {
        const int32_t t = todo[k];
        const Target& x = targets.at(t);
        const auto it = missing.find(t);
        const bool build_union = x.tokens >= kMinRegionUnionTokens && !x.uni;
        ByteSet bytes{};
        for (int b : it->second) bytes[static_cast<size_t>(b) >> 5] |= 1u << (b & 31);
        // The uncertain positions and exits of the runs of `byte_list` (ascending), found by search:
        // both lists are in walk order, and a scan of them per byte would be quadratic.
        auto take = [&](const std::vector<int>& byte_list, StateMask& p) {
          const auto& unc = whole->uncertain;
          const auto& ex = whole->exits;
          for (int b : byte_list) {
            const int32_t lo = static_cast<int32_t>(run_begin(b)), hi = static_cast<int32_t>(run_end(b));
            auto u0 = std::lower_bound(unc.begin(), unc.end(), lo);
            p.uncertain.insert(p.uncertain.end(), u0, std::lower_bound(u0, unc.end(), hi));
            auto by_begin = [](const RegionExit& e, int32_t pos) { return e.begin < pos; };
            auto e0 = std::lower_bound(ex.begin(), ex.end(), lo, by_begin);
            for (auto e = e0; e != ex.end() && e->begin < hi; ++e) p.exits.push_back(exit_in_t(x, *e));
          }
        };
        if (build_union) {
          auto uni = std::make_shared<StateMask>();
          std::vector<uint32_t> ub;
          size_t union_tokens = 0;
          for (int b : it->second) union_tokens += run_end(b) - run_begin(b);
          if (2 * union_tokens > tk.sorted.size()) {
            // Most of the vocabulary (the target a search pattern's mismatches go back to): the
            // walk's accepted tokens less those of the other first bytes (a pass over the union's
            // own tokens costs ~0.3 ms on one thread while the others wait).
            ub = scratch;
            for (int b = 0; b < 256; ++b) {
              if (has(bytes, static_cast<uint8_t>(b))) continue;
              for (size_t j = run_begin(b); j < run_end(b); ++j) {
                const int32_t id = tk.sorted[j];
                ub[static_cast<size_t>(id) >> 5] &= ~(1u << (id & 31));
              }
            }
          } else {
            ub.assign(static_cast<size_t>(tk.words), 0);
            for (int b : it->second) {
              for (size_t j = run_begin(b); j < run_end(b); ++j) {
                const int32_t id = tk.sorted[j];
                ub[static_cast<size_t>(id) >> 5] |= scratch[static_cast<size_t>(id) >> 5] & (1u << (id & 31));
              }
            }
          }
          uni->accepted_bits = std::move(ub);
          uni->first_bytes = bytes;
          take(it->second, *uni);
          g_.tok->cache_put(x.key + "UU", std::move(uni));
          continue;
        }
        for (int b : it->second) {
          auto p = std::make_shared<StateMask>();
          // Branch-free compaction, as in run_piece.
          std::vector<int32_t>& ids = p->accepted_ids;
          ids.resize(run_end(b) - run_begin(b));
          size_t n = 0;
          for (size_t j = run_begin(b); j < run_end(b); ++j) {
            const int32_t id = tk.sorted[j];
            ids[n] = id;
            n += (scratch[static_cast<size_t>(id) >> 5] >> (id & 31)) & 1u;
          }
          ids.resize(n);
          take({b}, *p);
          p->accepted_ids.shrink_to_fit();
          g_.tok->cache_put(x.key + static_cast<char>(b), std::move(p));
        }
      }
    });
    return whole;
  }
  // The targets' walks are independent (each caches the pieces of its own bytes): a batch fill's
  // threads take them one each. A search pattern's state after a partial match sends its bytes to
  // a dozen targets, walked one after another on one thread for milliseconds before.
  std::vector<int32_t> walk_order;
  for (int32_t t : order) {
    if (missing.count(t)) walk_order.push_back(t);
  }
  parallel_for(walk_order.size(), 1, [&](size_t i0, size_t i1) {
    std::vector<uint32_t> seen(static_cast<size_t>(tk.words));
    for (size_t i = i0; i < i1; ++i) {
      const int32_t t = walk_order[i];
      const Target& x = targets.at(t);
      const std::vector<int>& bytes = missing.at(t);
      std::vector<std::pair<size_t, size_t>> runs;
      for (int b : bytes) runs.emplace_back(run_begin(b), run_end(b));
      std::shared_ptr<const StateMask> walked;
      {
        profile::Scope scope(profile::kRegionWalk);
        walked = walk_region_depth1(t, x.exits, runs);
      }
      std::fill(seen.begin(), seen.end(), 0u);
      seed_bits(walked.get(), seen);
      parallel_for(bytes.size(), kPieceGrain, [&](size_t k0, size_t k1) {
        for (size_t k = k0; k < k1; ++k) {
          const int b = bytes[k];
          auto p = run_piece(tk, seen, *walked, run_begin(b), run_end(b), true);
          piece[static_cast<size_t>(b)] = g_.tok->cache_put(x.key + static_cast<char>(b), std::move(p));
        }
      });
    }
  });

  auto out = std::make_shared<StateMask>();
  std::vector<uint32_t> bits(static_cast<size_t>(tk.words), 0);
  auto add_exit = [&](const Target& x, RegionExit e) {
    e.exit = exit_of.at(x.exits[static_cast<size_t>(e.exit)]);
    out->exits.push_back(e);
  };
  // Both lists are filled in sorted segments (per target, then the pieces in byte order).
  std::vector<size_t> unc_segments, exit_segments;
  for (int32_t t : order) {
    Target& x = targets[t];
    unc_segments.push_back(out->uncertain.size());
    exit_segments.push_back(out->exits.size());
    if (x.exit) {
      // The first byte already leaves the region: the whole run exits at depth 1.
      for (int b = 0; b < 256; ++b) {
        if (!has(x.bytes, static_cast<uint8_t>(b))) continue;
        out->exits.push_back({static_cast<int32_t>(run_begin(b)), static_cast<int32_t>(run_end(b)), 1, x.exit_id, 0});
      }
      continue;
    }
    if (x.tokens < kMinRegionUnionTokens) continue;
    if (x.uni) {
      // The union minus the runs of bytes this state sends elsewhere (or nowhere)...
      std::copy(x.uni->accepted_bits.begin(), x.uni->accepted_bits.end(), scratch.begin());
      for (int b = 0; b < 256; ++b) {
        if (!has(x.uni->first_bytes, static_cast<uint8_t>(b)) || has(x.bytes, static_cast<uint8_t>(b))) continue;
        for (size_t j = run_begin(b); j < run_end(b); ++j) {
          const int32_t id = tk.sorted[j];
          scratch[static_cast<size_t>(id) >> 5] &= ~(1u << (id & 31));
        }
      }
      for (int32_t pos : x.uni->uncertain) {
        if (has(x.bytes, first_byte(pos))) out->uncertain.push_back(pos);
      }
      for (const RegionExit& e : x.uni->exits) {
        if (has(x.bytes, first_byte(e.begin))) add_exit(x, e);
      }
      // ...plus the pieces of the bytes the union lacks (ORed below, from `piece`).
    } else {
      // First state reaching this target with many tokens: build its union and cache it.
      auto uni = std::make_shared<StateMask>();
      std::fill(scratch.begin(), scratch.end(), 0u);
      for (int b = 0; b < 256; ++b) {
        if (!has(x.bytes, static_cast<uint8_t>(b))) continue;
        const StateMask* p = piece[static_cast<size_t>(b)].get();
        or_ids(scratch, p->accepted_ids);
        uni->uncertain.insert(uni->uncertain.end(), p->uncertain.begin(), p->uncertain.end());
        uni->exits.insert(uni->exits.end(), p->exits.begin(), p->exits.end());
        piece[static_cast<size_t>(b)] = nullptr;  // held by the union now
      }
      uni->accepted_bits = scratch;
      uni->first_bytes = x.bytes;
      out->uncertain.insert(out->uncertain.end(), uni->uncertain.begin(), uni->uncertain.end());
      for (const RegionExit& e : uni->exits) add_exit(x, e);
      g_.tok->cache_put(x.key + "UU", std::move(uni));
    }
    for (size_t w = 0; w < bits.size(); ++w) bits[w] |= scratch[w];
  }
  unc_segments.push_back(out->uncertain.size());
  exit_segments.push_back(out->exits.size());
  for (int b = 0; b < 256; ++b) {
    const StateMask* p = piece[static_cast<size_t>(b)].get();
    if (!p) continue;
    const Target& x = targets[target[static_cast<size_t>(b)]];
    or_ids(bits, p->accepted_ids);
    out->uncertain.insert(out->uncertain.end(), p->uncertain.begin(), p->uncertain.end());
    for (const RegionExit& e : p->exits) add_exit(x, e);
  }
  // Runs are disjoint, so positions are distinct; the exits' walks must run in sorted order.
  merge_segments(out->uncertain, unc_segments, std::less<int32_t>());
  merge_segments(out->exits, exit_segments, [](const RegionExit& a, const RegionExit& b) { return a.begin < b.begin; });
  const size_t n_accepted = count_bits(bits.data(), bits.size());
  finish_mask(*out, std::move(bits), n_accepted);
  out->uncertain.shrink_to_fit();
  out->exits.shrink_to_fit();
  return out;
}

}  // namespace grammar
}  // namespace agent_infer
