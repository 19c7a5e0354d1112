// Lowering of the flat grammar IR to one deterministic byte automaton per rule.
//
// Equal rules are merged first (grammar/lower/dedupe.cpp) and continuations that many rules spell alike
// are outlined into shared rules (grammar/lower/outline.cpp); then each rule reachable from the root is
// turned into a Thompson NFA (grammar/lower/nfa.cpp: UTF-8 byte ranges, expanded repeats, small finite
// rules inlined as their own minimized automata, grammar/lower/fragment.cpp) and determinized with
// byte ranges and rule references as the alphabet (grammar/lower/determinize.cpp); finite rules skip
// both and come out of the fragment store as minimal DFAs (grammar/lower/fragment_store.cpp), and
// finite right-linear chains are inlined whole (grammar/lower/inline.cpp). Finally rules with
// an empty language and states that can never reach an accepting state are trimmed away (every
// Earley item that survives is then a viable prefix, which is what makes the token masks exact)
// and equivalent states that reach no cycle are merged (grammar/lower/minimize.cpp). FOLLOW and
// escape sets: grammar/lower/follow.cpp.
#include <algorithm>
#include <chrono>
#include <new>

#include "grammar/automaton.h"
#include "grammar/compiled_grammar.h"
#include "grammar/errors.h"
#include "grammar/ir/program.h"
#include "grammar/lower/automata.h"
#include "grammar/lower/check_lowering.h"
#include "grammar/lower/determinizer.h"
#include "grammar/lower/nfa_builder.h"
#include "grammar/lower/rule_passes.h"
#include "grammar/lower/scratch.h"
#include "grammar/match/bounded.h"
#include "grammar/mask/state_mask.h"
#include "grammar/mask/tokenizer_info.h"

namespace agent_infer {
namespace grammar {

namespace {

// Memory ran out while lowering: the grammar is too large for this machine, which is a size limit
// of the input (GrammarLimitError), not an internal failure. The buffers of the failed lowering
// are freed by the unwinding before this message is built.
[[noreturn]] void throw_out_of_memory() {
  throw LimitError("grammar is too large: compiling it ran out of memory");
}

// Turns every check with kCheckProduct into its product automaton (grammar/lower/check_product.cpp),
// inner checks first (an item reaching a check still to be built waits for it), and removes it
// from `specs`: it is an ordinary rule from then on. A product that cannot be built is a
// LimitError naming the check's rule index (the compiler names the rule).
void decide_products(std::vector<CheckSpec>* specs, DfaPool* pool, std::vector<int32_t>* base,
                     std::vector<uint32_t>* count, const std::vector<uint8_t>& unique_rule,
                     const std::vector<int32_t>& max_length, size_t num_rules, Deadline* deadline) {
  // 1 decided at run time, 2 a product not built yet, 3 counted by the matcher (check_lowering.h)
  std::vector<uint8_t> undecided(num_rules, 0);
  for (size_t r = 0; r < num_rules; ++r) {
    if (unique_rule[r] || max_length[r] >= 0) undecided[r] = 3;
  }
  for (const CheckSpec& c : *specs) undecided[static_cast<size_t>(c.rule)] = c.product ? 2 : 1;
  std::string why;
  for (bool progress = true; progress;) {
    progress = false;
    for (size_t k = 0; k < specs->size();) {
      CheckSpec& c = (*specs)[k];
      if (!c.product) {
        ++k;
        continue;
      }
      bool blocked = false;
      const int32_t start = build_check_product(c, *base, *count, undecided, pool, deadline, &why, &blocked);
      if (start < 0 && !blocked) {
        throw LimitError("the check of rule #" + std::to_string(c.rule) + " cannot be compiled to one automaton: " + why);
      }
      if (start < 0) {
        ++k;  // waits for a check its items reach
        continue;
      }
      (*base)[static_cast<size_t>(c.rule)] = start;
      (*count)[static_cast<size_t>(c.rule)] = static_cast<uint32_t>(pool->size()) - static_cast<uint32_t>(start);
      undecided[static_cast<size_t>(c.rule)] = 0;
      specs->erase(specs->begin() + static_cast<long>(k));
      progress = true;
    }
  }
  for (const CheckSpec& c : *specs) {
    if (c.product) {
      throw LimitError("the check of rule #" + std::to_string(c.rule) +
                       " cannot be compiled to one automaton: its items reach checks that reach it (they recurse)");
    }
  }
}

}  // namespace

CompiledGrammar::CompiledGrammar(std::shared_ptr<TokenizerInfo> tok_, const std::vector<std::vector<int32_t>>& rules_in,
                                 int32_t root_, const Limits& limits)
    : tok(std::move(tok_)), root(root_), max_items_per_set(limits.max_items_per_set),
      max_work_per_byte(limits.max_work_per_byte),
      max_work_per_mask(limits.max_work_per_mask) {
  std::vector<std::vector<int32_t>> own_rules;  // the rules once rewritten, if they are
  try {
    lower_rules(rules_in, &own_rules, limits);
  } catch (const std::bad_alloc&) {
    throw_out_of_memory();
  }
}

// Programs the caller gives up (compile_serialized): merging and outlining rewrite them where they
// are, sparing a copy (~0.35 ms of a Kubernetes schema's compile).
CompiledGrammar::CompiledGrammar(std::shared_ptr<TokenizerInfo> tok_, std::vector<std::vector<int32_t>>&& rules_in,
                                 int32_t root_, const Limits& limits)
    : tok(std::move(tok_)), root(root_), max_items_per_set(limits.max_items_per_set),
      max_work_per_byte(limits.max_work_per_byte),
      max_work_per_mask(limits.max_work_per_mask) {
  try {
    lower_rules(rules_in, &rules_in, limits);
  } catch (const std::bad_alloc&) {
    throw_out_of_memory();
  }
}

void CompiledGrammar::lower_rules(const std::vector<std::vector<int32_t>>& rules_in,
                                  std::vector<std::vector<int32_t>>* own, const Limits& limits) {
  if (root < 0 || static_cast<size_t>(root) >= rules_in.size()) {
    throw DefinitionError("root rule index out of range");
  }
  Deadline deadline{std::chrono::steady_clock::now() +
                    std::chrono::microseconds(static_cast<int64_t>(limits.max_compile_seconds * 1e6))};
  std::vector<std::vector<int32_t>>& own_rules = *own;
  const std::vector<std::vector<int32_t>>* rules_ptr = &rules_in;
  if (merge_equal_rules(rules_in, root, &own_rules)) rules_ptr = &own_rules;
  // Unique-item and max-length marks: merging kept marked rules apart from unmarked ones (the
  // words are part of the program it compares); every later pass reads plain programs and the marks.
  unique_rule.assign(rules_ptr->size(), 0);
  max_length.assign(rules_ptr->size(), -1);
  for (size_t r = 0; r < rules_ptr->size(); ++r) {
    const std::vector<int32_t>& code = (*rules_ptr)[r];
    if (code.empty() || (code[0] != kUnique && code[0] != kMaxLength)) continue;
    if (rules_ptr != &own_rules) {
      own_rules = *rules_ptr;
      rules_ptr = &own_rules;
    }
    std::vector<int32_t>& body = own_rules[r];
    if (body[0] == kUnique) {
      body.erase(body.begin());
      if (body.empty()) throw DefinitionError("a unique array item rule has no expression");
      unique_rule[r] = 1;
      has_unique = true;
    } else {
      if (body.size() < 3 || body[1] < 0) throw DefinitionError("a max-length string rule has no bound or no expression");
      max_length[r] = body[1];
      body.erase(body.begin(), body.begin() + 2);
      has_bounded = true;
    }
  }
  if (unique_rule[static_cast<size_t>(root)]) throw DefinitionError("the root rule cannot be a unique array item");
  if (max_length[static_cast<size_t>(root)] >= 0) throw DefinitionError("the root rule cannot be a max-length string");
  if (hoist_repeat_items(*rules_ptr, &own_rules)) rules_ptr = &own_rules;
  // Marked rules stay rules of their own: the matcher reads their items' origins.
  std::vector<uint8_t> keep(rules_ptr->size(), 0);
  for (size_t r = 0; r < unique_rule.size(); ++r) keep[r] = unique_rule[r] || max_length[r] >= 0;
  std::vector<uint8_t> inl = choose_inline(*rules_ptr, root, keep);
  if (outline_continuations(*rules_ptr, &own_rules, &inl)) rules_ptr = &own_rules;
  const std::vector<std::vector<int32_t>>& rules = *rules_ptr;
  size_t R = rules.size();  // outlined rules come after the grammar's own (shadow copies after those)
  unique_rule.resize(R, 0);
  max_length.resize(R, -1);
  keep.resize(R, 0);
  inline_finite_chains(rules, root, keep, &inl);

  // Build the automata of the rules reachable from the root through non-inlined references.
  ScratchLease lease;
  LoweringScratch& scratch = *lease;
  NfaBuilder nfa_builder(rules, inl, limits.max_nfa_states, deadline, &scratch.nfa_shared);
  Determinizer& determinizer = scratch.determinizer;
  determinizer.reset(limits.max_dfa_states, deadline);
  Nfa& nfa = scratch.nfa;
  DfaPool& pool = scratch.pool;
  pool.reset();
  // A rule's states: [base[r], base[r] + count[r]).
  std::vector<int32_t>&base = scratch.base, &order = scratch.order, &work = scratch.work;
  std::vector<uint32_t>& count = scratch.count;
  base.assign(R, -1);
  order.clear();
  count.assign(R, 0);
  std::vector<uint8_t>& stored = scratch.stored;  // lowered through the store: minimal already
  stored.assign(R, 0);
  work.assign(1, root);
  base[root] = 0;  // marks "queued"; the real base is set when built
  std::vector<CheckSpec> check_specs;
  while (!work.empty()) {
    const int32_t r = work.back();
    work.pop_back();
    if (is_check(rules[r])) {
      // Start -> each carrier -> final (grammar/lower/runtime_checks.cpp); the shadow items are
      // built too, to be copied once every rule is.
      check_specs.push_back(read_check(rules[r], r, R));
      base[r] = lower_check(check_specs.back(), &pool);
      count[r] = static_cast<uint32_t>(pool.size()) - static_cast<uint32_t>(base[r]);
      order.push_back(r);
      for (int32_t q : check_specs.back().items) {
        if (base[q] < 0) {
          base[q] = 0;
          work.push_back(q);
        }
      }
      continue;
    }
    // A key trie's automaton is written directly: minimal, like the store's (grammar/lower/key_set.cpp).
    base[r] = is_key_trie(rules[r]) ? lower_key_trie(rules[r], R, &pool) : nfa_builder.lower_in_store(r, &pool);
    stored[r] = base[r] >= 0;
    if (stored[r]) determinizer.charge(static_cast<int64_t>(pool.size()) - base[r]);
    if (base[r] < 0) {
      nfa_builder.build_rule(r, &nfa);
      base[r] = determinizer.run(nfa, &pool);
    }
    count[r] = static_cast<uint32_t>(pool.size()) - static_cast<uint32_t>(base[r]);
    order.push_back(r);
    for (uint32_t e = pool.ref_begin[base[r]]; e < pool.refs.size(); ++e) {
      const int32_t q = pool.refs[e].rule;
      if (base[q] < 0) {
        base[q] = 0;
        work.push_back(q);
      }
    }
  }
  const bool had_checks = !check_specs.empty();
  if (had_checks) decide_products(&check_specs, &pool, &base, &count, unique_rule, max_length, R, &deadline);
  int32_t first_shadow_rule = static_cast<int32_t>(R);
  if (!check_specs.empty()) {
    // Shadow copies of what the checks' non-carrier items reach, appended as rules R, R + 1, ...
    std::vector<int32_t> copied_from;
    first_shadow_rule = copy_shadow_rules(&check_specs, &pool, &base, &count, &copied_from);
    const size_t copies = base.size() - R;
    // A shadow parse judges its item's whole language: copies keep their rule's unique-item and
    // max-length marks.
    unique_rule.resize(R + copies, 0);
    max_length.resize(R + copies, -1);
    for (size_t k = 0; k < copies; ++k) {
      unique_rule[R + k] = unique_rule[static_cast<size_t>(copied_from[k])];
      max_length[R + k] = max_length[static_cast<size_t>(copied_from[k])];
    }
    stored.resize(R + copies, 0);
    for (size_t k = 0; k < copies; ++k) {
      if (base[R + k] >= 0) order.push_back(static_cast<int32_t>(R + k));
    }
    R += copies;
  }
  std::vector<uint8_t>& built = scratch.built;
  built.assign(R, 0);
  for (int32_t r : order) built[r] = 1;
  if (had_checks) {
    // Rules reached only through shadow items (or only through checks now products) were built
    // for their copies or the products: left out of the grammar, as if never reached.
    std::vector<uint8_t> reached(R, 0);
    std::vector<int32_t> stack{root};
    reached[root] = 1;
    std::vector<int32_t> check_at(R, -1);
    for (size_t k = 0; k < check_specs.size(); ++k) check_at[check_specs[k].rule] = static_cast<int32_t>(k);
    while (!stack.empty()) {
      const int32_t r = stack.back();
      stack.pop_back();
      auto visit = [&](int32_t q) {
        if (!reached[q]) {
          reached[q] = 1;
          stack.push_back(q);
        }
      };
      if (built[r]) {
        for (uint32_t e = pool.ref_begin[base[r]]; e < pool.ref_begin[base[r] + count[r]]; ++e) visit(pool.refs[e].rule);
      }
      if (check_at[r] >= 0) {
        for (int32_t item : check_specs[static_cast<size_t>(check_at[r])].items) visit(item);
      }
    }
    for (size_t r = 0; r < R; ++r) built[r] = built[r] && reached[r];
    order.erase(std::remove_if(order.begin(), order.end(), [&](int32_t r) { return !built[r]; }), order.end());
  }

  // Productive rules (non-empty language), by a worklist: a rule is re-checked only when one of
  // its callees turns productive, and callees (built later) are checked first.
  std::vector<uint32_t>&caller_begin = scratch.caller_begin, &callers = scratch.callers;
  caller_begin.assign(R + 1, 0);
  for (int32_t r : order) {
    for (uint32_t e = pool.ref_begin[base[r]]; e < pool.ref_begin[base[r] + count[r]]; ++e) {
      ++caller_begin[pool.refs[e].rule + 1];
    }
  }
  for (size_t r = 0; r < R; ++r) caller_begin[r + 1] += caller_begin[r];
  callers.resize(caller_begin[R]);
  {
    std::vector<uint32_t>& fill = scratch.fill;
    fill.assign(caller_begin.begin(), caller_begin.end() - 1);
    for (int32_t r : order) {
      for (uint32_t e = pool.ref_begin[base[r]]; e < pool.ref_begin[base[r] + count[r]]; ++e) {
        callers[fill[pool.refs[e].rule]++] = static_cast<uint32_t>(r);
      }
    }
  }
  std::vector<uint8_t>&productive = scratch.productive, &queued = scratch.queued;
  productive.assign(R, 0);
  queued.assign(R, 0);
  std::vector<uint32_t>& seen = scratch.seen;
  seen.assign(pool.size(), 0);
  uint32_t stamp = 0;
  std::vector<int32_t>& stack = scratch.stack;
  stack.clear();
  std::vector<int32_t>& pending = scratch.pending;
  pending.assign(order.rbegin(), order.rend());
  for (int32_t r : order) queued[r] = 1;
  for (size_t qi = 0; qi < pending.size(); ++qi) {
    const int32_t r = pending[qi];
    queued[r] = 0;
    if (productive[r]) continue;
    deadline.check();
    // A rule lowered through the store reaches acceptance from every state (the store keeps no
    // dead state but the empty language's start, which has no edge and does not accept), using
    // references only to the rules it calls: once those are all productive, so is the rule.
    const uint32_t b = static_cast<uint32_t>(base[r]);
    bool ok = stored[r] && (pool.final[b] || pool.byte_begin[b + 1] > pool.byte_begin[b] ||
                            pool.ref_begin[b + 1] > pool.ref_begin[b]);
    for (uint32_t e = pool.ref_begin[b]; ok && e < pool.ref_begin[b + count[r]]; ++e) {
      ok = productive[pool.refs[e].rule] != 0;
    }
    ++stamp;
    stack.assign(1, base[r]);
    seen[base[r]] = stamp;
    while (!stack.empty() && !ok) {
      const int32_t x = stack.back();
      stack.pop_back();
      if (pool.final[x]) ok = true;
      for (uint32_t e = pool.byte_begin[x]; e < pool.byte_begin[x + 1]; ++e) {
        const int32_t y = pool.bytes[e].target;
        if (seen[y] != stamp) {
          seen[y] = stamp;
          stack.push_back(y);
        }
      }
      for (uint32_t e = pool.ref_begin[x]; e < pool.ref_begin[x + 1]; ++e) {
        const int32_t y = pool.refs[e].target;
        if (productive[pool.refs[e].rule] && seen[y] != stamp) {
          seen[y] = stamp;
          stack.push_back(y);
        }
      }
    }
    if (!ok) continue;
    productive[r] = 1;
    for (uint32_t k = caller_begin[r]; k < caller_begin[r + 1]; ++k) {
      const int32_t c = static_cast<int32_t>(callers[k]);
      if (!productive[c] && !queued[c]) {
        queued[c] = 1;
        pending.push_back(c);
      }
    }
  }
  if (!productive[root]) throw DefinitionError("the grammar's language is empty (no string matches the root rule)");

  // Trim: drop references to empty rules and states that cannot reach acceptance; lay out the
  // rules in index order, each rule's live states in their DFA order.
  rule_start.assign(R, -1);
  nullable.assign(R, 0);
  std::vector<int32_t>& remap = scratch.remap;
  remap.assign(pool.size(), -1);
  std::vector<uint32_t>&rev_begin = scratch.rev_begin, &rev = scratch.rev;
  std::vector<uint8_t>&live = scratch.live, &emit = scratch.emit;
  emit.assign(pool.size(), 0);
  std::vector<int32_t>& rep = scratch.rep;
  StateMerger& merger = scratch.merger;
  int32_t next = 0;
  for (size_t r = 0; r < R; ++r) {
    if (!built[r] || !productive[r]) continue;
    const uint32_t b = static_cast<uint32_t>(base[r]), n = count[r];
    // A rule lowered through the store is a minimal DFA whose every state reaches acceptance,
    // as long as the rules it calls are not empty: nothing to trim or merge.
    bool minimal = stored[r] != 0;
    for (uint32_t e = pool.ref_begin[b]; minimal && e < pool.ref_begin[b + n]; ++e) {
      minimal = productive[pool.refs[e].rule] != 0;
    }
    if (minimal) {
      for (uint32_t x = 0; x < n; ++x) {
        remap[b + x] = next++;
        emit[b + x] = 1;
      }
      rule_start[r] = remap[b];
      continue;
    }
    rev_begin.assign(n + 1, 0);
    auto each_edge = [&](auto&& fn) {
      for (uint32_t x = 0; x < n; ++x) {
        for (uint32_t e = pool.byte_begin[b + x]; e < pool.byte_begin[b + x + 1]; ++e) fn(x, pool.bytes[e].target - b);
        for (uint32_t e = pool.ref_begin[b + x]; e < pool.ref_begin[b + x + 1]; ++e) {
          if (productive[pool.refs[e].rule]) fn(x, pool.refs[e].target - b);
        }
      }
    };
    each_edge([&](uint32_t, uint32_t t) { ++rev_begin[t + 1]; });
    for (uint32_t x = 0; x < n; ++x) rev_begin[x + 1] += rev_begin[x];
    rev.resize(rev_begin[n]);
    each_edge([&](uint32_t x, uint32_t t) { rev[rev_begin[t]++] = x; });
    for (uint32_t x = n; x > 0; --x) rev_begin[x] = rev_begin[x - 1];
    rev_begin[0] = 0;
    live.assign(n, 0);
    stack.clear();
    for (uint32_t x = 0; x < n; ++x) {
      if (pool.final[b + x]) {
        live[x] = 1;
        stack.push_back(static_cast<int32_t>(x));
      }
    }
    while (!stack.empty()) {
      const int32_t x = stack.back();
      stack.pop_back();
      for (uint32_t k = rev_begin[x]; k < rev_begin[x + 1]; ++k) {
        if (!live[rev[k]]) {
          live[rev[k]] = 1;
          stack.push_back(static_cast<int32_t>(rev[k]));
        }
      }
    }
    // Equivalent states are laid out once; the others are renamed to their representative.
    merger.run(pool, b, n, live, productive, &rep);
    for (uint32_t x = 0; x < n; ++x) {
      if (live[x] && rep[x] == static_cast<int32_t>(x)) {
        remap[b + x] = next++;
        emit[b + x] = 1;
      }
    }
    for (uint32_t x = 0; x < n; ++x) {
      if (live[x] && rep[x] != static_cast<int32_t>(x)) remap[b + x] = remap[b + rep[x]];
    }
    rule_start[r] = remap[b];
  }
  states.resize(next);
  // At most one output edge per pool edge: written through a pointer and cut to size after (a
  // push_back per edge is an out-of-line call at this site).
  byte_edges.resize(pool.bytes.size());
  ByteEdge* const edge_out = byte_edges.data();
  uint32_t edges_written = 0;
  ref_edges.reserve(pool.refs.size());
  for (size_t r = 0; r < R; ++r) {
    if (rule_start[r] < 0) continue;
    const uint32_t b = static_cast<uint32_t>(base[r]);
    for (uint32_t x = b; x < b + count[r]; ++x) {
      if (!emit[x]) continue;
      const int32_t g = remap[x];
      State& st = states[g];
      st.rule = static_cast<int32_t>(r);
      st.final = pool.final[x];
      st.byte_begin = edges_written;
      for (uint32_t e = pool.byte_begin[x]; e < pool.byte_begin[x + 1]; ++e) {
        const ByteEdge& be = pool.bytes[e];
        const int32_t t = remap[be.target];
        if (t < 0) continue;
        if (edges_written > st.byte_begin) {
          ByteEdge& last = edge_out[edges_written - 1];
          if (last.target == t && last.hi + 1 == be.lo) {
            last.hi = be.hi;
            continue;
          }
        }
        edge_out[edges_written++] = {be.lo, be.hi, t};
      }
      st.byte_end = edges_written;
      st.ref_begin = static_cast<uint32_t>(ref_edges.size());
      for (uint32_t e = pool.ref_begin[x]; e < pool.ref_begin[x + 1]; ++e) {
        const RefEdge& re = pool.refs[e];
        const int32_t t = remap[re.target];
        if (t >= 0 && rule_start[re.rule] >= 0) ref_edges.push_back({re.rule, t});
      }
      st.ref_end = static_cast<uint32_t>(ref_edges.size());
    }
  }
  byte_edges.resize(edges_written);

  // Nullable rules: the start reaches acceptance through references to nullable rules only.
  std::vector<uint32_t>& reached = scratch.reached;
  reached.assign(states.size(), 0);
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t r = 0; r < R; ++r) {
      if (rule_start[r] < 0 || nullable[r]) continue;
      ++stamp;
      stack.assign(1, rule_start[r]);
      reached[rule_start[r]] = stamp;
      bool ok = false;
      while (!stack.empty() && !ok) {
        const int32_t x = stack.back();
        stack.pop_back();
        if (states[x].final) ok = true;
        for (uint32_t e = states[x].ref_begin; e < states[x].ref_end; ++e) {
          const RefEdge& re = ref_edges[e];
          if (nullable[re.rule] && reached[re.target] != stamp) {
            reached[re.target] = stamp;
            stack.push_back(re.target);
          }
        }
      }
      if (ok) {
        nullable[r] = 1;
        changed = true;
      }
    }
  }

  compute_follow_sets(limits);
  if (!check_specs.empty()) finish_runtime_checks(check_specs, first_shadow_rule);
  masks_.reset(states.size());
  if (has_bounded) bounded = BoundedTables::build(*this);
}

size_t CompiledGrammar::memory_bytes() const {
  return sizeof(*this) + states.size() * (sizeof(State) + sizeof(void*) + sizeof(ByteSet)) +
         follow.size() * sizeof(ByteSet) + byte_edges.size() * sizeof(ByteEdge) +
         ref_edges.size() * sizeof(RefEdge) + rule_start.size() * 5 + (bounded ? bounded->table_bytes() : 0);
}

}  // namespace grammar
}  // namespace agent_infer
