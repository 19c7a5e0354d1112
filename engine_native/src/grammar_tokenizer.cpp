// Tokenizer-level structures (the sorted token list that acts as a trie) and the adaptive
// per-state token classification: for an automaton state, every token is accepted (consumed
// inside the rule's automaton), rejected (dies before the rule could hand over control), or
// uncertain (the rule may complete or call another rule mid-token, so the context decides).
#include <algorithm>
#include <cstring>

#include "grammar.h"
#include "grammar_profile.h"

namespace agent_infer {
namespace grammar {

TokenizerInfo::TokenizerInfo(std::vector<std::string> token_bytes, int32_t vocab_size_, std::vector<int32_t> eos)
    : vocab_size(vocab_size_), eos_ids(std::move(eos)), tokens(std::move(token_bytes)) {
  if (vocab_size < static_cast<int32_t>(tokens.size())) vocab_size = static_cast<int32_t>(tokens.size());
  tokens.resize(vocab_size);
  words = (vocab_size + 31) / 32;
  for (int32_t e : eos_ids) {
    if (e < 0 || e >= vocab_size) throw std::invalid_argument("EOS token id outside the vocabulary");
    tokens[e].clear();
  }
  for (int32_t i = 0; i < vocab_size; ++i) {
    if (!tokens[i].empty()) {
      sorted.push_back(i);
      max_token_len = std::max(max_token_len, tokens[i].size());
    }
  }
  if (max_token_len > 65535) throw std::invalid_argument("token longer than 65535 bytes");
  std::sort(sorted.begin(), sorted.end(), [&](int32_t a, int32_t b) { return tokens[a] < tokens[b]; });
  sorted_off.assign(1, 0);
  for (int32_t id : sorted) {
    sorted_data += tokens[id];
    sorted_off.push_back(static_cast<uint32_t>(sorted_data.size()));
  }
  // first_byte_end[b]: end of the run of tokens starting with byte b (the walks' commonest skip).
  first_byte_end.assign(256, 0);
  {
    size_t j = 0;
    for (int b = 0; b < 256; ++b) {
      while (j < sorted.size() && static_cast<uint8_t>(tokens[sorted[j]][0]) <= b) ++j;
      first_byte_end[static_cast<size_t>(b)] = static_cast<uint32_t>(j);
    }
  }
  for (size_t i = 0; i < sorted.size(); ++i) {
    const size_t len = tokens[sorted[i]].size();
    if (len > kShortTokenLen) long_sorted.push_back(static_cast<int32_t>(i));
    for (size_t k = 0; k < kTwinLens.size(); ++k) {
      if (len > kTwinLens[k]) longer_sorted[k].push_back(static_cast<int32_t>(i));
    }
  }
  lcp.assign(sorted.size(), 0);
  for (size_t i = 1; i < sorted.size(); ++i) {
    const std::string& a = tokens[sorted[i - 1]];
    const std::string& b = tokens[sorted[i]];
    size_t n = std::min(a.size(), b.size()), k = 0;
    while (k < n && a[k] == b[k]) ++k;
    lcp[i] = static_cast<uint16_t>(k);
  }
}

void merge_uncertain(StateMask& out, const StateMask* base) {
  if (!base || base->uncertain.empty()) return;
  std::vector<int32_t> merged(out.uncertain.size() + base->uncertain.size());
  std::merge(out.uncertain.begin(), out.uncertain.end(), base->uncertain.begin(), base->uncertain.end(),
             merged.begin());
  out.uncertain.swap(merged);
}

void finish_mask(StateMask& out, std::vector<uint32_t>&& bits, size_t n_accepted) {
  if (n_accepted > bits.size()) {
    out.accepted_bits = std::move(bits);  // dense: OR word-wise at fill time
    return;
  }
  out.accepted_ids.reserve(n_accepted);
  for (size_t w = 0; w < bits.size(); ++w) {
    for (uint32_t v = bits[w]; v != 0; v &= v - 1) {
      out.accepted_ids.push_back(static_cast<int32_t>(w * 32 + static_cast<size_t>(__builtin_ctz(v))));
    }
  }
}

AcceptedSet::AcceptedSet(size_t words, const StateMask* base, size_t live_tokens)
    : list_(base == nullptr && live_tokens < words), words_(words) {
  if (list_) return;
  bits_.assign(words, 0);
  n_ = seed_bits(base, bits_);
}

void AcceptedSet::finish(StateMask& out) {
  if (!list_) {
    finish_mask(out, std::move(bits_), n_);
    return;
  }
  // Listed ascending, as finish_mask lists them: a few ids are sorted, more are put through a
  // bitset (sorting thousands cost more than the bitset's zeroing and scan).
  constexpr size_t kMaxSortedIds = 64;
  if (ids_.size() > kMaxSortedIds) {
    bits_.assign(words_, 0);
    for (int32_t id : ids_) bits_[static_cast<size_t>(id) >> 5] |= 1u << (id & 31);
    finish_mask(out, std::move(bits_), n_);
    return;
  }
  std::sort(ids_.begin(), ids_.end());
  out.accepted_ids = std::move(ids_);
  out.accepted_ids.shrink_to_fit();
}

size_t CompiledGrammar::live_tokens(const std::vector<WalkRange>& ranges) const {
  size_t n = 0;
  for (const WalkRange& r : ranges) {
    if (r.depth > 0) {
      n += r.end - r.begin;
      continue;
    }
    const State& st = states[static_cast<size_t>(r.state)];
    for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
      const ByteEdge& be = byte_edges[e];
      const size_t lo = std::max<size_t>(r.begin, be.lo == 0 ? 0 : tok->first_byte_end[be.lo - 1u]);
      const size_t hi = std::min<size_t>(r.end, tok->first_byte_end[be.hi]);
      if (hi > lo) n += hi - lo;
    }
  }
  return n;
}

size_t TokenizerInfo::run_end(size_t i, size_t plen) const {
  const size_t n = sorted.size();
  if (plen == 1) return first_byte_end[static_cast<uint8_t>(*sorted_ptr(i))];
  const char* p = sorted_ptr(i);
  auto shares = [&](size_t j) { return sorted_len(j) >= plen && std::memcmp(sorted_ptr(j), p, plen) == 0; };
  // Gallop before bisecting: most runs are short, so this costs O(log run) instead of O(log n).
  size_t good = i, step = 1, hi = n;  // tokens [i, good] share the prefix; hi does not (or is n)
  for (;;) {
    const size_t probe = good + step;
    if (probe >= n || !shares(probe)) {
      hi = std::min(probe, n);
      break;
    }
    good = probe;
    step *= 2;
  }
  size_t lo = good + 1;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (shares(mid)) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

size_t TokenizerInfo::skip_dead(size_t i, size_t d, size_t from, size_t limit,
                                const std::array<uint32_t, 8>& stop) const {
  if (from >= limit) return limit;
  const char* p = sorted_ptr(i);
  // `from` in i's run: it has more than d bytes then (the run's d-byte token sorts first).
  if (sorted_len(from) <= d || (d > 0 && std::memcmp(sorted_ptr(from), p, d) != 0)) return from;
  auto byte_at = [&](size_t k) { return static_cast<uint8_t>(sorted_ptr(k)[d]); };
  unsigned c = byte_at(from);
  if ((stop[c >> 5] >> (c & 31)) & 1u) return from;
  // The next byte of `stop` above c, if any: the tokens before its first occurrence are passed.
  unsigned next = 256;
  for (unsigned w = (c + 1) >> 5; w < 8 && next == 256; ++w) {
    uint32_t bits = stop[w];
    if (w == (c + 1) >> 5) bits &= (c + 1) % 32 == 0 ? ~0u : ~((1u << ((c + 1) & 31)) - 1);
    if (bits != 0) next = w * 32 + static_cast<unsigned>(__builtin_ctz(bits));
  }
  const size_t pend = std::min(d == 0 ? sorted.size() : run_end(i, d), limit);
  if (next == 256) return pend;
  size_t lo = from + 1, hi = pend;  // first position in [lo, hi) whose byte d is >= next
  while (lo < hi) {
    const size_t mid = lo + (hi - lo) / 2;
    if (byte_at(mid) < next) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

std::shared_ptr<const StateMask> TokenizerInfo::cache_get(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = cache_.find(key);
  return it == cache_.end() ? nullptr : it->second;
}

std::shared_ptr<const StateMask> TokenizerInfo::cache_put(const std::string& key,
                                                          std::shared_ptr<const StateMask> mask) {
  std::lock_guard<std::mutex> lock(mu_);
  auto res = cache_.emplace(key, mask);
  if (res.second) cache_bytes_ += mask->bytes() + key.size();
  return res.first->second;
}

void TokenizerInfo::cache_replace(const std::string& key, std::shared_ptr<const StateMask> mask) {
  std::lock_guard<std::mutex> lock(mu_);
  auto res = cache_.emplace(key, mask);
  if (res.second) {
    cache_bytes_ += mask->bytes() + key.size();
    return;
  }
  cache_bytes_ = cache_bytes_ - res.first->second->bytes() + mask->bytes();
  res.first->second = std::move(mask);
}

size_t TokenizerInfo::cache_bytes() {
  std::lock_guard<std::mutex> lock(mu_);
  return cache_bytes_;
}

size_t TokenizerInfo::cache_entries() {
  std::lock_guard<std::mutex> lock(mu_);
  return cache_.size();
}

// 128-bit digest of a byte string (two independent 64-bit mixes): keys are stored per cached
// mask, so they stay short however large the structure they name.
std::string digest(const std::string& data, char kind) {
  uint64_t h1 = 1469598103934665603ull ^ data.size(), h2 = 0x9E3779B97F4A7C15ull;
  size_t i = 0;
  for (; i + 8 <= data.size(); i += 8) {  // word at a time: component serializations reach megabytes
    uint64_t w;
    std::memcpy(&w, data.data() + i, 8);
    h1 = (h1 ^ w) * 0x100000001b3ull;
    h1 ^= h1 >> 31;
    h2 = (h2 + w + 1) * 0xff51afd7ed558ccdull;
    h2 ^= h2 >> 29;
  }
  for (; i < data.size(); ++i) {
    const uint64_t ch = static_cast<unsigned char>(data[i]);
    h1 = (h1 ^ ch) * 0x100000001b3ull;
    h2 = (h2 + ch + 1) * 0xff51afd7ed558ccdull;
    h2 ^= h2 >> 29;
  }
  std::string key(1, kind);
  key.append(reinterpret_cast<const char*>(&h1), sizeof(h1));
  key.append(reinterpret_cast<const char*>(&h2), sizeof(h2));
  return key;
}

size_t seed_bits(const StateMask* base, std::vector<uint32_t>& bits) {
  if (!base) return 0;
  size_t n = base->accepted_ids.size();
  if (!base->accepted_bits.empty()) {
    std::copy(base->accepted_bits.begin(), base->accepted_bits.end(), bits.begin());
    n = 0;
    for (uint32_t w : bits) n += static_cast<size_t>(__builtin_popcount(w));
  }
  for (int32_t id : base->accepted_ids) bits[static_cast<size_t>(id) >> 5] |= 1u << (id & 31);
  return n;
}

size_t seed_bits_except(const StateMask* base, std::vector<uint32_t>& bits, const std::vector<int32_t>& positions,
                        const std::vector<int32_t>& sorted) {
  size_t n = seed_bits(base, bits);
  for (int32_t j : positions) {
    const int32_t id = sorted[static_cast<size_t>(j)];
    uint32_t& w = bits[static_cast<size_t>(id) >> 5];
    const uint32_t bit = 1u << (id & 31);
    if (w & bit) {
      w &= ~bit;
      --n;
    }
  }
  return n;
}

namespace {
// Per-thread state -> row index scratch, reset entry by entry after each walk: clearing a vector
// of every grammar state per first-seen state cost ~0.1 ms on grammars with 10^5 states.
struct RowIndex {
  std::vector<int32_t> row_of;
  std::vector<int32_t> touched;
  explicit RowIndex(size_t n) : row_of(tls_rows()) {
    if (row_of.size() < n) row_of.resize(n, -1);
  }
  ~RowIndex() {
    for (int32_t q : touched) row_of[static_cast<size_t>(q)] = -1;
    tls_rows().swap(row_of);
  }
  static std::vector<int32_t>& tls_rows() {
    thread_local std::vector<int32_t> rows;
    return rows;
  }
};
}  // namespace

std::shared_ptr<const StateMask> CompiledGrammar::compute_mask(const std::vector<WalkRange>& ranges,
                                                               const StateMask* base) const {
  std::shared_ptr<const StateMask> split;
  if (split_walk(ranges, base, false, &split)) return split;
  return compute_mask_part(ranges, base, false);
}

std::shared_ptr<const StateMask> CompiledGrammar::compute_mask_part(const std::vector<WalkRange>& ranges,
                                                                    const StateMask* base, bool resume) const {
  const TokenizerInfo& t = *tok;
  auto out = std::make_shared<StateMask>();
  AcceptedSet accepted(static_cast<size_t>(t.words), base, live_tokens(ranges));
  // Dense 256-entry transition rows for the states this walk meets (the walk is the hot loop).
  RowIndex index(states.size());
  std::vector<int32_t>& row_of = index.row_of;
  std::vector<int32_t> rows;
  std::vector<const ByteSet*> row_escape;
  // Bytes after which a token is not simply rejected here: live edges and the escape set.
  std::vector<ByteSet> row_stop;
  std::vector<ByteSet> row_live;  // the bytes it has edges for
  auto row = [&](int32_t q) -> int32_t {
    if (row_of[q] >= 0) return row_of[q];
    int32_t r = static_cast<int32_t>(row_escape.size());
    row_of[q] = r;
    index.touched.push_back(q);
    rows.resize(rows.size() + 256, -1);
    row_live.push_back(ByteSet{});
    ByteSet& live = row_live.back();
    const State& st = states[q];
    for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
      const ByteEdge& be = byte_edges[e];
      for (int b = be.lo; b <= be.hi; ++b) {
        rows[static_cast<size_t>(r) * 256 + b] = be.target;
        live[static_cast<size_t>(b) >> 5] |= 1u << (b & 31);
      }
    }
    row_stop.push_back(live);
    for (size_t w = 0; w < 8; ++w) row_stop.back()[w] |= escape[q][w];
    row_escape.push_back(&escape[q]);
    return r;
  };
  // stack[d]: row of the automaton state after d bytes of the current token. flag[d]: at some
  // position j in [1, d) control could have left the rule to read byte j elsewhere (call a rule
  // or finish it, with byte j in the escape set); a token dying after such a point is only
  // "uncertain". Both depend on the first d bytes alone, so they are shared along the trie.
  std::vector<int32_t> stack(t.max_token_len + 1);
  std::vector<uint8_t> flag(t.max_token_len + 1);
  for (const WalkRange& range : ranges) {
    const size_t depth0 = range.depth;
    stack[depth0] = row(range.state);
    flag[depth0] = range.flag;
    size_t valid = depth0;  // stack entries valid for the previous token
    for (size_t i = range.begin; i < range.end; ++i) {
      size_t l = i == range.begin ? depth0 : t.lcp[i];
      long dead_at = -1;  // the token died reading byte dead_at
      const uint8_t* tokb = reinterpret_cast<const uint8_t*>(t.sorted_ptr(i));
      const size_t len = t.sorted_len(i);
      size_t d = std::min(l, valid);
      while (d < len) {
        int32_t nx = rows[static_cast<size_t>(stack[d]) * 256 + tokb[d]];
        if (nx < 0) {
          dead_at = static_cast<long>(d);
          break;
        }
        stack[d + 1] = row(nx);
        flag[d + 1] = flag[d] | static_cast<uint8_t>(d > 0 && has(*row_escape[stack[d]], tokb[d]));
        ++d;
      }
      valid = d;
      if (dead_at < 0) {
        accepted.add(t.sorted[i]);
        continue;
      }
      // Every token sharing the dead prefix shares this token's fate: classify the run at once.
      size_t end = t.run_end(i, static_cast<size_t>(dead_at) + 1);
      const bool continued = resume && i == range.begin && &range == &ranges.front() && t.lcp[i] > dead_at;
      if (!continued && (flag[d] || (d > 0 && has(*row_escape[stack[d]], tokb[d])))) {
        for (size_t j = i; j < end; ++j) out->uncertain.push_back(static_cast<int32_t>(j));
      }
      // The siblings that die here too, rejected, are passed over in one search (at byte 0
      // every death is a rejection).
      if (d == 0) {
        end = t.skip_dead(i, 0, end, range.end, row_live[static_cast<size_t>(stack[0])]);
      } else if (!flag[d]) {
        end = t.skip_dead(i, d, end, range.end, row_stop[static_cast<size_t>(stack[d])]);
      }
      i = end - 1;
    }
  }
  merge_uncertain(*out, base);
  accepted.finish(*out);
  out->uncertain.shrink_to_fit();
  return out;
}

namespace {
bool find_region(const CompiledGrammar& g, int32_t s, std::string* key, std::vector<int32_t>* exits);
}  // namespace

bool CompiledGrammar::region_of(int32_t s, std::string* key, std::vector<int32_t>* exits) const {
  // Memoized: the pieces of a region state ask for the regions of all its neighbours.
  {
    std::lock_guard<std::mutex> lock(region_mu_);
    auto it = region_memo_.find(s);
    if (it != region_memo_.end()) {
      *key = it->second.key;
      *exits = it->second.exits;
      return it->second.found;
    }
  }
  RegionMemo memo;
  memo.found = find_region(*this, s, &memo.key, &memo.exits);
  // Kept as digests (the serialization of a region reaches tens of KB).
  if (memo.found) {
    memo.digest_q = digest(memo.key, 'Q');
    memo.key = digest(memo.key, 'R');
  } else {
    memo.key.clear();
  }
  *key = memo.key;
  *exits = memo.exits;
  const bool found = memo.found;
  std::lock_guard<std::mutex> lock(region_mu_);
  region_memo_.emplace(s, std::move(memo));
  return found;
}

bool CompiledGrammar::region_digest_q(int32_t s, std::string* qkey, std::vector<int32_t>* exits) const {
  std::string raw;
  if (!region_of(s, &raw, exits)) return false;
  std::lock_guard<std::mutex> lock(region_mu_);
  *qkey = region_memo_.at(s).digest_q;
  return true;
}

namespace {
bool find_region(const CompiledGrammar& g, int32_t s, std::string* key, std::vector<int32_t>* exits) {
  const auto& states = g.states;
  const auto& byte_edges = g.byte_edges;
  using ByteSet = CompiledGrammar::ByteSet;
  // Bounded so that the search stays cheap next to the walk it replaces.
  constexpr size_t kMaxRegion = 512;
  auto inside = [&](int32_t q) { return states[q].ref_end == states[q].ref_begin; };
  if (!inside(s)) return false;
  // The region is s's strongly connected component among the states without references: what
  // the loop can return to. States it only leads to (the closing quote of a string and the
  // final state after it) are exits, walked per state, so the region (and its cached walk) is
  // the same for every string of one syntax whatever follows the string.
  // Per-thread state -> index scratch (reset entry by entry): grammars have up to 10^5 states.
  thread_local std::vector<int32_t> idx;
  if (idx.size() < states.size()) idx.resize(states.size(), -1);
  std::vector<int32_t> order{s};
  idx[static_cast<size_t>(s)] = 0;
  struct Reset {
    std::vector<int32_t>& order;
    ~Reset() {
      for (int32_t q : order) idx[static_cast<size_t>(q)] = -1;
    }
  } reset{order};
  for (size_t i = 0; i < order.size(); ++i) {
    const State& st = states[order[i]];
    for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
      const int32_t q = byte_edges[e].target;
      if (!inside(q) || idx[static_cast<size_t>(q)] >= 0) continue;
      if (order.size() >= kMaxRegion) return false;
      idx[static_cast<size_t>(q)] = static_cast<int32_t>(order.size());
      order.push_back(q);
    }
  }
  // Predecessor lists (CSR) within the forward set, then backward reachability to s.
  const size_t n = order.size();
  std::vector<int32_t> pstart(n + 1, 0), pred;
  for (size_t i = 0; i < n; ++i) {
    const State& st = states[order[i]];
    for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
      const int32_t k = inside(byte_edges[e].target) ? idx[static_cast<size_t>(byte_edges[e].target)] : -1;
      if (k >= 0) ++pstart[static_cast<size_t>(k) + 1];
    }
  }
  for (size_t i = 0; i < n; ++i) pstart[i + 1] += pstart[i];
  pred.resize(static_cast<size_t>(pstart[n]));
  {
    std::vector<int32_t> fill(pstart.begin(), pstart.end() - 1);
    for (size_t i = 0; i < n; ++i) {
      const State& st = states[order[i]];
      for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
        const int32_t k = inside(byte_edges[e].target) ? idx[static_cast<size_t>(byte_edges[e].target)] : -1;
        if (k >= 0) pred[static_cast<size_t>(fill[static_cast<size_t>(k)]++)] = static_cast<int32_t>(i);
      }
    }
  }
  std::vector<uint8_t> back(n, 0);  // can reach s
  bool cyclic = false;
  {
    std::vector<int32_t> work{0};
    while (!work.empty()) {
      const int32_t k = work.back();
      work.pop_back();
      for (int32_t j = pstart[static_cast<size_t>(k)]; j < pstart[static_cast<size_t>(k) + 1]; ++j) {
        const int32_t p = pred[static_cast<size_t>(j)];
        cyclic |= p == 0;
        if (!back[static_cast<size_t>(p)]) {
          back[static_cast<size_t>(p)] = 1;
          work.push_back(p);
        }
      }
    }
  }
  if (!cyclic) return false;
  // Serialize the region in discovery order from s; num[k]: region number of forward index k
  // (-1 unseen), exit_num: exit number of a target outside the region.
  std::vector<int32_t> num(n, -1), members{0};
  num[0] = 0;
  std::unordered_map<int32_t, int32_t> exit_ids;
  bool any_final = false;
  key->assign(1, 'R');
  key->reserve(64 * n);
  auto put = [&](int32_t v) { key->append(reinterpret_cast<const char*>(&v), sizeof(v)); };
  for (size_t i = 0; i < members.size(); ++i) {
    const State& st = states[order[static_cast<size_t>(members[i])]];
    any_final |= st.final;
    put(st.final ? 1 : 0);
    put(static_cast<int32_t>(st.byte_end - st.byte_begin));
    for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
      const ByteEdge& be = byte_edges[e];
      put((be.lo << 8) | be.hi);
      const int32_t k = inside(be.target) ? idx[static_cast<size_t>(be.target)] : -1;
      if (k >= 0 && back[static_cast<size_t>(k)]) {
        if (num[static_cast<size_t>(k)] < 0) {
          num[static_cast<size_t>(k)] = static_cast<int32_t>(members.size());
          members.push_back(k);
        }
        put(num[static_cast<size_t>(k)]);
      } else {
        auto it = exit_ids.find(be.target);
        if (it == exit_ids.end()) {
          it = exit_ids.emplace(be.target, static_cast<int32_t>(exits->size())).first;
          exits->push_back(be.target);
        }
        put(-1 - it->second);
      }
    }
  }
  // A final region state lets control leave the rule with any byte of its follow set (both walks
  // read exactly that as its escape set, since region states call nothing).
  if (any_final) key->append(reinterpret_cast<const char*>(g.follow[states[s].rule].data()), sizeof(ByteSet));
  return true;
}
}  // namespace

// Walks every token through a loop region alone: tokens that stay inside are accepted, tokens
// that die inside are rejected or uncertain exactly as in the full walks (region states call
// nothing, so their only escape is finishing the rule: the follow set at final states), and
// each run of tokens sharing the prefix that leaves the region is recorded as an exit. The
// result depends on the region's shape (and follow set) only, so every string-content state of
// every rule with the same string syntax shares it; each such state then walks just its exits.
std::shared_ptr<const StateMask> CompiledGrammar::compute_region(int32_t s) const {
  std::shared_ptr<const StateMask> split;
  if (split_region(s, &split)) return split;
  return compute_region_part(s, 0, tok->sorted.size(), false);
}

std::shared_ptr<const StateMask> CompiledGrammar::compute_region_part(int32_t s, size_t begin, size_t stop,
                                                                      bool resume) const {
  const TokenizerInfo& t = *tok;
  auto out = std::make_shared<StateMask>();
  std::vector<uint32_t> bits(static_cast<size_t>(t.words), 0);
  size_t n_accepted = 0;
  std::string unused;
  std::vector<int32_t> exit_states;
  region_of(s, &unused, &exit_states);
  std::unordered_map<int32_t, int32_t> exit_of;
  for (size_t k = 0; k < exit_states.size(); ++k) exit_of[exit_states[k]] = static_cast<int32_t>(k);
  // Rows over region states only; an exit edge is stored as -2 - (exit number).
  std::unordered_map<int32_t, int32_t> row_of;
  std::vector<int32_t> rows;
  std::vector<int32_t> pending;
  auto row = [&](int32_t q) -> int32_t {
    auto it = row_of.find(q);
    if (it != row_of.end()) return it->second;
    const int32_t r = static_cast<int32_t>(row_of.size());
    row_of.emplace(q, r);
    rows.resize(rows.size() + 256, -1);
    const State& st = states[q];
    for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
      const ByteEdge& be = byte_edges[e];
      auto ex = exit_of.find(be.target);
      for (int b = be.lo; b <= be.hi; ++b) {
        rows[static_cast<size_t>(r) * 256 + b] = ex == exit_of.end() ? be.target : -2 - ex->second;
      }
    }
    return r;
  };
  // Resolve every region state to its row up front so that the hot loop reads rows only.
  std::vector<int32_t> state_row;
  {
    std::vector<int32_t> work{s};
    row(s);
    while (!work.empty()) {
      int32_t q = work.back();
      work.pop_back();
      const int32_t r = row_of[q];
      for (int b = 0; b < 256; ++b) {
        const int32_t nx = rows[static_cast<size_t>(r) * 256 + b];
        if (nx >= 0 && row_of.find(nx) == row_of.end()) {
          row(nx);
          work.push_back(nx);
        }
      }
    }
    for (size_t k = 0; k < rows.size(); ++k) {
      if (rows[k] >= 0) rows[k] = row_of[rows[k]];  // state -> row
    }
  }
  std::vector<uint8_t> row_final(row_of.size());
  for (const auto& kv : row_of) row_final[static_cast<size_t>(kv.second)] = states[kv.first].final ? 1 : 0;
  const ByteSet& fol = follow[states[s].rule];
  // escapes(d, b): after d >= 1 bytes the rule may finish and byte b may follow it.
  auto escapes = [&](size_t d, int32_t r, uint8_t b) { return d > 0 && row_final[r] && has(fol, b); };
  std::vector<int32_t> stack(t.max_token_len + 1);
  std::vector<uint8_t> flag(t.max_token_len + 1, 0);
  stack[0] = row_of[s];
  size_t valid = 0;
  for (size_t i = begin; i < stop; ++i) {
    const uint8_t* tokb = reinterpret_cast<const uint8_t*>(t.sorted_ptr(i));
    const size_t len = t.sorted_len(i);
    size_t d = std::min<size_t>(i == begin ? 0 : t.lcp[i], valid);
    int32_t nx = 0;
    while (d < len) {
      nx = rows[static_cast<size_t>(stack[d]) * 256 + tokb[d]];
      if (nx < 0) break;
      flag[d + 1] = flag[d] | static_cast<uint8_t>(escapes(d, stack[d], tokb[d]));
      stack[d + 1] = nx;
      ++d;
    }
    valid = d;
    if (d == len) {
      const int32_t id = t.sorted[i];
      bits[id >> 5] |= 1u << (id & 31);
      ++n_accepted;
      continue;
    }
    // The run of tokens sharing the first d + 1 bytes dies (nx == -1) or exits here together.
    const size_t end = t.run_end(i, d + 1);
    const bool escaped = flag[d] || escapes(d, stack[d], tokb[d]);
    // A part resuming inside a run leaves it to the previous part, which classified it.
    const bool continued = resume && i == begin && t.lcp[i] > d;
    if (!continued && nx <= -2) {
      out->exits.push_back({static_cast<int32_t>(i), static_cast<int32_t>(end), static_cast<int32_t>(d + 1), -2 - nx,
                            escaped ? 1 : 0});
    } else if (!continued && escaped) {
      for (size_t j = i; j < end; ++j) out->uncertain.push_back(static_cast<int32_t>(j));
    }
    i = end - 1;
  }
  finish_mask(*out, std::move(bits), n_accepted);
  out->exits.shrink_to_fit();
  return out;
}

bool CompiledGrammar::dense_start(int32_t s) const {
  constexpr size_t kMinDense = 4096;
  size_t live = 0;
  const State& st = states[s];
  for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
    const ByteEdge& be = byte_edges[e];
    live += tok->first_byte_end[be.hi] - (be.lo == 0 ? 0 : tok->first_byte_end[be.lo - 1u]);
  }
  return live >= kMinDense;
}

// The pushdown walk of a dense state refines the plain walk: a token the plain walk accepts is
// consumed inside the rule, which the pushdown walk follows too (accepted); one it rejects dies
// before control could leave the rule, where the pushdown walk has no other configuration
// (rejected). Only the plain walk's uncertain tokens need the pushdown walk, and they come in
// runs that share the prefix where the rule could be left; the plain walk's rows cost less per
// byte than the pushdown walk's configuration sets, so the dense part of the vocabulary is
// cheaper there.
std::shared_ptr<const StateMask> CompiledGrammar::refine_with_calls(int32_t s) const {
  std::shared_ptr<const StateMask> plain = compute_mask({{0, tok->sorted.size(), 0, s, 0}}, nullptr);
  if (plain->uncertain.empty()) return plain;
  std::vector<WalkRange> ranges;
  for (size_t i = 0; i < plain->uncertain.size();) {
    size_t j = i + 1;
    while (j < plain->uncertain.size() && plain->uncertain[j] == plain->uncertain[j - 1] + 1) ++j;
    ranges.push_back({static_cast<size_t>(plain->uncertain[i]), static_cast<size_t>(plain->uncertain[j - 1]) + 1, 0, s, 0});
    i = j;
  }
  StateMask accepted;
  accepted.accepted_bits = plain->accepted_bits;
  accepted.accepted_ids = plain->accepted_ids;
  std::shared_ptr<const StateMask> refined = compute_mask_with_calls(ranges, &accepted);
  return refined ? refined : plain;  // a pushdown walk that gives up leaves the coarser answer
}

const StateMask& CompiledGrammar::mask_for(int32_t s) const {
  const StateMask* p = masks_[s].load(std::memory_order_acquire);
  if (p) return *p;
  const bool calls = calls_within_reach(s);
  // The shared cache pays off across grammars; within one grammar a state's key is its own.
  // A pushdown key is the Merkle digest of the whole rule call graph below the state's rule:
  // milliseconds on a large schema the first time (the root state of the first mask paid for
  // the whole grammar). A plain key serializes the state's rule: half a millisecond for a long
  // counted chain (a `maxLength` of 1 024). States whose key would cost that much are
  // classified for this grammar alone, until their key exists anyway.
  const bool keyed = calls ? pushdown_keys_ready(states[s].rule) : plain_key_cheap(states[s].rule);
  std::string key;
  std::shared_ptr<const StateMask> m;
  if (keyed) {
    profile::Scope scope(profile::kStateKey);
    key = structure_key(s);
    m = tok->cache_get(key);
  }
  if (!m) {
    // A state inside a loop region reuses the region's shared walk and classifies only the
    // tokens that leave the region; any other state walks every token.
    std::string region_key;
    std::vector<int32_t> exit_states;
    std::shared_ptr<const StateMask> region;
    if (region_of(s, &region_key, &exit_states)) {
      region_key = digest(region_key, 'R');
      region = tok->cache_get(region_key);
      if (!region) {
        // A dense region's walk from its first bytes' targets (shared by its neighbours'),
        // else the region walk itself.
        {
          profile::Scope scope(profile::kPieces);
          region = region_by_first_byte(s, exit_states);
        }
        profile::Scope scope(profile::kRegionWalk);
        region = tok->cache_put(region_key, region ? region : compute_region(s));
      }
    }
    std::vector<WalkRange> ranges;
    if (region) {
      for (const RegionExit& e : region->exits) {
        ranges.push_back({static_cast<size_t>(e.begin), static_cast<size_t>(e.end), static_cast<size_t>(e.depth),
                          exit_states[static_cast<size_t>(e.exit)], static_cast<uint8_t>(e.flag)});
      }
    } else {
      ranges.push_back({0, tok->sorted.size(), 0, s, 0});
    }
    // A dense state outside a loop region reuses the short-token mask of a state alike within
    // a short token's reach (counted repeats), or assembles its mask from cached first-byte pieces.
    std::shared_ptr<const StateMask> fresh;
    // A dense state may repeat the neighbourhood of an earlier one (grammar_twin.cpp): checked
    // first, as it needs no key.
    const bool twin_kind = !region && dense_start(s);
    bool from_twin = false;
    if (twin_kind) {
      profile::Scope scope(profile::kTwin);
      bool whole = false;
      fresh = compute_from_twin(s, &whole);
      from_twin = fresh != nullptr;
    }
    if (!fresh && !region) {
      profile::Scope scope(profile::kShortFill);
      fresh = compute_from_short(s, calls);
    }
    const bool from_short = fresh != nullptr && !from_twin;
    bool from_pieces = false;
    if (!fresh && !region) {
      profile::Scope scope(profile::kPieces);
      fresh = compute_by_first_byte(s);
      from_pieces = fresh != nullptr;
    }
    const profile::Kind walk_kind =
        region ? profile::kRegionExits : (calls ? profile::kFullCalls : profile::kFullPlain);
    if (!fresh && calls && !region && dense_start(s)) {
      profile::Scope scope(walk_kind);
      fresh = refine_with_calls(s);
    } else if (!fresh && calls) {
      profile::Scope scope(walk_kind);
      fresh = compute_mask_with_calls(ranges, region.get());
    }
    if (!fresh) {
      profile::Scope scope(region ? profile::kRegionExits : profile::kFullPlain);
      fresh = compute_mask(ranges, region.get());
    }
    // Only a walk's result is worth a short-token entry: pieces and twins are cheap already.
    if (!region && !from_short && !from_twin && !from_pieces) {
      profile::Scope scope(profile::kPutShort);
      put_short(s, *fresh);
    }
    m = keyed ? tok->cache_put(key, fresh) : fresh;
    if (twin_kind && !from_twin) remember_twin(s, m);
  }
  std::lock_guard<std::mutex> lock(mu_);
  p = masks_[s].load(std::memory_order_acquire);
  if (p) return *p;
  owned_.push_back(m);
  masks_[s].store(m.get(), std::memory_order_release);
  return *m;
}

}  // namespace grammar
}  // namespace agent_infer
