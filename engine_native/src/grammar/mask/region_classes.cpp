// Loop-region walks from byte classes: regions such as `[a-z]+`, `\w+` or `[0-9a-f]*`.
//
// A class region fails the content check (most content characters die in it), so its walk
// visits every token that starts inside it: ~0.3 ms at depth 0 for 129k tokens, and ~1 ms at
// depth 1 (first-byte pieces, grammar/mask/region_pieces.cpp), where the first byte is taken as read
// and every " word" token walks to its end. Yet most tokens are decided by which bytes they hold,
// not by their order: with stay = the bytes that keep a walk among a set of rows closed under
// them (grown from row 0), dead = the bytes every row rejects, and leave = the bytes some row
// exits on or may escape with (a final row and a byte of the rule's follow set), a token whose
// bytes all stay is accepted, and one that holds a dead byte but no leaving one dies before it
// without escaping, recording nothing. Each token's
// bytes after the first are a precomputed 128-bit set of byte groups (TokenizerInfo::byte_group),
// so deciding costs a few word operations; the undecided tokens are walked in blocks of
// consecutive positions as before, which keeps the result, walk order included, the full walk's.
//
// A run the walker classifies together (tokens sharing the prefix through a dying or leaving
// byte) lies within one block: its tokens hold that byte, so none is accepted by class; a dying
// run's tokens may be split between a block and tokens decided dead, but a dying run without an
// escape records nothing.
#include <algorithm>
#include <atomic>

#include "grammar/automaton.h"
#include "grammar/batch/batch.h"
#include "grammar/batch/pool.h"
#include "grammar/compiled_grammar.h"
#include "grammar/mask/mask_strategies.h"
#include "grammar/mask/state_mask.h"
#include "grammar/mask/tokenizer_info.h"

namespace agent_infer {
namespace grammar {

namespace {

using Groups = std::array<uint64_t, 2>;

struct ByteClasses {
  Groups stay{}, dead{}, leave{};
  // The groups of bytes 80-FF (TokenizerInfo::byte_group 16-31) where every character's UTF-8
  // sequence keeps a walk among the kept rows: they stay in a token well-formed from its start.
  Groups utf8{};
  // The rows the stay bytes keep a walk among, from row 0: a token entering one of them (at depth
  // 0, after its first byte) and holding only stay bytes after that is accepted.
  std::vector<uint8_t> kept;
};

// The stay bytes (one flag per byte, those from 80 on left out if ascii_only) and the kept rows
// they keep a walk among, a set closed under them that holds row 0. They start as the bytes row 0
// keeps inside; while a kept row rejects one, a narrow row (accepting under half of them: the two
// hex digits after a '%' in a URL path) is dropped with the bytes leading into it, and otherwise
// the byte is dropped.
std::array<uint8_t, 256> settle_stays(const std::vector<int32_t>& rows, size_t n_rows, bool ascii_only,
                                      std::vector<uint8_t>* kept) {
  // Repair rounds before settling for the bytes every row keeps inside, and the regions small
  // enough to repair (a round reads every kept row's table).
  constexpr int kMaxRounds = 8;
  constexpr size_t kMaxRepairRows = 64;
  const unsigned n_bytes = ascii_only ? 0x80u : 256u;
  std::array<uint8_t, 256> stays{};
  for (unsigned b = 0; b < n_bytes; ++b) stays[b] = rows[b] >= 0 ? 1 : 0;
  std::vector<uint8_t>& in = *kept;
  bool closed = false;
  for (int round = 0; round < kMaxRounds && !closed && n_rows <= kMaxRepairRows; ++round) {
    // The rows reached from row 0 over stay bytes.
    in.assign(n_rows, 0);
    in[0] = 1;
    std::vector<size_t> order{0};
    for (size_t i = 0; i < order.size(); ++i) {
      for (unsigned b = 0; b < 256; ++b) {
        const int32_t v = rows[order[i] * 256 + b];
        if (stays[b] && v >= 0 && !in[static_cast<size_t>(v)]) {
          in[static_cast<size_t>(v)] = 1;
          order.push_back(static_cast<size_t>(v));
        }
      }
    }
    size_t n_stay = 0;
    for (uint8_t x : stays) n_stay += x;
    closed = true;
    for (size_t r : order) {
      size_t accepted = 0;
      for (unsigned b = 0; b < 256; ++b) accepted += stays[b] && rows[r * 256 + b] >= 0;
      if (accepted == n_stay) continue;
      closed = false;
      if (r != 0 && accepted * 2 < n_stay) {
        for (size_t q : order) {
          for (unsigned b = 0; b < 256; ++b) {
            if (rows[q * 256 + b] == static_cast<int32_t>(r)) stays[b] = 0;
          }
        }
      } else {
        for (unsigned b = 0; b < 256; ++b) {
          if (rows[r * 256 + b] < 0) stays[b] = 0;
        }
      }
      break;  // the kept rows change: found afresh
    }
  }
  if (!closed) {
    in.assign(n_rows, 1);
    for (unsigned b = 0; b < n_bytes; ++b) {
      bool all = true;
      for (size_t r = 0; r < n_rows && all; ++r) all = rows[r * 256 + b] >= 0;
      stays[b] = all ? 1 : 0;
    }
  }
  return stays;
}

// Group-level classes of a region: a group stays (is dead) only if all its bytes do; it leaves if
// any of its bytes may.
void group_classes(const std::vector<int32_t>& rows, const std::vector<uint8_t>& row_final,
                   const ByteSet& fol, const std::array<uint8_t, 256>& stays, ByteClasses* c) {
  bool any_final = false;
  for (uint8_t f : row_final) any_final = any_final || f != 0;
  const size_t n_rows = row_final.size();
  c->stay = {~uint64_t{0}, ~uint64_t{0}};
  c->dead = c->stay;
  for (unsigned b = 0; b < 256; ++b) {
    bool all_dead = true;
    bool leave = any_final && has(fol, static_cast<uint8_t>(b));
    for (size_t r = 0; r < n_rows; ++r) {
      const int32_t v = rows[r * 256 + b];
      all_dead = all_dead && v == -1;
      leave = leave || v <= -2;
    }
    const unsigned g = TokenizerInfo::byte_group(static_cast<uint8_t>(b));
    const uint64_t bit = uint64_t{1} << (g & 63);
    if (!stays[b]) c->stay[g >> 6] &= ~bit;
    if (!all_dead || leave) c->dead[g >> 6] &= ~bit;
    if (leave) c->leave[g >> 6] |= bit;
  }
}

}  // namespace

std::shared_ptr<const StateMask> MaskStrategies::region_from_classes(
    const RegionRows& rr, int32_t s, const std::vector<std::pair<size_t, size_t>>& runs, size_t first) const {
  const TokenizerInfo& t = *g_.tok;
  const ByteSet& fol = g_.follow[g_.states[s].rule];
  // A class of characters (`[^/]+`, `\S+`) keeps the bytes of its non-ASCII characters among its
  // rows only as whole sequences: its ASCII stay bytes are settled first, then its sequences
  // checked; otherwise bytes from 80 on are treated like the others.
  ByteClasses c;
  std::array<uint8_t, 256> stays = settle_stays(rr.rows, rr.final.size(), true, &c.kept);
  if (region_keeps_utf8(rr, c.kept)) {
    c.utf8 = {0xFFFF0000ull, 0};
  } else {
    stays = settle_stays(rr.rows, rr.final.size(), false, &c.kept);
  }
  group_classes(rr.rows, rr.final, fol, stays, &c);
  // Nothing stays and nothing is dead everywhere: every token would be walked.
  if (c.stay == Groups{} && c.utf8 == Groups{} && c.dead == Groups{}) return nullptr;
  const unsigned utf8_bit = first == 1 ? 1u : 0u;  // utf8_from: well-formed from byte `first`
  const size_t budget = t.sorted.size() / 4;
  // Whether token i is accepted by class, and whether it is undecided (else it dies unrecorded).
  // Bitwise, not short-circuit: a branch on acceptance would be mispredicted half the time.
  auto classify = [&](size_t i, uint32_t* accepted) {
    const Groups& g = t.tail_groups[i];
    const uint64_t well_formed = (t.utf8_from[i] >> utf8_bit) & 1u;
    const uint64_t stay0 = c.stay[0] | (c.utf8[0] & (0 - well_formed));
    const uint64_t outside = (g[0] & ~stay0) | (g[1] & ~c.stay[1]);
    const uint64_t leaving = (g[0] & c.leave[0]) | (g[1] & c.leave[1]);
    const uint64_t dying = (g[0] & c.dead[0]) | (g[1] & c.dead[1]);
    *accepted = outside == 0 ? 1u : 0u;
    return (outside != 0) & ((leaving != 0) | (dying == 0));
  };
  // One walker per part of the ranges (the whole of them outside batch fills).
  struct Walker {
    std::vector<uint32_t> bits;
    std::vector<int32_t> stack;
    std::vector<uint8_t> flag;
    StateMask out;
    size_t n_walked = 0, n_accepted = 0;
  };
  auto make_walker = [&](Walker& w) {
    w.bits.assign(static_cast<size_t>(t.words), 0);
    w.stack.resize(t.max_token_len + 1);
    w.flag.assign(t.max_token_len + 1, 0);
  };
  auto walk = [&](Walker& w, size_t lo, size_t hi, bool counted) {
    w.n_walked += counted ? hi - lo : 0;
    w.n_accepted += walk_region_range(t, rr.rows, rr.final, fol, lo, hi, false, first, w.stack, w.flag, w.bits, w.out);
  };
  // Decides the tokens of [lo, hi), whose bytes from 1 on run from a kept row (or, at depth 0,
  // from a UTF-8 lead byte's row); walks the undecided ones. Accepting is branch-free; only the
  // rare undecided token (a block to walk) branches.
  auto decide = [&](Walker& w, size_t lo, size_t hi) {
    size_t block = hi;  // the start of the undecided block being gathered, if any
    for (size_t i = lo; i < hi; ++i) {
      uint32_t accepted = 0;
      const bool open = classify(i, &accepted);
      const int32_t id = t.sorted[i];
      w.bits[static_cast<size_t>(id) >> 5] |= accepted << (id & 31);
      w.n_accepted += accepted;
      if (open != (block != hi)) {  // an undecided block starts or ends here
        if (open) {
          block = i;
        } else {
          walk(w, block, i, true);
          block = hi;
        }
      }
    }
    if (block < hi) walk(w, block, hi, true);
  };
  // The ranges decided by class (0), and those walked whole (1; 2: outside the budget): at depth
  // 0 the first byte is read in row 0, where its whole run dies (nothing escapes before a byte is
  // read), exits (one exit record: walked), enters a row outside the kept ones (walked), or goes
  // on among them. At depth 1, where UTF-8 sequences are kept, a token starting with a byte from
  // 80 on continues its first character at row 0, which is a character boundary: those tokens
  // are walked, and mostly die at their second byte.
  std::vector<std::pair<size_t, size_t>> ranges;
  std::vector<uint8_t> whole;
  for (const auto& run : runs) {
    if (first == 1) {
      const size_t ascii_end = c.utf8 != Groups{} ? t.first_byte_end[0x7F] : run.second;
      if (run.first < std::min(run.second, ascii_end)) {
        ranges.emplace_back(run.first, std::min(run.second, ascii_end));
        whole.push_back(0);
      }
      if (std::max(run.first, ascii_end) < run.second) {
        ranges.emplace_back(std::max(run.first, ascii_end), run.second);
        whole.push_back(2);
      }
      continue;
    }
    for (size_t lo = run.first; lo < run.second;) {
      const uint8_t b0 = static_cast<uint8_t>(*t.sorted_ptr(lo));
      const size_t hi = std::min<size_t>(run.second, t.first_byte_end[b0]);
      const int32_t v = rr.rows[b0];
      if (v != -1) {
        ranges.emplace_back(lo, hi);
        // Entering a row the stay bytes do not keep a walk among: walked, but for a UTF-8 lead
        // byte where the sequences are kept (a token well-formed from it is decided by class).
        const bool lead = c.utf8 != Groups{} && b0 >= 0x80;
        whole.push_back(v <= -2 || (!c.kept[static_cast<size_t>(v)] && !lead) ? 1 : 0);
      }
      lo = hi;
    }
  }
  // Declining late (after walking a quarter of the vocabulary in blocks) costs more than the walk
  // saved elsewhere: every 16th position of the decided ranges first estimates their undecided share.
  {
    size_t sampled = 0, open = 0, decided = 0, walked = 0;
    for (size_t k = 0; k < ranges.size(); ++k) {
      if (whole[k]) {
        walked += whole[k] == 1 ? ranges[k].second - ranges[k].first : 0;
        continue;
      }
      decided += ranges[k].second - ranges[k].first;
      for (size_t i = ranges[k].first; i < ranges[k].second; i += 16) {
        ++sampled;
        uint32_t accepted = 0;
        open += classify(i, &accepted) ? 1 : 0;
      }
    }
    if (sampled > 0) walked += decided * open / sampled;
    if (walked > budget) return nullptr;
  }
  // Tokens walked per range. The walk declines once the tokens walked up to the end of a decided
  // range exceed the budget: a part stops when its own count does (a lower bound of the whole
  // walk's), and the parts' counts are checked in walk order afterwards.
  std::vector<size_t> walked(ranges.size(), 0);
  auto run = [&](Walker& w, size_t k0, size_t k1) {
    for (size_t k = k0; k < k1; ++k) {
      const size_t before = w.n_walked;
      if (whole[k]) {
        walk(w, ranges[k].first, ranges[k].second, whole[k] == 1);
      } else {
        decide(w, ranges[k].first, ranges[k].second);
      }
      walked[k] = w.n_walked - before;
      if (!whole[k] && w.n_walked > budget) return false;
    }
    return true;
  };
  auto over_budget = [&] {
    size_t sum = 0;
    for (size_t k = 0; k < ranges.size(); ++k) {
      sum += walked[k];
      if (!whole[k] && sum > budget) return true;
    }
    return false;
  };
  // Inside a batch fill a large walk is cut between its ranges (each range is walked on its own,
  // so no record spans a cut; at depth 0 they are runs of one first byte) into parts for the
  // batch's threads, put together in walk order as split walks are (grammar/batch/split.cpp). Outside
  // one, or when small, it runs here.
  size_t total = 0;
  for (const auto& r : ranges) total += r.second - r.first;
  const size_t threads = batch_team_threads();
  if (threads >= 2 && ranges.size() >= 2 && total >= split_min_tokens()) {
    const size_t n_parts = std::min(ranges.size(), 4 * threads);
    std::vector<size_t> cut{0};
    size_t acc = 0;
    for (size_t k = 0; k + 1 < ranges.size(); ++k) {
      acc += ranges[k].second - ranges[k].first;
      if (cut.size() < n_parts && acc * n_parts >= total * cut.size()) cut.push_back(k + 1);
    }
    cut.push_back(ranges.size());
    std::vector<std::shared_ptr<const StateMask>> done(cut.size() - 1);
    std::atomic<bool> declined{false};
    count_split();
    run_parts(done.size(), [&](size_t i) {
      if (declined.load(std::memory_order_relaxed)) return;
      Walker w;
      make_walker(w);
      if (!run(w, cut[i], cut[i + 1])) declined.store(true, std::memory_order_relaxed);
      auto part = std::make_shared<StateMask>(std::move(w.out));
      part->accepted_bits = std::move(w.bits);
      done[i] = std::move(part);
    });
    if (declined.load() || over_budget()) return nullptr;
    return assemble_parts(t, done, nullptr);
  }
  Walker w;
  make_walker(w);
  if (!run(w, 0, ranges.size())) return nullptr;
  auto out = std::make_shared<StateMask>(std::move(w.out));
  finish_mask(*out, std::move(w.bits), w.n_accepted);
  out->exits.shrink_to_fit();
  out->uncertain.shrink_to_fit();
  return out;
}

}  // namespace grammar
}  // namespace agent_infer
