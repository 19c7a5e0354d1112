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

// A canonical description of everything the classification of `s` depends on: the byte
// automaton reachable within one token's length, with each state's "leaves" flag.
std::string CompiledGrammar::structure_key(int32_t s) const {
  std::vector<int32_t> order{s};
  std::unordered_map<int32_t, int32_t> canon{{s, 0}};
  std::vector<uint16_t> depth{0};
  std::string key;
  auto put = [&](int32_t v) { key.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
  const size_t limit = tok->max_token_len;
  for (size_t i = 0; i < order.size(); ++i) {
    const State& st = states[order[i]];
    put(st.leaves ? 1 : 0);
    if (depth[i] >= limit) {
      put(-1);
      continue;
    }
    put(static_cast<int32_t>(st.byte_end - st.byte_begin));
    for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
      const ByteEdge& be = byte_edges[e];
      auto it = canon.find(be.target);
      int32_t c;
      if (it == canon.end()) {
        c = static_cast<int32_t>(order.size());
        canon.emplace(be.target, c);
        order.push_back(be.target);
        depth.push_back(static_cast<uint16_t>(depth[i] + 1));
      } else {
        c = it->second;
      }
      put((be.lo << 8) | be.hi);
      put(c);
    }
  }
  return key;
}

std::shared_ptr<const StateMask> CompiledGrammar::compute_mask(int32_t s) const {
  const TokenizerInfo& t = *tok;
  const size_t n = t.sorted.size();
  auto out = std::make_shared<StateMask>();
  std::vector<int32_t> accepted;
  // Dense 256-entry transition rows for the states this walk meets (the walk is the hot loop).
  std::unordered_map<int32_t, int32_t> row_of;
  std::vector<int32_t> rows;
  std::vector<uint8_t> row_leaves;
  auto row = [&](int32_t q) -> int32_t {
    auto it = row_of.find(q);
    if (it != row_of.end()) return it->second;
    int32_t r = static_cast<int32_t>(row_of.size());
    row_of.emplace(q, r);
    rows.resize(rows.size() + 256, -1);
    const State& st = states[q];
    for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
      const ByteEdge& be = byte_edges[e];
      for (int b = be.lo; b <= be.hi; ++b) rows[static_cast<size_t>(r) * 256 + b] = be.target;
    }
    row_leaves.push_back(st.leaves ? 1 : 0);
    return r;
  };
  // stack[d]: row of the automaton state after d bytes of the current token; flag[d]: some state
  // after 1..d bytes may leave the rule (complete or call), so a death after it is only "uncertain".
  std::vector<int32_t> stack(t.max_token_len + 1);
  std::vector<uint8_t> flag(t.max_token_len + 1);
  stack[0] = row(s);
  flag[0] = 0;
  size_t valid = 0;    // stack entries valid for the previous token
  long dead_at = -1;   // previous token died reading byte dead_at
  int prev_class = 0;  // 0 rejected, 1 accepted, 2 uncertain
  for (size_t i = 0; i < n; ++i) {
    size_t l = i == 0 ? 0 : t.lcp[i];
    if (dead_at >= 0 && static_cast<long>(l) > dead_at) {
      // Shares the byte that killed the previous token, hence its fate.
      if (prev_class == 2) out->uncertain.push_back(static_cast<int32_t>(i));
      continue;
    }
    const uint8_t* tokb = reinterpret_cast<const uint8_t*>(t.sorted_ptr(i));
    const size_t len = t.sorted_len(i);
    size_t d = std::min(l, valid);
    dead_at = -1;
    while (d < len) {
      int32_t nx = rows[static_cast<size_t>(stack[d]) * 256 + tokb[d]];
      if (nx < 0) {
        dead_at = static_cast<long>(d);
        break;
      }
      int32_t r = row(nx);
      stack[d + 1] = r;
      flag[d + 1] = flag[d] | row_leaves[r];
      ++d;
    }
    valid = d;
    if (dead_at < 0) {
      accepted.push_back(t.sorted[i]);
      prev_class = 1;
    } else if (flag[d]) {
      out->uncertain.push_back(static_cast<int32_t>(i));
      prev_class = 2;
    } else {
      prev_class = 0;
    }
  }
  if (accepted.size() > static_cast<size_t>(t.words)) {
    out->accepted_bits.assign(t.words, 0);
    for (int32_t id : accepted) out->accepted_bits[id >> 5] |= 1u << (id & 31);
  } else {
    std::sort(accepted.begin(), accepted.end());
    out->accepted_ids = std::move(accepted);
  }
  out->uncertain.shrink_to_fit();
  return out;
}

const StateMask& CompiledGrammar::mask_for(int32_t s) const {
  const StateMask* p = masks_[s].load(std::memory_order_acquire);
  if (p) return *p;
  const bool calls = calls_within_reach(s);
  std::string key = calls ? call_structure_key(s) : structure_key(s);
  std::shared_ptr<const StateMask> m = tok->cache_get(key);
  if (!m) {
    std::shared_ptr<const StateMask> fresh = calls ? compute_mask_with_calls(s) : nullptr;
    m = tok->cache_put(key, fresh ? fresh : compute_mask(s));
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
