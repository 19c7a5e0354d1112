// FOLLOW and escape sets of a lowered grammar (the byte sets the token walks test before calling
// a dying token uncertain; see docs/grammar_engine.md, "Token masks").
//
// FIRST of a state (the bytes readable next from it, leaving its rule included) and FOLLOW of a
// rule are the least solution of set inclusions between states and rules. The solution is a
// reachability problem: a node's set is the union of the initial sets (a state's own byte edges)
// of every node it depends on. So instead of sweeping all states until nothing changes (one
// sweep per link of the longest dependency chain), the dependency graph is condensed into its
// strongly connected components once, and each component's set is the union of its members'
// byte edges and of the components it depends on, which Tarjan's algorithm finishes first.
#include <algorithm>
#include <chrono>

#include "grammar/automaton.h"
#include "grammar/compiled_grammar.h"
#include "grammar/errors.h"
#include "grammar/thread_slot.h"

namespace agent_infer {
namespace grammar {
namespace {


void add_range(ByteSet& set, int lo, int hi) {
  const int first = lo >> 5, last = hi >> 5;
  const uint32_t low_bits = ~0u << (lo & 31), high_bits = ~0u >> (31 - (hi & 31));
  if (first == last) {
    set[first] |= low_bits & high_bits;
    return;
  }
  set[first] |= low_bits;
  for (int w = first + 1; w < last; ++w) set[w] = ~0u;
  set[last] |= high_bits;
}

void merge(ByteSet& dst, const ByteSet& src) {
  for (int w = 0; w < 8; ++w) dst[w] |= src[w];
}

// Work buffers kept per thread from grammar to grammar (every one is reset before it is read),
// so a small grammar's FOLLOW sets cost no allocations but their results.
struct FollowScratch {
  std::vector<ByteSet> first;
  std::vector<uint32_t> dep_begin, deps, fill, index, low, stack, pred_begin, preds, work;
  std::vector<std::pair<uint32_t, uint32_t>> calls;
  std::vector<uint8_t> queued;
  size_t retained_bytes() const {
    size_t n = first.capacity() * sizeof(ByteSet) + calls.capacity() * sizeof(calls[0]) + queued.capacity();
    for (const auto* v : {&dep_begin, &deps, &fill, &index, &low, &stack, &pred_begin, &preds, &work}) {
      n += v->capacity() * sizeof(uint32_t);
    }
    return n;
  }
};

// Past this a huge grammar's buffers are dropped rather than pinned for the thread's lifetime.
constexpr size_t kMaxRetainedBytes = size_t{16} << 20;

// Hands the thread's buffers out for one call; releases them afterwards if they grew too large.
class FollowLease {
 public:
  FollowLease() : scratch_(slot()) {}
  ~FollowLease() {
    if (scratch_.retained_bytes() > kMaxRetainedBytes) scratch_ = FollowScratch{};
  }
  FollowLease(const FollowLease&) = delete;
  FollowLease& operator=(const FollowLease&) = delete;
  FollowScratch& operator*() const { return scratch_; }

 private:
  static FollowScratch& slot() {
    return thread_slot<FollowScratch>();
  }
  FollowScratch& scratch_;
};

}  // namespace

void CompiledGrammar::compute_follow_sets(const Limits& limits) {
  using Clock = std::chrono::steady_clock;
  const auto end = Clock::now() + std::chrono::microseconds(static_cast<int64_t>(limits.max_compile_seconds * 1e6));
  size_t ticks = 0;
  auto check_time = [&]() {
    if ((++ticks & 4095) == 0 && Clock::now() > end) {
      throw LimitError("grammar compilation exceeded its time budget");
    }
  };
  const size_t S = states.size(), R = rule_start.size(), N = S + R;
  FollowLease lease;  // compute_follow_sets never runs inside itself, so one set per thread does
  FollowScratch& scratch = *lease;
  // FIRST sets are read only for rule starts, reference targets and what those depend on (the
  // searches below start from these alone), so a state's own bytes are filled in when the
  // search first meets it; the others are never read and never written.
  std::vector<ByteSet>& first = scratch.first;
  first.resize(S);
  follow.assign(R, ByteSet{});
  auto init_first = [&](uint32_t q) {
    ByteSet set{};
    for (uint32_t e = states[q].byte_begin; e < states[q].byte_end; ++e) {
      add_range(set, byte_edges[e].lo, byte_edges[e].hi);
    }
    first[q] = set;
  };
  auto value = [&](size_t u) -> ByteSet& { return u < S ? first[u] : follow[u - S]; };

  // Dependencies (node u's set includes node v's), as CSR: state i calling rule r and landing in
  // t needs FIRST(start of r), FIRST(t) if r is nullable; FOLLOW(r) needs FIRST(t); a final
  // state needs FOLLOW of its rule. Nodes 0..S-1 are states, S..S+R-1 rules' FOLLOW sets.
  std::vector<uint32_t>&dep_begin = scratch.dep_begin, &deps = scratch.deps;
  dep_begin.assign(N + 1, 0);
  for (size_t i = 0; i < S; ++i) {
    const State& st = states[i];
    for (uint32_t e = st.ref_begin; e < st.ref_end; ++e) {
      dep_begin[i + 1] += nullable[ref_edges[e].rule] ? 2 : 1;
      ++dep_begin[S + ref_edges[e].rule + 1];
    }
    if (st.final) ++dep_begin[i + 1];
  }
  for (size_t u = 0; u < N; ++u) dep_begin[u + 1] += dep_begin[u];
  deps.resize(dep_begin[N]);
  {
    std::vector<uint32_t>& fill = scratch.fill;
    fill.assign(dep_begin.begin(), dep_begin.end() - 1);
    for (size_t i = 0; i < S; ++i) {
      const State& st = states[i];
      for (uint32_t e = st.ref_begin; e < st.ref_end; ++e) {
        const RefEdge& re = ref_edges[e];
        deps[fill[i]++] = static_cast<uint32_t>(rule_start[re.rule]);
        if (nullable[re.rule]) deps[fill[i]++] = static_cast<uint32_t>(re.target);
        deps[fill[S + re.rule]++] = static_cast<uint32_t>(re.target);
      }
      if (st.final) deps[fill[i]++] = static_cast<uint32_t>(S + st.rule);
    }
  }

  // Iterative Tarjan; a component is complete when everything it depends on is.
  constexpr uint32_t kUnseen = ~0u, kDone = ~0u - 1;
  std::vector<uint32_t>&index = scratch.index, &low = scratch.low, &stack = scratch.stack;
  index.assign(N, kUnseen);
  low.resize(N);  // written when a node is first met, before it is read
  stack.clear();
  std::vector<std::pair<uint32_t, uint32_t>>& calls = scratch.calls;  // (node, next dependency)
  calls.clear();
  uint32_t counter = 0;
  auto search = [&](uint32_t root) {
    if (index[root] != kUnseen) return;
    if (root < S) init_first(root);
    if (dep_begin[root] == dep_begin[root + 1]) {
      index[root] = kDone;
      return;
    }
    calls.push_back({root, dep_begin[root]});
    index[root] = low[root] = counter++;
    stack.push_back(root);
    while (!calls.empty()) {
      check_time();
      const uint32_t u = calls.back().first;
      uint32_t& k = calls.back().second;
      if (k < dep_begin[u + 1]) {
        const uint32_t v = deps[k++];
        if (index[v] == kUnseen) {
          if (v < S) init_first(v);
          if (dep_begin[v] == dep_begin[v + 1]) {
            index[v] = kDone;  // depends on nothing: its set is final already
          } else {
            index[v] = low[v] = counter++;
            stack.push_back(v);
            calls.push_back({v, dep_begin[v]});
          }
        } else if (index[v] != kDone) {
          low[u] = std::min(low[u], index[v]);
        }
        continue;
      }
      calls.pop_back();
      if (!calls.empty()) {
        const uint32_t p = calls.back().first;
        if (index[u] != kDone) low[p] = std::min(low[p], low[u]);
      }
      if (low[u] != index[u]) continue;
      // u roots a component: its members are the stack above and including u.
      size_t top = stack.size();
      size_t bottom = top;
      while (stack[bottom - 1] != u) --bottom;
      --bottom;
      for (size_t m = bottom; m < top; ++m) index[stack[m]] = kDone;
      ByteSet set{};
      for (size_t m = bottom; m < top; ++m) {
        const uint32_t x = stack[m];
        merge(set, value(x));
        for (uint32_t d = dep_begin[x]; d < dep_begin[x + 1]; ++d) merge(set, value(deps[d]));
      }
      for (size_t m = bottom; m < top; ++m) value(stack[m]) = set;
      stack.resize(bottom);
    }
  };
  for (size_t r = 0; r < R; ++r) {
    if (rule_start[r] < 0) continue;
    search(static_cast<uint32_t>(rule_start[r]));
    search(static_cast<uint32_t>(S + r));
  }
  for (const RefEdge& re : ref_edges) search(static_cast<uint32_t>(re.target));

  // reach_call: a state with references is reachable through >= 1 byte edge (reverse search).
  std::vector<uint32_t>&pred_begin = scratch.pred_begin, &preds = scratch.preds;
  pred_begin.assign(S + 1, 0);
  preds.resize(byte_edges.size());
  for (size_t q = 0; q < S; ++q) {
    for (uint32_t e = states[q].byte_begin; e < states[q].byte_end; ++e) ++pred_begin[byte_edges[e].target + 1];
  }
  for (size_t q = 0; q < S; ++q) pred_begin[q + 1] += pred_begin[q];
  {
    std::vector<uint32_t>& fill = scratch.fill;
    fill.assign(pred_begin.begin(), pred_begin.end() - 1);
    for (size_t q = 0; q < S; ++q) {
      for (uint32_t e = states[q].byte_begin; e < states[q].byte_end; ++e) {
        preds[fill[byte_edges[e].target]++] = static_cast<uint32_t>(q);
      }
    }
  }
  reach_call.assign(S, 0);
  std::vector<uint8_t>& queued = scratch.queued;
  queued.assign(S, 0);
  std::vector<uint32_t>& work = scratch.work;
  work.clear();
  for (size_t q = 0; q < S; ++q) {
    if (states[q].ref_end > states[q].ref_begin) {
      queued[q] = 1;
      work.push_back(static_cast<uint32_t>(q));
    }
  }
  while (!work.empty()) {
    const uint32_t t = work.back();
    work.pop_back();
    for (uint32_t k = pred_begin[t]; k < pred_begin[t + 1]; ++k) {
      const uint32_t q = preds[k];
      if (reach_call[q]) continue;
      reach_call[q] = 1;
      if (!queued[q]) {
        queued[q] = 1;
        work.push_back(q);
      }
    }
  }

  escape.assign(S, ByteSet{});
  for (size_t q = 0; q < S; ++q) {
    const State& st = states[q];
    for (uint32_t e = st.ref_begin; e < st.ref_end; ++e) {
      const RefEdge& re = ref_edges[e];
      merge(escape[q], first[rule_start[re.rule]]);
      if (nullable[re.rule]) merge(escape[q], first[re.target]);
    }
    if (st.final) merge(escape[q], follow[st.rule]);
  }
}

}  // namespace grammar
}  // namespace agent_infer
