// Tokenizer-level structures: the sorted token list that acts as a trie (runs, dead-prefix
// skips), the process-wide cache of state masks and their digests, and the bit-set helpers
// the mask computations share (grammar/mask/state_mask.cpp classifies states, grammar/mask/region.cpp
// walks loop regions).
#include <algorithm>
#include <cstring>

#include "grammar/automaton.h"
#include "grammar/compiled_grammar.h"
#include "grammar/mask/mask_strategies.h"
#include "grammar/mask/profile.h"
#include "grammar/mask/state_mask.h"
#include "grammar/mask/tokenizer_info.h"

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
  for (std::vector<uint32_t>& b : longer_bits) b.assign(static_cast<size_t>(words), 0);
  for (size_t i = 0; i < sorted.size(); ++i) {
    const int32_t id = sorted[i];
    const size_t len = tokens[id].size();
    if (len > kShortTokenLen) long_sorted.push_back(static_cast<int32_t>(i));
    for (size_t k = 0; k < kTwinLens.size(); ++k) {
      if (len > kTwinLens[k]) {
        longer_sorted[k].push_back(static_cast<int32_t>(i));
        longer_bits[k][static_cast<size_t>(id) >> 5] |= 1u << (id & 31);
      }
    }
  }
  tail_groups.assign(sorted.size(), {0, 0});
  utf8_from.assign(sorted.size(), 0);
  for (size_t i = 0; i < sorted.size(); ++i) {
    const std::string& tb = tokens[static_cast<size_t>(sorted[i])];
    const auto* tp = reinterpret_cast<const uint8_t*>(tb.data());
    utf8_from[i] = static_cast<uint8_t>((utf8_well_formed(tp, tb.size()) ? 1 : 0) |
                                        (utf8_well_formed(tp + 1, tb.size() - 1) ? 2 : 0));
    for (size_t k = 1; k < tb.size(); ++k) {
      const unsigned g = byte_group(static_cast<uint8_t>(tb[k]));
      tail_groups[i][g >> 6] |= uint64_t{1} << (g & 63);
    }
  }
  content_bits.assign(static_cast<size_t>(words), 0);
  content_ascii_bits.assign(static_cast<size_t>(words), 0);
  content_chars_at.assign(sorted.size(), 0);
  for (std::vector<uint32_t>& b : content_upto_bits) b.assign(static_cast<size_t>(words), 0);
  for (size_t i = 0; i < sorted.size(); ++i) {
    const int32_t id = sorted[i];
    size_t dead_after = SIZE_MAX;
    const std::string& tb = tokens[static_cast<size_t>(id)];
    const size_t chars = content_chars(tb, &dead_after);
    if (chars <= kContentChars) {
      content_chars_at[i] = static_cast<uint8_t>(chars);
      for (size_t r = chars; r < kContentChars; ++r) {
        content_upto_bits[r][static_cast<size_t>(id) >> 5] |= 1u << (id & 31);
        ++content_upto_count[r];
      }
      content_bits[static_cast<size_t>(id) >> 5] |= 1u << (id & 31);
      ++content_count;
      if (static_cast<uint8_t>(tb[0]) < 0x80) {
        content_ascii_bits[static_cast<size_t>(id) >> 5] |= 1u << (id & 31);
        ++content_ascii_count;
      }
      // Each character start byte once (continuation bytes 80-BF start none).
      std::array<uint32_t, 8> starts{};
      for (unsigned char c : tb) {
        if ((c & 0xC0) == 0x80 || (starts[c >> 5] >> (c & 31)) & 1u) continue;
        starts[c >> 5] |= 1u << (c & 31);
        content_with[c].push_back(static_cast<int32_t>(i));
      }
      continue;
    }
    content_rest.push_back(static_cast<int32_t>(i));
    // The content before the dead byte: at most kContentChars characters, so the byte is read at
    // a character boundary the check covers.
    if (dead_after > kContentChars) {
      content_rest_walked.push_back(static_cast<int32_t>(i));
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
  for (size_t p = 0; p < short_run_end.size(); ++p) {
    std::vector<uint32_t>& ends = short_run_end[p];
    ends.resize(sorted.size());
    uint32_t next = static_cast<uint32_t>(sorted.size());  // the first j > i with lcp[j] < p + 2
    for (size_t i = sorted.size(); i-- > 0;) {
      ends[i] = next;
      if (lcp[i] < p + 2) next = static_cast<uint32_t>(i);
    }
  }
}

void merge_uncertain(StateMask& out, const StateMask* base) {
  if (!base || base->uncertain.empty()) return;
  std::vector<int32_t> merged(out.uncertain.size() + base->uncertain.size());
  std::merge(out.uncertain.begin(), out.uncertain.end(), base->uncertain.begin(), base->uncertain.end(),
             merged.begin());
  out.uncertain.swap(merged);
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("popcnt", "default")))
#endif
size_t count_bits(const uint32_t* words, size_t n) {
  size_t total = 0;
  for (size_t w = 0; w < n; ++w) total += static_cast<size_t>(__builtin_popcount(words[w]));
  return total;
}

void finish_mask(StateMask& out, std::vector<uint32_t>&& bits, size_t n_accepted) {
  if (KeepBits::active()) {
    if (n_accepted > 0) out.accepted_bits = std::move(bits);  // 0 counted: no bit is set
    return;
  }
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

size_t MaskStrategies::live_tokens(const std::vector<WalkRange>& ranges) const {
  size_t n = 0;
  for (const WalkRange& r : ranges) {
    if (r.depth > 0) {
      n += r.end - r.begin;
      continue;
    }
    const State& st = g_.states[static_cast<size_t>(r.state)];
    for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
      const ByteEdge& be = g_.byte_edges[e];
      const size_t lo = std::max<size_t>(r.begin, be.lo == 0 ? 0 : g_.tok->first_byte_end[be.lo - 1u]);
      const size_t hi = std::min<size_t>(r.end, g_.tok->first_byte_end[be.hi]);
      if (hi > lo) n += hi - lo;
    }
  }
  return n;
}

size_t TokenizerInfo::run_end(size_t i, size_t plen) const {
  const size_t n = sorted.size();
  if (plen == 1) return first_byte_end[static_cast<uint8_t>(*sorted_ptr(i))];
  if (plen - 2 < short_run_end.size()) return short_run_end[plen - 2][i];
  // Token j > i shares the prefix while every lcp in (i, j] is at least plen: longer prefixes
  // mostly have short runs, found by reading the lcp array in order.
  const size_t scan_end = std::min(n, i + 33);
  size_t j = i + 1;
  for (; j < scan_end; ++j) {
    if (lcp[j] < plen) return j;
  }
  if (j >= n) return n;
  const char* p = sorted_ptr(i);
  auto shares = [&](size_t k) { return sorted_len(k) >= plen && std::memcmp(sorted_ptr(k), p, plen) == 0; };
  // Then gallop before bisecting: O(log run) instead of O(log n).
  size_t good = j - 1, step = 1, hi = n;  // tokens [i, good] share the prefix; hi does not (or is n)
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

std::shared_ptr<StateMask> run_piece(const TokenizerInfo& tk, const std::vector<uint32_t>& bits,
                                     const StateMask& walked, size_t lo, size_t hi, bool exits) {
  auto p = std::make_shared<StateMask>();
  // Branch-free compaction: accepted and rejected tokens alternate unpredictably within a run.
  std::vector<int32_t>& ids = p->accepted_ids;
  ids.resize(hi - lo);
  size_t n = 0;
  for (size_t j = lo; j < hi; ++j) {
    const int32_t id = tk.sorted[j];
    ids[n] = id;
    n += (bits[static_cast<size_t>(id) >> 5] >> (id & 31)) & 1u;
  }
  ids.resize(n);
  ids.shrink_to_fit();
  // Uncertain positions and exits are in walk order (ascending).
  const auto& unc = walked.uncertain;
  auto u0 = std::lower_bound(unc.begin(), unc.end(), static_cast<int32_t>(lo));
  p->uncertain.assign(u0, std::lower_bound(u0, unc.end(), static_cast<int32_t>(hi)));
  if (exits) {
    auto by_begin = [](const RegionExit& e, int32_t pos) { return e.begin < pos; };
    const auto& ex = walked.exits;
    auto e0 = std::lower_bound(ex.begin(), ex.end(), static_cast<int32_t>(lo), by_begin);
    p->exits.assign(e0, std::lower_bound(e0, ex.end(), static_cast<int32_t>(hi), by_begin));
  }
  return p;
}

size_t seed_bits(const StateMask* base, std::vector<uint32_t>& bits) {
  if (!base) return 0;
  size_t n = base->accepted_ids.size();
  if (!base->accepted_bits.empty()) {
    std::copy(base->accepted_bits.begin(), base->accepted_bits.end(), bits.begin());
    n = count_bits(bits.data(), bits.size());
  }
  or_ids(bits, base->accepted_ids);
  return n;
}

size_t seed_bits_masked(const StateMask* base, std::vector<uint32_t>& bits, const std::vector<uint32_t>& drop) {
  if (!base) return 0;
  size_t n = 0;
  if (!base->accepted_bits.empty()) {
    for (size_t w = 0; w < bits.size(); ++w) bits[w] = base->accepted_bits[w] & ~drop[w];
    n = count_bits(bits.data(), bits.size());
  }
  for (int32_t id : base->accepted_ids) {
    const size_t w = static_cast<size_t>(id) >> 5;
    const uint32_t bit = 1u << (id & 31);
    if ((drop[w] & bit) || (bits[w] & bit)) continue;
    bits[w] |= bit;
    ++n;
  }
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

}  // namespace grammar
}  // namespace agent_infer
