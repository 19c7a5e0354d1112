// Lowering, step 2: subset construction of a rule's NFA into its DFA (see grammar/lower/determinizer.h).
//
// The alphabet is byte ranges plus rule references. A DFA state is the sorted set of the NFA
// states of an epsilon closure that carry information (byte or reference edges, or acceptance).
// Sets are numbered in the order they are first reached, expanding states in number order and,
// within a state, byte ranges in ascending order before references by ascending rule index.
#include <algorithm>
#include <array>
#include <string>

#include "grammar/automaton.h"
#include "grammar/errors.h"
#include "grammar/lower/automata.h"
#include "grammar/lower/determinizer.h"
#include "grammar/lower/set_table.h"

namespace agent_infer {
namespace grammar {

namespace {

uint64_t hash_set(const int32_t* data, size_t n) {
  uint64_t h = 1469598103934665603ull ^ n;
  for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<uint32_t>(data[i])) * 1099511628211ull;
  return h ^ (h >> 29);
}

}  // namespace

void Determinizer::closure(const Nfa& nfa, std::vector<int32_t>& seed) {
  closure_.clear();
  if (seed.size() == 1 && nfa.eps_begin[seed[0]] == nfa.eps_begin[seed[0] + 1]) {
    // Most targets (inside literals and byte sequences) have no epsilon edges.
    const int32_t x = seed[0];
    seed.clear();
    if (nfa.byte_begin[x] < nfa.byte_begin[x + 1] || nfa.ref_begin[x] < nfa.ref_begin[x + 1] || x == nfa.accept) {
      closure_.push_back(x);
    }
    return;
  }
  if (mark_.size() < nfa.size()) mark_.resize(nfa.size(), 0);
  if (bits_.size() < (nfa.size() + 63) / 64) bits_.resize((nfa.size() + 63) / 64, 0);
  if (++stamp_ == 0) {
    std::fill(mark_.begin(), mark_.end(), 0);
    stamp_ = 1;
  }
  size_t lo_word = bits_.size(), hi_word = 0;
  stack_.swap(seed);
  while (!stack_.empty()) {
    const int32_t x = stack_.back();
    stack_.pop_back();
    if (mark_[x] == stamp_) continue;
    mark_[x] = stamp_;
    if (nfa.byte_begin[x] < nfa.byte_begin[x + 1] || nfa.ref_begin[x] < nfa.ref_begin[x + 1] || x == nfa.accept) {
      closure_.push_back(x);
      const size_t w = static_cast<size_t>(x) >> 6;
      bits_[w] |= uint64_t{1} << (x & 63);
      lo_word = std::min(lo_word, w);
      hi_word = std::max(hi_word, w);
    }
    for (uint32_t e = nfa.eps_begin[x]; e < nfa.eps_begin[x + 1]; ++e) stack_.push_back(nfa.eps[e]);
  }
  stack_.swap(seed);  // hand the (now empty) buffer back for reuse
  if (closure_.size() <= 16 || hi_word - lo_word >= 4 * closure_.size()) {
    // Small sets sort faster than their words scan, and so do sets spread thin over a long
    // automaton (a counted repeat's copies: a few states in each of a hundred copies); the bits
    // only have to be cleared.
    std::sort(closure_.begin(), closure_.end());
    for (int32_t x : closure_) bits_[static_cast<size_t>(x) >> 6] = 0;
    return;
  }
  // Large sets (a pattern's search automaton: hundreds of states) come out of the bit words
  // already sorted, instead of an O(n log n) sort per closure.
  closure_.clear();
  for (size_t w = lo_word; w <= hi_word; ++w) {
    for (uint64_t word = bits_[w]; word != 0; word &= word - 1) {
      closure_.push_back(static_cast<int32_t>((w << 6) | static_cast<size_t>(__builtin_ctzll(word))));
    }
    bits_[w] = 0;
  }
}

void SetTable::clear() {
  data_.clear();
  off_.assign(1, 0);
  hash_.clear();
  if (table_.empty()) {
    table_.assign(64, -1);
    table_gen_.assign(64, 0);
  }
  if (++gen_ == 0) {
    std::fill(table_gen_.begin(), table_gen_.end(), 0);
    gen_ = 1;
  }
}

int32_t SetTable::find(const int32_t* data, size_t n, uint64_t h, size_t* slot) const {
  const size_t mask = table_.size() - 1;
  size_t i = static_cast<size_t>(h) & mask;
  for (; table_gen_[i] == gen_; i = (i + 1) & mask) {
    const int32_t id = table_[i];
    if (hash_[id] != h) continue;
    const uint32_t b = off_[id], e = off_[id + 1];
    if (e - b == n && std::equal(data, data + n, data_.begin() + b)) return id;
  }
  *slot = i;
  return -1;
}

int32_t SetTable::insert(const int32_t* data, size_t n, uint64_t h, size_t slot) {
  const int32_t id = size();
  data_.insert(data_.end(), data, data + n);
  off_.push_back(static_cast<uint32_t>(data_.size()));
  hash_.push_back(h);
  table_[slot] = id;
  table_gen_[slot] = gen_;
  if (hash_.size() * 2 > table_.size()) {
    // Grow and rehash this numbering's sets (entries of earlier ones are stale by generation).
    grow_id_table(&table_, &table_gen_, gen_, 0, hash_.size(), [this](size_t s) { return hash_[s]; });
  }
  return id;
}

size_t SetTable::retained_bytes() const {
  auto bytes = [](const auto& v) { return v.capacity() * sizeof(v[0]); };
  return bytes(data_) + bytes(off_) + bytes(hash_) + bytes(table_) + bytes(table_gen_);
}

int32_t Determinizer::new_state(DfaPool* pool, int32_t ref) {
  if (++total_ > max_states_) {
    throw LimitError("grammar is too large: more than " + std::to_string(max_states_) + " automaton states");
  }
  deadline_->check();
  if (sets_.bytes_used() + seeds_.bytes_used() + trie_.bytes_used() > kMaxDeterminizeBytes) {
    throw LimitError("grammar is too large: building one rule's automaton needs more than " +
                     std::to_string(kMaxDeterminizeBytes >> 20) + " MiB of state sets");
  }
  pool->final.push_back(0);
  state_ref_.push_back(ref);
  return static_cast<int32_t>(state_ref_.size()) - 1;
}

int32_t Determinizer::intern(const Nfa& nfa, DfaPool* pool) {
  if (closure_.size() > kFlatMembers) {
    const int32_t id = trie_.intern(closure_.data(), closure_.size());
    if (static_cast<size_t>(id) < trie_state_.size() && trie_state_[id] >= 0) return trie_state_[id];
    const int32_t d = new_state(pool, ~id);
    if (trie_state_.size() <= static_cast<size_t>(id)) trie_state_.resize(trie_.bound(), -1);
    trie_state_[id] = d;
    return d;
  }
  const uint64_t h = hash_set(closure_.data(), closure_.size());
  size_t slot = 0;
  const int32_t found = sets_.find(closure_.data(), closure_.size(), h, &slot);
  if (found >= 0) return flat_state_[found];
  const int32_t d = new_state(pool, sets_.insert(closure_.data(), closure_.size(), h, slot));
  flat_state_.push_back(d);
  return d;
}

int32_t Determinizer::close_intern(const Nfa& nfa, DfaPool* pool) {
  if (targets_.size() > 1) {
    std::sort(targets_.begin(), targets_.end());
    targets_.erase(std::unique(targets_.begin(), targets_.end()), targets_.end());
  }
  if (targets_.size() == 1) {
    const size_t x = static_cast<size_t>(targets_[0]);
    if (one_gen_.size() < nfa.size()) {
      one_gen_.resize(nfa.size(), 0);
      one_id_.resize(nfa.size(), -1);
    }
    if (one_gen_[x] == gen_) {
      targets_.clear();
      return one_id_[x];
    }
    closure(nfa, targets_);
    const int32_t id = intern(nfa, pool);
    one_gen_[x] = gen_;
    one_id_[x] = id;
    return id;
  }
  if (targets_.size() > kFlatMembers) {
    const int32_t seed = trie_.intern(targets_.data(), targets_.size());
    if (static_cast<size_t>(seed) < trie_seed_.size() && trie_seed_[seed] >= 0) {
      targets_.clear();
      return trie_seed_[seed];
    }
    closure(nfa, targets_);
    const int32_t id = intern(nfa, pool);
    if (trie_seed_.size() <= static_cast<size_t>(seed)) trie_seed_.resize(trie_.bound(), -1);
    trie_seed_[seed] = id;
    return id;
  }
  const uint64_t h = hash_set(targets_.data(), targets_.size());
  size_t slot = 0;
  const int32_t k = seeds_.find(targets_.data(), targets_.size(), h, &slot);
  if (k >= 0) {
    targets_.clear();
    return seed_id_[k];
  }
  seeds_.insert(targets_.data(), targets_.size(), h, slot);  // before closure() consumes targets_
  closure(nfa, targets_);
  const int32_t id = intern(nfa, pool);
  seed_id_.push_back(id);
  return id;
}

// Closes targets_ and adds the edge [a, b] to the set reached, joined with the previous edge when
// it is adjacent and leads to the same state.
void Determinizer::emit_interval(const Nfa& nfa, int32_t a, int32_t b, size_t first_edge, DfaPool* pool) {
  const int32_t t = base_ + close_intern(nfa, pool);
  if (pool->bytes.size() > first_edge && pool->bytes.back().target == t && pool->bytes.back().hi + 1 == a) {
    pool->bytes.back().hi = static_cast<uint8_t>(b);
  } else {
    pool->bytes.push_back({static_cast<uint8_t>(a), static_cast<uint8_t>(b), t});
  }
}

// The byte edges of a state with many NFA edges (a pattern's search automaton: hundreds of edges,
// ~100 intervals). Edges are bucketed by where they start and end, and a sweep over the byte
// boundaries keeps the active ones, so an interval costs its active edges rather than all of
// them; an interval whose active targets equal the previous one's extends its edge unclosed.
// The edges and the order sets are interned in are those of the plain interval scan.
void Determinizer::sweep_edges(const Nfa& nfa, size_t first_edge, DfaPool* pool) {
  const uint32_t E = static_cast<uint32_t>(edges_.size());
  std::array<uint32_t, 258> start_at{}, end_at{};  // counts, then bucket starts, by position
  std::array<uint64_t, 5> is_point{};
  for (const ByteEdge& e : edges_) {
    ++start_at[e.lo + 1];
    ++end_at[e.hi + 2];
    is_point[e.lo >> 6] |= uint64_t{1} << (e.lo & 63);
    is_point[(e.hi + 1) >> 6] |= uint64_t{1} << ((e.hi + 1) & 63);
  }
  for (size_t p = 0; p < 257; ++p) {
    start_at[p + 1] += start_at[p];
    end_at[p + 1] += end_at[p];
  }
  by_lo_.resize(E);
  by_end_.resize(E);
  slot_.resize(E);
  {
    std::array<uint32_t, 258> fs = start_at, fe = end_at;
    for (uint32_t e = 0; e < E; ++e) {
      by_lo_[fs[edges_[e].lo]++] = e;
      by_end_[fe[edges_[e].hi + 1]++] = e;
    }
  }
  if (count_in_.size() < nfa.size()) count_in_.resize(nfa.size(), 0);
  sweep_dirty_ = true;
  active_.clear();
  bool live = false;  // the previous interval had active edges (pool->bytes.back() is its edge)
  for (size_t w = 0; w < is_point.size(); ++w) {
    for (uint64_t word = is_point[w]; word != 0; word &= word - 1) {
      const int32_t a = static_cast<int32_t>((w << 6) | static_cast<size_t>(__builtin_ctzll(word)));
      bool changed = false;
      for (uint32_t k = end_at[a]; k < end_at[a + 1]; ++k) {
        const uint32_t e = by_end_[k];
        const uint32_t last = active_.back();
        active_[slot_[e]] = last;
        slot_[last] = slot_[e];
        active_.pop_back();
        changed |= --count_in_[edges_[e].target] == 0;
      }
      for (uint32_t k = start_at[a]; k < start_at[a + 1]; ++k) {
        const uint32_t e = by_lo_[k];
        slot_[e] = static_cast<uint32_t>(active_.size());
        active_.push_back(e);
        changed |= count_in_[edges_[e].target]++ == 0;
      }
      if (live && !changed) continue;  // same targets, same set: the run goes on
      if (live) pool->bytes.back().hi = static_cast<uint8_t>(a - 1);  // the run ends before a
      live = !active_.empty();
      if (!live) continue;
      targets_.clear();
      for (uint32_t e : active_) targets_.push_back(edges_[e].target);
      emit_interval(nfa, a, 255, first_edge, pool);  // 255 until the next point closes the run
    }
  }
  sweep_dirty_ = false;  // every edge ended at 256: the counts are back to zero
}

void Determinizer::expand(const Nfa& nfa, int32_t d, DfaPool* pool) {
  // Copied out: interning new sets may reallocate the table's members.
  const int32_t ref = state_ref_[d];
  if (ref >= 0) {
    current_.assign(sets_.members(ref), sets_.members_end(ref));
  } else {
    current_.clear();
    trie_.members(~ref, &current_);
  }
  edges_.clear();
  ref_pairs_.clear();
  uint8_t final = 0;
  for (int32_t x : current_) {
    if (x == nfa.accept) final = 1;
    edges_.insert(edges_.end(), nfa.bytes.begin() + nfa.byte_begin[x], nfa.bytes.begin() + nfa.byte_begin[x + 1]);
    ref_pairs_.insert(ref_pairs_.end(), nfa.refs.begin() + nfa.ref_begin[x], nfa.refs.begin() + nfa.ref_begin[x + 1]);
  }
  pool->final[base_ + d] = final;
  const size_t first_edge = pool->bytes.size();
  if (edges_.size() == 1) {
    targets_.assign(1, edges_[0].target);
    pool->bytes.push_back({edges_[0].lo, edges_[0].hi, base_ + close_intern(nfa, pool)});
  } else if (edges_.size() <= 8) {
    points_.clear();
    for (const ByteEdge& e : edges_) {
      points_.push_back(e.lo);
      points_.push_back(e.hi + 1);
    }
    std::sort(points_.begin(), points_.end());
    points_.erase(std::unique(points_.begin(), points_.end()), points_.end());
    for (size_t k = 0; k + 1 < points_.size(); ++k) {
      const int32_t a = points_[k], b = points_[k + 1] - 1;
      targets_.clear();
      for (const ByteEdge& e : edges_) {
        if (e.lo <= a && b <= e.hi) targets_.push_back(e.target);
      }
      if (targets_.empty()) continue;
      emit_interval(nfa, a, b, first_edge, pool);
    }
  } else {
    sweep_edges(nfa, first_edge, pool);
  }
  pool->byte_begin.push_back(static_cast<uint32_t>(pool->bytes.size()));
  std::sort(ref_pairs_.begin(), ref_pairs_.end(),
            [](const RefEdge& x, const RefEdge& y) { return x.rule != y.rule ? x.rule < y.rule : x.target < y.target; });
  for (size_t i = 0; i < ref_pairs_.size();) {
    size_t j = i;
    targets_.clear();
    while (j < ref_pairs_.size() && ref_pairs_[j].rule == ref_pairs_[i].rule) targets_.push_back(ref_pairs_[j++].target);
    pool->refs.push_back({ref_pairs_[i].rule, base_ + close_intern(nfa, pool)});
    i = j;
  }
  pool->ref_begin.push_back(static_cast<uint32_t>(pool->refs.size()));
}

int32_t Determinizer::run(const Nfa& nfa, DfaPool* pool) {
  if (sweep_dirty_) {
    std::fill(count_in_.begin(), count_in_.end(), 0);
    sweep_dirty_ = false;
  }
  base_ = static_cast<int32_t>(pool->size());
  sets_.clear();
  seeds_.clear();
  seed_id_.clear();
  trie_.clear(nfa.size());
  state_ref_.clear();
  flat_state_.clear();
  trie_state_.clear();
  trie_seed_.clear();
  if (++gen_ == 0) {
    std::fill(one_gen_.begin(), one_gen_.end(), 0);
    gen_ = 1;
  }
  targets_.assign(1, nfa.start);
  closure(nfa, targets_);
  intern(nfa, pool);
  for (size_t d = 0; d < state_ref_.size(); ++d) expand(nfa, static_cast<int32_t>(d), pool);
  return base_;
}

void Determinizer::charge(int64_t states) {
  total_ += states;
  if (total_ > max_states_) {
    throw LimitError("grammar is too large: more than " + std::to_string(max_states_) + " automaton states");
  }
}

size_t Determinizer::retained_bytes() const {
  auto bytes = [](const auto& v) { return v.capacity() * sizeof(v[0]); };
  return sets_.retained_bytes() + seeds_.retained_bytes() + trie_.retained_bytes() + bytes(state_ref_) +
         bytes(flat_state_) + bytes(trie_state_) + bytes(trie_seed_) + bytes(mark_) + bytes(bits_) + bytes(stack_) +
         bytes(closure_) + bytes(current_) + bytes(targets_) + bytes(points_) + bytes(by_lo_) + bytes(by_end_) +
         bytes(active_) + bytes(slot_) + bytes(count_in_) + bytes(edges_) + bytes(ref_pairs_) + bytes(one_id_) +
         bytes(one_gen_) + bytes(seed_id_);
}

}  // namespace grammar
}  // namespace agent_infer
