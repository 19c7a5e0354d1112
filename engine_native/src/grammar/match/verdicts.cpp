// The matcher's side of run-time checks (grammar/runtime_checks.h): predicting a check's shadow
// items with it, and deciding a check once the Earley set its carrier finished in is closed.
//
// A check's verdict reads which of its item rules finished over its span, and an item may itself
// finish through another check that ends at the same byte. Such checks begin at the same origin
// or later, so the pending checks are decided latest origin first and, at one origin, lowest rank
// first (an inner check before the check whose item begins with it): every verdict then reads
// finishes that are final. A passing check completes like any rule, which may finish more rules
// and make more checks pending; a failing one leaves its final item in the set, where it makes
// nothing viable.
#include <cstdint>

#include "grammar/compiled_grammar.h"
#include "grammar/match/matcher.h"
#include "grammar/runtime_checks.h"

namespace agent_infer {
namespace grammar {

void Matcher::predict_shadows(int32_t check_rule, int32_t pos) {
  const CompiledGrammar& g = *g_;
  const RuntimeCheck& c = g.checks.list[static_cast<size_t>(g.checks.of_rule[static_cast<size_t>(check_rule)])];
  for (size_t i = static_cast<size_t>(c.carriers); i < c.items.size(); ++i) {
    const int32_t start = g.rule_start[static_cast<size_t>(c.items[i])];
    if (start >= 0) add(start, pos, pos);
  }
}

bool Matcher::decide_check(int32_t pos) {
  const CompiledGrammar& g = *g_;
  while (!pending_.empty()) {
    size_t best = 0;
    for (size_t i = 1; i < pending_.size(); ++i) {
      const Span& a = pending_[i];
      const Span& b = pending_[best];
      const int32_t ra = g.checks.list[static_cast<size_t>(a.rule)].rank;
      const int32_t rb = g.checks.list[static_cast<size_t>(b.rule)].rank;
      if (a.origin > b.origin || (a.origin == b.origin && ra < rb)) best = i;
    }
    const Span p = pending_[best];
    pending_[best] = pending_.back();
    pending_.pop_back();
    const RuntimeCheck& c = g.checks.list[static_cast<size_t>(p.rule)];
    uint32_t members = 0;
    spend(static_cast<int64_t>(done_.size()) + 1);
    for (const Span& d : done_) {
      if (d.origin != p.origin) continue;
      for (size_t i = 0; i < c.items.size(); ++i) {
        if (c.items[i] == d.rule) members |= 1u << i;
      }
    }
    if (!c.accepts(members)) continue;
    if (g.checks.item[static_cast<size_t>(c.rule)]) done_.push_back({c.rule, p.origin});
    // Complete the check: advance the items of its origin set waiting on it.
    const size_t before = items_.size();
    const uint32_t end = set_begin_[static_cast<size_t>(p.origin) + 1];
    for (uint32_t j = set_begin_[static_cast<size_t>(p.origin)]; j < end; ++j) {
      spend(1);
      const Item w = items_[j];
      const State& ws = g.states[w.state];
      for (uint32_t e = ws.ref_begin; e < ws.ref_end; ++e) {
        if (g.ref_edges[e].rule == c.rule) add(g.ref_edges[e].target, w.origin, pos);
      }
    }
    if (items_.size() > before) return true;
  }
  return false;
}

bool Matcher::last_set_live() const {
  const CompiledGrammar& g = *g_;
  for (uint32_t k = set_begin_.back(); k < items_.size(); ++k) {
    const int32_t s = items_[k].state;
    if (g.scans(s) && !g.shadow_state(s)) return true;
  }
  return last_set_can_end();
}

}  // namespace grammar
}  // namespace agent_infer
