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

void NfaBuilder::Shared::reset(Deadline& deadline) {
  seqs.clear();
  if (class_key.size() > 1024) {
    // A big grammar's table: regrow from small rather than clear it for every small one after.
    class_key.clear();
    class_span.clear();
  } else {
    std::fill(class_key.begin(), class_key.end(), nullptr);
  }
  class_count = 0;
  fragments.clear();
  if (determinizer) determinizer->reset(0, deadline);
}

size_t NfaBuilder::Shared::retained_bytes() const {
  auto bytes = [](const auto& v) { return v.capacity() * sizeof(v[0]); };
  size_t nested_bytes = 0;
  for (const auto& b : nested) nested_bytes += bytes(b->eps_) + bytes(b->bytes_) + bytes(b->refs_);
  return bytes(seqs) + bytes(class_key) + bytes(class_span) + bytes(nfa.eps_begin) + bytes(nfa.byte_begin) +
         bytes(nfa.ref_begin) + bytes(nfa.eps) + bytes(nfa.bytes) + bytes(nfa.refs) + bytes(pool.final) +
         bytes(pool.byte_begin) + bytes(pool.ref_begin) + bytes(pool.bytes) + bytes(pool.refs) + bytes(rev_begin) +
         bytes(rev) + bytes(fill) + bytes(stack) + bytes(live) + bytes(rep) + bytes(remap) +
         (determinizer ? determinizer->retained_bytes() : 0) + nested_bytes;
}

const NfaBuilder::Fragment& NfaBuilder::fragment(int32_t r) {
  Shared& sh = *shared_;
  auto found = sh.fragments.find(r);
  if (found != sh.fragments.end()) return found->second;
  Fragment f;
  // The next depth's builder: this one is in the middle of a caller. Inlined rules are not
  // recursive, so nesting is bounded by the inlining depth.
  if (sh.nested.size() <= level_) {
    sh.nested.push_back(std::make_unique<NfaBuilder>(*rules_, *inline_rule_, max_states_, *deadline_));
    NfaBuilder& fresh = *sh.nested.back();
    fresh.own_shared_.reset();
    fresh.shared_ = shared_;
    fresh.level_ = level_ + 1;
  }
  NfaBuilder& nested = *sh.nested[level_];
  // Kept from an earlier grammar, perhaps one abandoned mid-build: bind it to this one afresh.
  nested.rules_ = rules_;
  nested.inline_rule_ = inline_rule_;
  nested.max_states_ = max_states_;
  nested.deadline_ = deadline_;
  nested.depth_ = 0;
  nested.total_ = 0;  // each fragment has the state budget a builder of its own had
  Nfa& nfa = sh.nfa;
  nested.build_rule(r, &nfa);
  // Deeper fragments are complete from here on: the shared buffers below are free.
  DfaPool& pool = sh.pool;
  pool.reset();
  if (!sh.determinizer) sh.determinizer = std::make_unique<Determinizer>(0, *deadline_);
  bool ok = true;
  try {
    // Subset construction can blow up on finite languages; past this the program is expanded.
    sh.determinizer->set_limit(std::max<int64_t>(4096, 4 * static_cast<int64_t>(nfa.size())));
    sh.determinizer->run(nfa, &pool);
  } catch (const LimitError&) {
    ok = false;  // a spent time budget is reported by the caller's next check
  }
  ok = ok && pool.refs.empty();
  const uint32_t n = static_cast<uint32_t>(pool.size());
  std::vector<uint8_t>& live = sh.live;
  live.assign(n, 0);
  if (ok) {
    // Trim: states that reach a final state (byte edges only).
    std::vector<uint32_t>&rev_begin = sh.rev_begin, &rev = sh.rev, &fill = sh.fill, &stack = sh.stack;
    rev_begin.assign(n + 1, 0);
    rev.resize(pool.bytes.size());
    for (const ByteEdge& e : pool.bytes) ++rev_begin[e.target + 1];
    for (uint32_t x = 0; x < n; ++x) rev_begin[x + 1] += rev_begin[x];
    fill.assign(rev_begin.begin(), rev_begin.end() - 1);
    for (uint32_t x = 0; x < n; ++x) {
      for (uint32_t e = pool.byte_begin[x]; e < pool.byte_begin[x + 1]; ++e) rev[fill[pool.bytes[e].target]++] = x;
    }
    stack.clear();
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
    std::vector<int32_t>&rep = sh.rep, &remap = sh.remap;
    static const std::vector<uint8_t> kNoRules;  // fragments have no references
    sh.merger.run(pool, 0, n, live, kNoRules, &rep);
    remap.assign(n, -1);
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
  return sh.fragments.emplace(r, std::move(f)).first->second;
}

}  // namespace grammar
}  // namespace agent_infer
