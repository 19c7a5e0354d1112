// First-byte pieces: a cheap first visit for dense automaton states outside loop regions.
//
// A token's fate from state s depends only on where its first byte leads: the walks never mark
// a token uncertain at byte 0 (what s could predict or complete there is in the Earley set with
// masks of its own), so the tokens of the run starting with byte b are classified exactly as a
// walk entering t = step(s, b) at depth 1 classifies them. That classification depends only on
// the part of the grammar reachable from t, so it is cached per (reachable sub-automaton of t,
// b) in the tokenizer and shared by every state, rule and grammar that leads there: e.g. all
// the prefix states of a "key other than these property names" automaton lead, for most bytes,
// into the same free string-content state, so only the first of them pays for a full walk; the
// others assemble their mask from cached pieces (an OR over the accepted ids) and walk only the
// runs of the bytes that continue a property name.
#include <algorithm>
#include <cstring>

#include "grammar/automaton.h"
#include "grammar/batch/pool.h"
#include "grammar/compiled_grammar.h"
#include "grammar/mask/mask_strategies.h"
#include "grammar/mask/profile.h"
#include "grammar/mask/state_mask.h"
#include "grammar/mask/tokenizer_info.h"

namespace agent_infer {
namespace grammar {

namespace {
// Sparse states walk few tokens and stay on the direct walks.
constexpr size_t kMinPieceTokens = 4096;
// Sub-automata larger than this are named by their rule's key instead (exact, shared less).
constexpr size_t kMaxLocalStates = 512;
// A first visit starts pieces only if the target most tokens go to reaches at most this many
// states (a loop, a call): such targets are shared by many states. A long finite chain (the
// positions of a counted repeat) is unique to each position: splitting its walk into cached
// pieces would only add work, so such states keep the direct walk.
constexpr size_t kMaxSharedStates = 64;
// Byte groups leading this many tokens into one target are assembled from a cached union.
constexpr size_t kMinUnionTokens = 2048;
// First bytes per slice when a batch fill's threads build pieces together.
constexpr size_t kPieceGrain = 8;

// Per-target tables of a first visit: a state sends its 256 bytes to a handful of targets, and
// consecutive bytes mostly to the same one, so a flat list with the last hit remembered is
// cheaper than hashing each byte's target.
template <class V>
class TargetMap {
 public:
  V& operator[](int32_t key) {
    if (last_ < items_.size() && items_[last_].first == key) return items_[last_].second;
    for (size_t k = 0; k < items_.size(); ++k) {
      if (items_[k].first == key) {
        last_ = k;
        return items_[k].second;
      }
    }
    last_ = items_.size();
    items_.emplace_back(key, V());
    return items_.back().second;
  }
  void emplace(int32_t key, V value) { (*this)[key] = std::move(value); }
  typename std::vector<std::pair<int32_t, V>>::iterator begin() { return items_.begin(); }
  typename std::vector<std::pair<int32_t, V>>::iterator end() { return items_.end(); }

 private:
  std::vector<std::pair<int32_t, V>> items_;
  size_t last_ = 0;
};
}  // namespace

bool MaskStrategies::piece_calls(int32_t t) const {
  // The walk entering t at depth 1 expands t's own references, so they count here too.
  return g_.states[t].ref_end > g_.states[t].ref_begin || g_.reach_call[t] != 0;
}

// Canonical serialization of what a walk entering t reads: the states reachable from t (through
// byte edges, and in the pushdown walk also through reference returns), numbered in discovery
// order, with their edges, final flags and escape sets (plain walk) or callee digests and the
// rule's follow set (pushdown walk).
namespace {
template <class Num, class RuleKey>
void append_state(const CompiledGrammar& g, int32_t q, bool calls, bool with_escape, const Num& num,
                  const RuleKey& rule_key, std::string& ser) {
  auto put = [&](int32_t v) { ser.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
  const State& st = g.states[q];
  put(st.final ? 1 : 0);
  if (with_escape) {
    for (uint32_t w : g.escape[q]) put(static_cast<int32_t>(w));
  }
  put(static_cast<int32_t>(st.byte_end - st.byte_begin));
  for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
    put((g.byte_edges[e].lo << 8) | g.byte_edges[e].hi);
    put(num(g.byte_edges[e].target));
  }
  if (calls) {
    put(static_cast<int32_t>(st.ref_end - st.ref_begin));
    for (uint32_t e = st.ref_begin; e < st.ref_end; ++e) {
      ser += rule_key(g.ref_edges[e].rule);
      put(num(g.ref_edges[e].target));
    }
  }
}
}  // namespace

void MaskStrategies::append_state_key(int32_t q, bool calls, bool with_escape,
                                       const std::unordered_map<int32_t, int32_t>& num, std::string& ser) const {
  append_state(
      g_, q, calls, with_escape, [&](int32_t x) { return num.at(x); },
      [&](int32_t r) { return callee_name(r); }, ser);
}

void MaskStrategies::append_state_key(int32_t q, bool calls, bool with_escape, const std::vector<int32_t>& num_of,
                                       std::string& ser) const {
  append_state(
      g_, q, calls, with_escape, [&](int32_t x) { return num_of[static_cast<size_t>(x)]; },
      [&](int32_t r) { return callee_name(r); }, ser);
}

std::string MaskStrategies::local_key(int32_t t) const {
  profile::Scope scope(profile::kLocalKey);
  {
    std::lock_guard<std::mutex> lock(local_mu_);
    auto it = local_keys_.find(t);
    if (it != local_keys_.end()) return it->second.first;
  }
  const bool calls = piece_calls(t);
  const int32_t r = g_.states[t].rule;
  std::unordered_map<int32_t, int32_t> num{{t, 0}};
  std::vector<int32_t> order{t};
  bool overflow = false;
  auto reach = [&](int32_t q) {
    if (num.count(q) || overflow) return;
    if (order.size() >= kMaxLocalStates) {
      overflow = true;
      return;
    }
    num.emplace(q, static_cast<int32_t>(order.size()));
    order.push_back(q);
  };
  for (size_t i = 0; i < order.size() && !overflow; ++i) {
    const State& st = g_.states[order[i]];
    for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) reach(g_.byte_edges[e].target);
    if (calls) {
      for (uint32_t e = st.ref_begin; e < st.ref_end; ++e) reach(g_.ref_edges[e].target);
    }
  }
  std::string ser(1, calls ? 'c' : 'p');
  auto put = [&](int32_t v) { ser.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
  if (!overflow) {
    for (int32_t q : order) append_state_key(q, calls, !calls, num, ser);
  } else {
    // Named by the whole rule (as the per-state cache does) plus t's index inside it.
    ser.assign(1, calls ? 'C' : 'P');
    ser += calls ? callee_name(r) : rule_key(r, false);
    put(t - g_.rule_start[r]);
  }
  if (calls) ser.append(reinterpret_cast<const char*>(g_.follow[r].data()), sizeof(ByteSet));
  std::string key = digest(ser, 'L');
  std::lock_guard<std::mutex> lock(local_mu_);
  const size_t size = overflow ? kMaxLocalStates + 1 : order.size();
  return local_keys_.emplace(t, std::make_pair(std::move(key), size)).first->second.first;
}

bool MaskStrategies::local_key_known(int32_t t) const {
  std::lock_guard<std::mutex> lock(local_mu_);
  return local_keys_.count(t) != 0;
}

bool MaskStrategies::local_small(int32_t t) const {
  const bool calls = piece_calls(t);
  std::vector<int32_t> order{t};
  auto reach = [&](int32_t q) {
    if (std::find(order.begin(), order.end(), q) == order.end()) order.push_back(q);
  };
  for (size_t i = 0; i < order.size() && order.size() <= kMaxSharedStates; ++i) {
    const State& st = g_.states[static_cast<size_t>(order[i])];
    for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) reach(g_.byte_edges[e].target);
    if (calls) {
      for (uint32_t e = st.ref_begin; e < st.ref_end; ++e) reach(g_.ref_edges[e].target);
    }
  }
  return order.size() <= kMaxSharedStates;
}

size_t MaskStrategies::local_size(int32_t t) const {
  local_key(t);
  std::lock_guard<std::mutex> lock(local_mu_);
  return local_keys_.at(t).second;
}

std::shared_ptr<const StateMask> MaskStrategies::compute_by_first_byte(int32_t s, bool cached_only) const {
  const TokenizerInfo& tk = *g_.tok;
  auto run_begin = [&](int b) -> size_t { return b == 0 ? 0 : tk.first_byte_end[static_cast<size_t>(b) - 1]; };
  std::array<int32_t, 256> target{};
  size_t live = 0;
  for (int b = 0; b < 256; ++b) {
    target[static_cast<size_t>(b)] = g_.step(s, static_cast<uint8_t>(b));
    if (target[static_cast<size_t>(b)] >= 0) live += tk.first_byte_end[static_cast<size_t>(b)] - run_begin(b);
  }
  if (live < kMinPieceTokens) return nullptr;
  // Pieces pay off when they are shared (see kMaxSharedStates).
  {
    int best = -1;
    size_t best_n = 0;
    TargetMap<size_t> by_target;
    for (int b = 0; b < 256; ++b) {
      const int32_t t = target[static_cast<size_t>(b)];
      if (t < 0) continue;
      const size_t n = (by_target[t] += tk.first_byte_end[static_cast<size_t>(b)] - run_begin(b));
      if (n > best_n) {
        best_n = n;
        best = b;
      }
    }
    const int32_t t = target[static_cast<size_t>(best)];
    // The key of a large sub-automaton costs up to 512 states' serialization (a position of a
    // `format` string pays it on every first visit): counted first, and keyed only if small or
    // keyed already (an earlier state's pieces may then have cached this one's).
    if (!local_key_known(t) && !local_small(t)) return nullptr;
    std::string key = local_key(t);
    key.push_back(static_cast<char>(best));
    const bool cached = g_.tok->cache_get(key) != nullptr;
    if (!cached && (cached_only || local_size(t) > kMaxSharedStates)) return nullptr;
  }

  // Bytes grouped by target. A large group (the bytes leading into free string content, say)
  // is taken from the cached union of its target's pieces, stored densely with the bytes it was
  // built for: a state whose group differs by a few bytes (the prefix states of a key automaton,
  // which differ in the bytes that continue a property name) copies it, clears the runs of
  // bytes it lacks and ORs the pieces of bytes it adds, instead of ORing ~10^5 ids.
  struct Group {
    ByteSet bytes{};
    size_t tokens = 0;
    std::string key;
    std::shared_ptr<const StateMask> ref;
  };
  TargetMap<Group> groups;
  for (int b = 0; b < 256; ++b) {
    const int32_t t = target[static_cast<size_t>(b)];
    if (t < 0 || run_begin(b) == tk.first_byte_end[static_cast<size_t>(b)]) continue;
    Group& grp = groups[t];
    grp.bytes[static_cast<size_t>(b) >> 5] |= 1u << (b & 31);
    grp.tokens += tk.first_byte_end[static_cast<size_t>(b)] - run_begin(b);
  }
  // Each target's key once (local_key locks and copies).
  TargetMap<std::string> tkey;
  for (const auto& kv : groups) tkey.emplace(kv.first, local_key(kv.first));
  for (auto& kv : groups) {
    Group& grp = kv.second;
    if (grp.tokens < kMinUnionTokens) continue;
    grp.key = tkey[kv.first] + "UU";  // 19 bytes: never a piece key (18)
    grp.ref = g_.tok->cache_get(grp.key);
  }

  std::array<std::shared_ptr<const StateMask>, 256> piece;
  std::array<std::string, 256> piece_key;
  TargetMap<std::vector<int>> missing;  // target -> bytes without a cached piece
  for (int b = 0; b < 256; ++b) {
    const int32_t t = target[static_cast<size_t>(b)];
    if (t < 0 || run_begin(b) == tk.first_byte_end[static_cast<size_t>(b)]) continue;
    Group& grp = groups[t];
    if (grp.ref && has(grp.ref->first_bytes, static_cast<uint8_t>(b))) continue;  // in the union
    std::string& key = piece_key[static_cast<size_t>(b)];
    key = tkey[t];
    key.push_back(static_cast<char>(b));
    piece[static_cast<size_t>(b)] = g_.tok->cache_get(key);
    if (!piece[static_cast<size_t>(b)]) missing[t].push_back(b);
  }
  // Missing runs are walked, then split into per-byte pieces. Targets in loop regions walk
  // alone (from their region's shared depth-1 walk); the others share one walk per kind (plain
  // or pushdown): ranges carry their own start states, and one walk instead of one per target
  // saves its fixed costs (a key state sends each property name's first letter elsewhere).
  std::vector<uint32_t> scratch(static_cast<size_t>(tk.words));
  auto split = [&](const std::vector<int>& bytes, const StateMask& walked, std::vector<uint32_t>& seen) {
    std::fill(seen.begin(), seen.end(), 0u);
    seed_bits(&walked, seen);
    // Pieces are independent: a batch fill's threads build them together.
    parallel_for(bytes.size(), kPieceGrain, [&](size_t k0, size_t k1) {
      for (size_t k = k0; k < k1; ++k) {
        const int b = bytes[k];
        auto p = run_piece(tk, seen, walked, run_begin(b), tk.first_byte_end[static_cast<size_t>(b)], false);
        piece[static_cast<size_t>(b)] = g_.tok->cache_put(piece_key[static_cast<size_t>(b)], std::move(p));
      }
    });
  };
  std::vector<std::pair<int32_t, const std::vector<int>*>> todo;
  for (const auto& kv : missing) todo.emplace_back(kv.first, &kv.second);
  std::vector<uint8_t> outside(todo.size(), 0);  // targets outside loop regions
  // Targets inside loop regions are independent (each walks its region and its bytes' exits and
  // caches its own pieces): a batch fill's threads take them one each. A state that sends its
  // bytes to a dozen regions (a search pattern's partial matches) walked them one after another
  // on one thread, for milliseconds, while the batch's other threads waited.
  parallel_for(todo.size(), 1, [&](size_t k0, size_t k1) {
    std::vector<uint32_t> seen;
    for (size_t k = k0; k < k1; ++k) {
      const int32_t t = todo[k].first;
      const std::vector<int>& bytes = *todo[k].second;
      std::vector<int32_t> exit_states;
      std::shared_ptr<const StateMask> region = region_at_depth1(t, &exit_states, bytes);
      if (!region) {
        outside[k] = 1;
        continue;
      }
      // The region's shared depth-1 walk, plus the exit runs of these bytes walked from their
      // exit states (the split below reads only these runs).
      std::vector<WalkRange> ranges;
      for (const RegionExit& e : region->exits) {
        const uint8_t b0 = static_cast<uint8_t>(tk.sorted_data[tk.sorted_off[static_cast<size_t>(e.begin)]]);
        if (std::find(bytes.begin(), bytes.end(), static_cast<int>(b0)) == bytes.end()) continue;
        ranges.push_back({static_cast<size_t>(e.begin), static_cast<size_t>(e.end), static_cast<size_t>(e.depth),
                          exit_states[static_cast<size_t>(e.exit)], static_cast<uint8_t>(e.flag)});
      }
      std::shared_ptr<const StateMask> walked;
      {
        profile::Scope scope(profile::kPiecesWalk);
        walked = piece_calls(t) ? compute_mask_with_calls(ranges, region.get()) : nullptr;
        if (!walked) walked = compute_mask(ranges, region.get());
      }
      seen.resize(static_cast<size_t>(tk.words));
      split(bytes, *walked, seen);
    }
  });
  std::vector<int> shared_bytes[2];  // [calls]: bytes of targets outside loop regions
  for (size_t k = 0; k < todo.size(); ++k) {
    if (!outside[k]) continue;
    auto& into = shared_bytes[piece_calls(todo[k].first) ? 1 : 0];
    into.insert(into.end(), todo[k].second->begin(), todo[k].second->end());
  }
  for (int calls = 0; calls < 2; ++calls) {
    std::vector<int>& bytes = shared_bytes[calls];
    if (bytes.empty()) continue;
    std::sort(bytes.begin(), bytes.end());  // ranges in sorted-token order
    std::vector<WalkRange> ranges;
    for (int b : bytes) {
      ranges.push_back({run_begin(b), tk.first_byte_end[static_cast<size_t>(b)], 1, target[static_cast<size_t>(b)], 0});
    }
    std::shared_ptr<const StateMask> walked;
    {
      profile::Scope scope(profile::kPiecesWalk);
      walked = calls ? compute_mask_with_calls(ranges, nullptr) : nullptr;
      if (!walked) walked = compute_mask(ranges, nullptr);
    }
    split(bytes, *walked, scratch);
  }

  auto out = std::make_shared<StateMask>();
  std::vector<uint32_t> bits(static_cast<size_t>(tk.words), 0);
  auto first_byte = [&](int32_t pos) {
    return static_cast<uint8_t>(tk.sorted_data[tk.sorted_off[static_cast<size_t>(pos)]]);
  };
  // out->uncertain is filled in sorted segments (one per union, then the pieces in byte order),
  // merged at the end in linear time.
  std::vector<size_t> segments;
  for (auto& kv : groups) {
    Group& grp = kv.second;
    if (grp.key.empty()) continue;
    segments.push_back(out->uncertain.size());
    if (grp.ref) {
      std::copy(grp.ref->accepted_bits.begin(), grp.ref->accepted_bits.end(), scratch.begin());
      // The union grows by the pieces of this group's bytes it lacks (the first letters of the
      // property names, for the first key state's union): the next key states of the object
      // copy it and clear a few runs instead of ORing tens of thousands of ids again.
      auto grown = std::make_shared<StateMask>();
      grown->first_bytes = grp.ref->first_bytes;
      for (int b = 0; b < 256; ++b) {
        if (!has(grp.bytes, static_cast<uint8_t>(b)) || has(grp.ref->first_bytes, static_cast<uint8_t>(b))) continue;
        const StateMask* p = piece[static_cast<size_t>(b)].get();
        or_ids(scratch, p->accepted_ids);
        grown->uncertain.insert(grown->uncertain.end(), p->uncertain.begin(), p->uncertain.end());
        grown->first_bytes[static_cast<size_t>(b) >> 5] |= 1u << (b & 31);
        piece[static_cast<size_t>(b)] = nullptr;  // held by the union now
      }
      if (grown->first_bytes != grp.ref->first_bytes) {
        const size_t added = grown->uncertain.size();
        grown->uncertain.insert(grown->uncertain.end(), grp.ref->uncertain.begin(), grp.ref->uncertain.end());
        std::inplace_merge(grown->uncertain.begin(), grown->uncertain.begin() + static_cast<long>(added),
                           grown->uncertain.end());
        grown->accepted_bits = scratch;
        grp.ref = std::move(grown);
        g_.tok->cache_replace(grp.key, grp.ref);
      }
      // The union minus the runs of bytes this state sends elsewhere (or nowhere)...
      for (int b = 0; b < 256; ++b) {
        if (!has(grp.ref->first_bytes, static_cast<uint8_t>(b)) || has(grp.bytes, static_cast<uint8_t>(b))) continue;
        for (size_t j = run_begin(b); j < tk.first_byte_end[static_cast<size_t>(b)]; ++j) {
          const int32_t id = tk.sorted[j];
          scratch[static_cast<size_t>(id) >> 5] &= ~(1u << (id & 31));
        }
      }
      for (int32_t pos : grp.ref->uncertain) {
        if (has(grp.bytes, first_byte(pos))) out->uncertain.push_back(pos);
      }
    } else {
      // First state with this target: build the union from its pieces and cache it.
      auto uni = std::make_shared<StateMask>();
      std::fill(scratch.begin(), scratch.end(), 0u);
      for (int b = 0; b < 256; ++b) {
        if (!has(grp.bytes, static_cast<uint8_t>(b))) continue;
        const StateMask* p = piece[static_cast<size_t>(b)].get();
        or_ids(scratch, p->accepted_ids);
        uni->uncertain.insert(uni->uncertain.end(), p->uncertain.begin(), p->uncertain.end());
        piece[static_cast<size_t>(b)] = nullptr;  // held by the union now
      }
      uni->accepted_bits = scratch;
      uni->first_bytes = grp.bytes;
      out->uncertain.insert(out->uncertain.end(), uni->uncertain.begin(), uni->uncertain.end());
      g_.tok->cache_put(grp.key, std::move(uni));
    }
    for (size_t w = 0; w < bits.size(); ++w) bits[w] |= scratch[w];
  }
  segments.push_back(out->uncertain.size());
  for (int b = 0; b < 256; ++b) {
    const StateMask* p = piece[static_cast<size_t>(b)].get();
    if (!p) continue;
    or_ids(bits, p->accepted_ids);
    out->uncertain.insert(out->uncertain.end(), p->uncertain.begin(), p->uncertain.end());
  }
  // Runs are disjoint, so the positions are distinct; groups interleave them.
  merge_segments(out->uncertain, segments, std::less<int32_t>());
  const size_t n_accepted = count_bits(bits.data(), bits.size());
  finish_mask(*out, std::move(bits), n_accepted);
  out->uncertain.shrink_to_fit();
  return out;
}

}  // namespace grammar
}  // namespace agent_infer
