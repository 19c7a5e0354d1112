// Hoisting of large repeated items into rules of their own before lowering.
//
// A pattern inside a JSON string spells each character class with its JSON escapes: `\S` is one
// alternation of dozens of UTF-8 byte ranges and `\uXXXX` sequences, a few hundred program
// words. Under a loop or a counted repeat (`(?:\S+\s+){0,99}\S+`) the NFA builder expands that
// alternation once per copy, and the subset construction walks its epsilon fan-out at every
// character of every copy; the DFA it produces keeps the alternation's unminimized states in
// each copy, since minimization only merges states that reach no cycle. A rule of its own with
// the same program is small and finite, so choose_inline() inlines it: it is lowered once to its
// minimal automaton (grammar/lower/fragment.cpp) and spliced into every copy. Same language, fewer
// states: `Github_medium---o21062`'s string rule drops from 15 798 to 9 002 states and its
// lowering by ~3.5x. Only items that cannot change what gets inlined are hoisted: call-free
// (no references, no key tries), loop-free and without repeats, and big enough to matter.
#include <map>
#include <utility>

#include "grammar/errors.h"
#include "grammar/ir/program.h"
#include "grammar/lower/rule_passes.h"

namespace agent_infer {
namespace grammar {
namespace {

constexpr size_t kMinHoistedProgram = 32;  // item program words: below this the NFA is small anyway
constexpr size_t kMaxHoistedProgram = 2000;  // choose_inline()'s bound on an inlined rule
constexpr int kMaxDepth = 2000;

// End of the expression at `pc` if it is made of literals, classes, sequences and alternatives
// only (nothing a caller could lower differently); 0 otherwise.
size_t plain_end(const std::vector<int32_t>& code, size_t pc, int depth = 0) {
  if (depth > kMaxDepth) throw LimitError("grammar expression nesting is deeper than 2000 levels");
  const int32_t op = code.at(pc);
  if (op == kSeq || op == kAlt) {
    const int32_t n = code.at(pc + 1);
    pc += 2;
    for (int32_t i = 0; i < n; ++i) {
      pc = plain_end(code, pc, depth + 1);
      if (pc == 0) return 0;
    }
    return pc;
  }
  if (op == kEmpty || op == kLiteral || op == kClass) return pc + instruction_length(code, pc);
  return 0;
}

// The [begin, end) spans of the hoistable items of repeats in `code`, in program order. Items
// are repeat-free, so spans never nest.
void find_items(const std::vector<int32_t>& code, std::vector<std::pair<size_t, size_t>>* spans) {
  spans->clear();
  for (size_t pc = 0; pc < code.size();) {
    if (code[pc] != kRepeat) {
      pc += instruction_length(code, pc);
      continue;
    }
    const size_t item = pc + instruction_length(code, pc);
    const size_t end = item < code.size() && (code[item] == kAlt || code[item] == kSeq) ? plain_end(code, item) : 0;
    if (end != 0 && end - item >= kMinHoistedProgram && end - item <= kMaxHoistedProgram) {
      spans->push_back({item, end});
      pc = end;
    } else {
      pc = item;
    }
  }
}

}  // namespace

bool hoist_repeat_items(const std::vector<std::vector<int32_t>>& rules, std::vector<std::vector<int32_t>>* out) {
  std::vector<std::pair<size_t, size_t>> spans;
  size_t first = rules.size();
  for (size_t r = 0; r < rules.size() && first == rules.size(); ++r) {
    find_items(rules[r], &spans);
    if (!spans.empty()) first = r;
  }
  if (first == rules.size()) return false;
  if (out != &rules) *out = rules;
  std::vector<std::vector<int32_t>>& prog = *out;
  const size_t R = prog.size();
  // Equal items share one rule; ordered map keeps rule numbering independent of hashing.
  std::map<std::vector<int32_t>, int32_t> rule_of;
  std::vector<int32_t> rewritten;
  for (size_t r = first; r < R; ++r) {
    find_items(prog[r], &spans);
    if (spans.empty()) continue;
    const std::vector<int32_t>& code = prog[r];
    rewritten.clear();
    rewritten.reserve(code.size());
    size_t at = 0;
    for (const auto& [b, e] : spans) {
      rewritten.insert(rewritten.end(), code.begin() + static_cast<std::ptrdiff_t>(at),
                       code.begin() + static_cast<std::ptrdiff_t>(b));
      std::vector<int32_t> item(code.begin() + static_cast<std::ptrdiff_t>(b),
                                code.begin() + static_cast<std::ptrdiff_t>(e));
      auto [it, fresh] = rule_of.try_emplace(std::move(item), static_cast<int32_t>(R + rule_of.size()));
      rewritten.push_back(kRef);
      rewritten.push_back(it->second);
      at = e;
    }
    rewritten.insert(rewritten.end(), code.begin() + static_cast<std::ptrdiff_t>(at), code.end());
    prog[r].swap(rewritten);
  }
  prog.resize(R + rule_of.size());
  for (auto& [item, q] : rule_of) prog[static_cast<size_t>(q)] = item;
  return true;
}

}  // namespace grammar
}  // namespace agent_infer
