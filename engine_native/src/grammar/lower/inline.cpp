// Which rules are inlined into their callers (lowered once as automata and spliced in, see
// grammar/lower/fragment.cpp) rather than kept as rules of their own.
//
// choose_inline() inlines small finite rules, bounded by their expanded (tree) size. That size
// grows exponentially along a chain of rules that share their continuations: a `pattern` under
// `maxLength` becomes one right-linear rule per position of its counted automaton, each calling
// the next positions. Only the chain's tail stayed inlined, and every rule at the cut copied the
// whole tail into its own automaton. inline_finite_chains() therefore also inlines a finite rule
// whose references are all in tail position, when they are referenced from such rules (and at
// most once from elsewhere), as a fragment in the shared store (grammar/lower/fragment_store.cpp): the
// chain costs its own states once, and its one caller copies the minimal automaton once. That
// decision is tentative (kInlineIfFits): a rule whose fragment does not fit the store stays a
// rule of its own (grammar/lower/nfa.cpp).
#include <algorithm>
#include <functional>

#include "grammar/errors.h"
#include "grammar/ir/program.h"
#include "grammar/lower/rule_passes.h"

namespace agent_infer {
namespace grammar {

namespace {

// Rules with loops, or with counted repeats longer than this, are not inlined: a long chain
// (a `maxLength` string) is built once and its positions' masks are shared by every caller.
constexpr int32_t kMaxInlineRepeat = 32;

// Whether every reference in the expression at pc is in tail position (nothing follows it in
// the rule), given whether the expression itself is; moves pc past the expression.
bool refs_in_tail(const std::vector<int32_t>& code, size_t& pc, bool tail, int depth) {
  if (depth > 2000) throw DefinitionError("grammar expression nesting is deeper than 2000 levels");
  switch (code.at(pc)) {
    case kRef:
      pc += 2;
      return tail;
    case kSeq:
    case kAlt: {
      const bool seq = code[pc] == kSeq;
      const int32_t n = code.at(pc + 1);
      pc += 2;
      bool ok = true;
      for (int32_t i = 0; i < n; ++i) ok = refs_in_tail(code, pc, tail && (!seq || i + 1 == n), depth + 1) && ok;
      return ok;
    }
    case kRepeat:
      pc += 3;
      return refs_in_tail(code, pc, false, depth + 1);
    default:
      pc += instruction_length(code, pc);
      return true;
  }
}

constexpr int64_t kCap = int64_t{1} << 40;  // sizes and counts saturate here

// a * b for a, b in [0, kCap], saturated at kCap.
int64_t sat_mul(int64_t a, int64_t b) { return b != 0 && a > kCap / b ? kCap : std::min(a * b, kCap); }

// Adds to (*words)[r] the program words of the expression at pc times `mult` (the copies the
// enclosing counted repeats make of it), and to (*refs) each reference with its multiplicity;
// moves pc past the expression.
void count_copies(const std::vector<int32_t>& code, size_t& pc, int64_t mult, int64_t* words,
                  std::vector<std::pair<int32_t, int64_t>>* refs, int depth) {
  if (depth > 2000) throw LimitError("grammar expression nesting is deeper than 2000 levels");
  const int32_t op = code.at(pc);
  const size_t len = instruction_length(code, pc);
  *words = std::min(*words + sat_mul(mult, static_cast<int64_t>(len)), kCap);
  if (op == kRef) refs->push_back({code.at(pc + 1), mult});
  pc += len;
  if (op == kSeq || op == kAlt) {
    const int32_t n = code.at(pc - 1);
    for (int32_t i = 0; i < n; ++i) count_copies(code, pc, mult, words, refs, depth + 1);
  } else if (op == kRepeat) {
    const int64_t copies = std::max<int64_t>(1, std::max(code.at(pc - 2), code.at(pc - 1)));
    count_copies(code, pc, sat_mul(mult, copies), words, refs, depth + 1);
  }
}

}  // namespace

// An inlined rule is copied into every caller, and into every copy a counted repeat around the
// reference makes. choose_inline() bounds a rule's size with each callee counted once. A rule
// whose own counted repeats multiply it (an array of enum strings with `maxItems`: one copy of
// the enum's automaton per item) to at least kMinCopiedRule words, and whose extra copies (one
// per reference past the first) would add more than kMaxExtraCopies words, stays a rule of its
// own, built once instead of once per caller (`Github_medium---o21108`: the same arrays under
// eight `anyOf` branches). Rules without counted repeats (`char`, `char-high`) always stay
// inlined: behind a reference, every position of a string would need a pushdown walk.
constexpr int64_t kMinCopiedRule = 1000;
constexpr int64_t kMaxExtraCopies = 4000;

// Drops from `inl` the rules described above, and then every inlined rule that
// calls a rule no longer inlined (inlined rules only call inlined rules).
// counted[r]: rule r holds a repeat of two or more copies.
static void demote_copied_rules(const std::vector<std::vector<int32_t>>& rules, const std::vector<uint8_t>& counted,
                                std::vector<uint8_t>* inl) {
  const size_t R = rules.size();
  bool any = false;
  for (size_t r = 0; r < R && !any; ++r) any = counted[r] && (*inl)[r];
  if (!any) return;  // most grammars: nothing to demote, and no second pass over the programs
  // References with their multiplicity, flat per rule; program words times the copies made.
  std::vector<uint32_t> ref_begin(R + 1, 0);
  std::vector<std::pair<int32_t, int64_t>> refs;
  std::vector<int64_t> own(R, 0), uses(R, 0), expanded(R, -1);
  for (size_t r = 0; r < R; ++r) {
    size_t pc = 0;
    while (pc < rules[r].size()) count_copies(rules[r], pc, 1, &own[r], &refs, 0);
    ref_begin[r + 1] = static_cast<uint32_t>(refs.size());
  }
  for (const auto& [q, m] : refs) uses[q] = std::min(uses[q] + m, kCap);
  // Inlined rules call only inlined rules and form no cycle: sizes by depth-first recursion.
  std::function<int64_t(int32_t)> size_of = [&](int32_t r) -> int64_t {
    if (expanded[r] >= 0) return expanded[r];
    int64_t total = own[r];
    for (uint32_t k = ref_begin[r]; k < ref_begin[r + 1]; ++k) {
      const auto [q, m] = refs[k];
      if ((*inl)[q]) total = std::min(total + sat_mul(m, size_of(q)), kCap);
    }
    return expanded[r] = total;
  };
  bool changed = false;
  for (size_t r = 0; r < R; ++r) {
    if (!counted[r] || !(*inl)[r] || uses[r] < 2) continue;
    const int64_t size = size_of(static_cast<int32_t>(r));
    if (size >= kMinCopiedRule && uses[r] - 1 > kMaxExtraCopies / size) {
      (*inl)[r] = 0;
      changed = true;
    }
  }
  while (changed) {
    changed = false;
    for (size_t r = 0; r < R; ++r) {
      if (!(*inl)[r]) continue;
      for (uint32_t k = ref_begin[r]; k < ref_begin[r + 1]; ++k) {
        if (!(*inl)[refs[k].first]) {
          (*inl)[r] = 0;
          changed = true;
          break;
        }
      }
    }
  }
}

// Rules with loops (strings, numbers) or long chains stay separate so their states' masks are shared.
std::vector<uint8_t> choose_inline(const std::vector<std::vector<int32_t>>& rules, int32_t root,
                                   const std::vector<uint8_t>& keep) {
  const size_t R = rules.size();
  // References per rule, flat (one scan of each program, which also finds its long repeats).
  std::vector<uint32_t> ref_begin(R + 1, 0);
  std::vector<int32_t> ref_list;
  std::vector<uint8_t> long_repeat(R, 0), counted(R, 0);
  for (size_t r = 0; r < R; ++r) {
    const std::vector<int32_t>& code = rules[r];
    for (size_t pc = 0; pc < code.size(); pc += instruction_length(code, pc)) {
      if (code[pc] == kRef) {
        ref_list.push_back(code.at(pc + 1));
      } else if ((code[pc] == kRepeat &&
                  (code.at(pc + 2) < 0 || std::max(code.at(pc + 1), code.at(pc + 2)) > kMaxInlineRepeat)) ||
                 code[pc] == kKeyTrie || code[pc] == kCheck) {
        // A key trie calls its rest rule, a loop; a check is decided where it ends, as a rule of
        // its own: never inlined.
        long_repeat[r] = 1;
      }
      if (code[pc] == kRepeat && std::max(code.at(pc + 1), code.at(pc + 2)) >= 2) counted[r] = 1;
    }
    if (r < keep.size() && keep[r]) long_repeat[r] = 1;  // as a loop would: never inlined, nor its callers
    ref_begin[r + 1] = static_cast<uint32_t>(ref_list.size());
  }
  // state: 0 = unvisited, 1 = in progress, 2 = done. size = estimated expanded code size, -1 = no.
  std::vector<int> st(R, 0);
  std::vector<int64_t> size(R, -1);
  std::vector<uint8_t> inl(R, 0);
  const int64_t kMaxInline = 2000;
  std::function<void(int32_t)> visit = [&](int32_t r) {
    st[r] = 1;
    bool ok = !long_repeat[r];
    int64_t total = static_cast<int64_t>(rules[r].size());
    for (uint32_t k = ref_begin[r]; k < ref_begin[r + 1]; ++k) {
      const int32_t q = ref_list[k];
      if (q < 0 || static_cast<size_t>(q) >= R) throw DefinitionError("reference to unknown rule");
      if (st[q] == 0) visit(q);
      if (st[q] == 1 || size[q] < 0) {
        ok = false;  // recursion (or a callee that cannot be inlined)
      } else {
        total += size[q];
      }
    }
    st[r] = 2;
    size[r] = (ok && total <= kMaxInline) ? total : -1;
    inl[r] = size[r] >= 0 && r != root;
  };
  // Recursion through a rule still being visited marks only the caller; a cycle's entry rule is
  // then fixed up here: any rule that can reach itself must never be inlined.
  for (size_t r = 0; r < R; ++r) {
    if (st[r] == 0) visit(static_cast<int32_t>(r));
  }
  for (size_t r = 0; r < R; ++r) {
    if (!inl[r]) continue;
    // Confirm acyclicity from r (inlined rules only call inlined rules, which are acyclic by size).
    for (uint32_t k = ref_begin[r]; k < ref_begin[r + 1]; ++k) {
      if (!inl[ref_list[k]]) {
        inl[r] = 0;
        break;
      }
    }
  }
  demote_copied_rules(rules, counted, &inl);
  return inl;
}


void inline_finite_chains(const std::vector<std::vector<int32_t>>& rules, int32_t root,
                          const std::vector<uint8_t>& keep, std::vector<uint8_t>* inl) {
  const size_t R = rules.size();
  std::vector<uint32_t> ref_begin(R + 1, 0);
  std::vector<int32_t> refs;
  std::vector<uint8_t> finite(R, 1);
  for (size_t r = 0; r < R; ++r) {
    const std::vector<int32_t>& code = rules[r];
    for (size_t pc = 0; pc < code.size(); pc += instruction_length(code, pc)) {
      if (code[pc] == kRef) {
        const int32_t q = code.at(pc + 1);
        if (q < 0 || static_cast<size_t>(q) >= R) return;  // lowering reports it
        refs.push_back(q);
      } else if ((code[pc] == kRepeat &&
                  (code.at(pc + 2) < 0 || std::max(code.at(pc + 1), code.at(pc + 2)) > kMaxInlineRepeat)) ||
                 code[pc] == kKeyTrie || code[pc] == kCheck) {
        finite[r] = 0;
      }
    }
    if (r < keep.size() && keep[r]) finite[r] = 0;
    ref_begin[r + 1] = static_cast<uint32_t>(refs.size());
  }
  // Finite: no long repeat, no recursion, only finite callees. An iterative depth-first search
  // (chains are thousands of rules deep): 0 unvisited, 1 on the stack, 2 done.
  std::vector<uint8_t> mark(R, 0);
  std::vector<std::pair<int32_t, uint32_t>> stack;
  for (size_t s = 0; s < R; ++s) {
    if (mark[s]) continue;
    stack.assign(1, {static_cast<int32_t>(s), ref_begin[s]});
    mark[s] = 1;
    while (!stack.empty()) {
      auto& [r, k] = stack.back();
      if (k < ref_begin[r + 1]) {
        const int32_t q = refs[k++];
        if (mark[q] == 0) {
          mark[q] = 1;
          stack.push_back({q, ref_begin[q]});
        } else if (mark[q] == 1 || !finite[q]) {
          finite[r] = 0;  // recursion, or a callee that is not finite
        }
        continue;
      }
      const int32_t done = r;
      mark[done] = 2;
      stack.pop_back();
      if (!stack.empty() && !finite[done]) finite[stack.back().first] = 0;
    }
  }
  std::vector<uint8_t> cand(R, 0);
  bool any = false;
  for (size_t r = 0; r < R; ++r) {
    if (!finite[r] || (*inl)[r] || static_cast<int32_t>(r) == root) continue;
    // Right-linear rules only (a chain): their fragments point into their callees' states, where
    // a reference followed by more would copy the callee's automaton per continuation.
    size_t pc = 0;
    cand[r] = refs_in_tail(rules[r], pc, true, 0);
    any |= cand[r] != 0;
  }
  if (!any) return;
  // References from rules that stay separate; a candidate met twice there stays separate too
  // (its automaton would be copied per reference), which makes its own callees outside ones.
  std::vector<uint32_t> outside(R, 0);
  std::vector<int32_t> drop;
  for (size_t p = 0; p < R; ++p) {
    if (cand[p] || (*inl)[p]) continue;
    for (uint32_t k = ref_begin[p]; k < ref_begin[p + 1]; ++k) {
      if (cand[refs[k]] && ++outside[refs[k]] == 2) drop.push_back(refs[k]);
    }
  }
  while (!drop.empty()) {
    const int32_t q = drop.back();
    drop.pop_back();
    if (!cand[q]) continue;
    cand[q] = 0;
    for (uint32_t k = ref_begin[q]; k < ref_begin[q + 1]; ++k) {
      if (cand[refs[k]] && ++outside[refs[k]] == 2) drop.push_back(refs[k]);
    }
  }
  for (size_t r = 0; r < R; ++r) {
    if (cand[r]) (*inl)[r] = kInlineIfFits;
  }
}

}  // namespace grammar
}  // namespace agent_infer
