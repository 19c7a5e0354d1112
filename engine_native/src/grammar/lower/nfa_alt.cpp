// Lowering, step 1 (continued): alternations whose branches share a large first or last element.
//
// A `pattern` search such as "dev|alpha|beta" lowers to one branch per word, each wrapped in its
// own copy of the JSON string-character loop (`C* alpha C*`). Subset construction then carries
// every branch's copy of the loop in every DFA state (sets of hundreds of NFA states: ~5 µs per
// state). Here branches that end in the same expression (same program words) reach one shared
// copy of it through a join state, and among them those that start with the same expression
// share one copy of that too: C* alpha C* | C* beta C* becomes C* (alpha | beta) C*. Concatenation
// distributes over union, so the language is the same; the NFA is smaller and its closures too.
#include <algorithm>
#include <cstring>

#include "grammar/errors.h"
#include "grammar/ir/program.h"
#include "grammar/lower/nfa_builder.h"

namespace agent_infer {
namespace grammar {

namespace {

// Elements shorter than this (program words) are cheap to copy: not worth a join state.
constexpr size_t kMinSharedWords = 8;
// Alternations with more branches are built as before (the grouping compares branch pairs).
constexpr int32_t kMaxFactoredBranches = 64;

bool same_words(const std::vector<int32_t>& code, size_t a, size_t a_end, size_t b, size_t b_end) {
  return a_end - a == b_end - b && std::memcmp(&code[a], &code[b], (a_end - a) * sizeof(int32_t)) == 0;
}

}  // namespace

bool NfaBuilder::build_factored_alt(const std::vector<int32_t>& code, size_t& pc, int32_t from, bool tail,
                                    int32_t* end_out) {
  const int32_t count = code.at(pc + 1);
  if (count < 2 || count > kMaxFactoredBranches) return false;
  // Each branch's element spans: a Seq of two or more elements, or the branch itself.
  using Branch = AltBranch;
  std::vector<Branch>& branches = alt_branches_;
  std::vector<size_t>& elems = alt_elems_;
  const size_t saved_branches = branches.size(), saved_elems = elems.size();
  size_t p = pc + 2;
  bool any_seq = false;
  for (int32_t i = 0; i < count; ++i) {
    Branch br{p, skip_expression(code, p), static_cast<uint32_t>(elems.size()), 1, -1};
    if (code[p] == kSeq && code.at(p + 1) >= 2) {
      br.n = static_cast<uint32_t>(code[p + 1]);
      size_t q = p + 2;
      for (uint32_t k = 0; k < br.n; ++k) {
        elems.push_back(q);
        q = skip_expression(code, q);
      }
      elems.push_back(q);
      any_seq = true;
    } else {
      elems.push_back(p);
      elems.push_back(br.end);
    }
    branches.push_back(br);
    p = br.end;
  }
  auto restore = [&]() {
    branches.resize(saved_branches);
    elems.resize(saved_elems);
  };
  if (!any_seq) {
    restore();
    return false;
  }
  // Group the multi-element branches by their last element.
  const size_t B = saved_branches;
  int32_t groups = 0;
  for (size_t i = B; i < branches.size(); ++i) {
    Branch& x = branches[i];
    if (x.n < 2 || x.group >= 0) continue;
    const size_t xs = elems[x.first + x.n - 1], xe = elems[x.first + x.n];
    if (xe - xs < kMinSharedWords) continue;
    for (size_t j = i + 1; j < branches.size(); ++j) {
      Branch& y = branches[j];
      if (y.n < 2 || y.group >= 0) continue;
      if (same_words(code, xs, xe, elems[y.first + y.n - 1], elems[y.first + y.n])) {
        if (x.group < 0) x.group = groups++;
        y.group = x.group;
      }
    }
  }
  if (groups == 0) {
    restore();
    return false;
  }
  const int32_t end = fresh();
  // Ungrouped branches: as a plain alternation would build them.
  for (size_t i = B; i < branches.size(); ++i) {
    if (branches[i].group >= 0) continue;
    const int32_t s = fresh();
    eps_.push_back({from, s});
    size_t q = branches[i].begin;
    const int32_t e = build(code, q, s, tail);
    eps_.push_back({e, end});
  }
  // build() may recurse into nested alternations, which grow (and may move) the branch and
  // element buffers: everything is read by index, after each call.
  for (int32_t g = 0; g < groups; ++g) {
    const int32_t join = fresh();
    size_t last = 0, last_end = 0;
    for (size_t i = B; i < branches.size(); ++i) {
      if (branches[i].group != g || branches[i].n == 0) continue;  // n == 0: built with a shared head
      const uint32_t xf = branches[i].first, xn = branches[i].n;
      last = elems[xf + xn - 1];
      last_end = elems[xf + xn];
      int32_t s = fresh();
      eps_.push_back({from, s});
      uint32_t k = 0;
      const size_t hs = elems[xf], he = elems[xf + 1];
      if (xn >= 3 && he - hs >= kMinSharedWords) {
        // Branches of the group that start with the same large element share one copy of it.
        size_t q = hs;
        s = build(code, q, s, false);
        k = 1;
        for (size_t j = i + 1; j < branches.size(); ++j) {
          const uint32_t yf = branches[j].first, yn = branches[j].n;
          if (branches[j].group != g || yn < 3 || !same_words(code, hs, he, elems[yf], elems[yf + 1])) continue;
          int32_t t = fresh();
          eps_.push_back({s, t});
          for (uint32_t m = 1; m + 1 < yn; ++m) {
            size_t r = elems[yf + m];
            t = build(code, r, t, false);
          }
          eps_.push_back({t, join});
          branches[j].n = 0;
        }
      }
      for (; k + 1 < xn; ++k) {
        size_t q = elems[xf + k];
        s = build(code, q, s, false);
      }
      eps_.push_back({s, join});
    }
    size_t q = last;
    const int32_t e = build(code, q, join, tail);
    if (q != last_end) throw DefinitionError("malformed grammar code (alternation)");
    eps_.push_back({e, end});
  }
  pc = p;
  restore();
  *end_out = end;
  return true;
}

}  // namespace grammar
}  // namespace agent_infer
