// A check compiled to one automaton (ir.nodes.Check with `product`, kCheckProduct).
//
// A check is a boolean combination of its items' languages. This decides it by one automaton:
// its states are tuples of the items' parse configurations (state, return stack), as the mask's
// pushdown walk keeps them, and a state is final where a carrier and exactly an accepted set of
// items can finish. States from which no final state is reachable are dropped, so every prefix
// the automaton keeps has a completion the check accepts: masks need no run-time verdict and no
// proof about dead prefixes.
//
// The construction walks the product breadth first from the items' starts. A state's bytes are cut
// into intervals at every boundary of its configurations' byte edges, so one step per interval
// decides all its bytes.
//
// A rule called other than in tail position (a member's value, the free JSON value an open
// object's members take, a nested object) is not expanded at first: a call to it stays a call in
// the product, one reference edge carrying every item that makes it to its return configurations.
// That is exact when no item could read the same bytes another way at that point: the rule's
// FIRST bytes must be disjoint from every byte the state's configurations read themselves and
// from the FIRST bytes of the other rules called there, and the rule must not match the empty
// string. Then every item that reads the span reads it through the rule, whose language is the
// same for all of them. Where the condition does not hold, the calls are expanded there like any
// other (an item that reads a string where another calls a free JSON value: the value's string
// branch meets the string, its other branches go alone). Calls in tail position are expanded
// without a stack frame, so right-linear recursion (a residue automaton's digits) stays flat.
//
// It fails (the caller reports why) when a stack passes kMaxProductDepth (items recursing in step
// through rules that differ), when an item reaches a check still decided at run time, or when the
// product passes kMaxProductStates states or kMaxProductWork steps.
#include <algorithm>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "grammar/automaton.h"
#include "grammar/item_map.h"
#include "grammar/lower/check_lowering.h"

namespace agent_infer {
namespace grammar {

namespace {

constexpr int32_t kMaxProductDepth = 64;
constexpr uint8_t kCounted = 3;  // undecided[r]: a rule the matcher counts (see check_lowering.h)
constexpr size_t kMaxProductStates = 100000;
constexpr size_t kMaxItemConfigs = 4096;
// Configurations closed plus intervals stepped, over the whole construction (about 2 s).
constexpr size_t kMaxProductWork = 8000000;

struct Config {
  int32_t state, stack;  // stack: a return node, or -1 for the item's own level
  bool operator==(const Config& o) const { return state == o.state && stack == o.stack; }
  bool operator<(const Config& o) const { return state != o.state ? state < o.state : stack < o.stack; }
};

// A call to a recursive rule kept as a call: returning to `ret` with `stack` below it.
struct Call {
  int32_t rule, ret, stack;
  bool operator==(const Call& o) const { return rule == o.rule && ret == o.ret && stack == o.stack; }
  bool operator<(const Call& o) const {
    if (rule != o.rule) return rule < o.rule;
    return ret != o.ret ? ret < o.ret : stack < o.stack;
  }
};

// Sets bits lo..hi of a byte set, a word at a time (edges span up to 256 bytes).
void add_range(ByteSet& set, int lo, int hi) {
  for (int w = lo >> 5; w <= hi >> 5; ++w) {
    const int a = std::max(lo, w * 32) - w * 32, b = std::min(hi, w * 32 + 31) - w * 32;
    const uint32_t bits = b - a == 31 ? 0xFFFFFFFFu : ((1u << (b - a + 1)) - 1u) << a;
    set[static_cast<size_t>(w)] |= bits;
  }
}

uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
  return h * 0xff51afd7ed558ccdull;
}

class Product {
 public:
  Product(const CheckSpec& spec, const std::vector<int32_t>& base, const std::vector<uint32_t>& count,
          const std::vector<uint8_t>& undecided, const DfaPool& pool, Deadline* deadline)
      : spec_(spec), base_(base), count_(count), undecided_(undecided), pool_(pool), deadline_(deadline) {}

  // The product automaton appended to `out`; its start, or -1 (why_).
  int32_t build(DfaPool* out) {
    find_first_sets();
    const size_t n = spec_.items.size();
    std::vector<int32_t> start(n);
    for (size_t i = 0; i < n; ++i) {
      const int32_t r = spec_.items[i];
      if (base_[static_cast<size_t>(r)] < 0) {
        start[i] = -1;
        continue;
      }
      if (undecided_[static_cast<size_t>(r)] == kCounted) {
        fail("an item is a unique array item or a max-length string (the product cannot count it)");
        return -1;
      }
      cfg_.assign(1, Config{base_[static_cast<size_t>(r)], -1});
      start[i] = close();
      if (failed_) return -1;
    }
    width_ = n;
    slots_.assign(1024, -1);
    intern_tuple(start);
    for (size_t p = 0; p < num_tuples(); ++p) {
      deadline_->check();
      if (!expand(p)) return -1;
    }
    return emit(out);
  }

  const std::string& why() const { return why_; }
  bool blocked() const { return blocked_; }

 private:
  // Per-item configuration sets, interned: the byte-reading configurations, and whether the item
  // may finish there (a final state with nothing left on its stack).
  struct Set {
    std::vector<Config> cfg;
    std::vector<Call> calls;
    bool done;
    // Read off cfg once: the bytes it reads, its edges' boundaries, the recursive rules it calls.
    ByteSet reads{};
    std::vector<int> cuts;
    std::vector<int32_t> called;
  };

  static Set make_set(const DfaPool& pool, std::vector<Config> cfg, std::vector<Call> calls, bool done) {
    Set set{std::move(cfg), std::move(calls), done, ByteSet{}, {}, {}};
    for (const Config& c : set.cfg) {
      const uint32_t s = static_cast<uint32_t>(c.state);
      for (uint32_t e = pool.byte_begin[s]; e < pool.byte_begin[s + 1]; ++e) {
        const ByteEdge& be = pool.bytes[e];
        set.cuts.push_back(be.lo);
        set.cuts.push_back(be.hi + 1);
        add_range(set.reads, be.lo, be.hi);
      }
    }
    std::sort(set.cuts.begin(), set.cuts.end());
    set.cuts.erase(std::unique(set.cuts.begin(), set.cuts.end()), set.cuts.end());
    for (const Call& c : set.calls) {
      if (std::find(set.called.begin(), set.called.end(), c.rule) == set.called.end()) set.called.push_back(c.rule);
    }
    return set;
  }

  // The FIRST bytes of the rules reachable from the items, and whether they match the empty
  // string (both by fixpoint over the pool's automata).
  void find_first_sets() {
    const size_t R = base_.size();
    std::vector<int32_t> reach;
    std::vector<uint8_t> seen(R, 0);
    for (int32_t item : spec_.items) {
      if (!seen[static_cast<size_t>(item)]) {
        seen[static_cast<size_t>(item)] = 1;
        reach.push_back(item);
      }
    }
    for (size_t k = 0; k < reach.size(); ++k) {
      const int32_t r = reach[k];
      const int32_t b = base_[static_cast<size_t>(r)];
      if (b < 0) continue;
      for (uint32_t e = pool_.ref_begin[static_cast<size_t>(b)];
           e < pool_.ref_begin[static_cast<size_t>(b) + count_[static_cast<size_t>(r)]]; ++e) {
        const int32_t q = pool_.refs[e].rule;
        if (!seen[static_cast<size_t>(q)]) {
          seen[static_cast<size_t>(q)] = 1;
          reach.push_back(q);
        }
      }
    }
    // FIRST bytes and nullability of every reachable rule, to a fixpoint.
    first_.assign(R, ByteSet{});
    nullable_.assign(R, 0);
    for (bool changed = true; changed;) {
      changed = false;
      for (int32_t r : reach) {
        const int32_t b = base_[static_cast<size_t>(r)];
        if (b < 0) continue;
        ByteSet first{};
        bool empty = false;
        std::vector<int32_t> todo{b};
        std::vector<int32_t> visited{b};
        while (!todo.empty()) {
          const uint32_t q = static_cast<uint32_t>(todo.back());
          todo.pop_back();
          if (pool_.final[q]) empty = true;
          for (uint32_t e = pool_.byte_begin[q]; e < pool_.byte_begin[q + 1]; ++e) {
            add_range(first, pool_.bytes[e].lo, pool_.bytes[e].hi);
          }
          for (uint32_t e = pool_.ref_begin[q]; e < pool_.ref_begin[q + 1]; ++e) {
            const RefEdge& re = pool_.refs[e];
            for (size_t w = 0; w < 8; ++w) first[w] |= first_[static_cast<size_t>(re.rule)][w];
            if (nullable_[static_cast<size_t>(re.rule)] &&
                std::find(visited.begin(), visited.end(), re.target) == visited.end()) {
              visited.push_back(re.target);
              todo.push_back(re.target);
            }
          }
        }
        if (first != first_[static_cast<size_t>(r)] || static_cast<uint8_t>(empty) != nullable_[static_cast<size_t>(r)]) {
          first_[static_cast<size_t>(r)] = first;
          nullable_[static_cast<size_t>(r)] = empty ? 1 : 0;
          changed = true;
        }
      }
    }
  }

  bool fail(std::string why) {
    failed_ = true;
    why_ = std::move(why);
    return false;
  }

  // A return to a state that can only finish: the call is a tail call, which pushes nothing (so
  // right-linear recursion, a residue automaton's digits, stays as shallow as a loop).
  bool tail_return(int32_t ret) const {
    const uint32_t rs = static_cast<uint32_t>(ret);
    return pool_.final[rs] && pool_.byte_begin[rs + 1] == pool_.byte_begin[rs] &&
           pool_.ref_begin[rs + 1] == pool_.ref_begin[rs];
  }

  int32_t node(int32_t ret, int32_t parent) {
    if (tail_return(ret)) return parent;
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
    std::vector<Config>& work = work_;
    work.swap(cfg_);
    cfg_.clear();
    calls_.clear();
    bool done = false;
    closed_ = 0;
    work_done_ += work.size();
    for (size_t k = 0; k < work.size() && !failed_; ++k) {
      const Config c = work[k];
      const uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(c.state)) << 32) |
                           static_cast<uint32_t>(c.stack + 1);
      if (!seen_.insert(key)) continue;
      if (++closed_ > kMaxItemConfigs) {
        fail("an item's parse holds more than " + std::to_string(kMaxItemConfigs) + " configurations");
        break;
      }
      const uint32_t s = static_cast<uint32_t>(c.state);
      if (pool_.byte_begin[s + 1] > pool_.byte_begin[s]) cfg_.push_back(c);
      for (uint32_t e = pool_.ref_begin[s]; e < pool_.ref_begin[s + 1]; ++e) {
        const RefEdge& re = pool_.refs[e];
        const uint8_t u = undecided_[static_cast<size_t>(re.rule)];
        if (u == kCounted) {
          // The matcher applies the rule's mark where the rule completes: kept as a call, every
          // item reading the span through it is judged the same; expanded, the mark would be lost.
          if (tail_return(re.target)) {
            fail("an item ends with a unique array item or a max-length string (the product cannot count it)");
            break;
          }
          calls_.push_back({re.rule, re.target, c.stack});
          continue;
        }
        if (u != 0) {
          blocked_ = u == 2 && re.rule != spec_.rule;
          fail(re.rule == spec_.rule ? "an item contains the check itself (it recurses)"
               : u == 1              ? "an item reaches a check decided at run time"
                                     : "an item reaches another such check not built yet");
          break;
        }
        const int32_t b = base_[static_cast<size_t>(re.rule)];
        if (b < 0 || count_[static_cast<size_t>(re.rule)] == 0) continue;
        if (!tail_return(re.target)) {
          calls_.push_back({re.rule, re.target, c.stack});  // kept as a call (see the file comment)
          continue;
        }
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
    // A set being expanded (expand_calls) keeps what it held besides the calls it expands.
    cfg_.insert(cfg_.end(), extra_cfg_.begin(), extra_cfg_.end());
    calls_.insert(calls_.end(), extra_calls_.begin(), extra_calls_.end());
    done = done || extra_done_;
    if (failed_ || (cfg_.empty() && calls_.empty() && !done)) return -1;
    std::sort(cfg_.begin(), cfg_.end());
    cfg_.erase(std::unique(cfg_.begin(), cfg_.end()), cfg_.end());
    std::sort(calls_.begin(), calls_.end());
    calls_.erase(std::unique(calls_.begin(), calls_.end()), calls_.end());
    uint64_t h = done ? 1 : 2;
    for (const Config& c : cfg_) h = mix(h, (static_cast<uint64_t>(static_cast<uint32_t>(c.state)) << 32) | static_cast<uint32_t>(c.stack));
    for (const Call& c : calls_) {
      h = mix(h, (static_cast<uint64_t>(static_cast<uint32_t>(c.rule)) << 32) | static_cast<uint32_t>(c.ret));
      h = mix(h, static_cast<uint64_t>(static_cast<uint32_t>(c.stack)));
    }
    auto [at, fresh] = set_ids_.emplace(h, -1);
    for (int32_t id = at->second; id >= 0; id = set_next_[static_cast<size_t>(id)]) {
      const Set& other = sets_[static_cast<size_t>(id)];
      if (other.done == done && other.cfg == cfg_ && other.calls == calls_) return id;
    }
    const int32_t id = static_cast<int32_t>(sets_.size());
    sets_.push_back(make_set(pool_, cfg_, calls_, done));
    set_next_.push_back(at->second);
    at->second = id;
    return id;
  }

  // The set item set `a` goes to on byte b (memoized in a row of 256 per set), -1 dead.
  int32_t step(int32_t a, uint8_t b) {
    const size_t row = static_cast<size_t>(a) * 256;
    if (steps_.size() < row + 256) steps_.resize(sets_.size() * 256, kUnknown);
    if (steps_[row + b] != kUnknown) return steps_[row + b];
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
    if (steps_.size() < row + 256) steps_.resize(sets_.size() * 256, kUnknown);
    steps_[row + b] = id;
    return id;
  }

  // Set `a` with its calls to the recursive rule `rule` expanded (pushed, as any other call), for
  // a point where the rule cannot be one edge for all items (memoized).
  int32_t expand_calls(int32_t a, int32_t rule) {
    if (undecided_[static_cast<size_t>(rule)] == kCounted) {
      fail("another item reads a unique array item or a max-length string another way");
      return -1;
    }
    const uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(rule);
    auto found = expansions_.find(key);
    if (found != expansions_.end()) return found->second;
    const Set s = sets_[static_cast<size_t>(a)];
    cfg_.clear();
    extra_calls_.clear();
    for (const Call& c : s.calls) {
      if (c.rule != rule) {
        extra_calls_.push_back(c);
        continue;
      }
      const int32_t st = node(c.ret, c.stack);
      if (failed_) return -1;
      cfg_.push_back({base_[static_cast<size_t>(rule)], st});
    }
    extra_cfg_ = s.cfg;
    extra_done_ = s.done;
    const int32_t id = close();
    extra_cfg_.clear();
    extra_calls_.clear();
    extra_done_ = false;
    expansions_.emplace(key, id);
    return id;
  }

  // The set an item set goes to when the recursive rule `rule`, called there, finishes: its
  // configurations returned to (memoized), -1 if it makes no such call.
  int32_t returned(int32_t a, int32_t rule) {
    const uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(rule);
    auto found = returns_.find(key);
    if (found != returns_.end()) return found->second;
    cfg_.clear();
    for (const Call& c : sets_[static_cast<size_t>(a)].calls) {
      if (c.rule == rule) cfg_.push_back({c.ret, c.stack});
    }
    const int32_t id = cfg_.empty() ? -1 : close();
    returns_.emplace(key, id);
    return id;
  }

  size_t num_tuples() const { return arena_.size() / width_; }
  const int32_t* tuple(size_t p) const { return arena_.data() + p * width_; }

  static uint64_t hash_tuple(const int32_t* t, size_t n) {
    uint64_t h = 7;
    for (size_t i = 0; i < n; ++i) h = mix(h, static_cast<uint64_t>(static_cast<uint32_t>(t[i] + 1)));
    return h;
  }

  // The id of tuple t (open addressing over the arena's rows), adding it if new.
  int32_t intern_tuple(const std::vector<int32_t>& t) {
    if (num_tuples() * 2 >= slots_.size()) {
      std::vector<int32_t> grown(slots_.size() * 2, -1);
      for (size_t p = 0; p < num_tuples(); ++p) {
        size_t k = hash_tuple(tuple(p), width_) & (grown.size() - 1);
        while (grown[k] >= 0) k = (k + 1) & (grown.size() - 1);
        grown[k] = static_cast<int32_t>(p);
      }
      slots_.swap(grown);
    }
    size_t k = hash_tuple(t.data(), width_) & (slots_.size() - 1);
    for (; slots_[k] >= 0; k = (k + 1) & (slots_.size() - 1)) {
      if (std::equal(t.begin(), t.end(), tuple(static_cast<size_t>(slots_[k])))) return slots_[k];
    }
    const int32_t id = static_cast<int32_t>(num_tuples());
    slots_[k] = id;
    arena_.insert(arena_.end(), t.begin(), t.end());
    return id;
  }

  bool carrier_alive(const std::vector<int32_t>& t) const {
    for (int32_t i = 0; i < spec_.carriers; ++i) {
      if (t[static_cast<size_t>(i)] >= 0) return true;
    }
    return false;
  }

  bool is_final(const int32_t* t) const {
    uint32_t members = 0;
    for (size_t i = 0; i < width_; ++i) {
      if (t[i] >= 0 && sets_[static_cast<size_t>(t[i])].done) members |= 1u << i;
    }
    const uint32_t carriers = (1u << spec_.carriers) - 1;
    return (members & carriers) != 0 && std::binary_search(spec_.accept.begin(), spec_.accept.end(), members);
  }

  // The rule of a call in tuple t that cannot be one edge for all items (its FIRST bytes meet bytes
  // read there otherwise, or another called rule's), or -1.
  int32_t conflict(const std::vector<int32_t>& t) {
    ByteSet direct{};
    std::vector<int32_t> called;
    for (int32_t id : t) {
      if (id < 0) continue;
      const Set& set = sets_[static_cast<size_t>(id)];
      for (size_t w = 0; w < 8; ++w) direct[w] |= set.reads[w];
      for (int32_t rule : set.called) {
        if (std::find(called.begin(), called.end(), rule) == called.end()) called.push_back(rule);
      }
    }
    ByteSet claimed = direct;
    for (int32_t rule : called) {
      const ByteSet& first = first_[static_cast<size_t>(rule)];
      bool clash = nullable_[static_cast<size_t>(rule)] != 0;
      for (size_t w = 0; w < 8 && !clash; ++w) clash = (claimed[w] & first[w]) != 0;
      if (clash) return rule;
      for (size_t w = 0; w < 8; ++w) claimed[w] |= first[w];
    }
    return -1;
  }

  bool expand(size_t p) {
    std::vector<int32_t> t(tuple(p), tuple(p) + width_);
    byte_at_.push_back(static_cast<uint32_t>(byte_out_.size()));
    ref_at_.push_back(static_cast<uint32_t>(ref_out_.size()));
    // Calls that cannot be one edge are expanded in this state's sets (the product state stays
    // the same language); an item recursing in step with another fails on its stack depth.
    for (int32_t rule = conflict(t); rule >= 0; rule = conflict(t)) {
      for (int32_t& id : t) {
        if (id >= 0) {
          const std::vector<int32_t>& called = sets_[static_cast<size_t>(id)].called;
          if (std::find(called.begin(), called.end(), rule) != called.end()) id = expand_calls(id, rule);
        }
      }
      if (failed_) return false;
    }
    // Decided here, on the expanded sets: a call expanded for a nullable rule may finish an item.
    finals_.push_back(is_final(t.data()) ? 1 : 0);
    // Cut points: every edge boundary of every configuration of every item; the bytes they read.
    std::vector<int>& cuts = cuts_;
    cuts.clear();
    std::vector<int32_t> called;
    for (int32_t id : t) {
      if (id < 0) continue;
      const Set& set = sets_[static_cast<size_t>(id)];
      cuts.insert(cuts.end(), set.cuts.begin(), set.cuts.end());
      for (int32_t rule : set.called) {
        if (std::find(called.begin(), called.end(), rule) == called.end()) called.push_back(rule);
      }
    }
    // Recursive rules called here: each one edge for all items (nothing else reads their bytes).
    for (int32_t rule : called) {
      std::vector<int32_t> next(t.size());
      for (size_t i = 0; i < t.size(); ++i) next[i] = t[i] < 0 ? -1 : returned(t[i], rule);
      if (failed_) return false;
      if (!carrier_alive(next)) continue;
      const int32_t to = intern_tuple(next);
      if (num_tuples() > kMaxProductStates) {
        return fail("the product of its items passes " + std::to_string(kMaxProductStates) + " states");
      }
      ref_out_.push_back({rule, to});
    }
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    std::vector<int32_t> next(t.size());
    work_done_ += cuts.size() * t.size();
    if (work_done_ > kMaxProductWork) {
      return fail("building the product of its items takes more than " + std::to_string(kMaxProductWork) + " steps");
    }
    for (size_t k = 0; k + 1 < cuts.size(); ++k) {
      const int lo = cuts[k], hi = cuts[k + 1] - 1;
      for (size_t i = 0; i < t.size(); ++i) next[i] = t[i] < 0 ? -1 : step(t[i], static_cast<uint8_t>(lo));
      if (failed_) return false;
      if (!carrier_alive(next)) continue;
      const int32_t to = intern_tuple(next);
      if (num_tuples() > kMaxProductStates) {
        return fail("the product of its items passes " + std::to_string(kMaxProductStates) + " states");
      }
      byte_out_.push_back({static_cast<uint8_t>(lo), static_cast<uint8_t>(hi), to});
    }
    return true;
  }

  int32_t emit(DfaPool* out) {
    const size_t S = num_tuples();
    byte_at_.push_back(static_cast<uint32_t>(byte_out_.size()));
    ref_at_.push_back(static_cast<uint32_t>(ref_out_.size()));
    auto bytes_of = [&](size_t p) {
      return std::pair<const ByteEdge*, const ByteEdge*>(byte_out_.data() + byte_at_[p], byte_out_.data() + byte_at_[p + 1]);
    };
    auto refs_of = [&](size_t p) {
      return std::pair<const RefEdge*, const RefEdge*>(ref_out_.data() + ref_at_[p], ref_out_.data() + ref_at_[p + 1]);
    };
    // Live: a final state is reachable (backward search over the reversed edges).
    std::vector<std::vector<int32_t>> rev(S);
    std::vector<uint8_t> live(S, 0);
    std::vector<int32_t> work;
    for (size_t p = 0; p < S; ++p) {
      for (auto [e, end] = bytes_of(p); e != end; ++e) rev[static_cast<size_t>(e->target)].push_back(static_cast<int32_t>(p));
      for (auto [e, end] = refs_of(p); e != end; ++e) rev[static_cast<size_t>(e->target)].push_back(static_cast<int32_t>(p));
      if (finals_[p]) {
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
      out->final.push_back(live[p] && finals_[p] ? 1 : 0);
      if (live[p]) {
        for (auto [e, end] = bytes_of(p); e != end; ++e) {
          const int32_t to = at[static_cast<size_t>(e->target)];
          if (to >= 0 && live[static_cast<size_t>(e->target)]) out->bytes.push_back({e->lo, e->hi, to});
        }
      }
      out->byte_begin.push_back(static_cast<uint32_t>(out->bytes.size()));
      if (live[p]) {
        for (auto [e, end] = refs_of(p); e != end; ++e) {
          const int32_t to = at[static_cast<size_t>(e->target)];
          if (to >= 0 && live[static_cast<size_t>(e->target)]) out->refs.push_back({e->rule, to});
        }
      }
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
  Deadline* deadline_;
  std::vector<Node> nodes_;
  std::unordered_map<uint64_t, int32_t> node_ids_;
  std::vector<Config> cfg_;
  std::vector<Call> calls_;
  std::vector<int> cuts_;
  std::vector<Config> extra_cfg_;
  std::vector<Call> extra_calls_;
  bool extra_done_ = false;
  std::unordered_map<uint64_t, int32_t> expansions_;
  std::vector<Config> work_;
  ItemMap seen_;  // the configurations one close() has met
  size_t closed_ = 0;
  size_t work_done_ = 0;
  std::vector<uint8_t> nullable_;
  std::vector<ByteSet> first_;
  std::unordered_map<uint64_t, int32_t> returns_;
  // Edges of tuple p: [byte_at_[p], byte_at_[p + 1]) of byte_out_ (tuples are expanded in order).
  std::vector<ByteEdge> byte_out_;
  std::vector<RefEdge> ref_out_;
  std::vector<uint32_t> byte_at_, ref_at_;
  std::vector<uint8_t> finals_;  // per tuple, whether it is final (set by expand)
  std::vector<Set> sets_;
  std::unordered_map<uint64_t, int32_t> set_ids_;  // hash -> newest set, chained by set_next_
  std::vector<int32_t> set_next_;
  static constexpr int32_t kUnknown = -2;
  std::vector<int32_t> steps_;  // 256 per set: the set a byte leads to, -1 dead, kUnknown not yet
  size_t width_ = 0;
  std::vector<int32_t> arena_;  // tuples, width_ set ids each
  std::vector<int32_t> slots_;  // open addressing: tuple ids, -1 free
  bool failed_ = false;
  bool blocked_ = false;
  std::string why_;
};

}  // namespace

int32_t build_check_product(const CheckSpec& spec, const std::vector<int32_t>& base, const std::vector<uint32_t>& count,
                            const std::vector<uint8_t>& undecided, DfaPool* pool, Deadline* deadline,
                            std::string* why, bool* blocked) {
  // Built into a separate pool first: the source automata are read while the product is made.
  DfaPool out;
  out.reset();
  Product product(spec, base, count, undecided, *pool, deadline);
  if (product.build(&out) < 0) {
    *why = product.why();
    *blocked = product.blocked();
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
    for (uint32_t e = out.ref_begin[s]; e < out.ref_begin[s + 1]; ++e) {
      RefEdge re = out.refs[e];
      re.target += shift;
      pool->refs.push_back(re);
    }
    pool->ref_begin.push_back(static_cast<uint32_t>(pool->refs.size()));
  }
  return shift;
}

}  // namespace grammar
}  // namespace agent_infer
