// Run-time checks in the lowering: a check rule's automaton, shadow copies, and the tables of
// grammar/runtime_checks.h.
//
// A check's shadow items decide membership without ever letting a byte through, but Earley items
// are (state, origin): a shadow item in a state that a carrier also uses would be
// indistinguishable from the carrier's. So every rule a shadow item reaches is copied after the
// grammar's automata are built (states and edges copied, references renamed), and the copies'
// states are marked: the mask fill skips them and a set holding only them is dead.
#include <algorithm>
#include <functional>
#include <string>
#include <unordered_map>

#include "grammar/compiled_grammar.h"
#include "grammar/errors.h"
#include "grammar/ir/program.h"
#include "grammar/lower/check_lowering.h"

namespace agent_infer {
namespace grammar {

CheckSpec read_check(const std::vector<int32_t>& code, int32_t rule, size_t num_rules) {
  auto bad = [](const char* what) { return DefinitionError(std::string("malformed run-time check: ") + what); };
  if (code.size() < 5 || code[0] != kCheck || static_cast<size_t>(code[1]) != code.size() - 2) {
    throw bad("it must be a rule's whole body");
  }
  CheckSpec spec;
  spec.rule = rule;
  const int32_t n = code[2];
  spec.product = (code[3] & kCheckProduct) != 0;
  spec.carriers = code[3] & ~kCheckProduct;
  const int32_t count = code[4];
  if (n < 1 || n > 16 || spec.carriers < 1 || spec.carriers > n || count < 0 ||
      code.size() != 5 + static_cast<size_t>(count) + static_cast<size_t>(n)) {
    throw bad("its item, carrier or signature counts do not fit");
  }
  for (int32_t i = 0; i < count; ++i) {
    const int32_t sig = code[5 + static_cast<size_t>(i)];
    if (sig < 0 || sig >= (1 << n) || (!spec.accept.empty() && static_cast<uint32_t>(sig) <= spec.accept.back())) {
      throw bad("its signatures must be sorted, distinct bitmasks over its items");
    }
    spec.accept.push_back(static_cast<uint32_t>(sig));
  }
  for (int32_t i = 0; i < n; ++i) {
    const int32_t q = code[5 + static_cast<size_t>(count) + static_cast<size_t>(i)];
    if (q < 0 || static_cast<size_t>(q) >= num_rules) throw DefinitionError("reference to unknown rule");
    spec.items.push_back(q);
  }
  return spec;
}

int32_t lower_check(const CheckSpec& spec, DfaPool* pool) {
  const int32_t start = static_cast<int32_t>(pool->size());
  const int32_t fin = start + 1;
  pool->final.push_back(0);
  pool->byte_begin.push_back(static_cast<uint32_t>(pool->bytes.size()));
  // A carrier named twice is one edge (the automaton is deterministic over references too).
  std::vector<int32_t> carriers(spec.items.begin(), spec.items.begin() + spec.carriers);
  std::sort(carriers.begin(), carriers.end());
  carriers.erase(std::unique(carriers.begin(), carriers.end()), carriers.end());
  for (int32_t c : carriers) pool->refs.push_back({c, fin});
  pool->ref_begin.push_back(static_cast<uint32_t>(pool->refs.size()));
  pool->final.push_back(1);
  pool->byte_begin.push_back(static_cast<uint32_t>(pool->bytes.size()));
  pool->ref_begin.push_back(static_cast<uint32_t>(pool->refs.size()));
  return start;
}

int32_t copy_shadow_rules(std::vector<CheckSpec>* checks, DfaPool* pool, std::vector<int32_t>* base,
                          std::vector<uint32_t>* count, std::vector<int32_t>* copied_from) {
  const int32_t R = static_cast<int32_t>(base->size());
  std::unordered_map<int32_t, size_t> check_at;
  for (size_t k = 0; k < checks->size(); ++k) check_at[(*checks)[k].rule] = k;
  // The rules to copy: everything a shadow item reaches, in discovery order.
  std::vector<int32_t> copy_of(static_cast<size_t>(R), -1), order;
  auto reach = [&](int32_t q) {
    if (copy_of[static_cast<size_t>(q)] >= 0) return;
    copy_of[static_cast<size_t>(q)] = R + static_cast<int32_t>(order.size());
    order.push_back(q);
  };
  for (const CheckSpec& c : *checks) {
    for (size_t i = static_cast<size_t>(c.carriers); i < c.items.size(); ++i) reach(c.items[i]);
  }
  for (size_t k = 0; k < order.size(); ++k) {
    const int32_t q = order[k];
    const int32_t b = (*base)[static_cast<size_t>(q)];
    if (b < 0) continue;  // never built: nothing to copy (its copy is empty too)
    for (uint32_t e = pool->ref_begin[static_cast<size_t>(b)]; e < pool->ref_begin[static_cast<size_t>(b) + (*count)[q]];
         ++e) {
      reach(pool->refs[e].rule);
    }
    auto found = check_at.find(q);
    if (found != check_at.end()) {
      for (int32_t item : (*checks)[found->second].items) reach(item);
    }
  }
  base->resize(static_cast<size_t>(R) + order.size(), -1);
  count->resize(static_cast<size_t>(R) + order.size(), 0);
  for (size_t k = 0; k < order.size(); ++k) {
    const int32_t q = order[k];
    const int32_t b = (*base)[static_cast<size_t>(q)];
    if (b < 0) continue;
    const uint32_t n = (*count)[static_cast<size_t>(q)];
    const int32_t nb = static_cast<int32_t>(pool->size());
    for (uint32_t x = 0; x < n; ++x) {
      const size_t s = static_cast<size_t>(b) + x;
      pool->final.push_back(pool->final[s]);
      for (uint32_t e = pool->byte_begin[s]; e < pool->byte_begin[s + 1]; ++e) {
        ByteEdge be = pool->bytes[e];
        be.target = be.target - b + nb;
        pool->bytes.push_back(be);
      }
      pool->byte_begin.push_back(static_cast<uint32_t>(pool->bytes.size()));
      for (uint32_t e = pool->ref_begin[s]; e < pool->ref_begin[s + 1]; ++e) {
        RefEdge re = pool->refs[e];
        re.rule = copy_of[static_cast<size_t>(re.rule)];
        re.target = re.target - b + nb;
        pool->refs.push_back(re);
      }
      pool->ref_begin.push_back(static_cast<uint32_t>(pool->refs.size()));
    }
    (*base)[static_cast<size_t>(R) + k] = nb;
    (*count)[static_cast<size_t>(R) + k] = n;
  }
  // Copied checks decide like their originals, over copied items; every check's shadows are copies.
  const size_t originals = checks->size();
  for (size_t k = 0; k < originals; ++k) {
    const CheckSpec& c = (*checks)[k];
    if (copy_of[static_cast<size_t>(c.rule)] < 0) continue;
    CheckSpec copy = c;
    copy.rule = copy_of[static_cast<size_t>(c.rule)];
    for (int32_t& item : copy.items) item = copy_of[static_cast<size_t>(item)];
    checks->push_back(std::move(copy));
  }
  for (size_t k = 0; k < originals; ++k) {
    CheckSpec& c = (*checks)[k];
    for (size_t i = static_cast<size_t>(c.carriers); i < c.items.size(); ++i) {
      c.items[i] = copy_of[static_cast<size_t>(c.items[i])];
    }
  }
  *copied_from = std::move(order);
  return R;
}

void CompiledGrammar::finish_runtime_checks(const std::vector<CheckSpec>& specs, int32_t first_shadow_rule) {
  RuntimeChecks& rc = checks;
  const size_t R = rule_start.size(), S = states.size();
  rc.first_shadow_rule = first_shadow_rule;
  rc.of_rule.assign(R, -1);
  rc.item.assign(R, 0);
  for (const CheckSpec& spec : specs) {
    if (rule_start[static_cast<size_t>(spec.rule)] < 0) continue;  // empty or unreachable
    if (spec.rule == root) throw DefinitionError("a run-time check cannot be the root rule (refer to it from the root)");
    if (nullable[static_cast<size_t>(spec.rule)]) {
      throw DefinitionError("a run-time check's carriers must not match the empty string");
    }
    RuntimeCheck c;
    c.rule = spec.rule;
    c.carriers = spec.carriers;
    c.items = spec.items;
    c.accept = spec.accept;
    rc.of_rule[static_cast<size_t>(c.rule)] = static_cast<int32_t>(rc.list.size());
    for (int32_t item : c.items) rc.item[static_cast<size_t>(item)] = 1;
    rc.list.push_back(std::move(c));
  }
  if (rc.list.empty()) {
    rc = RuntimeChecks();
    return;
  }
  rc.shadow.assign(S, 0);
  for (size_t q = 0; q < S; ++q) rc.shadow[q] = states[q].rule >= first_shadow_rule ? 1 : 0;

  auto rule_states = [&](int32_t r, auto&& fn) {
    if (rule_start[static_cast<size_t>(r)] < 0) return;
    for (size_t q = static_cast<size_t>(rule_start[static_cast<size_t>(r)]); q < S && states[q].rule == r; ++q) {
      fn(static_cast<int32_t>(q));
    }
  };
  // States from which the rule can finish reading nothing: final, or through references to
  // nullable rules only. A reference that lands in such a state is in tail position.
  std::vector<uint8_t> ends_here(S, 0);
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t q = 0; q < S; ++q) {
      if (ends_here[q]) continue;
      bool e = states[q].final;
      for (uint32_t k = states[q].ref_begin; !e && k < states[q].ref_end; ++k) {
        e = nullable[static_cast<size_t>(ref_edges[k].rule)] && ends_here[static_cast<size_t>(ref_edges[k].target)];
      }
      if (e) {
        ends_here[q] = 1;
        changed = true;
      }
    }
  }
  // Rules that may be the last part of a check's item: the items, and what they call in tail position.
  std::vector<uint8_t> tail(R, 0);
  std::vector<int32_t> work;
  for (const RuntimeCheck& c : rc.list) {
    for (int32_t item : c.items) {
      if (!tail[static_cast<size_t>(item)]) {
        tail[static_cast<size_t>(item)] = 1;
        work.push_back(item);
      }
    }
  }
  while (!work.empty()) {
    const int32_t r = work.back();
    work.pop_back();
    rule_states(r, [&](int32_t q) {
      for (uint32_t k = states[q].ref_begin; k < states[q].ref_end; ++k) {
        const RefEdge& re = ref_edges[k];
        if (ends_here[static_cast<size_t>(re.target)] && !tail[static_cast<size_t>(re.rule)]) {
          tail[static_cast<size_t>(re.rule)] = 1;
          work.push_back(re.rule);
        }
      }
    });
  }
  rc.end.assign(S, 0);
  for (size_t q = 0; q < S; ++q) {
    const State& st = states[q];
    if (!tail[static_cast<size_t>(st.rule)] || !st.final || st.byte_end > st.byte_begin) continue;
    bool extends = false;
    for (uint32_t k = st.ref_begin; k < st.ref_end && !extends; ++k) {
      extends = !nullable[static_cast<size_t>(ref_edges[k].rule)];
    }
    rc.end[q] = extends ? 0 : 1;
  }
  // Affected rules: tails, checks, and every rule that may call a check (callers, transitively).
  rc.affected.assign(R, 0);
  for (size_t r = 0; r < R; ++r) rc.affected[r] = tail[r];
  std::vector<std::vector<int32_t>> callers(R);
  for (size_t q = 0; q < S; ++q) {
    for (uint32_t k = states[q].ref_begin; k < states[q].ref_end; ++k) {
      callers[static_cast<size_t>(ref_edges[k].rule)].push_back(states[q].rule);
    }
  }
  for (const RuntimeCheck& c : rc.list) {
    if (rc.affected[static_cast<size_t>(c.rule)] == 2) continue;
    rc.affected[static_cast<size_t>(c.rule)] = 2;
    work.push_back(c.rule);
  }
  while (!work.empty()) {
    const int32_t r = work.back();
    work.pop_back();
    for (int32_t caller : callers[static_cast<size_t>(r)]) {
      if (rc.affected[static_cast<size_t>(caller)] != 2) {
        rc.affected[static_cast<size_t>(caller)] = 2;
        work.push_back(caller);
      }
    }
  }
  for (uint8_t& a : rc.affected) a = a != 0;

  // Ranks. first[r]: rules r may begin with (references reachable from its start through
  // references to nullable rules only); a check also begins with each of its items.
  std::vector<std::vector<int32_t>> first(R);
  for (size_t r = 0; r < R; ++r) {
    if (rule_start[r] < 0) continue;
    std::vector<int32_t> stack{rule_start[r]}, seen{rule_start[r]};
    while (!stack.empty()) {
      const int32_t q = stack.back();
      stack.pop_back();
      for (uint32_t k = states[static_cast<size_t>(q)].ref_begin; k < states[static_cast<size_t>(q)].ref_end; ++k) {
        const RefEdge& re = ref_edges[k];
        first[r].push_back(re.rule);
        if (nullable[static_cast<size_t>(re.rule)] && std::find(seen.begin(), seen.end(), re.target) == seen.end()) {
          seen.push_back(re.target);
          stack.push_back(re.target);
        }
      }
    }
  }
  for (const RuntimeCheck& c : rc.list) {
    first[static_cast<size_t>(c.rule)].insert(first[static_cast<size_t>(c.rule)].end(), c.items.begin(), c.items.end());
  }
  // rank(check) = 1 + the highest rank of a check reachable through `first` (0 if none).
  std::vector<int32_t> rank(R, -1);
  std::vector<uint8_t> busy(R, 0);
  std::function<int32_t(int32_t)> rank_of = [&](int32_t c) -> int32_t {
    if (rank[static_cast<size_t>(c)] >= 0) return rank[static_cast<size_t>(c)];
    if (busy[static_cast<size_t>(c)]) {
      throw DefinitionError("a run-time check begins with itself (left recursion through a check)");
    }
    busy[static_cast<size_t>(c)] = 1;
    int32_t inner = 0;
    std::vector<int32_t> stack(first[static_cast<size_t>(c)]);
    std::vector<uint8_t> seen(R, 0);
    while (!stack.empty()) {
      const int32_t x = stack.back();
      stack.pop_back();
      if (seen[static_cast<size_t>(x)]) continue;
      seen[static_cast<size_t>(x)] = 1;
      if (rc.of_rule[static_cast<size_t>(x)] >= 0) {
        inner = std::max(inner, rank_of(x) + 1);
        continue;
      }
      stack.insert(stack.end(), first[static_cast<size_t>(x)].begin(), first[static_cast<size_t>(x)].end());
    }
    busy[static_cast<size_t>(c)] = 0;
    return rank[static_cast<size_t>(c)] = inner;
  };
  for (RuntimeCheck& c : rc.list) c.rank = rank_of(c.rule);
}

}  // namespace grammar
}  // namespace agent_infer
