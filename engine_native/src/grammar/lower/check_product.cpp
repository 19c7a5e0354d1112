// A run-time check compiled to one automaton (ir.nodes.Check with `product`, kCheckProduct).
//
// When a check's items do not recurse, each item's language is regular: its rule's automaton with
// the rules it calls expanded in place. The check is then a boolean combination of regular
// languages, decided by one deterministic automaton over bytes: its states are tuples of the
// items' parse configurations (state, return stack), as the mask's pushdown walk keeps them, and a
// state is final where a carrier and exactly the accepted set of items can finish. States from
// which no final state is reachable are dropped, so every prefix the automaton keeps has a
// completion the check accepts: masks need no run-time verdict and no proof about dead prefixes.
//
// The construction walks the product breadth first from the items' starts. A state's bytes are cut
// into intervals at every boundary of its configurations' byte edges, so one step per interval
// decides all its bytes. It fails (the caller reports why) when a stack passes kMaxProductDepth (a
// recursive item), when an item reaches a check that is still decided at run time, or when the
// product passes kMaxProductStates states.
#include <algorithm>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "grammar/automaton.h"
#include "grammar/lower/check_lowering.h"

namespace agent_infer {
namespace grammar {

namespace {

constexpr int32_t kMaxProductDepth = 64;
constexpr size_t kMaxProductStates = 20000;
constexpr size_t kMaxItemConfigs = 4096;

struct Config {
  int32_t state, stack;  // stack: a return node, or -1 for the item's own level
  bool operator==(const Config& o) const { return state == o.state && stack == o.stack; }
  bool operator<(const Config& o) const { return state != o.state ? state < o.state : stack < o.stack; }
};

uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
  return h * 0xff51afd7ed558ccdull;
}

class Product {
 public:
  Product(const CheckSpec& spec, const std::vector<int32_t>& base, const std::vector<uint32_t>& count,
          const std::vector<uint8_t>& undecided, const DfaPool& pool)
      : spec_(spec), base_(base), count_(count), undecided_(undecided), pool_(pool) {}

  // The product automaton appended to `out`; its start, or -1 (why_).
  int32_t build(DfaPool* out) {
    const size_t n = spec_.items.size();
    std::vector<int32_t> start(n);
    for (size_t i = 0; i < n; ++i) {
      const int32_t r = spec_.items[i];
      if (base_[static_cast<size_t>(r)] < 0) {
        start[i] = -1;
        continue;
      }
      cfg_.assign(1, Config{base_[static_cast<size_t>(r)], -1});
      start[i] = close();
      if (failed_) return -1;
    }
    intern_tuple(start);
    for (size_t p = 0; p < tuples_.size(); ++p) {
      if (!expand(p)) return -1;
    }
    return emit(out);
  }

  const std::string& why() const { return why_; }

 private:
  // Per-item configuration sets, interned: the byte-reading configurations, and whether the item
  // may finish there (a final state with nothing left on its stack).
  struct Set {
    std::vector<Config> cfg;
    bool done;
  };

  bool fail(std::string why) {
    failed_ = true;
    why_ = std::move(why);
    return false;
  }

  int32_t node(int32_t ret, int32_t parent) {
    // A return to a state that can only finish returns straight on (a tail call).
    const uint32_t rs = static_cast<uint32_t>(ret);
    if (pool_.final[rs] && pool_.byte_begin[rs + 1] == pool_.byte_begin[rs] &&
        pool_.ref_begin[rs + 1] == pool_.ref_begin[rs]) {
      return parent;
    }
    const uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(ret)) << 32) | static_cast<uint32_t>(parent + 1);
    auto found = node_ids_.find(key);
    if (found != node_ids_.end()) return found->second;
    const int32_t depth = parent < 0 ? 1 : nodes_[static_cast<size_t>(parent)].depth + 1;
    if (depth > kMaxProductDepth) {
      fail("an item calls rules more than " + std::to_string(kMaxProductDepth) + " deep (it recurses)");
      return -1;
    }
    const int32_t id = static_cast<int32_t>(nodes_.size());
    nodes_.push_back({ret, parent, depth});
    node_ids_.emplace(key, id);
    return id;
  }

  // Closes cfg_ (calls pushed, finishes popped) and interns the byte-reading part; -1 if empty.
  int32_t close() {
    seen_.clear();
    std::vector<Config> work;
    work.swap(cfg_);
    cfg_.clear();
    bool done = false;
    for (size_t k = 0; k < work.size() && !failed_; ++k) {
      const Config c = work[k];
      const uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(c.state)) << 32) |
                           static_cast<uint32_t>(c.stack + 1);
      if (!seen_.emplace(key, 0).second) continue;
      if (seen_.size() > kMaxItemConfigs) {
        fail("an item's parse holds more than " + std::to_string(kMaxItemConfigs) + " configurations");
        break;
      }
      const uint32_t s = static_cast<uint32_t>(c.state);
      if (pool_.byte_begin[s + 1] > pool_.byte_begin[s]) cfg_.push_back(c);
      for (uint32_t e = pool_.ref_begin[s]; e < pool_.ref_begin[s + 1]; ++e) {
        const RefEdge& re = pool_.refs[e];
        if (const uint8_t u = undecided_[static_cast<size_t>(re.rule)]) {
          fail(re.rule == spec_.rule ? "an item contains the check itself (it recurses)"
               : u == 1              ? "an item reaches a check decided at run time"
                                     : "an item reaches another such check that cannot be built first (they recurse)");
          break;
        }
        const int32_t b = base_[static_cast<size_t>(re.rule)];
        if (b < 0 || count_[static_cast<size_t>(re.rule)] == 0) continue;
        const int32_t st = node(re.target, c.stack);
        if (failed_) break;
        work.push_back({b, st});
      }
      if (pool_.final[s]) {
        if (c.stack < 0) {
          done = true;
        } else {
          const Node& nd = nodes_[static_cast<size_t>(c.stack)];
          work.push_back({nd.ret, nd.parent});
        }
      }
    }
    if (failed_ || (cfg_.empty() && !done)) return -1;
    std::sort(cfg_.begin(), cfg_.end());
    cfg_.erase(std::unique(cfg_.begin(), cfg_.end()), cfg_.end());
    uint64_t h = done ? 1 : 2;
    for (const Config& c : cfg_) h = mix(h, (static_cast<uint64_t>(static_cast<uint32_t>(c.state)) << 32) | static_cast<uint32_t>(c.stack));
    auto [at, fresh] = set_ids_.emplace(h, std::vector<int32_t>());
    for (int32_t id : at->second) {
      if (sets_[static_cast<size_t>(id)].done == done && sets_[static_cast<size_t>(id)].cfg == cfg_) return id;
    }
    const int32_t id = static_cast<int32_t>(sets_.size());
    sets_.push_back({cfg_, done});
    at->second.push_back(id);
    return id;
  }

  // The set item set `a` goes to on byte b (memoized), -1 dead.
  int32_t step(int32_t a, uint8_t b) {
    const uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 8) | b;
    auto found = steps_.find(key);
    if (found != steps_.end()) return found->second;
    cfg_.clear();
    for (const Config& c : sets_[static_cast<size_t>(a)].cfg) {
      const uint32_t s = static_cast<uint32_t>(c.state);
      for (uint32_t e = pool_.byte_begin[s]; e < pool_.byte_begin[s + 1]; ++e) {
        const ByteEdge& be = pool_.bytes[e];
        if (b >= be.lo && b <= be.hi) {
          cfg_.push_back({be.target, c.stack});
          break;
        }
      }
    }
    const int32_t id = cfg_.empty() ? -1 : close();
    steps_.emplace(key, id);
    return id;
  }

  int32_t intern_tuple(const std::vector<int32_t>& t) {
    uint64_t h = 7;
    for (int32_t x : t) h = mix(h, static_cast<uint64_t>(static_cast<uint32_t>(x + 1)));
    auto [at, fresh] = tuple_ids_.emplace(h, std::vector<int32_t>());
    for (int32_t id : at->second) {
      if (tuples_[static_cast<size_t>(id)] == t) return id;
    }
    const int32_t id = static_cast<int32_t>(tuples_.size());
    tuples_.push_back(t);
    at->second.push_back(id);
    edges_.emplace_back();
    return id;
  }

  bool carrier_alive(const std::vector<int32_t>& t) const {
    for (int32_t i = 0; i < spec_.carriers; ++i) {
      if (t[static_cast<size_t>(i)] >= 0) return true;
    }
    return false;
  }

  bool is_final(const std::vector<int32_t>& t) const {
    uint32_t members = 0;
    for (size_t i = 0; i < t.size(); ++i) {
      if (t[i] >= 0 && sets_[static_cast<size_t>(t[i])].done) members |= 1u << i;
    }
    const uint32_t carriers = (1u << spec_.carriers) - 1;
    return (members & carriers) != 0 && std::binary_search(spec_.accept.begin(), spec_.accept.end(), members);
  }

  bool expand(size_t p) {
    const std::vector<int32_t> t = tuples_[p];
    // Cut points: every edge boundary of every configuration of every item.
    std::vector<int> cuts;
    for (int32_t id : t) {
      if (id < 0) continue;
      for (const Config& c : sets_[static_cast<size_t>(id)].cfg) {
        const uint32_t s = static_cast<uint32_t>(c.state);
        for (uint32_t e = pool_.byte_begin[s]; e < pool_.byte_begin[s + 1]; ++e) {
          cuts.push_back(pool_.bytes[e].lo);
          cuts.push_back(pool_.bytes[e].hi + 1);
        }
      }
    }
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    std::vector<int32_t> next(t.size());
    for (size_t k = 0; k + 1 < cuts.size(); ++k) {
      const int lo = cuts[k], hi = cuts[k + 1] - 1;
      for (size_t i = 0; i < t.size(); ++i) next[i] = t[i] < 0 ? -1 : step(t[i], static_cast<uint8_t>(lo));
      if (failed_) return false;
      if (!carrier_alive(next)) continue;
      const int32_t to = intern_tuple(next);
      if (tuples_.size() > kMaxProductStates) {
        return fail("the product of its items passes " + std::to_string(kMaxProductStates) + " states");
      }
      edges_[p].push_back({static_cast<uint8_t>(lo), static_cast<uint8_t>(hi), to});
    }
    return true;
  }

  int32_t emit(DfaPool* out) {
    const size_t S = tuples_.size();
    // Live: a final state is reachable (backward search over the reversed edges).
    std::vector<std::vector<int32_t>> rev(S);
    std::vector<uint8_t> live(S, 0);
    std::vector<int32_t> work;
    for (size_t p = 0; p < S; ++p) {
      for (const ByteEdge& e : edges_[p]) rev[static_cast<size_t>(e.target)].push_back(static_cast<int32_t>(p));
      if (is_final(tuples_[p])) {
        live[p] = 1;
        work.push_back(static_cast<int32_t>(p));
      }
    }
    while (!work.empty()) {
      const int32_t p = work.back();
      work.pop_back();
      for (int32_t q : rev[static_cast<size_t>(p)]) {
        if (!live[static_cast<size_t>(q)]) {
          live[static_cast<size_t>(q)] = 1;
          work.push_back(q);
        }
      }
    }
    std::vector<int32_t> at(S, -1);
    const int32_t first = static_cast<int32_t>(out->size());
    int32_t next = first;
    at[0] = next++;  // the start, live or not (an empty language is a start without edges)
    for (size_t p = 1; p < S; ++p) {
      if (live[p]) at[p] = next++;
    }
    for (size_t p = 0; p < S; ++p) {
      if (at[p] < 0) continue;
      out->final.push_back(live[p] && is_final(tuples_[p]) ? 1 : 0);
      if (live[p]) {
        for (const ByteEdge& e : edges_[p]) {
          const int32_t to = at[static_cast<size_t>(e.target)];
          if (to >= 0 && live[static_cast<size_t>(e.target)]) out->bytes.push_back({e.lo, e.hi, to});
        }
      }
      out->byte_begin.push_back(static_cast<uint32_t>(out->bytes.size()));
      out->ref_begin.push_back(static_cast<uint32_t>(out->refs.size()));
    }
    return first;
  }

  struct Node {
    int32_t ret, parent, depth;
  };

  const CheckSpec& spec_;
  const std::vector<int32_t>& base_;
  const std::vector<uint32_t>& count_;
  const std::vector<uint8_t>& undecided_;
  const DfaPool& pool_;
  std::vector<Node> nodes_;
  std::unordered_map<uint64_t, int32_t> node_ids_;
  std::vector<Config> cfg_;
  std::unordered_map<uint64_t, int> seen_;
  std::vector<Set> sets_;
  std::unordered_map<uint64_t, std::vector<int32_t>> set_ids_;
  std::unordered_map<uint64_t, int32_t> steps_;
  std::vector<std::vector<int32_t>> tuples_;
  std::unordered_map<uint64_t, std::vector<int32_t>> tuple_ids_;
  std::vector<std::vector<ByteEdge>> edges_;
  bool failed_ = false;
  std::string why_;
};

}  // namespace

int32_t build_check_product(const CheckSpec& spec, const std::vector<int32_t>& base, const std::vector<uint32_t>& count,
                            const std::vector<uint8_t>& undecided, DfaPool* pool, std::string* why) {
  // Built into a separate pool first: the source automata are read while the product is made.
  DfaPool out;
  out.reset();
  Product product(spec, base, count, undecided, *pool);
  if (product.build(&out) < 0) {
    *why = product.why();
    return -1;
  }
  const int32_t shift = static_cast<int32_t>(pool->size());
  for (size_t s = 0; s < out.size(); ++s) {
    pool->final.push_back(out.final[s]);
    for (uint32_t e = out.byte_begin[s]; e < out.byte_begin[s + 1]; ++e) {
      ByteEdge be = out.bytes[e];
      be.target += shift;
      pool->bytes.push_back(be);
    }
    pool->byte_begin.push_back(static_cast<uint32_t>(pool->bytes.size()));
    pool->ref_begin.push_back(static_cast<uint32_t>(pool->refs.size()));
  }
  return shift;
}

}  // namespace grammar
}  // namespace agent_infer
