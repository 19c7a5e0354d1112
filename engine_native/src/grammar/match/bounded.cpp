// Max-length strings at run time: the tables the lowering builds for each max-length rule (the
// fewest code points that finish its string from each state and decoding context, by a 0-1
// breadth-first search over their product), the per-(state, context) lists of tokens that may
// overrun a string, and the matcher's side: the count per open string, the items dropped in
// advance(), and the mask's recheck of the tokens that may overrun a string near its bound.
#include "grammar/match/bounded.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <string>

#include "grammar/compiled_grammar.h"
#include "grammar/errors.h"
#include "grammar/mask/tokenizer_info.h"
#include "grammar/match/matcher.h"
#include "grammar/match/unique.h"

namespace agent_infer {
namespace grammar {

namespace {
constexpr int K = bounded::kLexStates;
// Token ids the cached lists of one grammar hold at most (8 bytes each with their needs, 16 MiB):
// past this many, a list is computed for the fill that needs it and not kept.
constexpr size_t kMaxStoredTokens = size_t{1} << 21;

// Calls fn(b_lo, b_hi, target, next_lex, counted) for each run of bytes of state s's edges that
// take context `lex` to the same (next context, code points counted).
template <typename Fn>
void each_move(const CompiledGrammar& g, int32_t s, uint8_t lex, Fn&& fn) {
  const State& st = g.states[static_cast<size_t>(s)];
  for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
    const ByteEdge& be = g.byte_edges[e];
    int32_t prev_n = -1;
    uint8_t prev_l = 0;
    for (int b = be.lo; b <= be.hi; ++b) {
      int32_t n = 0;
      const uint8_t l = bounded::lex_step(lex, static_cast<uint8_t>(b), &n);
      if (l == prev_l && n == prev_n) continue;
      prev_l = l;
      prev_n = n;
      fn(be.target, l, n);
    }
  }
}
}  // namespace

std::shared_ptr<const BoundedTables> BoundedTables::build(const CompiledGrammar& g) {
  auto out = std::make_shared<BoundedTables>();
  BoundedTables& t = *out;
  const size_t S = g.states.size();
  const size_t R = g.max_length.size();
  t.row_.assign(S, -1);
  std::vector<int32_t> state_of;
  for (size_t s = 0; s < S; ++s) {
    const State& st = g.states[s];
    if (g.max_length[static_cast<size_t>(st.rule)] < 0) continue;
    if (st.ref_end > st.ref_begin) {
      throw DefinitionError("a max-length string rule (rule " + std::to_string(st.rule) +
                            ") calls another rule; its expression must lower to one automaton");
    }
    t.row_[s] = static_cast<int32_t>(state_of.size());
    state_of.push_back(static_cast<int32_t>(s));
  }
  const size_t N = state_of.size() * K;
  // Reverse moves of the product (state, context), as a flat list bucketed by their target.
  std::vector<uint32_t> begin(N + 1, 0);
  struct Move {
    uint32_t to, from;
    uint8_t w;
  };
  std::vector<Move> moves;
  for (size_t row = 0; row < state_of.size(); ++row) {
    for (int lex = 0; lex < K; ++lex) {
      const uint32_t from = static_cast<uint32_t>(row * K + lex);
      each_move(g, state_of[row], static_cast<uint8_t>(lex), [&](int32_t target, uint8_t l, int32_t n) {
        const int32_t trow = t.row_[static_cast<size_t>(target)];
        if (trow < 0) return;
        moves.push_back({static_cast<uint32_t>(trow * K + l), from, static_cast<uint8_t>(n)});
      });
    }
  }
  for (const Move& m : moves) ++begin[m.to + 1];
  for (size_t i = 0; i < N; ++i) begin[i + 1] += begin[i];
  std::vector<std::pair<uint32_t, uint8_t>> into(moves.size());
  {
    std::vector<uint32_t> fill(begin.begin(), begin.end() - 1);
    for (const Move& m : moves) into[fill[m.to]++] = {m.from, m.w};
  }
  std::vector<Move>().swap(moves);
  t.dmin_.assign(N, bounded::kInf);
  std::deque<uint32_t> queue;
  for (size_t row = 0; row < state_of.size(); ++row) {
    if (!g.states[static_cast<size_t>(state_of[row])].final) continue;
    for (int lex = 0; lex < K; ++lex) {
      t.dmin_[row * K + lex] = 0;
      queue.push_back(static_cast<uint32_t>(row * K + lex));
    }
  }
  while (!queue.empty()) {
    const uint32_t u = queue.front();
    queue.pop_front();
    for (uint32_t k = begin[u]; k < begin[u + 1]; ++k) {
      const auto [v, w] = into[k];
      const int32_t d = t.dmin_[u] + w;
      if (d < t.dmin_[v]) {
        t.dmin_[v] = d;
        if (w == 0) {
          queue.push_front(v);
        } else {
          queue.push_back(v);
        }
      }
    }
  }
  // Per rule: the largest finite dmin over the pairs its strings reach.
  t.dmax_.assign(R, 0);
  t.dead_.assign(R, 0);
  std::vector<uint8_t> seen(N, 0);
  std::vector<uint32_t> stack;
  for (size_t r = 0; r < R; ++r) {
    if (g.max_length[r] < 0 || g.rule_start[r] < 0) continue;
    const uint32_t start = static_cast<uint32_t>(t.row_[static_cast<size_t>(g.rule_start[r])] * K + bounded::kPre);
    t.dead_[r] = t.dmin_[start] > g.max_length[r];
    int32_t most = 0;
    stack.assign(1, start);
    seen[start] = 1;
    while (!stack.empty()) {
      const uint32_t u = stack.back();
      stack.pop_back();
      if (t.dmin_[u] >= bounded::kInf) continue;
      most = std::max(most, t.dmin_[u]);
      each_move(g, state_of[u / K], static_cast<uint8_t>(u % K), [&](int32_t target, uint8_t l, int32_t) {
        const uint32_t v = static_cast<uint32_t>(t.row_[static_cast<size_t>(target)] * K + l);
        if (!seen[v]) {
          seen[v] = 1;
          stack.push_back(v);
        }
      });
    }
    t.dmax_[r] = most;
    // A rule no string fits is never predicted, but a state mask reading into it through a call
    // does not know that: every token with a quote is then checked.
    t.quote_slack_ = std::min(t.quote_slack_, t.dead_[r] ? -1 : std::max(0, g.max_length[r] - most));
  }
  const TokenizerInfo& tok = *g.tok;
  if (static_cast<int64_t>(t.quote_slack_) < static_cast<int64_t>(tok.max_token_len)) {
    for (size_t i = 0; i < tok.sorted.size(); ++i) {
      const char* p = tok.sorted_ptr(i);
      const size_t len = tok.sorted_len(i);
      const char* q = static_cast<const char*>(memchr(p, '"', len));
      if (q != nullptr && static_cast<int64_t>(p + len - q - 1) > static_cast<int64_t>(t.quote_slack_)) {
        t.quote_tokens_.push_back(static_cast<int32_t>(i));
      }
    }
  }
  return out;
}

std::shared_ptr<const BoundedTokens> BoundedTables::tokens(const CompiledGrammar& g, int32_t s, uint8_t lex) const {
  const int64_t key = static_cast<int64_t>(s) * K + lex;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto found = tokens_.find(key);
    if (found != tokens_.end()) return found->second;
  }
  const TokenizerInfo& t = *g.tok;
  const int32_t base = dmin(s, lex);
  struct Frame {
    int32_t state;
    uint8_t lex;
    int32_t count, need;
  };
  std::vector<Frame> fr(t.max_token_len + 1);
  fr[0] = {s, lex, 0, base};
  std::vector<std::pair<int32_t, int32_t>> found;  // (need, id)
  auto record = [&](size_t from, size_t to, int32_t need) {
    if (need <= base) return;
    for (size_t i = from; i < to; ++i) found.push_back({need, t.sorted[i]});
  };
  size_t depth = 0;  // frames [0, depth] hold the walk along the previous token
  for (size_t i = 0; i < t.sorted.size();) {
    const uint8_t* p = reinterpret_cast<const uint8_t*>(t.sorted_ptr(i));
    const size_t len = t.sorted_len(i);
    size_t d = std::min<size_t>(i == 0 ? 0 : t.lcp[i], depth);
    bool dead = false, closed = false;
    while (d < len) {
      const Frame& f = fr[d];
      const int32_t next = g.step(f.state, p[d]);
      if (next < 0) {
        dead = true;
        break;
      }
      int32_t count = f.count;
      const uint8_t l = bounded::lex_step(f.lex, p[d], &count);
      const int32_t rest = dmin(next, l);
      if (rest >= bounded::kInf) {
        dead = true;
        break;
      }
      fr[d + 1] = {next, l, count, std::max(f.need, count + rest)};
      ++d;
      if (l == bounded::kClosed && g.states[static_cast<size_t>(next)].final) {
        closed = true;
        break;
      }
    }
    depth = d;
    if (dead) {
      i = t.run_end(i, d + 1);  // every token with this prefix dies
    } else if (closed) {
      const size_t end = t.run_end(i, d);  // the string ends inside each token with this prefix
      record(i, end, fr[d].need);
      i = end;
    } else {
      record(i, i + 1, fr[len].need);
      ++i;
    }
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  auto list = std::make_shared<BoundedTokens>();
  list->need.reserve(found.size());
  list->ids.reserve(found.size());
  for (const auto& [need, id] : found) {
    list->need.push_back(need);
    list->ids.push_back(id);
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto [it, fresh] = tokens_.try_emplace(key, nullptr);
  if (!fresh) return it->second;
  if (stored_ + found.size() > kMaxStoredTokens) {
    tokens_.erase(it);
    return list;
  }
  stored_ += found.size();
  it->second = std::move(list);
  return it->second;
}

// -- the matcher's side -----------------------------------------------------------------------

void Matcher::push_bounded(uint8_t b) {
  const uint32_t from = bopen_begin_.back();
  const uint32_t to = static_cast<uint32_t>(bopen_.size());
  bopen_begin_.push_back(to);
  for (uint32_t i = from; i < to; ++i) {
    BoundedOpen e = bopen_[i];
    if (e.lex == bounded::kClosed) continue;
    e.lex = bounded::lex_step(e.lex, b, &e.count);
    bopen_.push_back(e);
  }
}

const Matcher::BoundedOpen* Matcher::open_string(int32_t origin) const {
  for (uint32_t i = bopen_begin_.back(); i < bopen_.size(); ++i) {
    if (bopen_[i].origin == origin) return &bopen_[i];
  }
  return nullptr;
}

bool Matcher::overruns(int32_t state, int32_t origin) const {
  const CompiledGrammar& g = *g_;
  const int32_t limit = g.max_length[static_cast<size_t>(g.states[static_cast<size_t>(state)].rule)];
  if (limit < 0) return false;
  const BoundedOpen* e = open_string(origin);
  return e != nullptr && e->count + g.bounded->dmin(state, e->lex) > limit;
}

bool Matcher::bounded_near() const {
  const CompiledGrammar& g = *g_;
  const int64_t reach = static_cast<int64_t>(g.tok->max_token_len);
  for (uint32_t k = set_begin_.back(); k < items_.size(); ++k) {
    const Item& it = items_[k];
    const int32_t r = g.states[static_cast<size_t>(it.state)].rule;
    const int32_t limit = g.max_length[static_cast<size_t>(r)];
    if (limit < 0) continue;
    const BoundedOpen* e = open_string(it.origin);
    if (e != nullptr && e->count + reach + g.bounded->dmax(r) > limit) return true;
  }
  return false;
}

bool Matcher::bounded_tight() const {
  const CompiledGrammar& g = *g_;
  for (uint32_t k = set_begin_.back(); k < items_.size(); ++k) {
    const Item& it = items_[k];
    const int32_t r = g.states[static_cast<size_t>(it.state)].rule;
    const int32_t limit = g.max_length[static_cast<size_t>(r)];
    if (limit < 0) continue;
    const BoundedOpen* e = open_string(it.origin);
    if (e != nullptr && e->count + 1 + g.bounded->dmax(r) > limit) return true;
  }
  return false;
}

int Matcher::bytes_taken(int* only) {
  const CompiledGrammar& g = *g_;
  ByteSet bytes{};
  for (uint32_t k = set_begin_.back(); k < items_.size(); ++k) g.add_live_bytes(items_[k].state, bytes);
  int count = 0;
  for (int b = 0; b < 256 && count < 2; ++b) {
    if (!has(bytes, static_cast<uint8_t>(b))) continue;
    budget(false);
    if (!advance(static_cast<uint8_t>(b))) continue;
    pop_set();
    ++count;
    *only = b;
  }
  return count;
}

void Matcher::recheck_bounded(uint32_t* mask, int64_t vw) {
  const CompiledGrammar& g = *g_;
  const BoundedTables& bt = *g.bounded;
  const TokenizerInfo& t = *g.tok;
  const int64_t reach = static_cast<int64_t>(t.max_token_len);
  auto allowed = [&](int32_t id) { return id < vw * 32 && (mask[id >> 5] >> (id & 31)) & 1u; };
  // Per token, the scanning items it overruns; one overrun by every scanning item is invalid,
  // one overrun by some is decided by Earley steps (which drop the overrunning items).
  touched_.clear();
  uint32_t scanning = 0;
  for (uint32_t k = set_begin_.back(); k < items_.size(); ++k) {
    const Item& it = items_[k];
    if (!g.scans(it.state)) continue;
    ++scanning;
    const int32_t r = g.states[static_cast<size_t>(it.state)].rule;
    const int32_t limit = g.max_length[static_cast<size_t>(r)];
    if (limit < 0) continue;
    const BoundedOpen* e = open_string(it.origin);
    if (e == nullptr || e->count + reach + bt.dmax(r) <= limit) continue;
    const int32_t budget = limit - e->count;
    const std::shared_ptr<const BoundedTokens> list = bt.tokens(g, it.state, e->lex);
    if (viol_.empty()) viol_.assign(static_cast<size_t>(t.vocab_size), 0);
    for (size_t j = 0; j < list->need.size() && list->need[j] > budget; ++j) {
      const int32_t id = list->ids[j];
      if (!allowed(id)) continue;
      if (viol_[static_cast<size_t>(id)]++ == 0) touched_.push_back(id);
    }
  }
  scratch_.clear();
  if (!touched_.empty()) {
    const std::vector<int32_t>& pos_of = t.json_token_classes().pos_of;
    for (int32_t id : touched_) {
      const bool every = viol_[static_cast<size_t>(id)] == scanning;
      viol_[static_cast<size_t>(id)] = 0;
      mask[id >> 5] &= ~(1u << (id & 31));
      if (!every) scratch_.push_back(pos_of[static_cast<size_t>(id)]);
    }
  }
  // Tokens that may open a max-length string and overrun it within themselves.
  for (int32_t pos : bt.quote_tokens()) {
    const int32_t id = t.sorted[static_cast<size_t>(pos)];
    if (!allowed(id)) continue;
    mask[id >> 5] &= ~(1u << (id & 31));
    scratch_.push_back(pos);
  }
  if (scratch_.empty()) return;
  std::sort(scratch_.begin(), scratch_.end());
  scratch_.erase(std::unique(scratch_.begin(), scratch_.end()), scratch_.end());
  check_uncertain(mask);
}

}  // namespace grammar
}  // namespace agent_infer
