// Inlined rules as minimized automata.
//
// Re-expanding an inlined rule from its program at every use would copy a JSON string character
// (escapes, \uXXXX with surrogate pairs, each UTF-8 length: ~100 NFA states) once per position
// of a counted string and once per node of a "key except these names" trie, and determinizing
// the caller would rediscover, per use, states the rule's own minimal automaton shares. Instead
// each inlined rule is lowered once per grammar and its automaton is spliced into callers: fewer
// NFA states and closures, the same language. The automata are computed in the fragment store
// (grammar/lower/fragment_store.cpp) straight from the programs (store_eval), which also lowers whole
// finite rules (lower_in_store); a rule the store cannot hold takes the NFA path (NFA, subset
// construction, trimming, merging of equivalent states).
#include <algorithm>

#include "grammar/automaton.h"
#include "grammar/errors.h"
#include "grammar/ir/program.h"
#include "grammar/lower/automata.h"
#include "grammar/lower/determinizer.h"
#include "grammar/lower/fragment_store.h"
#include "grammar/lower/nfa_builder.h"

namespace agent_infer {
namespace grammar {

namespace {

// lower_in_store(): the most states one rule may add to the store (past it, subset construction
// takes the rule as before).
constexpr int64_t kMaxStoredRuleStates = int64_t{1} << 17;
// fragment_state() nesting (rules inlined into rules).
constexpr int kMaxStoreNesting = 1000;

}  // namespace

void NfaBuilder::Shared::reset(Deadline& deadline, size_t program_words) {
  seqs.clear();
  if (class_key.size() > 1024) {
    // A big grammar's table: regrow from small rather than clear it for every small one after.
    class_key.clear();
    class_span.clear();
    class_hash.clear();
  } else {
    std::fill(class_key.begin(), class_key.end(), nullptr);
  }
  class_count = 0;
  class_then.clear();
  fragments.clear();
  store.bind(&deadline);  // first: reset() makes the accepting state, which checks the deadline
  // Store states and unions per program word, from the 200-schema sample: at least ~1/8 and ~1/16
  // for the big schemas (a guess under the need only leaves some doubling to do).
  store.reset(program_words / 8, program_words / 16);
  rule_state.clear();
  if (determinizer) determinizer->reset(0, deadline);
}

size_t NfaBuilder::Shared::retained_bytes() const {
  auto bytes = [](const auto& v) { return v.capacity() * sizeof(v[0]); };
  size_t nested_bytes = 0;
  for (const auto& b : nested) nested_bytes += bytes(b->eps_) + bytes(b->bytes_) + bytes(b->refs_);
  return bytes(seqs) + bytes(class_key) + bytes(class_span) + bytes(class_hash) + class_then.retained_bytes() +
         bytes(nfa.eps_begin) + bytes(nfa.byte_begin) +
         bytes(nfa.ref_begin) + bytes(nfa.eps) + bytes(nfa.bytes) + bytes(nfa.refs) + bytes(pool.final) +
         bytes(pool.byte_begin) + bytes(pool.ref_begin) + bytes(pool.bytes) + bytes(pool.refs) + bytes(rev_begin) +
         bytes(rev) + bytes(fill) + bytes(stack) + bytes(live) + bytes(rep) + bytes(remap) +
         (determinizer ? determinizer->retained_bytes() : 0) + nested_bytes + store.retained_bytes() +
         bytes(rule_state);
}

int32_t NfaBuilder::store_eval(const std::vector<int32_t>& code, size_t& pc, int32_t cont) {
  FragmentStore& st = shared_->store;
  if (cont == FragmentStore::kDead) {
    pc = skip_expression(code, pc);
    return FragmentStore::kDead;
  }
  if (depth_ > 2000) throw FragmentStore::Overflow();
  switch (code.at(pc)) {
    case kEmpty:
      ++pc;
      return cont;
    case kLiteral: {
      const int32_t len = code.at(pc + 1);
      int32_t s = cont;
      std::pair<uint8_t, uint8_t> one;
      for (int32_t i = len - 1; i >= 0 && s != FragmentStore::kDead; --i) {
        const uint8_t b = static_cast<uint8_t>(code.at(pc + 2 + i));
        one = {b, b};
        s = st.chain(&one, 1, s);
      }
      pc += 2 + static_cast<size_t>(len);
      return s;
    }
    case kClass: {
      const std::pair<uint32_t, uint32_t> span = class_span(code, pc);
      pc += 2 + 2 * static_cast<size_t>(code.at(pc + 1));
      // The store is hash-consed and its unions memoized, so the same class before the same
      // continuation always comes out as the same state: computed once per grammar.
      const uint64_t then_key = (static_cast<uint64_t>(span.first) << 32) | static_cast<uint32_t>(cont);
      const bool keyed = span.second > span.first;  // an empty span is no class's own key
      if (keyed) {
        const int32_t known = shared_->class_then.find(then_key);
        if (known != -2) return known;
      }
      // One-byte pieces (sorted and disjoint, as utf8_split writes ordered ranges) make one
      // state; longer ones are chains joined by union.
      std::vector<ByteEdge>& singles = shared_->class_edges;
      singles.clear();
      bool ordered = true;
      int32_t acc = FragmentStore::kDead;
      for (uint32_t k = span.first; k < span.second; ++k) {
        const ByteSeq& seq = shared_->seqs[k];
        if (seq.n == 1) {
          if (!singles.empty() && singles.back().hi >= seq.r[0].first) ordered = false;
          singles.push_back({seq.r[0].first, seq.r[0].second, cont});
        } else {
          acc = st.unite(acc, st.chain(seq.r.data(), seq.n, cont));
        }
      }
      if (ordered) {
        acc = st.unite(acc, st.make(false, singles, nullptr));
      } else {
        for (uint32_t k = span.first; k < span.second; ++k) {
          const ByteSeq& seq = shared_->seqs[k];
          if (seq.n == 1) acc = st.unite(acc, st.chain(seq.r.data(), 1, cont));
        }
      }
      if (keyed) shared_->class_then.insert(then_key, acc);
      return acc;
    }
    case kSeq: {
      const int32_t count = code.at(pc + 1);
      const size_t base = seq_pcs_.size();
      pc += 2;
      for (int32_t i = 0; i < count; ++i) {
        seq_pcs_.push_back(pc);
        pc = skip_expression(code, pc);
      }
      int32_t s = cont;
      ++depth_;
      for (int32_t i = count - 1; i >= 0; --i) {
        size_t p = seq_pcs_[base + static_cast<size_t>(i)];
        s = store_eval(code, p, s);
      }
      --depth_;
      seq_pcs_.resize(base);
      return s;
    }
    case kAlt: {
      const int32_t count = code.at(pc + 1);
      pc += 2;
      int32_t acc = FragmentStore::kDead;
      ++depth_;
      for (int32_t i = 0; i < count; ++i) acc = st.unite(acc, store_eval(code, pc, cont));
      --depth_;
      return acc;
    }
    case kRepeat: {
      const int32_t lo = code.at(pc + 1), hi = code.at(pc + 2);
      if (hi < 0 || lo < 0 || hi < lo) throw FragmentStore::Overflow();  // loops: not a finite rule
      const size_t child = pc + 3;
      // x{lo,hi} cont = x^lo (cont | x (cont | x (...))), the optional copies innermost.
      int32_t t = cont;
      ++depth_;
      for (int32_t j = lo; j < hi; ++j) {
        size_t p = child;
        t = st.unite(cont, store_eval(code, p, t));
      }
      for (int32_t i = 0; i < lo; ++i) {
        size_t p = child;
        t = store_eval(code, p, t);
      }
      --depth_;
      pc = skip_expression(code, child);
      return t;
    }
    case kRef: {
      const int32_t q = code.at(pc + 1);
      pc += 2;
      if (q < 0 || static_cast<size_t>(q) >= rules_->size()) throw FragmentStore::Overflow();
      if (!(*inline_rule_)[q]) {
        if (!store_refs_) throw FragmentStore::Overflow();  // fragments have no references
        return st.reference(q, cont);
      }
      const int32_t f = fragment_state(q);
      if (f == -2) throw FragmentStore::Overflow();
      return st.concat(f, cont);
    }
    default:
      throw FragmentStore::Overflow();  // the NFA path reports malformed code
  }
}

int32_t NfaBuilder::fragment_state(int32_t r) {
  Shared& sh = *shared_;
  if (sh.rule_state.size() < rules_->size()) sh.rule_state.resize(rules_->size(), -3);
  if (sh.rule_state[r] != -3) return sh.rule_state[r];
  // Each level of a chain is a few C++ frames: past this depth its rest stays in separate rules.
  if (store_nesting_ >= kMaxStoreNesting) throw FragmentStore::Overflow();
  const std::vector<int32_t>& code = (*rules_)[r];
  const bool saved_refs = store_refs_;
  store_refs_ = false;
  ++store_nesting_;
  const int32_t s = eval_program(code, std::max<int64_t>(4096, 16 * static_cast<int64_t>(code.size())), depth_);
  --store_nesting_;
  store_refs_ = saved_refs;
  sh.rule_state[r] = s;
  return s;
}

int32_t NfaBuilder::eval_program(const std::vector<int32_t>& code, int64_t budget, int depth_after_overflow) {
  FragmentStore& st = shared_->store;
  const int64_t saved_limit = st.limit();
  const size_t before = st.size(), saved_pcs = seq_pcs_.size();
  st.set_limit(static_cast<int64_t>(before) + budget);
  int32_t s = -2;
  try {
    size_t pc = 0;
    s = store_eval(code, pc, st.accept());
    if (pc != code.size()) s = -2;
  } catch (const FragmentStore::Overflow&) {
    s = -2;
    st.clear_depth();
    seq_pcs_.resize(saved_pcs);
    depth_ = depth_after_overflow;
  }
  // What the program added does not count against the caller's own budget.
  st.set_limit(saved_limit + static_cast<int64_t>(st.size() - before));
  return s;
}

int32_t NfaBuilder::lower_in_store(int32_t r, DfaPool* pool) {
  const std::vector<int32_t>& code = (*rules_)[r];
  // Finite programs only: loops stay with subset construction, and so does a tail reference to
  // the rule itself, which the NFA path turns into a loop (no parser items). Long counted repeats
  // gain most (a JSON string's `maxLength`: ~20 states per position, which subset construction
  // rediscovers one closure at a time), but the store's minimal DFA, built without an NFA, is
  // also cheaper for the many small rules of a big schema.
  for (size_t pc = 0; pc < code.size(); pc += instruction_length(code, pc)) {
    if ((code[pc] == kRepeat && code.at(pc + 2) < 0) || (code[pc] == kRef && code.at(pc + 1) == r) ||
        code[pc] == kKeyTrie || code[pc] == kCheck) {
      return -1;
    }
  }
  store_refs_ = true;
  const int32_t s = eval_program(code, kMaxStoredRuleStates, 0);
  store_refs_ = false;
  if (s == -2) return -1;
  return shared_->store.flatten_into(s, pool);
}

const NfaBuilder::Fragment& NfaBuilder::fragment(int32_t r) {
  Shared& sh = *shared_;
  auto found = sh.fragments.find(r);
  if (found != sh.fragments.end()) return found->second;
  Fragment f;
  const int32_t in_store = fragment_state(r);
  if (in_store != -2) {
    // An empty language (kDead) keeps the expansion from the program (and its dead end), as below.
    if (in_store >= 0) {
      sh.store.flatten(in_store, &f.final, &f.begin, &f.bytes);
      f.usable = true;
    }
    return sh.fragments.emplace(r, std::move(f)).first->second;
  }
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
  nested.store_nesting_ = 0;  // a time-budget error may have unwound its last fragment_state()
  nested.store_refs_ = false;
  nested.seq_pcs_.clear();
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
    ok = n > 0 && live[0];  // an empty language keeps the expansion from the program (and its dead end)
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
