// Loop regions: a string-content (or similar) loop whose states call nothing is walked once per
// shape, and every state of every rule with the same region shares the result; see
// compute_region below.
#include <algorithm>
#include <cstring>
#include <mutex>

#include "grammar/automaton.h"
#include "grammar/compiled_grammar.h"
#include "grammar/mask/mask_strategies.h"
#include "grammar/mask/profile.h"
#include "grammar/mask/state_mask.h"
#include "grammar/mask/tokenizer_info.h"
#include "grammar/thread_slot.h"

namespace agent_infer {
namespace grammar {

namespace {
bool find_region(const CompiledGrammar& g, int32_t s, std::string* key, std::vector<int32_t>* exits);
}  // namespace

bool MaskStrategies::region_of(int32_t s, std::string* key, std::vector<int32_t>* exits) const {
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
  memo.found = find_region(g_, s, &memo.key, &memo.exits);
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

bool MaskStrategies::region_digest_q(int32_t s, std::string* qkey, std::vector<int32_t>* exits) const {
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
  // Bounded so that the search stays cheap next to the walk it replaces.
  constexpr size_t kMaxRegion = 512;
  auto inside = [&](int32_t q) { return states[q].ref_end == states[q].ref_begin; };
  if (!inside(s)) return false;
  // The region is s's strongly connected component among the states without references: what
  // the loop can return to. States it only leads to (the closing quote of a string and the
  // final state after it) are exits, walked per state, so the region (and its cached walk) is
  // the same for every string of one syntax whatever follows the string.
  // Per-thread state -> index scratch (reset entry by entry): grammars have up to 10^5 states.
  struct RegionIndex {
    std::vector<int32_t> v;
  };
  std::vector<int32_t>& idx = thread_slot<RegionIndex>().v;
  if (idx.size() < states.size()) idx.resize(states.size(), -1);
  std::vector<int32_t> order{s};
  idx[static_cast<size_t>(s)] = 0;
  struct Reset {
    std::vector<int32_t>& order;
    std::vector<int32_t>& idx;
    ~Reset() {
      for (int32_t q : order) idx[static_cast<size_t>(q)] = -1;
    }
  } reset{order, idx};
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
std::shared_ptr<const StateMask> MaskStrategies::compute_region(int32_t s, const std::vector<int32_t>& exits) const {
  // Built once per walk: a split walk's parts share it.
  const RegionRows rr = region_rows(s, exits);
  if (auto content = compute_region_content(rr, s, 0)) return content;
  if (auto classes = region_from_classes(rr, s, {{0, g_.tok->sorted.size()}}, 0)) return classes;
  std::shared_ptr<const StateMask> split;
  if (split_region(s, rr, &split)) return split;
  return compute_region_part(rr, s, 0, g_.tok->sorted.size(), false);
}

MaskStrategies::RegionRows MaskStrategies::region_rows(int32_t start, const std::vector<int32_t>& exits) const {
  std::unordered_map<int32_t, int32_t> exit_of;
  for (size_t k = 0; k < exits.size(); ++k) exit_of[exits[k]] = static_cast<int32_t>(k);
  std::unordered_map<int32_t, int32_t> row_of{{start, 0}};
  std::vector<int32_t> order{start};
  for (size_t i = 0; i < order.size(); ++i) {
    const State& st = g_.states[order[i]];
    for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
      const int32_t q = g_.byte_edges[e].target;
      if (!exit_of.count(q) && row_of.emplace(q, static_cast<int32_t>(order.size())).second) order.push_back(q);
    }
  }
  RegionRows rr;
  rr.rows.assign(order.size() * 256, -1);
  rr.final.resize(order.size());
  for (size_t r = 0; r < order.size(); ++r) {
    const State& st = g_.states[order[r]];
    rr.final[r] = st.final ? 1 : 0;
    for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
      const ByteEdge& be = g_.byte_edges[e];
      auto ex = exit_of.find(be.target);
      const int32_t v = ex == exit_of.end() ? row_of.at(be.target) : -2 - ex->second;
      for (int b = be.lo; b <= be.hi; ++b) rr.rows[r * 256 + static_cast<size_t>(b)] = v;
    }
  }
  return rr;
}

size_t walk_region_range(const TokenizerInfo& t, const std::vector<int32_t>& rows, const std::vector<uint8_t>& row_final,
                         const ByteSet& fol, size_t begin, size_t stop, bool resume, size_t first,
                         std::vector<int32_t>& stack, std::vector<uint8_t>& flag, std::vector<uint32_t>& bits,
                         StateMask& out) {
  size_t n_accepted = 0;
  // escapes(d, b): after d >= 1 bytes the rule may finish and byte b may follow it.
  auto escapes = [&](size_t d, int32_t r, uint8_t b) { return d > 0 && row_final[r] && has(fol, b); };
  stack[first] = 0;  // the start state's row
  flag[first] = 0;
  size_t valid = first;
  for (size_t i = begin; i < stop; ++i) {
    const uint8_t* tokb = reinterpret_cast<const uint8_t*>(t.sorted_ptr(i));
    const size_t len = t.sorted_len(i);
    size_t d = std::max(first, std::min<size_t>(i == begin ? first : t.lcp[i], valid));
    int32_t nx = 0;
    while (d < len) {
      nx = rows[static_cast<size_t>(stack[d]) * 256 + tokb[d]];
      if (nx < 0) break;
      flag[d + 1] = flag[d] | static_cast<uint8_t>(escapes(d, stack[d], tokb[d]));
      stack[d + 1] = nx;
      ++d;
    }
    valid = d;
    if (d >= len) {
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
      out.exits.push_back({static_cast<int32_t>(i), static_cast<int32_t>(end), static_cast<int32_t>(d + 1), -2 - nx,
                           escaped ? 1 : 0});
    } else if (!continued && escaped) {
      for (size_t j = i; j < end; ++j) out.uncertain.push_back(static_cast<int32_t>(j));
    }
    i = end - 1;
  }
  return n_accepted;
}

std::shared_ptr<const StateMask> MaskStrategies::compute_region_part(const RegionRows& rr, int32_t s, size_t begin,
                                                                      size_t stop, bool resume) const {
  const TokenizerInfo& t = *g_.tok;
  auto out = std::make_shared<StateMask>();
  std::vector<uint32_t> bits(static_cast<size_t>(t.words), 0);
  std::vector<int32_t> stack(t.max_token_len + 1);
  std::vector<uint8_t> flag(t.max_token_len + 1, 0);
  const size_t n_accepted =
      walk_region_range(t, rr.rows, rr.final, g_.follow[g_.states[s].rule], begin, stop, resume, 0, stack, flag, bits, *out);
  finish_mask(*out, std::move(bits), n_accepted);
  out->exits.shrink_to_fit();
  return out;
}

std::shared_ptr<const StateMask> MaskStrategies::compute_region_content(const RegionRows& rr, int32_t s,
                                                                         size_t first) const {
  const TokenizerInfo& t = *g_.tok;
  // A vocabulary that is not mostly content tokens walks most of itself anyway.
  ByteSet walked{};
  size_t whole_chars = 0;
  if (t.content_count * 2 < t.sorted.size() || !region_content_deep(rr, &walked, &whole_chars)) return nullptr;
  // At depth 1 a token's bytes after the first start at a character boundary only if its first
  // byte is ASCII: the tokens starting with a byte from 80 on (from `ascii_end`) are walked, and
  // mostly die at once (a continuation byte at a boundary).
  const size_t ascii_end = first == 0 ? t.sorted.size() : t.first_byte_end[0x7F];
  // The tokens walked: the non-content ones and the content tokens with a character starting with
  // a walked byte, in sorted order. Every other content token stays inside the region, and so
  // does every content token of at most whole_chars characters (after the first, at depth 1).
  std::vector<uint32_t> bits(first == 0 ? t.content_bits : t.content_ascii_bits);
  size_t n_accepted = first == 0 ? t.content_count : t.content_ascii_count;
  const size_t budget = t.sorted.size() / 4;
  std::vector<int32_t> listed;
  for (int32_t j : t.content_rest) {
    if (static_cast<size_t>(j) < ascii_end) listed.push_back(j);
  }
  const size_t n_rest = listed.size();
  for (unsigned b = 0; b < 256; ++b) {
    if (!has(walked, static_cast<uint8_t>(b))) continue;
    for (int32_t j : t.content_with[b]) {
      if (static_cast<size_t>(j) >= ascii_end) break;  // ascending
      if (t.content_chars_at[static_cast<size_t>(j)] <= whole_chars + first) continue;
      const int32_t id = t.sorted[static_cast<size_t>(j)];
      uint32_t& w = bits[static_cast<size_t>(id) >> 5];
      const uint32_t bit = 1u << (id & 31);
      // A token with characters of several walked start bytes is listed (and cleared) once.
      if (w & bit) {
        w &= ~bit;
        --n_accepted;
        listed.push_back(j);
      }
    }
    if (listed.size() > budget) return nullptr;
  }
  // Walking most of the vocabulary as scattered blocks is slower than the one full walk.
  if (listed.size() > budget) return nullptr;
  if (listed.size() > n_rest) std::sort(listed.begin(), listed.end());
  for (size_t j = ascii_end; j < t.sorted.size(); ++j) listed.push_back(static_cast<int32_t>(j));
  // A run of tokens that dies or exits together holds no token taken as accepted here, so it lies
  // within one block of consecutive listed positions, and starts it or a later token of it (the
  // token before the block shares too short a prefix to be in the run).
  auto out = std::make_shared<StateMask>();
  std::vector<int32_t> stack(t.max_token_len + 1);
  std::vector<uint8_t> flag(t.max_token_len + 1, 0);
  const ByteSet& fol = g_.follow[g_.states[s].rule];
  for (size_t i = 0; i < listed.size();) {
    size_t j = i + 1;
    while (j < listed.size() && listed[j] == listed[j - 1] + 1) ++j;
    n_accepted += walk_region_range(t, rr.rows, rr.final, fol, static_cast<size_t>(listed[i]),
                                    static_cast<size_t>(listed[j - 1]) + 1, false, first, stack, flag, bits, *out);
    i = j;
  }
  finish_mask(*out, std::move(bits), n_accepted);
  out->exits.shrink_to_fit();
  out->uncertain.shrink_to_fit();
  return out;
}

}  // namespace grammar
}  // namespace agent_infer
