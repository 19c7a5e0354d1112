// The automata of a grammar's inlined rules, as one hash-consed store of acyclic DFA states.
//
// Inlined rules have finite languages, so each is an acyclic DFA, and two acyclic DFA states
// accept the same language exactly when they agree on finality and their (maximally joined)
// byte edges lead to the same states: interning every state by that signature keeps the store
// minimal with no separate minimization. A rule's automaton is computed from its program
// right to left against a continuation state (L(x) then L(cont)), so a fragment that ends in a
// reference to another inlined rule points into that rule's states instead of copying them:
// a counted chain of right-linear rules (a `pattern` under `maxLength`: one rule per position)
// costs its own top states per rule, where lowering each rule as a whole automaton cost the
// whole rest of the chain per rule. Union and concatenation are memoized on their operands.
#include <algorithm>

#include "grammar/automaton.h"
#include "grammar/lower/automata.h"
#include "grammar/lower/fragment_store.h"

namespace agent_infer {
namespace grammar {

namespace {

uint64_t mix(uint64_t h, uint64_t v) { return (h ^ v) * 0x9E3779B97F4A7C15ull; }

uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

// Both halves of the key reach the low bits (a multiply alone leaves them to the low half).
size_t slot_of(uint64_t key, size_t mask) {
  key ^= key >> 33;
  key *= 0xFF51AFD7ED558CCDull;
  key ^= key >> 33;
  return static_cast<size_t>(key) & mask;
}

// The power-of-two table size (at least 64) that holds `expected` entries at most half full.
size_t table_size_for(size_t expected) {
  size_t n = 64;
  while (n < 2 * expected + 2) n *= 2;
  return n;
}

}  // namespace

void PairMemo::clear(size_t expected) {
  const size_t want = table_size_for(expected);
  // A table much bigger than this grammar needs (a big grammar's) starts over at the size wanted
  // rather than being cleared whole for every small grammar after it.
  if (keys_.size() < want || keys_.size() > std::max<size_t>(want, 4096)) {
    keys_.assign(want, 0);
    values_.assign(want, -2);
  } else {
    std::fill(values_.begin(), values_.end(), -2);
  }
  count_ = 0;
}

int32_t PairMemo::find(uint64_t key) const {
  const size_t mask = keys_.size() - 1;
  for (size_t i = slot_of(key, mask); values_[i] != -2; i = (i + 1) & mask) {
    if (keys_[i] == key) return values_[i];
  }
  return -2;
}

void PairMemo::insert(uint64_t key, int32_t value) {
  if (2 * (count_ + 1) > keys_.size()) {
    std::vector<uint64_t> keys(2 * keys_.size(), 0);
    std::vector<int32_t> values(keys.size(), -2);
    const size_t mask = keys.size() - 1;
    for (size_t i = 0; i < keys_.size(); ++i) {
      if (values_[i] == -2) continue;
      size_t j = slot_of(keys_[i], mask);
      while (values[j] != -2) j = (j + 1) & mask;
      keys[j] = keys_[i];
      values[j] = values_[i];
    }
    keys_.swap(keys);
    values_.swap(values);
  }
  const size_t mask = keys_.size() - 1;
  size_t i = slot_of(key, mask);
  while (values_[i] != -2) i = (i + 1) & mask;
  keys_[i] = key;
  values_[i] = value;
  ++count_;
}

void FragmentStore::reset(size_t expected_states, size_t expected_unions) {
  final_.clear();
  begin_.assign(1, 0);
  edges_.clear();
  ref_begin_.assign(1, 0);
  refs_.clear();
  hash_.clear();
  const size_t want = table_size_for(expected_states);
  if (table_.size() < want || table_.size() > std::max<size_t>(want, 4096)) {
    table_.assign(want, 0);  // a big grammar's table: not cleared whole for every small one after
  } else {
    std::fill(table_.begin(), table_.end(), 0);
  }
  unions_.clear(expected_unions);
  concats_.clear();
  depth_ = 0;
  limit_ = 1;
  accept_ = intern(true, nullptr, 0, nullptr, 0);
}

size_t FragmentStore::retained_bytes() const {
  auto bytes = [](const auto& v) { return v.capacity() * sizeof(v[0]); };
  size_t n = bytes(final_) + bytes(begin_) + bytes(edges_) + bytes(ref_begin_) + bytes(refs_) + bytes(hash_) +
             bytes(table_) + bytes(local_) +
             bytes(queue_) + unions_.retained_bytes() + concats_.retained_bytes();
  for (const auto& b : bufs_) n += bytes(b);
  for (const auto& b : ref_bufs_) n += bytes(b);
  return n;
}

ByteEdge* FragmentStore::buffer(size_t depth, size_t need) {
  while (bufs_.size() <= depth) bufs_.emplace_back();
  // Grown, never shrunk or cleared: callers write what they need and pass its length on.
  if (bufs_[depth].size() < need) bufs_[depth].resize(std::max(need, 2 * bufs_[depth].size()));
  return bufs_[depth].data();
}

size_t FragmentStore::compact(std::vector<RefEdge>* refs) {
  size_t m = 0;
  for (const RefEdge& e : *refs) {
    if (e.target >= 0) (*refs)[m++] = e;
  }
  refs->resize(m);
  return m;
}

std::vector<RefEdge>& FragmentStore::ref_buffer(size_t depth) {
  while (ref_bufs_.size() <= depth) ref_bufs_.emplace_back();
  ref_bufs_[depth].clear();
  return ref_bufs_[depth];
}

int32_t FragmentStore::make(bool final, std::vector<ByteEdge>& edges, std::vector<RefEdge>* refs) {
  edges.resize(canonical(edges.data(), edges.size()));
  size_t m = 0;
  if (refs != nullptr) {
    // At most one edge per rule, by ascending rule (as subset construction groups them).
    for (const RefEdge& e : *refs) {
      if (e.target >= 0) (*refs)[m++] = e;
    }
    refs->resize(m);
  }
  return intern(final, edges.data(), edges.size(), m > 0 ? refs->data() : nullptr, m);
}

size_t FragmentStore::canonical(ByteEdge* edges, size_t count) {
  // No dead targets, adjacent ranges with one target joined.
  size_t n = 0;
  for (size_t k = 0; k < count; ++k) {
    const ByteEdge e = edges[k];
    if (e.target < 0) continue;
    if (n > 0 && edges[n - 1].target == e.target && edges[n - 1].hi + 1 == e.lo) {
      edges[n - 1].hi = e.hi;
    } else {
      edges[n++] = e;
    }
  }
  return n;
}

int32_t FragmentStore::intern(bool final, const ByteEdge* edges, size_t n, const RefEdge* refs, size_t m) {
  if (n == 0 && m == 0 && !final) return kDead;
  uint64_t h = mix(0x51ED270B, final ? 1 : 2);
  for (size_t k = 0; k < n; ++k) {
    const ByteEdge& e = edges[k];
    h = mix(h, (static_cast<uint64_t>(e.lo) << 40) ^ (static_cast<uint64_t>(e.hi) << 32) ^
                   static_cast<uint32_t>(e.target));
  }
  for (size_t k = 0; k < m; ++k) {
    const RefEdge& e = refs[k];
    h = mix(h, (static_cast<uint64_t>(static_cast<uint32_t>(e.rule)) << 32) ^ static_cast<uint32_t>(e.target) ^
                   (uint64_t{1} << 63));
  }
  h ^= h >> 31;
  constexpr uint64_t kTag = 0xFFFFFFFF00000000ull;
  size_t mask = table_.size() - 1;
  size_t i = static_cast<size_t>(h) & mask;
  for (; table_[i] != 0; i = (i + 1) & mask) {
    if ((table_[i] ^ h) & kTag) continue;
    const int32_t s = static_cast<int32_t>(static_cast<uint32_t>(table_[i]) - 1);
    if (hash_[s] != h || final_[s] != static_cast<uint8_t>(final) || begin_[s + 1] - begin_[s] != n ||
        ref_begin_[s + 1] - ref_begin_[s] != m) {
      continue;
    }
    bool same = true;
    for (size_t k = 0; k < n && same; ++k) {
      const ByteEdge& a = edges_[begin_[s] + k];
      same = a.lo == edges[k].lo && a.hi == edges[k].hi && a.target == edges[k].target;
    }
    for (size_t k = 0; k < m && same; ++k) {
      const RefEdge& a = refs_[ref_begin_[s] + k];
      same = a.rule == refs[k].rule && a.target == refs[k].target;
    }
    if (same) return s;
  }
  if (static_cast<int64_t>(final_.size()) >= limit_) throw Overflow();
  if (deadline_ != nullptr) deadline_->check();
  const int32_t s = static_cast<int32_t>(final_.size());
  final_.push_back(final ? 1 : 0);
  edges_.insert(edges_.end(), edges, edges + n);
  begin_.push_back(static_cast<uint32_t>(edges_.size()));
  if (m > 0) refs_.insert(refs_.end(), refs, refs + m);
  ref_begin_.push_back(static_cast<uint32_t>(refs_.size()));
  hash_.push_back(h);
  table_[i] = (h & kTag) | (static_cast<uint64_t>(s) + 1);
  if (final_.size() * 2 > table_.size()) {
    std::vector<uint64_t> table(table_.size() * 2, 0);
    mask = table.size() - 1;
    for (size_t x = 0; x < final_.size(); ++x) {
      size_t j = static_cast<size_t>(hash_[x]) & mask;
      while (table[j] != 0) j = (j + 1) & mask;
      table[j] = (hash_[x] & kTag) | (x + 1);
    }
    table_.swap(table);
  }
  return s;
}

int32_t FragmentStore::unite(int32_t a, int32_t b) {
  if (a == b || b == kDead) return a;
  if (a == kDead) return b;
  if (a > b) std::swap(a, b);
  const uint64_t key = pair_key(a, b);
  const int32_t found = unions_.find(key);
  if (found != -2) return found;
  if (++depth_ > kMaxDepth) throw Overflow();
  // A sweep over both sorted, disjoint edge lists; overlaps lead to the union of the targets.
  uint32_t i = begin_[a], j = begin_[b];
  const uint32_t ie = begin_[a + 1], je = begin_[b + 1];
  // Every piece written ends at the end of an edge or just before another edge starts: at most
  // two per edge. Written in place (push_back is an out-of-line call here); the recursion below
  // fills deeper buffers only, so `put` stays valid.
  ByteEdge* const put = buffer(depth_, 2 * static_cast<size_t>(ie - i + je - j));
  size_t n_out = 0;
  int a_lo = i < ie ? edges_[i].lo : 256, b_lo = j < je ? edges_[j].lo : 256;
  while (i < ie || j < je) {
    if (j >= je || (i < ie && a_lo < b_lo)) {
      const ByteEdge e = edges_[i];
      const int hi = j < je ? std::min<int>(e.hi, b_lo - 1) : e.hi;
      put[n_out++] = {static_cast<uint8_t>(a_lo), static_cast<uint8_t>(hi), e.target};
      a_lo = hi + 1;
      if (a_lo > e.hi && ++i < ie) a_lo = edges_[i].lo;
    } else if (i >= ie || b_lo < a_lo) {
      const ByteEdge e = edges_[j];
      const int hi = i < ie ? std::min<int>(e.hi, a_lo - 1) : e.hi;
      put[n_out++] = {static_cast<uint8_t>(b_lo), static_cast<uint8_t>(hi), e.target};
      b_lo = hi + 1;
      if (b_lo > e.hi && ++j < je) b_lo = edges_[j].lo;
    } else {
      const ByteEdge ea = edges_[i], eb = edges_[j];
      const int hi = std::min<int>(ea.hi, eb.hi);
      const int32_t t = unite(ea.target, eb.target);  // may grow edges_: ea, eb are copies
      put[n_out++] = {static_cast<uint8_t>(a_lo), static_cast<uint8_t>(hi), t};
      a_lo = b_lo = hi + 1;
      if (a_lo > ea.hi && ++i < ie) a_lo = edges_[i].lo;
      if (b_lo > eb.hi && ++j < je) b_lo = edges_[j].lo;
    }
    if (i >= ie) a_lo = 256;
    if (j >= je) b_lo = 256;
  }
  std::vector<RefEdge>* rout = nullptr;
  if (ref_begin_[a] < ref_begin_[a + 1] || ref_begin_[b] < ref_begin_[b + 1]) {
    rout = &ref_buffer(depth_);
    uint32_t x = ref_begin_[a], y = ref_begin_[b];
    const uint32_t xe = ref_begin_[a + 1], ye = ref_begin_[b + 1];
    while (x < xe || y < ye) {
      if (y >= ye || (x < xe && refs_[x].rule < refs_[y].rule)) {
        rout->push_back(refs_[x++]);
      } else if (x >= xe || refs_[y].rule < refs_[x].rule) {
        rout->push_back(refs_[y++]);
      } else {
        const RefEdge ra = refs_[x++], rb = refs_[y++];
        const int32_t t = unite(ra.target, rb.target);
        rout->push_back({ra.rule, t});
      }
    }
  }
  const size_t m = rout != nullptr ? compact(rout) : 0;
  const int32_t s = intern(final_[a] || final_[b], put, canonical(put, n_out), m > 0 ? rout->data() : nullptr, m);
  --depth_;
  unions_.insert(key, s);
  return s;
}

int32_t FragmentStore::concat(int32_t s, int32_t cont) {
  if (s == kDead || cont == kDead) return kDead;
  if (cont == accept_) return s;
  const uint64_t key = pair_key(s, cont);
  const int32_t found = concats_.find(key);
  if (found != -2) return found;
  if (++depth_ > kMaxDepth) throw Overflow();
  const size_t n_out = begin_[s + 1] - begin_[s];
  ByteEdge* const put = buffer(depth_, n_out);  // written in place: deeper calls use deeper buffers
  for (uint32_t e = begin_[s]; e < begin_[s + 1]; ++e) {
    const ByteEdge edge = edges_[e];
    const int32_t t = concat(edge.target, cont);  // may grow edges_: `edge` is a copy
    put[e - begin_[s]] = {edge.lo, edge.hi, t};
  }
  std::vector<RefEdge>* rout = nullptr;
  if (ref_begin_[s] < ref_begin_[s + 1]) {
    rout = &ref_buffer(depth_);
    for (uint32_t e = ref_begin_[s]; e < ref_begin_[s + 1]; ++e) {
      const RefEdge edge = refs_[e];
      rout->push_back({edge.rule, concat(edge.target, cont)});
    }
  }
  const size_t m = rout != nullptr ? compact(rout) : 0;
  int32_t r = intern(false, put, canonical(put, n_out), m > 0 ? rout->data() : nullptr, m);
  if (final_[s]) r = unite(r, cont);
  --depth_;
  concats_.insert(key, r);
  return r;
}

int32_t FragmentStore::chain(const std::pair<uint8_t, uint8_t>* ranges, int n, int32_t cont) {
  int32_t s = cont;
  for (int i = n - 1; i >= 0 && s != kDead; --i) {
    const ByteEdge one{ranges[i].first, ranges[i].second, s};
    s = intern(false, &one, 1, nullptr, 0);
  }
  return s;
}

void FragmentStore::flatten(int32_t start, std::vector<uint8_t>* final, std::vector<uint32_t>* begin,
                            std::vector<ByteEdge>* bytes) {
  if (local_.size() < final_.size()) local_.resize(final_.size(), -1);
  queue_.assign(1, start);
  local_[start] = 0;
  final->clear();
  bytes->clear();
  begin->assign(1, 0);
  for (size_t k = 0; k < queue_.size(); ++k) {
    const int32_t s = queue_[k];
    final->push_back(final_[s]);
    for (uint32_t e = begin_[s]; e < begin_[s + 1]; ++e) {
      const int32_t t = edges_[e].target;
      if (local_[t] < 0) {
        local_[t] = static_cast<int32_t>(queue_.size());
        queue_.push_back(t);
      }
      bytes->push_back({edges_[e].lo, edges_[e].hi, local_[t]});
    }
    begin->push_back(static_cast<uint32_t>(bytes->size()));
  }
  for (int32_t s : queue_) local_[s] = -1;  // all -1 between calls
}

}  // namespace grammar
}  // namespace agent_infer

namespace agent_infer {
namespace grammar {

int32_t FragmentStore::reference(int32_t rule, int32_t cont) {
  if (cont == kDead) return kDead;
  const RefEdge one{rule, cont};
  return intern(false, nullptr, 0, &one, 1);
}

int32_t FragmentStore::flatten_into(int32_t start, DfaPool* pool) {
  const int32_t base = static_cast<int32_t>(pool->size());
  if (start == kDead) {
    // The empty language: one state that neither accepts nor moves (trimmed with its rule).
    pool->final.push_back(0);
    pool->byte_begin.push_back(static_cast<uint32_t>(pool->bytes.size()));
    pool->ref_begin.push_back(static_cast<uint32_t>(pool->refs.size()));
    return base;
  }
  if (local_.size() < final_.size()) local_.resize(final_.size(), -1);
  // Number the reachable states first, so the pool grows once per array and the edges are
  // written in place (a push_back per edge is an out-of-line call here).
  queue_.assign(1, start);
  local_[start] = 0;
  size_t n_bytes = 0, n_refs = 0;
  auto visit = [&](int32_t t) {
    if (local_[t] < 0) {
      local_[t] = static_cast<int32_t>(queue_.size());
      queue_.push_back(t);
    }
  };
  for (size_t k = 0; k < queue_.size(); ++k) {
    const int32_t s = queue_[k];
    n_bytes += begin_[s + 1] - begin_[s];
    n_refs += ref_begin_[s + 1] - ref_begin_[s];
    for (uint32_t e = begin_[s]; e < begin_[s + 1]; ++e) visit(edges_[e].target);
    for (uint32_t e = ref_begin_[s]; e < ref_begin_[s + 1]; ++e) visit(refs_[e].target);
  }
  const size_t n = queue_.size(), s0 = pool->final.size(), b0 = pool->bytes.size(), r0 = pool->refs.size();
  pool->final.resize(s0 + n);
  pool->byte_begin.resize(s0 + n + 1);
  pool->ref_begin.resize(s0 + n + 1);
  pool->bytes.resize(b0 + n_bytes);
  pool->refs.resize(r0 + n_refs);
  uint8_t* final = pool->final.data() + s0;
  uint32_t* byte_begin = pool->byte_begin.data() + s0 + 1;
  uint32_t* ref_begin = pool->ref_begin.data() + s0 + 1;
  ByteEdge* bytes = pool->bytes.data();
  RefEdge* refs = pool->refs.data();
  uint32_t nb = static_cast<uint32_t>(b0), nr = static_cast<uint32_t>(r0);
  for (size_t k = 0; k < n; ++k) {
    const int32_t s = queue_[k];
    final[k] = final_[s];
    for (uint32_t e = begin_[s]; e < begin_[s + 1]; ++e) {
      bytes[nb++] = {edges_[e].lo, edges_[e].hi, base + local_[edges_[e].target]};
    }
    byte_begin[k] = nb;
    for (uint32_t e = ref_begin_[s]; e < ref_begin_[s + 1]; ++e) {
      refs[nr++] = {refs_[e].rule, base + local_[refs_[e].target]};
    }
    ref_begin[k] = nr;
  }
  for (int32_t s : queue_) local_[s] = -1;
  return base;
}

}  // namespace grammar
}  // namespace agent_infer
