// Earley recognizer over bytes. Items are (automaton state, origin); the rule is implied by the
// state. Each input byte appends one Earley set to a flat history, so rollback is a truncation,
// and a fork is a copy of two flat vectors. Nullable rules use the Aycock-Horspool shortcut.
#include <algorithm>
#include <cstring>

#include "grammar/automaton.h"
#include "grammar/batch/pool.h"
#include "grammar/compiled_grammar.h"
#include "grammar/errors.h"
#include "grammar/item_map.h"
#include "grammar/mask/mask_strategies.h"
#include "grammar/mask/profile.h"
#include "grammar/mask/state_mask.h"
#include "grammar/mask/tokenizer_info.h"
#include "grammar/match/bounded.h"
#include "grammar/match/matcher.h"

namespace agent_infer {
namespace grammar {

namespace {
inline uint64_t item_key(int32_t state, int32_t origin) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(state)) << 32) | static_cast<uint32_t>(origin);
}
}  // namespace

Matcher::Matcher(std::shared_ptr<const CompiledGrammar> g, bool terminate_without_eos, int32_t max_rollback)
    : g_(std::move(g)), terminate_without_eos_(terminate_without_eos), max_rollback_(max_rollback) {
  unique_on_ = g_->has_unique;
  bounded_on_ = g_->has_bounded;
  state_stamp_.assign(g_->states.size(), 0);
  reset();
}

Matcher::Matcher(const Matcher& o)
    : g_(o.g_),
      terminate_without_eos_(o.terminate_without_eos_),
      max_rollback_(o.max_rollback_),
      terminated_(o.terminated_),
      items_(o.items_),
      set_begin_(o.set_begin_),
      token_marks_(o.token_marks_),
      state_stamp_(o.g_->states.size(), 0),
      hist_(o.hist_),
      epoch_(o.epoch_),
      epoch_next_(o.epoch_next_),
      ulex_(o.ulex_),
      bopen_(o.bopen_),
      bopen_begin_(o.bopen_begin_) {
  unique_on_ = o.unique_on_;
  bounded_on_ = o.bounded_on_;
}

void Matcher::reset() {
  // Built beside the current state, which a throwing reset keeps.
  std::vector<Item> items;
  std::vector<uint32_t> sets(1, 0);
  std::vector<uint8_t> hist;
  std::vector<uint32_t> epoch;
  std::vector<UniqueLex> ulex(unique_on_ ? 1 : 0);
  std::vector<BoundedOpen> bopen;
  std::vector<uint32_t> bopen_begin(bounded_on_ ? 1 : 0, 0);
  auto swap_all = [&] {
    items_.swap(items);
    set_begin_.swap(sets);
    hist_.swap(hist);
    epoch_.swap(epoch);
    ulex_.swap(ulex);
    bopen_.swap(bopen);
    bopen_begin_.swap(bopen_begin);
  };
  swap_all();
  try {
    seen_.clear();
    budget(false);
    add(g_->rule_start[g_->root], 0, 0);
    closure(0, 0);
  } catch (...) {
    swap_all();
    throw;
  }
  siblings_.clear();
  token_marks_.clear();
  terminated_ = false;
}

void Matcher::work_exceeded() const {
  const int64_t limit = per_mask_ ? g_->max_work_per_mask : g_->max_work_per_byte;
  throw LimitError("grammar matching exceeded its work budget of " + std::to_string(limit) +
                   (per_mask_ ? " parser steps for one token mask (max_work_per_mask)" :
                                " parser steps for one byte (max_work_per_byte)") +
                   " at input offset " + std::to_string(work_at_) + "; the grammar is too ambiguous");
}

void Matcher::add(int32_t state, int32_t origin, int32_t pos) {
  if (seen_.insert(item_key(state, origin))) {
    spend(1);
    items_.push_back({state, origin});
    if (static_cast<int64_t>(items_.size() - set_begin_[pos]) > g_->max_items_per_set) {
      throw LimitError("grammar matching exceeded " + std::to_string(g_->max_items_per_set) +
                       " parser items in one step (a highly ambiguous grammar?)");
    }
  }
}

void Matcher::closure(uint32_t begin, int32_t pos) {
  const CompiledGrammar& g = *g_;
  const bool checks = g.checks.any();
  if (checks) {
    done_.clear();
    pending_.clear();
  }
  for (uint32_t k = begin;; ++k) {
    // Closed but for the pending checks: decide them innermost first; one that passes grows the
    // set, which is then closed further.
    while (k >= items_.size()) {
      if (!checks || !decide_check(pos)) return;
    }
    const Item it = items_[k];
    const State& st = g.states[it.state];
    for (uint32_t e = st.ref_begin; e < st.ref_end; ++e) {
      const RefEdge& re = g.ref_edges[e];
      if (bounded_on_ && g.max_length[re.rule] >= 0) {
        if (g.bounded->dead(re.rule)) continue;  // no string of it fits the bound
        open_bounded(pos);
      }
      add(g.rule_start[re.rule], pos, pos);
      if (checks && g.checks.of_rule[static_cast<size_t>(re.rule)] >= 0) predict_shadows(re.rule, pos);
      if (g.nullable[re.rule]) add(re.target, it.origin, pos);
      if (unique_on_ && g.unique_rule[re.rule] && !ulex_.back().active) ulex_.back() = UniqueLex{1, 0, 0};
    }
    if (st.final) {
      const int32_t rule = st.rule;
      const int32_t o = it.origin;
      // A unique array item equal to an earlier one does not complete (its callers stay put).
      if (unique_on_ && g.unique_rule[rule] && repeats_earlier_item(o, pos)) continue;
      if (checks) {
        const int32_t c = g.checks.of_rule[static_cast<size_t>(rule)];
        if (c >= 0) {
          pending_.push_back({c, o});  // its items' finishes here are not all known yet
          continue;
        }
        if (g.checks.item[static_cast<size_t>(rule)]) done_.push_back({rule, o});
      }
      // Advance every item of the origin set waiting on `rule` (the current set may grow here).
      for (uint32_t j = set_begin_[o];; ++j) {
        uint32_t end = (o + 1 < static_cast<int32_t>(set_begin_.size())) ? set_begin_[o + 1]
                                                                         : static_cast<uint32_t>(items_.size());
        if (j >= end) break;
        spend(1);
        const Item w = items_[j];
        const State& ws = g.states[w.state];
        for (uint32_t e = ws.ref_begin; e < ws.ref_end; ++e) {
          if (g.ref_edges[e].rule == rule) add(g.ref_edges[e].target, w.origin, pos);
        }
      }
    }
  }
}

bool Matcher::advance(uint8_t b) {
  const CompiledGrammar& g = *g_;
  const uint32_t prev_begin = set_begin_.back();
  const uint32_t prev_end = static_cast<uint32_t>(items_.size());
  const int32_t pos = static_cast<int32_t>(set_begin_.size());
  set_begin_.push_back(prev_end);
  if (unique_on_) push_unique(b);
  if (bounded_on_) push_bounded(b);
  try {
    seen_.clear();
    for (uint32_t k = prev_begin; k < prev_end; ++k) {
      int32_t t = g.step(items_[k].state, b);
      if (t < 0 || (bounded_on_ && overruns(t, items_[k].origin))) continue;
      add(t, items_[k].origin, pos);
    }
    if (items_.size() == prev_end) {
      pop_set();
      return false;
    }
    closure(prev_end, pos);
    if (g.checks.any() && !last_set_live()) {
      pop_set();
      return false;
    }
  } catch (...) {
    pop_set();
    throw;
  }
  return true;
}

bool Matcher::any_byte_possible() const {
  for (uint32_t k = set_begin_.back(); k < items_.size(); ++k) {
    if (g_->scans(items_[k].state) && !g_->shadow_state(items_[k].state)) return true;
  }
  return false;
}

bool Matcher::can_terminate() const { return !terminated_ && last_set_can_end(); }

bool Matcher::is_terminated() const {
  if (terminated_) return true;
  return terminate_without_eos_ && last_set_can_end() && !any_byte_possible();
}

bool Matcher::accept_token(int32_t id) {
  const TokenizerInfo& t = *g_->tok;
  if (id < 0 || id >= t.vocab_size) {
    throw UsageError("token_id " + std::to_string(id) + " is outside the vocabulary of " +
                         std::to_string(t.vocab_size) + " tokens",
                     "token_id");
  }
  if (is_terminated()) return false;
  if (std::find(t.eos_ids.begin(), t.eos_ids.end(), id) != t.eos_ids.end()) {
    if (terminate_without_eos_ || !last_set_can_end()) return false;
    token_marks_.push_back({static_cast<uint32_t>(set_begin_.size()), terminated_});
    terminated_ = true;
  } else {
    const std::string& bytes = t.tokens[id];
    if (bytes.empty()) return false;
    if (!accept_bytes(bytes)) return false;
    return true;
  }
  if (max_rollback_ >= 0 && static_cast<int32_t>(token_marks_.size()) > max_rollback_) {
    token_marks_.erase(token_marks_.begin());
  }
  return true;
}

bool Matcher::accept_bytes(const std::string& bytes) {
  if (is_terminated()) return false;
  const uint32_t base = static_cast<uint32_t>(set_begin_.size());
  try {
    for (char c : bytes) {
      budget(false);
      if (!advance(static_cast<uint8_t>(c))) {
        pop_to(base);
        return false;
      }
    }
    if (unique_on_ && !alive()) {
      pop_to(base);
      return false;
    }
    token_marks_.push_back({base, terminated_});
  } catch (...) {
    pop_to(base);
    throw;
  }
  if (max_rollback_ >= 0 && static_cast<int32_t>(token_marks_.size()) > max_rollback_) {
    token_marks_.erase(token_marks_.begin());
  }
  return true;
}

void Matcher::rollback(int32_t n) {
  if (n < 0 || n > static_cast<int32_t>(token_marks_.size())) {
    throw UsageError("cannot roll back " + std::to_string(n) + " tokens; only " +
                         std::to_string(token_marks_.size()) + " can be rolled back",
                     "num_tokens");
  }
  if (n == 0) return;
  Mark m = token_marks_[token_marks_.size() - n];
  token_marks_.resize(token_marks_.size() - n);
  while (set_begin_.size() > m.sets) pop_set();
  terminated_ = m.terminated;
}

std::vector<std::array<int64_t, 5>> Matcher::debug_items() const {
  std::vector<std::array<int64_t, 5>> out;
  for (uint32_t k = set_begin_.back(); k < items_.size(); ++k) {
    const Item& it = items_[k];
    int64_t acc = -1, unc = -1;
    if (g_->scans(it.state)) {
      const StateMask& m = g_->mask_for(it.state);
      acc = 0;
      acc = static_cast<int64_t>(count_bits(m.accepted_bits.data(), m.accepted_bits.size()));
      acc += static_cast<int64_t>(m.accepted_ids.size());
      unc = static_cast<int64_t>(m.uncertain.size());
    }
    out.push_back({it.state, g_->states[it.state].rule, it.origin, acc, unc});
  }
  return out;
}

std::string Matcher::forced_bytes(bool* must_end) {
  std::string out;
  const uint32_t base = static_cast<uint32_t>(set_begin_.size());
  *must_end = false;
  if (is_terminated()) return out;
  try {
    forced_loop(out, must_end);
  } catch (...) {
    pop_to(base);
    throw;
  }
  pop_to(base);
  return out;
}

void Matcher::forced_loop(std::string& out, bool* must_end) {
  const CompiledGrammar& g = *g_;
  while (out.size() < 65536) {
    bool can_end = last_set_can_end();
    uint32_t seen[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int count = 0;
    int only = -1;
    for (uint32_t k = set_begin_.back(); k < items_.size() && count < 2; ++k) {
      if (g.shadow_state(items_[k].state)) continue;
      const State& st = g.states[items_[k].state];
      for (uint32_t e = st.byte_begin; e < st.byte_end && count < 2; ++e) {
        const ByteEdge& be = g.byte_edges[e];
        for (int b = be.lo; b <= be.hi && count < 2; ++b) {
          if (!(seen[b >> 5] & (1u << (b & 31)))) {
            seen[b >> 5] |= 1u << (b & 31);
            ++count;
            only = b;
          }
        }
      }
    }
    if (count == 0) {
      *must_end = can_end;
      break;
    }
    // Near a max-length string's bound some of the edges' bytes are refused: count the others.
    if (count > 1 && !can_end && bounded_on_ && bounded_tight()) count = bytes_taken(&only);
    if (count == 0) {
      *must_end = can_end;
      break;
    }
    if (count > 1 || can_end) break;
    budget(false);
    // The one byte an item's edges allow may still be refused (a max-length string at its bound).
    if (!advance(static_cast<uint8_t>(only))) break;
    out.push_back(static_cast<char>(only));
  }
}

}  // namespace grammar
}  // namespace agent_infer
