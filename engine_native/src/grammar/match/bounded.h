// Max-length JSON strings at run time (ir.BoundedString, CompiledGrammar::max_length): the
// string's automaton is the constraint's without the bound, and the matcher counts the decoded
// code points of each open string, dropping an item of the rule once its count plus the fewest
// characters that can still finish the string exceeds the bound. Exact where the product of the
// constraint's automaton and a length counter would be too large to build.
#pragma once

#include <climits>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace agent_infer {
namespace grammar {

class CompiledGrammar;

namespace bounded {

// Where a string's decoding stands after a byte: before its opening quote, in its text (after a
// high surrogate escape: a low one next joins it into one code point), after a backslash, inside
// `\uXXXX` (U1..U3: digits read; D: the first was d, H: a high surrogate, X: neither), inside the
// escape after a high surrogate (UH: not counted until it is known not to be the pair's low half),
// and after the closing quote.
enum Lex : uint8_t {
  kPre,
  kStr,
  kStrHigh,
  kEsc,
  kEscHigh,
  kU0,
  kU1D,
  kU1X,
  kU2H,
  kU2X,
  kU3H,
  kU3X,
  kUH0,
  kUH1D,
  kUH2L,
  kUH3L,
  kClosed,
  kLexStates
};

constexpr int32_t kInf = INT32_MAX / 4;

// The context after byte b in context c; adds to *count the code points b completes or starts
// (JSON's decoding, as json.loads counts them: an escape is one, a surrogate pair one, a lone
// surrogate one). Escapes are assumed well formed: the string's automaton checks them.
inline uint8_t lex_step(uint8_t c, uint8_t b, int32_t* count) {
  const uint8_t lower = b | 0x20;
  const bool hex_ab = (b == '8' || b == '9' || lower == 'a' || lower == 'b');
  switch (c) {
    case kPre:
      return b == '"' ? kStr : kClosed;
    case kStr:
    case kStrHigh:
      if (b == '"') return kClosed;
      if (b == '\\') {
        if (c == kStr) {
          ++*count;
          return kEsc;
        }
        return kEscHigh;
      }
      if ((b & 0xC0) != 0x80) ++*count;
      return kStr;
    case kEsc:
      return b == 'u' ? kU0 : kStr;
    case kEscHigh:
      if (b == 'u') return kUH0;
      ++*count;
      return kStr;
    case kU0:
      return lower == 'd' ? kU1D : kU1X;
    case kU1D:
      return hex_ab ? kU2H : kU2X;
    case kU1X:
      return kU2X;
    case kU2H:
      return kU3H;
    case kU2X:
      return kU3X;
    case kU3H:
      return kStrHigh;
    case kU3X:
      return kStr;
    case kUH0:
      if (lower == 'd') return kUH1D;
      ++*count;
      return kU1X;
    case kUH1D:
      if (lower >= 'c' && lower <= 'f') return kUH2L;
      ++*count;
      return hex_ab ? kU2H : kU2X;
    case kUH2L:
      return kUH3L;
    case kUH3L:
      return kStr;
    default:
      return kClosed;
  }
}

}  // namespace bounded

// The tokens that may overrun an open max-length string from one (state, context): with `need`
// the most code points the string needs once the token is read up to any of its bytes inside the
// string (the count it adds plus the fewest still to come), sorted by need, largest first. A
// token overruns a string with `budget` code points left iff its need exceeds the budget. Tokens
// whose need never exceeds the fewest the string needs anyway are left out.
struct BoundedTokens {
  std::vector<int32_t> need;
  std::vector<int32_t> ids;
};

class BoundedTables {
 public:
  // Throws DefinitionError when a max-length rule's automaton calls another rule (its items'
  // count would lie in the callee's items).
  static std::shared_ptr<const BoundedTables> build(const CompiledGrammar& g);

  // The fewest code points that finish the string from state s (of a max-length rule) in context
  // `lex`; kInf when none do.
  int32_t dmin(int32_t s, uint8_t lex) const {
    return dmin_[static_cast<size_t>(row_[static_cast<size_t>(s)]) * bounded::kLexStates + lex];
  }
  // The largest dmin a string of rule r can meet: with fewer than this plus a token's length left,
  // a token may overrun it.
  int32_t dmax(int32_t r) const { return dmax_[static_cast<size_t>(r)]; }
  // Whether no string of rule r fits its bound (the matcher does not predict it).
  bool dead(int32_t r) const { return dead_[static_cast<size_t>(r)] != 0; }
  // Sorted positions of the tokens that may open a max-length string and overrun it within
  // themselves: more bytes after their first quote than the fewest code points any max-length
  // rule has to spare after its dmax (every token with a quote, where no string fits a rule).
  const std::vector<int32_t>& quote_tokens() const { return quote_tokens_; }
  std::shared_ptr<const BoundedTokens> tokens(const CompiledGrammar& g, int32_t s, uint8_t lex) const;
  // The tables built with the grammar (the token lists, built later and bounded by
  // kMaxStoredTokens, are left out like the state masks).
  size_t table_bytes() const {
    return (row_.size() + dmin_.size() + dmax_.size() + quote_tokens_.size()) * sizeof(int32_t) + dead_.size();
  }

 private:
  std::vector<int32_t> row_;   // per state: its row of dmin_, -1 outside max-length rules
  std::vector<int32_t> dmin_;  // kLexStates per row
  std::vector<int32_t> dmax_;  // per rule
  std::vector<uint8_t> dead_;  // per rule
  int32_t quote_slack_ = bounded::kInf;  // see quote_tokens()
  std::vector<int32_t> quote_tokens_;
  mutable std::mutex mu_;
  mutable std::unordered_map<int64_t, std::shared_ptr<const BoundedTokens>> tokens_;
  mutable size_t stored_ = 0;
};

}  // namespace grammar
}  // namespace agent_infer
