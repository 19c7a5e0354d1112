// Earley recognizer over bytes. Items are (automaton state, origin); the rule is implied by the
// state. Each input byte appends one Earley set to a flat history, so rollback is a truncation,
// and a fork is a copy of two flat vectors. Nullable rules use the Aycock-Horspool shortcut.
#include <algorithm>
#include <cstring>

#include "grammar/grammar.h"
#include "grammar/batch/pool.h"
#include "grammar/mask/profile.h"

namespace agent_infer {
namespace grammar {

namespace {
inline uint64_t item_key(int32_t state, int32_t origin) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(state)) << 32) | static_cast<uint32_t>(origin);
}
// Uncertain sets at least this large have their check memoized per parse context.
constexpr size_t kMemoUncertain = 1024;
// From this many uncertain tokens on, the pushdown walk beats per-byte Earley sets. It was 128:
// inside Snowplow's bounded strings a step's few dozen uncertain tokens cost ≈ 0.3 ms of Earley
// sets each time; at 16, MaskBench dev (2 778 schemas, DeepSeek-V4) TBM avg 25.9 → 24.3 µs and
// p99 351 → 330 µs, the 200-schema sample avg 18.6 → 17.6 µs and p99 197 → 175 µs.
constexpr size_t kWalkUncertain = 16;
inline size_t mix(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdull;
  k ^= k >> 33;
  return static_cast<size_t>(k);
}
}  // namespace

size_t ItemMap::slot(uint64_t key, bool* found) {
  if ((size_ + 1) * 2 > keys_.size()) grow();
  const size_t mask = keys_.size() - 1;
  for (size_t i = mix(key) & mask;; i = (i + 1) & mask) {
    if (stamps_[i] != stamp_) {
      stamps_[i] = stamp_;
      keys_[i] = key;
      ++size_;
      *found = false;
      return i;
    }
    if (keys_[i] == key) {
      *found = true;
      return i;
    }
  }
}

int32_t* ItemMap::find(uint64_t key) {
  if (keys_.empty()) return nullptr;
  const size_t mask = keys_.size() - 1;
  for (size_t i = mix(key) & mask;; i = (i + 1) & mask) {
    if (stamps_[i] != stamp_) return nullptr;
    if (keys_[i] == key) return &values_[i];
  }
}

void ItemMap::grow() {
  std::vector<uint64_t> old_keys;
  std::vector<int32_t> old_values;
  std::vector<uint32_t> old_stamps;
  old_keys.swap(keys_);
  old_values.swap(values_);
  old_stamps.swap(stamps_);
  const size_t cap = std::max<size_t>(64, old_keys.size() * 2);
  keys_.assign(cap, 0);
  values_.assign(cap, 0);
  stamps_.assign(cap, 0);
  const size_t mask = cap - 1;
  for (size_t j = 0; j < old_keys.size(); ++j) {
    if (old_stamps[j] != stamp_) continue;
    for (size_t i = mix(old_keys[j]) & mask;; i = (i + 1) & mask) {
      if (stamps_[i] != stamp_) {
        stamps_[i] = stamp_;
        keys_[i] = old_keys[j];
        values_[i] = old_values[j];
        break;
      }
    }
  }
}

Matcher::Matcher(std::shared_ptr<const CompiledGrammar> g, bool terminate_without_eos, int32_t max_rollback)
    : g_(std::move(g)), terminate_without_eos_(terminate_without_eos), max_rollback_(max_rollback) {
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
      state_stamp_(o.g_->states.size(), 0) {}

void Matcher::reset() {
  // Built beside the current state, which a throwing reset keeps.
  std::vector<Item> items;
  std::vector<uint32_t> sets(1, 0);
  items_.swap(items);
  set_begin_.swap(sets);
  try {
    seen_.clear();
    budget(false);
    add(g_->rule_start[g_->root], 0, 0);
    closure(0, 0);
  } catch (...) {
    items_.swap(items);
    set_begin_.swap(sets);
    throw;
  }
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
  for (uint32_t k = begin; k < items_.size(); ++k) {
    const Item it = items_[k];
    const State& st = g.states[it.state];
    for (uint32_t e = st.ref_begin; e < st.ref_end; ++e) {
      const RefEdge& re = g.ref_edges[e];
      add(g.rule_start[re.rule], pos, pos);
      if (g.nullable[re.rule]) add(re.target, it.origin, pos);
    }
    if (st.final) {
      const int32_t rule = st.rule;
      const int32_t o = it.origin;
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
  try {
    seen_.clear();
    for (uint32_t k = prev_begin; k < prev_end; ++k) {
      int32_t t = g.step(items_[k].state, b);
      if (t >= 0) add(t, items_[k].origin, pos);
    }
    if (items_.size() == prev_end) {
      set_begin_.pop_back();
      return false;
    }
    closure(prev_end, pos);
  } catch (...) {
    pop_set();
    throw;
  }
  return true;
}

void Matcher::pop_set() {
  items_.resize(set_begin_.back());
  set_begin_.pop_back();
}

bool Matcher::last_set_can_end() const {
  const CompiledGrammar& g = *g_;
  for (uint32_t k = set_begin_.back(); k < items_.size(); ++k) {
    const Item& it = items_[k];
    if (it.origin == 0 && g.states[it.state].final && g.states[it.state].rule == g.root) return true;
  }
  return false;
}

bool Matcher::any_byte_possible() const {
  for (uint32_t k = set_begin_.back(); k < items_.size(); ++k) {
    if (g_->scans(items_[k].state)) return true;
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
        mask[id >> 5] |= 1u << (id & 31);
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
    if (g.scans(s) && !g.mask_ready(s)) cost += g.dense_start(s) ? 4 : 1;
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
    if (g.scans(s) && !g.mask_ready(s)) todo.push_back(s);
  }
  if (todo.size() < 2) return;
  std::sort(todo.begin(), todo.end());
  todo.erase(std::unique(todo.begin(), todo.end()), todo.end());
  if (todo.size() < 2) return;
  // Dense first visits are the long ones: they start first.
  std::stable_partition(todo.begin(), todo.end(), [&](int32_t s) { return g.dense_start(s); });
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
    if (state_stamp_[s] == stamp_ || !g.scans(s)) continue;
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
  if (scratch_.size() >= kMemoUncertain) {
    // Large uncertain sets recur with the same parse context (every test decoding a schema,
    // every request reusing it), and checking them costs milliseconds: memoize the outcome.
    std::string key;
    {
      profile::Scope scope(profile::kContextKey);
      key = context_key();
    }
    if (auto hit = g.checked_get(key)) {
      if (!hit->accepted_bits.empty()) {
        for (int64_t w = 0; w < vw; ++w) mask[w] |= hit->accepted_bits[static_cast<size_t>(w)];
      }
      or_ids(mask, hit->accepted_ids);
    } else {
      allowed_before_.assign(mask, mask + vw);
      if (!check_uncertain_walk(mask)) check_uncertain(mask);
      std::vector<uint32_t> bits(static_cast<size_t>(t.words), 0);
      size_t n = 0;
      for (int64_t w = 0; w < vw; ++w) bits[static_cast<size_t>(w)] = mask[w] & ~allowed_before_[static_cast<size_t>(w)];
      n = count_bits(bits.data(), bits.size());
      auto allowed = std::make_shared<StateMask>();
      finish_mask(*allowed, std::move(bits), n);
      g.checked_put(key, std::move(allowed));
    }
  } else if (scratch_.size() >= kWalkUncertain) {
    if (!check_uncertain_walk(mask)) check_uncertain(mask);
  } else if (!scratch_.empty()) {
    check_uncertain(mask);
  }
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

std::shared_ptr<const StateMask> CompiledGrammar::checked_get(const std::string& key) const {
  std::lock_guard<std::mutex> lock(checked_mu_);
  auto it = checked_.find(key);
  return it == checked_.end() ? nullptr : it->second;
}

void CompiledGrammar::checked_put(const std::string& key, std::shared_ptr<const StateMask> allowed) const {
  // Bounded per grammar (and left out of memory_bytes(), which the compiler's LRU cache reads
  // once at insertion): past the budget new outcomes are simply recomputed each time.
  constexpr size_t kMaxCheckedBytes = size_t{8} << 20;
  const size_t bytes = key.size() + allowed->bytes() + 64;
  std::lock_guard<std::mutex> lock(checked_mu_);
  if (checked_bytes_ + bytes > kMaxCheckedBytes) return;
  if (checked_.emplace(key, std::move(allowed)).second) checked_bytes_ += bytes;
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
    if (count > 1 || can_end) break;
    budget(false);
    advance(static_cast<uint8_t>(only));
    out.push_back(static_cast<char>(only));
  }
}

}  // namespace grammar
}  // namespace agent_infer
