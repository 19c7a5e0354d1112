// JSON text helpers for unique array items (ir.UniqueItem, CompiledGrammar::unique_rule): the
// matcher rejects the completion of a marked item whose value equals an earlier item of the same
// array. Values are compared, not spellings (`1` = `1.0` = `1e0`, `"a"` = `"\u0061"`, objects
// in any member order), so the grammar may spell items freely.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace agent_infer {
namespace grammar {

class TokenizerInfo;

namespace unique {

// Nesting depth up to which an item's value is compared; deeper items raise LimitError.
constexpr int kMaxDepth = 256;

// The canonical form of the JSON value spelled by bytes [p, p + n): equal forms for equal values
// under JSON Schema's equality (numbers by exact decimal value, strings by their code points,
// objects by member set, the last of duplicate keys winning as json.loads keeps it). The text is
// read leniently where the grammar ends an item before its forced tail: a lone `n`, `t`, `f`
// is null, true, false, and a container left open at the end is closed. Throws LimitError past
// kMaxDepth or for a number exponent beyond 10^15.
void canonical_value(const uint8_t* p, size_t n, std::string* out);

// Whether b is JSON whitespace.
inline bool is_ws(uint8_t b) { return b == ' ' || b == '\t' || b == '\n' || b == '\r'; }
// Whether b can be part of a JSON number.
inline bool number_byte(uint8_t b) {
  return (b >= '0' && b <= '9') || b == '.' || b == 'e' || b == 'E' || b == '+' || b == '-';
}

// The first byte of the JSON value whose last byte is text[last], read backwards (strings by
// their unescaped quotes, containers by bracket depth outside strings, scalars by their
// characters); -1 if the text there is not the end of a value.
int64_t value_start(const uint8_t* text, int64_t last);

// JSON lexer contexts at a position: outside strings, inside one, after a backslash in one, and
// after `\u` with 0..3 hex digits read.
enum Lex : uint8_t { kOut = 0, kStr = 1, kEsc = 2, kU0 = 3, kU1 = 4, kU2 = 5, kU3 = 6, kLexContexts = 7 };

// The context after reading b in context c (escapes assumed well formed: the grammar checks them).
inline uint8_t lex_step(uint8_t c, uint8_t b) {
  switch (c) {
    case kOut:
      return b == '"' ? kStr : kOut;
    case kStr:
      return b == '"' ? kOut : b == '\\' ? kEsc : kStr;
    case kEsc:
      return b == 'u' ? kU0 : kStr;
    case kU3:
      return kStr;
    default:
      return static_cast<uint8_t>(c + 1);
  }
}

}  // namespace unique

// Per tokenizer: for each lexer context, the tokens whose bytes read from it may complete a JSON
// value (an id bitmask of `words` words). A token outside them, read where an item is open,
// leaves every value as it was or opens a string and stays in it, so no unique item can complete
// inside it. `with_comma`: tokens holding a comma, the only ones that may complete two items of
// one array (a duplicate within the token) where no unique array is open yet.
struct JsonTokenClasses {
  std::vector<uint32_t> may_complete[unique::kLexContexts];
  std::vector<uint32_t> with_comma;
  std::vector<int32_t> pos_of;  // token id -> its position in TokenizerInfo::sorted (-1: none)
};

JsonTokenClasses build_json_token_classes(const TokenizerInfo& t);

}  // namespace grammar
}  // namespace agent_infer
