// Inlined rules as minimized automata.
//
// An inlined rule used to be re-expanded from its program at every use: a JSON string character
// (escapes, \uXXXX with surrogate pairs, each UTF-8 length: ~100 NFA states) once per position
// of a counted string and once per node of a "key except these names" trie. Determinizing the
// caller then had to rediscover, per use, states the rule's own minimal automaton shares. Here
// each inlined rule is lowered once per grammar (NFA, subset construction, trimming, merging of
// equivalent states) and its automaton is spliced into callers: fewer NFA states and closures,
// the same language.
#include <algorithm>

#include "grammar.h"
#include "grammar_lower.h"

namespace agent_infer {
namespace grammar {

const NfaBuilder::Fragment& NfaBuilder::fragment(int32_t r) {
  auto found = fragments_->find(r);
  if (found != fragments_->end()) return found->second;
  Fragment f;
  // A separate builder: this one is in the middle of a caller. Inlined rules are not recursive,
  // so nesting is bounded by the inlining depth.
  NfaBuilder nested(rules_, inline_rule_, max_states_, deadline_);
  nested.fragments_ = fragments_;
  Nfa nfa;
  nested.build_rule(r, &nfa);
  DfaPool pool;
  bool ok = true;
  try {
    // Subset construction can blow up on finite languages; past this the program is expanded.
    Determinizer det(std::max<int64_t>(4096, 4 * static_cast<int64_t>(nfa.size())), deadline_);
    det.run(nfa, &pool);
  } catch (const LimitError&) {
    ok = false;  // a spent time budget is reported by the caller's next check
  }
  ok = ok && pool.refs.empty();
  const uint32_t n = static_cast<uint32_t>(pool.size());
  std::vector<uint8_t> live(n, 0);
  if (ok) {
    // Trim: states that reach a final state (byte edges only).
    std::vector<uint32_t> rev_begin(n + 1, 0), rev(pool.bytes.size());
    for (const ByteEdge& e : pool.bytes) ++rev_begin[e.target + 1];
    for (uint32_t x = 0; x < n; ++x) rev_begin[x + 1] += rev_begin[x];
    std::vector<uint32_t> fill(rev_begin.begin(), rev_begin.end() - 1);
    for (uint32_t x = 0; x < n; ++x) {
      for (uint32_t e = pool.byte_begin[x]; e < pool.byte_begin[x + 1]; ++e) rev[fill[pool.bytes[e].target]++] = x;
    }
    std::vector<uint32_t> stack;
    for (uint32_t x = 0; x < n; ++x) {
      if (pool.final[x]) {
        live[x] = 1;
        stack.push_back(x);
      }
    }
    while (!stack.empty()) {
      const uint32_t x = stack.back();
      stack.pop_back();
      for (uint32_t k = rev_begin[x]; k < rev_begin[x + 1]; ++k) {
        if (!live[rev[k]]) {
          live[rev[k]] = 1;
          stack.push_back(rev[k]);
        }
      }
    }
    ok = n > 0 && live[0];  // an empty language keeps the old expansion (and its dead end)
  }
  if (ok) {
    std::vector<int32_t> rep;
    StateMerger merger;
    merger.run(pool, 0, n, live, std::vector<uint8_t>(), &rep);
    std::vector<int32_t> remap(n, -1);
    int32_t next = 0;
    for (uint32_t x = 0; x < n; ++x) {
      if (live[x] && rep[x] == static_cast<int32_t>(x)) remap[x] = next++;
    }
    for (uint32_t x = 0; x < n; ++x) {
      if (live[x]) remap[x] = remap[rep[x]];
    }
    f.begin.assign(1, 0);
    for (uint32_t x = 0; x < n; ++x) {
      if (!live[x] || rep[x] != static_cast<int32_t>(x)) continue;
      f.final.push_back(pool.final[x]);
      const size_t first_edge = f.bytes.size();
      for (uint32_t e = pool.byte_begin[x]; e < pool.byte_begin[x + 1]; ++e) {
        const ByteEdge& be = pool.bytes[e];
        const int32_t t = remap[be.target];
        if (t < 0) continue;
        if (f.bytes.size() > first_edge && f.bytes.back().target == t && f.bytes.back().hi + 1 == be.lo) {
          f.bytes.back().hi = be.hi;
        } else {
          f.bytes.push_back({be.lo, be.hi, t});
        }
      }
      f.begin.push_back(static_cast<uint32_t>(f.bytes.size()));
    }
    f.usable = true;
  }
  return fragments_->emplace(r, std::move(f)).first->second;
}

}  // namespace grammar
}  // namespace agent_infer
