// The flat per-rule programs the lowering reads: the IR as agent_infer/grammar/compile serializes
// it (and grammar/ir/serialize.cpp writes it natively), one prefix-coded program per rule.
#pragma once

#include <cstdint>
#include <vector>

#include "grammar/errors.h"

namespace agent_infer {
namespace grammar {

// Opcodes of the flat IR written by grammar/ir/serialize.cpp (tests/support/python_serializer.py: its oracle).
//   EMPTY | LITERAL n b0..b(n-1) (UTF-8 bytes) | CLASS n lo0 hi0 .. (normalized code point ranges)
//   SEQ n child.. | ALT n child.. | REPEAT min max(-1 = unbounded) child | REF rule_index
//   | KEY_TRIE n free_rule rest_rule count (len cp0..cp(len-1))..: n payload words; a JSON
//     object key (quotes excluded) that is none of `count` names (sorted, distinct, plain printable
//     ASCII), where
//     a plain character that continues no name is followed by rest_rule and free_rule reads a
//     special character and the rest. Only as a rule's whole body; lowered straight to its
//     automaton (grammar/lower/key_set.cpp).
//   | UNIQUE (one word, then the rule's expression): the rule is an item of a JSON array whose
//     items must be distinct (ir.UniqueItem). Only as a rule's first word; the lowering records
//     the mark (CompiledGrammar::unique_rule) and removes the word before any other pass but the
//     merging of equal rules, which keeps marked and unmarked rules apart through it.
//   | MAX_LENGTH n (two words, then the rule's expression): the rule is a JSON string of at most n
//     code points once decoded (ir.BoundedString); like UNIQUE, only as a rule's first word, recorded
//     (CompiledGrammar::max_length) and removed after the merging of equal rules.
//   | CHECK n items carriers count sig0..sig(count-1) rule0..rule(items-1): n payload words; a run-
//     time check (ir.nodes.Check): a span the first `carriers` rules scan, kept when the set of
//     item rules whose language holds it (bit i: rule i) is one of the `count` sorted signatures;
//     the carriers word also holds kCheckProduct (ir.nodes.Check.product). Only as a rule's whole
//     body; its automaton is start -> each carrier -> final, which the matcher decides
//     (grammar/lower/runtime_checks.cpp, grammar/match/verdicts.cpp), or, with kCheckProduct, the
//     exact product of its items (grammar/lower/check_product.cpp).
enum Op : int32_t {
  kEmpty = 0,
  kLiteral = 1,
  kClass = 2,
  kSeq = 3,
  kAlt = 4,
  kRepeat = 5,
  kRef = 6,
  kKeyTrie = 7,
  kUnique = 8,
  kMaxLength = 9,
  kCheck = 10
};
constexpr int32_t kCheckProduct = 1 << 12;


// Throws the DefinitionError for an opcode instruction_length() does not know (out of line, so
// the inline stepper below stays small).
[[noreturn]] void throw_unknown_opcode();

// Length in words of the instruction at `pc` (opcodes and layout above). A rule's program is
// prefix-coded, so stepping by this visits every instruction in pre-order. Inline: every pass
// over the programs (merging, outlining, inlining, NFA building) steps through each word with it.
inline size_t instruction_length(const std::vector<int32_t>& code, size_t pc) {
  switch (code[pc]) {
    case kEmpty:
    case kUnique:
      return 1;
    case kLiteral:
      return 2 + static_cast<size_t>(code.at(pc + 1));
    case kClass:
      return 2 + 2 * static_cast<size_t>(code.at(pc + 1));
    case kSeq:
    case kAlt:
    case kRef:
    case kMaxLength:
      return 2;
    case kRepeat:
      return 3;
    case kKeyTrie:
    case kCheck:
      return 2 + static_cast<size_t>(code.at(pc + 1));
    default:
      throw_unknown_opcode();
  }
}

// A key-trie rule (its body is one KEY_TRIE instruction, see enum Op).
inline bool is_key_trie(const std::vector<int32_t>& code) { return !code.empty() && code[0] == kKeyTrie; }
// A run-time check rule (its body is one CHECK instruction, see enum Op).
inline bool is_check(const std::vector<int32_t>& code) { return !code.empty() && code[0] == kCheck; }
// Where a CHECK instruction's item rules begin (its payload: items, carriers, count, signatures).
inline size_t check_items_at(const std::vector<int32_t>& code, size_t pc) {
  return pc + 5 + static_cast<size_t>(code.at(pc + 4));
}


// The position after the expression at `pc`.
size_t skip_expression(const std::vector<int32_t>& code, size_t pc);

}  // namespace grammar
}  // namespace agent_infer
