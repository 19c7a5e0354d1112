// Content masks: a cheap first visit for the states inside a JSON string.
//
// About 96 % of a vocabulary is plain string content (words, punctuation, CJK text: no quote, no
// backslash, no control byte, whole characters). A state from which every string of up to
// kContentChars such characters has a path accepts all of those tokens, whatever follows the
// string; only the rest (tokens that close the string or escape, split characters, long tokens)
// depends on the state's surroundings and is walked. This is llguidance's "slices" idea applied
// to every state that passes the check, not to one lexeme: a free string's state, and every
// position of a `maxLength` string farther than kContentChars characters from its end (a counted
// chain of distinct states, which otherwise walk the whole vocabulary on the first visit of
// each string property: ~2.5 ms for 129k tokens).
//
// The check follows the automaton's byte edges level by level, one level per character: every
// state of a level must cover the ASCII content bytes and every well-formed UTF-8 sequence of a
// non-ASCII character (Unicode Table 3-7), and the states reached form the next level.
#include <algorithm>
#include <array>
#include <climits>

#include "grammar/automaton.h"
#include "grammar/compiled_grammar.h"
#include "grammar/mask/mask_strategies.h"
#include "grammar/mask/state_mask.h"
#include "grammar/mask/tokenizer_info.h"

namespace agent_infer {
namespace grammar {

namespace {

struct Range {
  uint8_t lo, hi;
};
// The ASCII content bytes: U+0020..U+007F but '"' (0x22) and '\' (0x5C).
constexpr std::array<Range, 3> kAsciiContent{{{0x20, 0x21}, {0x23, 0x5B}, {0x5D, 0x7F}}};
// Well-formed UTF-8 sequences of U+0080..U+10FFFF (no overlongs, no surrogates).
struct Utf8Seq {
  uint8_t len;
  std::array<Range, 4> bytes;
};
constexpr std::array<Utf8Seq, 8> kUtf8{{
    {2, {{{0xC2, 0xDF}, {0x80, 0xBF}, {0, 0}, {0, 0}}}},
    {3, {{{0xE0, 0xE0}, {0xA0, 0xBF}, {0x80, 0xBF}, {0, 0}}}},
    {3, {{{0xE1, 0xEC}, {0x80, 0xBF}, {0x80, 0xBF}, {0, 0}}}},
    {3, {{{0xED, 0xED}, {0x80, 0x9F}, {0x80, 0xBF}, {0, 0}}}},
    {3, {{{0xEE, 0xEF}, {0x80, 0xBF}, {0x80, 0xBF}, {0, 0}}}},
    {4, {{{0xF0, 0xF0}, {0x90, 0xBF}, {0x80, 0xBF}, {0x80, 0xBF}}}},
    {4, {{{0xF1, 0xF3}, {0x80, 0xBF}, {0x80, 0xBF}, {0x80, 0xBF}}}},
    {4, {{{0xF4, 0xF4}, {0x80, 0x8F}, {0x80, 0xBF}, {0x80, 0xBF}}}},
}};
// States per level at most: a string automaton has one per character position (a pattern's
// product a few); wider levels are not string content and fail the check early.
constexpr size_t kMaxLevel = 8;

bool in(const Range& r, uint8_t b) { return b >= r.lo && b <= r.hi; }

void add_once(std::vector<int32_t>& v, int32_t x) {
  if (std::find(v.begin(), v.end(), x) == v.end()) v.push_back(x);
}

// The bytes of the non-ASCII character starting at p[0] (n >= 1 bytes left), or 0 if it is not
// well-formed; *bad_lead: p[0] starts no character (80-C1, F5-FF). A character the token ends
// inside (byte-level BPE splits them) has a path wherever its whole sequence has one: it counts.
size_t utf8_char(const uint8_t* p, size_t n, bool* bad_lead) {
  const Utf8Seq* seq = nullptr;
  for (const Utf8Seq& u : kUtf8) {
    if (in(u.bytes[0], p[0])) seq = &u;
  }
  *bad_lead = seq == nullptr;
  if (seq == nullptr) return 0;
  const size_t have = std::min<size_t>(seq->len, n);
  for (size_t k = 1; k < have; ++k) {
    if (!in(seq->bytes[k], p[k])) return 0;
  }
  return have;
}

// Steps through a region's rows (deterministic: a level is a set of rows, at most kMaxRows).
struct RowSteps {
  static constexpr size_t kMaxRows = 64;
  const std::vector<int32_t>& rows;
  std::vector<int32_t> cur, nxt;
  // Adds the rows reached from `from` over bytes [lo, hi] to `to`: 0, or 1 if one dies or exits,
  // or 2 if the level grows too wide.
  int step(const std::vector<int32_t>& from, unsigned lo, unsigned hi, std::vector<int32_t>& to) const {
    for (int32_t x : from) {
      const int32_t* row = rows.data() + static_cast<size_t>(x) * 256;
      for (unsigned b = lo; b <= hi; ++b) {
        if (row[b] < 0) return 1;
        add_once(to, row[b]);
      }
    }
    return to.size() <= kMaxRows ? 0 : 2;
  }
  // The rows after one character of sequence u whose start bytes lie in [lo, hi], into `to`.
  int sequence(const std::vector<int32_t>& from, const Utf8Seq& u, unsigned lo, unsigned hi, std::vector<int32_t>& to) {
    cur.clear();
    if (int r = step(from, lo, hi, cur)) return r;
    for (size_t k = 1; k < u.len; ++k) {
      nxt.clear();
      if (int r = step(cur, u.bytes[k].lo, u.bytes[k].hi, nxt)) return r;
      cur.swap(nxt);
    }
    for (int32_t x : cur) add_once(to, x);
    return to.size() <= kMaxRows ? 0 : 2;
  }
};

}  // namespace

size_t content_chars(const std::string& token, size_t* dead_after) {
  const auto* p = reinterpret_cast<const uint8_t*>(token.data());
  const size_t n = token.size();
  size_t chars = 0;
  if (dead_after) *dead_after = SIZE_MAX;
  for (size_t i = 0; i < n; ++chars) {
    const uint8_t b = p[i];
    if (b < 0x80) {
      if (!(in(kAsciiContent[0], b) || in(kAsciiContent[1], b) || in(kAsciiContent[2], b))) {
        if (dead_after && b < 0x20) *dead_after = chars;
        return SIZE_MAX;
      }
      ++i;
      continue;
    }
    bool bad_lead = false;
    const size_t k = utf8_char(p + i, n - i, &bad_lead);
    if (k == 0) {
      // A byte no character starts with, at a character boundary, is dead there.
      if (dead_after && bad_lead) *dead_after = chars;
      return SIZE_MAX;
    }
    i += k;
  }
  return chars;
}

bool utf8_well_formed(const uint8_t* p, size_t n) {
  for (size_t i = 0; i < n;) {
    bool bad_lead = false;
    const size_t k = p[i] < 0x80 ? 1 : utf8_char(p + i, n - i, &bad_lead);
    if (k == 0) return false;
    i += k;
  }
  return true;
}

bool MaskStrategies::region_keeps_utf8(const RegionRows& rr, const std::vector<uint8_t>& kept) {
  RowSteps rs{rr.rows, {}, {}};
  std::vector<int32_t> from, to;
  for (size_t r = 0; r < kept.size(); ++r) {
    if (!kept[r]) continue;
    from.assign(1, static_cast<int32_t>(r));
    for (const Utf8Seq& u : kUtf8) {
      to.clear();
      if (rs.sequence(from, u, u.bytes[0].lo, u.bytes[0].hi, to) != 0) return false;
      for (int32_t x : to) {
        if (!kept[static_cast<size_t>(x)]) return false;
      }
    }
  }
  return true;
}

bool MaskStrategies::range_targets(int32_t q, uint8_t lo, uint8_t hi, std::vector<int32_t>& out) const {
  const State& st = g_.states[static_cast<size_t>(q)];
  unsigned need = lo;  // the first byte of [lo, hi] not yet covered
  for (uint32_t e = st.byte_begin; e < st.byte_end && need <= hi; ++e) {
    const ByteEdge& be = g_.byte_edges[e];
    if (be.hi < need) continue;
    if (be.lo > need) return false;  // edges are sorted and disjoint: a gap
    add_once(out, be.target);
    need = static_cast<unsigned>(be.hi) + 1;
  }
  return need > hi;
}

bool MaskStrategies::content_deep(int32_t s, bool* ctrl_dead, size_t* limit) const {
  std::vector<int32_t> level{s}, next, cur, step;
  // Whether a control byte, and a byte no character starts with (80-C1, F5-FF), is dead at every
  // character boundary within reach, and no byte read there can leave the rule but a quote or a
  // backslash (nor enter a callee): then a token that reads such a byte after at most
  // kContentChars content characters is rejected without a walk.
  bool dead = true;
  auto quiet = [&](int32_t q) {
    const State& st = g_.states[static_cast<size_t>(q)];
    if (st.ref_begin < st.ref_end) return false;  // a callee might take the byte
    const ByteSet& e = g_.escape[static_cast<size_t>(q)];
    for (size_t w = 0; w < e.size(); ++w) {
      const uint32_t allowed = w == 1 ? (1u << (0x22 - 32)) : w == 2 ? (1u << (0x5C - 64)) : 0u;
      if (e[w] & ~allowed) return false;
    }
    return true;
  };
  *limit = TokenizerInfo::kContentChars;
  for (size_t depth = 0;; ++depth) {
    // Whether no state of the level has an edge on a byte a content character starts with (20-7F
    // but '"' and '\\', C2-F4), and none can leave the rule on one.
    bool closed = depth > 0;
    for (int32_t q : level) {
      const State& st = g_.states[static_cast<size_t>(q)];
      for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
        const ByteEdge& be = g_.byte_edges[e];
        if (be.lo < 0x20 || (be.lo <= 0xC1 && be.hi >= 0x80) || be.hi >= 0xF5) dead = false;
        for (const Range& r : kAsciiContent) {
          if (be.lo <= r.hi && be.hi >= r.lo) closed = false;
        }
        if (be.lo <= 0xF4 && be.hi >= 0xC2) closed = false;
      }
      if (!quiet(q)) {
        dead = false;
        closed = false;
      }
    }
    if (closed) {
      *limit = depth;
      break;
    }
    if (depth == TokenizerInfo::kContentChars) break;
    next.clear();
    for (int32_t q : level) {
      for (const Range& r : kAsciiContent) {
        if (!range_targets(q, r.lo, r.hi, next)) return false;
      }
      for (const Utf8Seq& u : kUtf8) {
        cur.assign(1, q);
        for (size_t k = 0; k < u.len; ++k) {
          step.clear();
          for (int32_t x : cur) {
            if (!range_targets(x, u.bytes[k].lo, u.bytes[k].hi, step)) return false;
          }
          if (step.size() > kMaxLevel) return false;
          cur.swap(step);
          if (k + 1 < u.len) {
            for (int32_t x : cur) dead = dead && quiet(x);
          }
        }
        for (int32_t x : cur) add_once(next, x);
      }
      if (next.size() > kMaxLevel) return false;
    }
    level.swap(next);
  }
  *ctrl_dead = dead;
  return true;
}

bool MaskStrategies::region_content_deep(const RegionRows& rr, ByteSet* walked, size_t* whole_chars) {
  // Start bytes excluded at most (each one's tokens are walked), and checks begun afresh at most.
  // A level wider than RowSteps::kMaxRows is not a string syntax's (a pattern's product has a few)
  // and fails the check.
  constexpr size_t kMaxWalked = 16;
  constexpr int kMaxRounds = 8;
  RowSteps rs{rr.rows, {}, {}};
  size_t n_walked = 0;
  for (unsigned c = 0; c < 256; ++c) n_walked += has(*walked, static_cast<uint8_t>(c));
  std::vector<int32_t> level, next;
  std::vector<std::vector<int32_t>> seen;
  // Round 0 excludes nothing yet: every string of fewer characters than the depth it fails at
  // stays inside, whatever bytes start its characters.
  *whole_chars = TokenizerInfo::kContentChars;
  for (int round = 0; round < kMaxRounds; ++round) {
    // Start bytes found to fail in this round: excluded, and the check begun afresh.
    std::vector<unsigned> failing;
    level.assign(1, 0);
    seen.clear();
    for (size_t depth = 0; depth < TokenizerInfo::kContentChars && failing.empty(); ++depth) {
      std::sort(level.begin(), level.end());
      // A level met before repeats the levels that followed it, all of which passed.
      if (std::find(seen.begin(), seen.end(), level) != seen.end()) return true;
      seen.push_back(level);
      next.clear();
      for (const Range& r : kAsciiContent) {
        for (unsigned b = r.lo; b <= r.hi; ++b) {
          if (has(*walked, static_cast<uint8_t>(b))) continue;
          const int res = rs.step(level, b, b, next);
          if (res == 2) return false;
          if (res == 1) failing.push_back(b);
        }
      }
      for (const Utf8Seq& u : kUtf8) {
        // The whole group at once; start byte by start byte only where that fails.
        bool open = true;
        for (unsigned b = u.bytes[0].lo; b <= u.bytes[0].hi; ++b) open = open && !has(*walked, static_cast<uint8_t>(b));
        const int whole = open ? rs.sequence(level, u, u.bytes[0].lo, u.bytes[0].hi, next) : 1;
        if (whole == 2) return false;
        if (whole == 0) continue;
        for (unsigned b = u.bytes[0].lo; b <= u.bytes[0].hi; ++b) {
          if (has(*walked, static_cast<uint8_t>(b))) continue;
          const int res = rs.sequence(level, u, b, b, next);
          if (res == 2) return false;
          if (res == 1) failing.push_back(b);
        }
      }
      level.swap(next);
    }
    if (failing.empty()) return true;
    if (round == 0 && n_walked == 0) *whole_chars = seen.size() - 1;
    for (unsigned b : failing) {
      (*walked)[b >> 5] |= 1u << (b & 31);
      if (++n_walked > kMaxWalked) return false;
    }
  }
  return false;
}

std::shared_ptr<const StateMask> MaskStrategies::compute_from_content(int32_t s) const {
  const TokenizerInfo& tk = *g_.tok;
  // A vocabulary that is not mostly content tokens walks most of itself anyway.
  bool ctrl_dead = false;
  size_t limit = 0;
  if (tk.content_count * 2 < tk.sorted.size() || !content_deep(s, &ctrl_dead, &limit)) return nullptr;
  auto base = std::make_shared<StateMask>();
  if (limit < TokenizerInfo::kContentChars) {
    finish_mask(*base, std::vector<uint32_t>(tk.content_upto_bits[limit]), tk.content_upto_count[limit]);
  } else {
    finish_mask(*base, std::vector<uint32_t>(tk.content_bits), tk.content_count);
  }
  return walk_listed(s, ctrl_dead ? tk.content_rest_walked : tk.content_rest, base.get(), calls_within_reach(s));
}

}  // namespace grammar
}  // namespace agent_infer
