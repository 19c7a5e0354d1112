// Tokenizer-level structures (the sorted token list that acts as a trie) and the adaptive
// per-state token classification: for an automaton state, every token is accepted (consumed
// inside the rule's automaton), rejected (dies before the rule could hand over control), or
// uncertain (the rule may complete or call another rule mid-token, so the context decides).
#include <algorithm>
#include <cstring>

#include "grammar.h"

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
  lcp.assign(sorted.size(), 0);
  for (size_t i = 1; i < sorted.size(); ++i) {
    const std::string& a = tokens[sorted[i - 1]];
    const std::string& b = tokens[sorted[i]];
    size_t n = std::min(a.size(), b.size()), k = 0;
    while (k < n && a[k] == b[k]) ++k;
    lcp[i] = static_cast<uint16_t>(k);
  }
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

size_t TokenizerInfo::run_end(size_t i, size_t plen) const {
  const char* p = sorted_ptr(i);
  size_t lo = i + 1, hi = sorted.size();
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (sorted_len(mid) >= plen && std::memcmp(sorted_ptr(mid), p, plen) == 0) {
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

size_t TokenizerInfo::cache_bytes() {
  std::lock_guard<std::mutex> lock(mu_);
  return cache_bytes_;
}

size_t TokenizerInfo::cache_entries() {
  std::lock_guard<std::mutex> lock(mu_);
  return cache_.size();
}

// The classification of a state depends on its rule's automaton and escape sets (plain walk),
// or on the automata of every rule reachable through calls plus the rule's follow set (pushdown
// walk). Rules are laid out contiguously, so "rule key + local state index" names the state
// canonically: identical rules in different grammars share their masks.
const std::string& CompiledGrammar::rule_key(int32_t r, bool calls) const {
  std::lock_guard<std::mutex> lock(key_mu_);
  const int c = calls ? 1 : 0;
  if (rule_key_done_[c].empty()) {
    rule_key_done_[c].assign(rule_start.size(), 0);
    rule_keys_[c].assign(rule_start.size(), std::string());
  }
  std::string& key = rule_keys_[c][r];
  if (rule_key_done_[c][r]) return key;
  rule_key_done_[c][r] = 1;
  auto put = [&](int32_t v) { key.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
  std::vector<int32_t> order{r};
  std::unordered_map<int32_t, int32_t> index{{r, 0}};
  key = calls ? "G" : "F";
  if (calls) {
    for (uint32_t w : follow[r]) put(static_cast<int32_t>(w));
  }
  const size_t S = states.size();
  for (size_t i = 0; i < order.size(); ++i) {
    if (key.size() > (64u << 20)) {
      key.clear();  // too large to be worth sharing
      return key;
    }
    const int32_t rr = order[i];
    const int32_t first = rule_start[rr];
    size_t last = static_cast<size_t>(first);
    while (last < S && states[last].rule == rr) ++last;
    put(static_cast<int32_t>(last - first));
    for (size_t q = static_cast<size_t>(first); q < last; ++q) {
      const State& st = states[q];
      put(st.final ? 1 : 0);
      if (!calls) {
        for (uint32_t w : escape[q]) put(static_cast<int32_t>(w));
      }
      put(static_cast<int32_t>(st.byte_end - st.byte_begin));
      for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
        put((byte_edges[e].lo << 8) | byte_edges[e].hi);
        put(byte_edges[e].target - first);
      }
      if (!calls) continue;
      put(static_cast<int32_t>(st.ref_end - st.ref_begin));
      for (uint32_t e = st.ref_begin; e < st.ref_end; ++e) {
        const RefEdge& re = ref_edges[e];
        auto it = index.find(re.rule);
        if (it == index.end()) {
          it = index.emplace(re.rule, static_cast<int32_t>(order.size())).first;
          order.push_back(re.rule);
        }
        put(it->second);
        put(re.target - first);
      }
    }
  }
  // Keep a 128-bit digest, not the serialization: state keys are stored per cached mask.
  uint64_t h1 = 1469598103934665603ull, h2 = 0x9E3779B97F4A7C15ull;
  for (unsigned char ch : key) {
    h1 = (h1 ^ ch) * 1099511628211ull;
    h2 = (h2 + ch + 1) * 0xff51afd7ed558ccdull;
    h2 ^= h2 >> 29;
  }
  const char kind = key[0];
  key.assign(1, kind);
  key.append(reinterpret_cast<const char*>(&h1), sizeof(h1));
  key.append(reinterpret_cast<const char*>(&h2), sizeof(h2));
  return key;
}

std::string CompiledGrammar::structure_key(int32_t s) const {
  const bool calls = calls_within_reach(s);
  const int32_t r = states[s].rule;
  const std::string& base = rule_key(r, calls);
  if (base.empty()) return base;
  std::string key = base;
  int32_t local = s - rule_start[r];
  key.append(reinterpret_cast<const char*>(&local), sizeof(local));
  return key;
}

std::shared_ptr<const StateMask> CompiledGrammar::compute_mask(int32_t s) const {
  const TokenizerInfo& t = *tok;
  const size_t n = t.sorted.size();
  auto out = std::make_shared<StateMask>();
  std::vector<uint32_t> bits(static_cast<size_t>(t.words), 0);  // accepted tokens
  size_t n_accepted = 0;
  // Dense 256-entry transition rows for the states this walk meets (the walk is the hot loop).
  std::vector<int32_t> row_of(states.size(), -1);
  std::vector<int32_t> rows;
  std::vector<const ByteSet*> row_escape;
  auto row = [&](int32_t q) -> int32_t {
    if (row_of[q] >= 0) return row_of[q];
    int32_t r = static_cast<int32_t>(row_escape.size());
    row_of[q] = r;
    rows.resize(rows.size() + 256, -1);
    const State& st = states[q];
    for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
      const ByteEdge& be = byte_edges[e];
      for (int b = be.lo; b <= be.hi; ++b) rows[static_cast<size_t>(r) * 256 + b] = be.target;
    }
    row_escape.push_back(&escape[q]);
    return r;
  };
  // stack[d]: row of the automaton state after d bytes of the current token. flag[d]: at some
  // position j in [1, d) control could have left the rule to read byte j elsewhere (call a rule
  // or finish it, with byte j in the escape set); a token dying after such a point is only
  // "uncertain". Both depend on the first d bytes alone, so they are shared along the trie.
  std::vector<int32_t> stack(t.max_token_len + 1);
  std::vector<uint8_t> flag(t.max_token_len + 1);
  stack[0] = row(s);
  flag[0] = 0;
  size_t valid = 0;  // stack entries valid for the previous token
  for (size_t i = 0; i < n; ++i) {
    size_t l = i == 0 ? 0 : t.lcp[i];
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
      const int32_t id = t.sorted[i];
      bits[id >> 5] |= 1u << (id & 31);
      ++n_accepted;
      continue;
    }
    // Every token sharing the dead prefix shares this token's fate: classify the run at once.
    size_t end = t.run_end(i, static_cast<size_t>(dead_at) + 1);
    if (flag[d] || (d > 0 && has(*row_escape[stack[d]], tokb[d]))) {
      for (size_t j = i; j < end; ++j) out->uncertain.push_back(static_cast<int32_t>(j));
    }
    i = end - 1;
  }
  finish_mask(*out, std::move(bits), n_accepted);
  out->uncertain.shrink_to_fit();
  return out;
}

const StateMask& CompiledGrammar::mask_for(int32_t s) const {
  const StateMask* p = masks_[s].load(std::memory_order_acquire);
  if (p) return *p;
  const bool calls = calls_within_reach(s);
  std::string key = structure_key(s);
  std::shared_ptr<const StateMask> m = key.empty() ? nullptr : tok->cache_get(key);
  if (!m) {
    std::shared_ptr<const StateMask> fresh = calls ? compute_mask_with_calls(s) : nullptr;
    if (!fresh) fresh = compute_mask(s);
    m = key.empty() ? fresh : tok->cache_put(key, fresh);
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
