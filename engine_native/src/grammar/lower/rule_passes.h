// Rewrites of the rule programs before they are lowered: equal-rule merging (dedupe.cpp), hoisting
// of large repeated items (hoist.cpp), the choice of rules to inline (inline.cpp) and outlining of
// shared continuations (outline.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "grammar/ir/program.h"

namespace agent_infer {
namespace grammar {

// Rules whose programs are equal once every reference is replaced by its target's class (the
// coarsest such partition) derive the same language, so their callers can share one automaton.
// If any rules merge, writes the programs with every reference redirected to its class's
// representative (the root for the root's class, else the lowest index) and returns true.
// Returns false (nothing merged, `out` untouched) also when finding the partition costs too much.
bool merge_equal_rules(const std::vector<std::vector<int32_t>>& rules, int32_t root,
                       std::vector<std::vector<int32_t>>* out);

// Replaces each large call-free, repeat-free item of a repeat (a pattern's character class with
// its JSON escapes, under `+` or `{m,n}`) by a reference to an appended rule holding it, one rule
// per distinct item, so the item is lowered once to its minimal automaton and spliced into each
// copy (grammar/lower/hoist.cpp). If anything is hoisted, writes the rules to `out` (which may be
// `rules` itself) and returns true; else leaves `out` untouched and returns false.
bool hoist_repeat_items(const std::vector<std::vector<int32_t>>& rules, std::vector<std::vector<int32_t>>* out);

// Rules to inline into their callers: not recursive, a finite language, small once expanded.
// Rules marked in `keep` (unique array items, whose completions the matcher must see) stay rules
// of their own, and so do their callers (size 0: none kept).
std::vector<uint8_t> choose_inline(const std::vector<std::vector<int32_t>>& rules, int32_t root,
                                   const std::vector<uint8_t>& keep);

// An inline_rule value: inline the rule if its automaton fits the fragment store (else it stays
// a rule of its own). choose_inline() writes 1 (always inline) and 0.
constexpr uint8_t kInlineIfFits = 2;

// Marks kInlineIfFits the finite, right-linear rules (no recursion, no long repeat, references
// only in tail position) that choose_inline() left separate for their expanded size, where every
// reference to them comes from such rules but at most one (grammar/lower/inline.cpp). Rules marked
// in `keep` are never candidates, nor is a rule that calls one.
void inline_finite_chains(const std::vector<std::vector<int32_t>>& rules, int32_t root,
                          const std::vector<uint8_t>& keep, std::vector<uint8_t>* inl);

// Rewrites Seq(Alt(a..., Ref x), Ref y) (x inlined and big, y separate, the pair met at least
// twice) as Alt(Seq(Alt(a...), Ref y), Ref z) with one appended rule z ::= x y per pair, so x's
// automaton is built once instead of once per occurrence (grammar/lower/outline.cpp). If anything is
// outlined, writes the rules to `out` (which may be `rules` itself), extends `inline_rule` with
// the new rules (not inlined) and returns true; else leaves both untouched and returns false.
bool outline_continuations(const std::vector<std::vector<int32_t>>& rules, std::vector<std::vector<int32_t>>* out,
                           std::vector<uint8_t>* inline_rule);

}  // namespace grammar
}  // namespace agent_infer
