// The matcher's next-token mask: the union of the current Earley set's state masks, and the
// run-time check of the tokens they leave uncertain (per-byte Earley steps for a few, the
// pushdown walk of grammar/match/check.cpp for more, memoized per parse context for many).
#include <algorithm>
#include <cstring>

#include "grammar/batch/pool.h"
#include "grammar/compiled_grammar.h"
#include "grammar/errors.h"
#include "grammar/mask/profile.h"
#include "grammar/match/matcher.h"

namespace agent_infer {
namespace grammar {

namespace {
// Uncertain sets at least this large have their check memoized per parse context.
constexpr size_t kMemoUncertain = 1024;
// From this many uncertain tokens on, the pushdown walk beats per-byte Earley sets: inside a
// bounded string a step's few dozen uncertain tokens cost about 0.3 ms of Earley sets each time.
constexpr size_t kWalkUncertain = 16;
}  // namespace

void Matcher::check_uncertain(uint32_t* mask) {
  profile::Scope scope(profile::kCheckEarley);
  const TokenizerInfo& t = *g_->tok;
  const uint32_t base = static_cast<uint32_t>(set_begin_.size());
  size_t depth = 0;
  const char* prev = nullptr;
  size_t prev_len = 0;
  try {
    for (size_t k = 0; k < scratch_.size();) {
      const int32_t pos = scratch_[k];
      const int32_t id = t.sorted[pos];
      if (mask[id >> 5] & (1u << (id & 31))) {
        ++k;
        continue;
      }
      const char* tokb = t.sorted_ptr(pos);
      const size_t len = t.sorted_len(pos);
      size_t cp = 0;
      {
        size_t n = std::min(prev_len, len);
        while (cp < n && prev[cp] == tokb[cp]) ++cp;
      }
      prev = tokb;
      prev_len = len;
      while (depth > cp) {
        pop_set();
        --depth;
      }
      long dead_at = -1;
      while (depth < len) {
        if (!advance(static_cast<uint8_t>(tokb[depth]))) {
          dead_at = static_cast<long>(depth);
          break;
        }
        ++depth;
      }
      if (dead_at < 0) {
        if (!unique_on_ || alive()) mask[id >> 5] |= 1u << (id & 31);
        ++k;
        continue;
      }
      // Every token starting with the dead prefix tokb[0..dead_at] dies too; skip past them.
      const size_t lo = t.run_end(static_cast<size_t>(pos), static_cast<size_t>(dead_at) + 1);
      k = static_cast<size_t>(std::lower_bound(scratch_.begin() + k + 1, scratch_.end(), static_cast<int32_t>(lo)) - scratch_.begin());
    }
  } catch (...) {
    while (set_begin_.size() > base) pop_set();
    throw;
  }
  while (set_begin_.size() > base) pop_set();
}

uint32_t Matcher::pending_visits() const {
  if (terminated_ || set_begin_.empty()) return 0;
  const CompiledGrammar& g = *g_;
  uint32_t cost = 0;
  for (uint32_t k = set_begin_.back(); k < items_.size(); ++k) {
    const int32_t s = items_[k].state;
    if (g.scans(s) && !g.shadow_state(s) && !g.mask_ready(s)) cost += g.masks().dense_start(s) ? 4 : 1;
  }
  return cost;
}

void Matcher::first_visits_in_parallel(uint32_t pending) {
  // Fewer than two pending states (cost 0 or 1) leave nothing to spread: most rows of a step.
  if (pending < 2 || batch_team_threads() < 2) return;
  const CompiledGrammar& g = *g_;
  std::vector<int32_t> todo;
  for (uint32_t k = set_begin_.back(); k < items_.size(); ++k) {
    const int32_t s = items_[k].state;
    if (g.scans(s) && !g.shadow_state(s) && !g.mask_ready(s)) todo.push_back(s);
  }
  if (todo.size() < 2) return;
  std::sort(todo.begin(), todo.end());
  todo.erase(std::unique(todo.begin(), todo.end()), todo.end());
  if (todo.size() < 2) return;
  // Dense first visits are the long ones: they start first.
  std::stable_partition(todo.begin(), todo.end(), [&](int32_t s) { return g.masks().dense_start(s); });
  count_spread_row();
  parallel_for(todo.size(), 1, [&](size_t k0, size_t k1) {
    for (size_t k = k0; k < k1; ++k) g.mask_for(todo[k]);
  });
}

bool Matcher::fill_mask(int32_t* row, int64_t words, uint32_t pending) {
  const CompiledGrammar& g = *g_;
  const TokenizerInfo& t = *g.tok;
  uint32_t* mask = reinterpret_cast<uint32_t*>(row);
  if (is_terminated()) {
    std::memset(mask, 0, static_cast<size_t>(words) * 4);
    return true;
  }
  budget(true);
  // A row meeting several states for the first time (dozens, in a set that opens many
  // alternatives) computes their masks on the threads of its batch fill.
  first_visits_in_parallel(pending);
  const int64_t vw = std::min<int64_t>(words, t.words);
  // The row is written once: the first dense set is copied into it rather than ORed into a
  // zeroed row (one pass over the row fewer; a cached step is bound by these passes).
  bool written = false;
  auto zero_row = [&] {
    if (!written) std::memset(mask, 0, static_cast<size_t>(words) * 4);
    written = true;
  };
  scratch_.clear();
  if (++stamp_ == 0) {
    std::fill(state_stamp_.begin(), state_stamp_.end(), 0);
    stamp_ = 1;
  }
  int contributors = 0;
  for (uint32_t k = set_begin_.back(); k < items_.size(); ++k) {
    const int32_t s = items_[k].state;
    // A shadow item of a run-time check never lets a byte through (grammar/runtime_checks.h).
    if (state_stamp_[s] == stamp_ || !g.scans(s) || g.shadow_state(s)) continue;
    state_stamp_[s] = stamp_;
    const StateMask& m = g.mask_for(s);
    if (!m.accepted_bits.empty()) {
      const uint32_t* src = m.accepted_bits.data();
      if (written) {
        for (int64_t w = 0; w < vw; ++w) mask[w] |= src[w];
      } else {
        std::memcpy(mask, src, static_cast<size_t>(vw) * 4);
        if (words > vw) std::memset(mask + vw, 0, static_cast<size_t>(words - vw) * 4);
        written = true;
      }
    } else {
      zero_row();
      or_ids(mask, m.accepted_ids);
    }
    if (!m.uncertain.empty()) {
      // Each list is sorted: merging keeps the union sorted in linear time.
      if (scratch_.empty()) {
        scratch_.assign(m.uncertain.begin(), m.uncertain.end());
      } else {
        merged_.resize(scratch_.size() + m.uncertain.size());
        std::merge(scratch_.begin(), scratch_.end(), m.uncertain.begin(), m.uncertain.end(), merged_.begin());
        scratch_.swap(merged_);
      }
      ++contributors;
    }
  }
  zero_row();
  if (contributors > 1) {
    scratch_.erase(std::unique(scratch_.begin(), scratch_.end()), scratch_.end());
  }
  // Near a max-length string's bound the Earley check drops items by the string's count, which
  // the parse context's key does not hold: no memo there.
  if (scratch_.size() >= kMemoUncertain && !(bounded_on_ && bounded_near())) {
    // Large uncertain sets recur with the same parse context (every test decoding a schema,
    // every request reusing it), and checking them costs milliseconds: memoize the outcome.
    std::string key;
    {
      profile::Scope scope(profile::kContextKey);
      key = context_key();
    }
    if (auto hit = g.masks().checked_get(key)) {
      if (!hit->accepted_bits.empty()) {
        for (int64_t w = 0; w < vw; ++w) mask[w] |= hit->accepted_bits[static_cast<size_t>(w)];
      }
      or_ids(mask, hit->accepted_ids);
    } else {
      allowed_before_.assign(mask, mask + vw);
      if (g.checks.any() || !check_uncertain_walk(mask)) check_uncertain(mask);
      std::vector<uint32_t> bits(static_cast<size_t>(t.words), 0);
      size_t n = 0;
      for (int64_t w = 0; w < vw; ++w) bits[static_cast<size_t>(w)] = mask[w] & ~allowed_before_[static_cast<size_t>(w)];
      n = count_bits(bits.data(), bits.size());
      auto allowed = std::make_shared<StateMask>();
      finish_mask(*allowed, std::move(bits), n);
      g.masks().checked_put(key, std::move(allowed));
    }
  } else if (scratch_.size() >= kWalkUncertain && !g.checks.any()) {
    // The pushdown walk knows nothing of run-time checks' verdicts: with checks, Earley steps.
    if (!check_uncertain_walk(mask)) check_uncertain(mask);
  } else if (!scratch_.empty()) {
    check_uncertain(mask);
  }
  if (bounded_on_) recheck_bounded(mask, vw);
  if (unique_on_) recheck_unique(mask, vw);
  if (!terminate_without_eos_ && last_set_can_end()) {
    for (int32_t e : t.eos_ids) {
      if (e < words * 32) mask[e >> 5] |= 1u << (e & 31);
    }
  }
  // A row that allows everything needs no application; report whether it restricts anything.
  for (int64_t w = 0; w + 1 < vw; ++w) {
    if (mask[w] != 0xFFFFFFFFu) return true;
  }
  if (vw == 0) return true;
  int32_t tail = t.vocab_size - static_cast<int32_t>((vw - 1) * 32);
  uint32_t full = tail >= 32 ? 0xFFFFFFFFu : ((1u << tail) - 1);
  return (mask[vw - 1] & full) != full;
}

std::string Matcher::context_key() {
  // Sets are renumbered in discovery order (the current one is 0), so equal contexts at
  // different positions of the input share a key.
  std::string ser;
  auto put = [&](int32_t v) { ser.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
  ctx_ids_.clear();
  ctx_sets_.clear();
  const int32_t cur = static_cast<int32_t>(set_begin_.size()) - 1;
  ctx_ids_.emplace(cur, 0);
  ctx_sets_.push_back(cur);
  for (size_t k = 0; k < ctx_sets_.size(); ++k) {
    const int32_t set = ctx_sets_[k];
    const uint32_t begin = set_begin_[static_cast<size_t>(set)];
    const uint32_t end = set == cur ? static_cast<uint32_t>(items_.size()) : set_begin_[static_cast<size_t>(set) + 1];
    put(static_cast<int32_t>(end - begin));
    for (uint32_t j = begin; j < end; ++j) {
      const Item& it = items_[j];
      auto found = ctx_ids_.find(it.origin);
      if (found == ctx_ids_.end()) {
        found = ctx_ids_.emplace(it.origin, static_cast<int32_t>(ctx_sets_.size())).first;
        ctx_sets_.push_back(it.origin);
      }
      put(it.state);
      put(found->second);
    }
  }
  // 128-bit digest: the key is stored per memoized outcome.
  uint64_t h1 = 1469598103934665603ull ^ ser.size(), h2 = 0x9E3779B97F4A7C15ull;
  for (size_t i = 0; i + 4 <= ser.size(); i += 4) {
    uint32_t w;
    std::memcpy(&w, ser.data() + i, 4);
    h1 = (h1 ^ w) * 0x100000001b3ull;
    h1 ^= h1 >> 31;
    h2 = (h2 + w + 1) * 0xff51afd7ed558ccdull;
    h2 ^= h2 >> 29;
  }
  std::string key(reinterpret_cast<const char*>(&h1), sizeof(h1));
  key.append(reinterpret_cast<const char*>(&h2), sizeof(h2));
  return key;
}

}  // namespace grammar
}  // namespace agent_infer
