// Lowering of the flat grammar IR to one deterministic byte automaton per rule.
//
// Code point classes become UTF-8 byte-range sequences (surrogates excluded, so the automata
// accept only valid UTF-8), repeats are expanded (bounded by Limits), small rules with a finite
// language are inlined into their callers, and each rule's NFA is determinized with byte ranges
// and rule references as the alphabet. Finally rules with an empty language and states that can
// never reach an accepting state are trimmed away: every Earley item that survives is then a
// viable prefix, which is what makes the token masks exact.
#include <algorithm>
#include <array>
#include <chrono>
#include <functional>
#include <map>

#include "grammar.h"

namespace agent_infer {
namespace grammar {
namespace {

using Clock = std::chrono::steady_clock;

struct Deadline {
  Clock::time_point end;
  int counter = 0;
  void check() {
    if ((++counter & 1023) == 0 && Clock::now() > end) {
      throw LimitError("grammar compilation exceeded its time budget");
    }
  }
};

struct NState {
  std::vector<int32_t> eps;
  std::vector<ByteEdge> bytes;
  std::vector<RefEdge> refs;
};

struct ByteSeq {
  int n = 0;
  std::array<std::pair<uint8_t, uint8_t>, 4> r{};
};

int utf8_len(uint32_t cp) { return cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4; }

void utf8_encode(uint32_t cp, uint8_t* out) {
  switch (utf8_len(cp)) {
    case 1:
      out[0] = static_cast<uint8_t>(cp);
      break;
    case 2:
      out[0] = static_cast<uint8_t>(0xC0 | (cp >> 6));
      out[1] = static_cast<uint8_t>(0x80 | (cp & 0x3F));
      break;
    case 3:
      out[0] = static_cast<uint8_t>(0xE0 | (cp >> 12));
      out[1] = static_cast<uint8_t>(0x80 | ((cp >> 6) & 0x3F));
      out[2] = static_cast<uint8_t>(0x80 | (cp & 0x3F));
      break;
    default:
      out[0] = static_cast<uint8_t>(0xF0 | (cp >> 18));
      out[1] = static_cast<uint8_t>(0x80 | ((cp >> 12) & 0x3F));
      out[2] = static_cast<uint8_t>(0x80 | ((cp >> 6) & 0x3F));
      out[3] = static_cast<uint8_t>(0x80 | (cp & 0x3F));
  }
}

// Splits [lo, hi] until each piece is a product of per-byte ranges of one encoded length.
void utf8_split(uint32_t lo, uint32_t hi, std::vector<ByteSeq>& out) {
  if (lo > hi) return;
  if (lo <= 0xDFFF && hi >= 0xD800) {
    if (lo < 0xD800) utf8_split(lo, 0xD7FF, out);
    if (hi > 0xDFFF) utf8_split(0xE000, hi, out);
    return;
  }
  static const uint32_t kMax[3] = {0x7F, 0x7FF, 0xFFFF};
  for (uint32_t m : kMax) {
    if (lo <= m && hi > m) {
      utf8_split(lo, m, out);
      utf8_split(m + 1, hi, out);
      return;
    }
  }
  int n = utf8_len(lo);
  for (int i = 1; i < n; ++i) {
    uint32_t m = (1u << (6 * i)) - 1;
    if ((lo & ~m) != (hi & ~m)) {
      if ((lo & m) != 0) {
        utf8_split(lo, lo | m, out);
        utf8_split((lo | m) + 1, hi, out);
        return;
      }
      if ((hi & m) != m) {
        utf8_split(lo, (hi & ~m) - 1, out);
        utf8_split(hi & ~m, hi, out);
        return;
      }
    }
  }
  uint8_t a[4], b[4];
  utf8_encode(lo, a);
  utf8_encode(hi, b);
  ByteSeq s;
  s.n = n;
  for (int i = 0; i < n; ++i) s.r[i] = {a[i], b[i]};
  out.push_back(s);
}

size_t skip_expr(const std::vector<int32_t>& code, size_t pc) {
  switch (code.at(pc)) {
    case kEmpty:
      return pc + 1;
    case kLiteral:
      return pc + 2 + code.at(pc + 1);
    case kClass:
      return pc + 2 + 2 * static_cast<size_t>(code.at(pc + 1));
    case kSeq:
    case kAlt: {
      int32_t n = code.at(pc + 1);
      pc += 2;
      for (int32_t i = 0; i < n; ++i) pc = skip_expr(code, pc);
      return pc;
    }
    case kRepeat:
      return skip_expr(code, pc + 3);
    case kRef:
      return pc + 2;
    default:
      throw DefinitionError("malformed grammar code (unknown opcode)");
  }
}

struct NfaBuilder {
  const std::vector<std::vector<int32_t>>& rules;
  const std::vector<uint8_t>& inline_rule;
  int64_t max_states;
  Deadline& deadline;
  std::vector<NState> n;
  int64_t* total;  // NFA states created across all rules (the grammar-size limit)
  int depth = 0;   // expression nesting, bounded so deep input cannot overflow the C++ stack
  // The rule being built and its NFA start: a reference to itself in tail position becomes a
  // jump back to the start (R ::= x R | "" is x*), so right recursion costs no parser items.
  int32_t self_rule = -1;
  int32_t self_start = -1;

  int32_t fresh() {
    if (++*total > max_states) {
      throw LimitError("grammar is too large: more than " + std::to_string(max_states) +
                       " automaton states after expanding repeats");
    }
    deadline.check();
    n.emplace_back();
    return static_cast<int32_t>(n.size() - 1);
  }

  // Adds the fragment of the expression at code[pc] starting in `from`; returns its end state.
  // `tail`: nothing of the rule follows this expression, so its end is the rule's end.
  int32_t build(const std::vector<int32_t>& code, size_t& pc, int32_t from, bool tail = false) {
    if (++depth > 2000) throw LimitError("grammar expression nesting is deeper than 2000 levels");
    int32_t end = build_node(code, pc, from, tail);
    --depth;
    return end;
  }

  int32_t build_node(const std::vector<int32_t>& code, size_t& pc, int32_t from, bool tail) {
    int32_t op = code.at(pc);
    switch (op) {
      case kEmpty:
        ++pc;
        return from;
      case kLiteral: {
        int32_t len = code.at(pc + 1);
        int32_t s = from;
        for (int32_t i = 0; i < len; ++i) {
          int32_t t = fresh();
          uint8_t b = static_cast<uint8_t>(code.at(pc + 2 + i));
          n[s].bytes.push_back({b, b, t});
          s = t;
        }
        pc += 2 + len;
        return s;
      }
      case kClass: {
        int32_t count = code.at(pc + 1);
        std::vector<ByteSeq> seqs;
        for (int32_t i = 0; i < count; ++i) {
          utf8_split(static_cast<uint32_t>(code.at(pc + 2 + 2 * i)),
                     static_cast<uint32_t>(code.at(pc + 3 + 2 * i)), seqs);
        }
        pc += 2 + 2 * static_cast<size_t>(count);
        int32_t end = fresh();
        for (const ByteSeq& s : seqs) {
          int32_t cur = from;
          for (int i = 0; i < s.n; ++i) {
            int32_t t = (i + 1 == s.n) ? end : fresh();
            n[cur].bytes.push_back({s.r[i].first, s.r[i].second, t});
            cur = t;
          }
        }
        return end;  // an empty class leaves `end` unreachable: the empty language
      }
      case kSeq: {
        int32_t count = code.at(pc + 1);
        pc += 2;
        int32_t s = from;
        for (int32_t i = 0; i < count; ++i) s = build(code, pc, s, tail && i + 1 == count);
        return s;
      }
      case kAlt: {
        int32_t count = code.at(pc + 1);
        pc += 2;
        int32_t end = fresh();
        for (int32_t i = 0; i < count; ++i) {
          int32_t s = fresh();
          n[from].eps.push_back(s);
          int32_t e = build(code, pc, s, tail);
          n[e].eps.push_back(end);
        }
        return end;
      }
      case kRepeat: {
        int32_t lo = code.at(pc + 1), hi = code.at(pc + 2);
        size_t child = pc + 3;
        size_t after = skip_expr(code, child);
        int64_t copies = static_cast<int64_t>(lo) + (hi < 0 ? 1 : hi - lo);
        if (copies > max_states) {
          throw LimitError("repeat {" + std::to_string(lo) + "," + std::to_string(hi) + "} is too large");
        }
        int32_t s = from;
        const bool child_tail = tail && hi == 1;  // x? and x{1} end where the repeat ends
        for (int32_t i = 0; i < lo; ++i) {
          size_t p = child;
          s = build(code, p, s, child_tail);
        }
        if (hi < 0) {
          // A fresh loop state, so the back edge cannot leak into whatever preceded the repeat.
          int32_t loop = fresh();
          n[s].eps.push_back(loop);
          size_t p = child;
          int32_t e = build(code, p, loop);
          n[e].eps.push_back(loop);
          s = loop;
        } else if (hi > lo) {
          int32_t end = fresh();
          for (int32_t i = lo; i < hi; ++i) {
            n[s].eps.push_back(end);
            int32_t entry = fresh();
            n[s].eps.push_back(entry);
            size_t p = child;
            s = build(code, p, entry, child_tail);
          }
          n[s].eps.push_back(end);
          s = end;
        }
        pc = after;
        return s;
      }
      case kRef: {
        int32_t r = code.at(pc + 1);
        pc += 2;
        if (r < 0 || static_cast<size_t>(r) >= rules.size()) throw DefinitionError("reference to unknown rule");
        if (tail && r == self_rule) {
          n[from].eps.push_back(self_start);
          return fresh();  // nothing continues from here: the jump's path ends at the rule's end
        }
        if (inline_rule[r]) {
          size_t p = 0;
          int32_t entry = fresh();
          n[from].eps.push_back(entry);
          return build(rules[r], p, entry);
        }
        int32_t t = fresh();
        n[from].refs.push_back({r, t});
        return t;
      }
      default:
        throw DefinitionError("malformed grammar code (unknown opcode)");
    }
  }
};

struct VecHash {
  size_t operator()(const std::vector<int32_t>& v) const {
    uint64_t h = 1469598103934665603ull;
    for (int32_t x : v) h = (h ^ static_cast<uint32_t>(x)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

struct Dfa {
  struct DState {
    bool final = false;
    std::vector<ByteEdge> bytes;
    std::vector<RefEdge> refs;
  };
  std::vector<DState> s;
};

class Determinizer {
 public:
  Determinizer(const std::vector<NState>& n, int32_t accept, int64_t max_states, int64_t* total, Deadline& dl)
      : n_(n), accept_(accept), max_states_(max_states), total_(total), dl_(dl), mark_(n.size(), 0) {}

  Dfa run(int32_t start) {
    std::vector<int32_t> init{start};
    id_of(closure(init));
    for (size_t d = 0; d < sets_.size(); ++d) expand(d);
    return std::move(dfa_);
  }

 private:
  std::vector<int32_t> closure(std::vector<int32_t> seed) {
    ++stamp_;
    std::vector<int32_t> out;
    std::vector<int32_t> stack = std::move(seed);
    while (!stack.empty()) {
      int32_t x = stack.back();
      stack.pop_back();
      if (mark_[x] == stamp_) continue;
      mark_[x] = stamp_;
      // Keep only states that carry information: edges or acceptance.
      if (!n_[x].bytes.empty() || !n_[x].refs.empty() || x == accept_) out.push_back(x);
      for (int32_t y : n_[x].eps) stack.push_back(y);
    }
    std::sort(out.begin(), out.end());
    return out;
  }

  int32_t id_of(std::vector<int32_t>&& set) {
    auto it = ids_.find(set);
    if (it != ids_.end()) return it->second;
    if (++*total_ > max_states_) {
      throw LimitError("grammar is too large: more than " + std::to_string(max_states_) + " automaton states");
    }
    dl_.check();
    int32_t id = static_cast<int32_t>(sets_.size());
    ids_.emplace(set, id);
    sets_.push_back(std::move(set));
    dfa_.s.emplace_back();
    return id;
  }

  void expand(size_t d) {
    const std::vector<int32_t> set = sets_[d];
    Dfa::DState out;
    std::vector<ByteEdge> edges;
    std::map<int32_t, std::vector<int32_t>> refs;
    for (int32_t x : set) {
      if (x == accept_) out.final = true;
      edges.insert(edges.end(), n_[x].bytes.begin(), n_[x].bytes.end());
      for (const RefEdge& r : n_[x].refs) refs[r.rule].push_back(r.target);
    }
    if (!edges.empty()) {
      std::vector<int32_t> points;
      for (const ByteEdge& e : edges) {
        points.push_back(e.lo);
        points.push_back(e.hi + 1);
      }
      std::sort(points.begin(), points.end());
      points.erase(std::unique(points.begin(), points.end()), points.end());
      for (size_t k = 0; k + 1 < points.size(); ++k) {
        int32_t a = points[k], b = points[k + 1] - 1;
        std::vector<int32_t> targets;
        for (const ByteEdge& e : edges) {
          if (e.lo <= a && b <= e.hi) targets.push_back(e.target);
        }
        if (targets.empty()) continue;
        int32_t t = id_of(closure(std::move(targets)));
        if (!out.bytes.empty() && out.bytes.back().target == t && out.bytes.back().hi + 1 == a) {
          out.bytes.back().hi = static_cast<uint8_t>(b);
        } else {
          out.bytes.push_back({static_cast<uint8_t>(a), static_cast<uint8_t>(b), t});
        }
      }
    }
    for (auto& kv : refs) out.refs.push_back({kv.first, id_of(closure(std::move(kv.second)))});
    dfa_.s[d] = std::move(out);
  }

  const std::vector<NState>& n_;
  int32_t accept_;
  int64_t max_states_;
  int64_t* total_;
  Deadline& dl_;
  std::vector<uint32_t> mark_;
  uint32_t stamp_ = 0;
  std::vector<std::vector<int32_t>> sets_;
  std::unordered_map<std::vector<int32_t>, int32_t, VecHash> ids_;
  Dfa dfa_;
};

// Length in words of the instruction at ``pc`` (opcodes and layout in grammar.h); shared by every
// linear scan over a rule's program so they agree on the encoding.
size_t instruction_length(const std::vector<int32_t>& code, size_t pc) {
  switch (code[pc]) {
    case kEmpty:
      return 1;
    case kLiteral:
      return 2 + static_cast<size_t>(code.at(pc + 1));
    case kClass:
      return 2 + 2 * static_cast<size_t>(code.at(pc + 1));
    case kSeq:
    case kAlt:
    case kRef:
      return 2;
    case kRepeat:
      return 3;
    default:
      throw DefinitionError("malformed grammar code (unknown opcode)");
  }
}

void collect_refs(const std::vector<int32_t>& code, std::vector<int32_t>& out) {
  for (size_t pc = 0; pc < code.size(); pc += instruction_length(code, pc)) {
    if (code[pc] == kRef) out.push_back(code.at(pc + 1));
  }
}

// Rules with loops, or with counted repeats longer than this, are not inlined: a long chain
// (a `maxLength` string) is built once and its positions' masks are shared by every caller.
constexpr int32_t kMaxInlineRepeat = 32;

bool has_unbounded_or_long_repeat(const std::vector<int32_t>& code) {
  for (size_t pc = 0; pc < code.size(); pc += instruction_length(code, pc)) {
    if (code[pc] == kRepeat && (code.at(pc + 2) < 0 || std::max(code.at(pc + 1), code.at(pc + 2)) > kMaxInlineRepeat)) {
      return true;
    }
  }
  return false;
}

// Rules worth inlining: not recursive, a finite language, and small once expanded. Rules with
// loops (strings, numbers) or long chains stay separate so their states' masks are shared.
std::vector<uint8_t> choose_inline(const std::vector<std::vector<int32_t>>& rules, int32_t root) {
  const size_t R = rules.size();
  std::vector<std::vector<int32_t>> refs(R);
  for (size_t r = 0; r < R; ++r) collect_refs(rules[r], refs[r]);
  // state: 0 = unvisited, 1 = in progress, 2 = done. size = estimated expanded code size, -1 = no.
  std::vector<int> st(R, 0);
  std::vector<int64_t> size(R, -1);
  std::vector<uint8_t> inl(R, 0);
  const int64_t kMaxInline = 2000;
  std::function<void(int32_t)> visit = [&](int32_t r) {
    st[r] = 1;
    bool ok = !has_unbounded_or_long_repeat(rules[r]);
    int64_t total = static_cast<int64_t>(rules[r].size());
    for (int32_t q : refs[r]) {
      if (q < 0 || static_cast<size_t>(q) >= R) throw DefinitionError("reference to unknown rule");
      if (st[q] == 0) visit(q);
      if (st[q] == 1 || size[q] < 0) {
        ok = false;  // recursion (or a callee that cannot be inlined)
      } else {
        total += size[q];
      }
    }
    st[r] = 2;
    size[r] = (ok && total <= kMaxInline) ? total : -1;
    inl[r] = size[r] >= 0 && r != root;
  };
  // Recursion through a rule still being visited marks only the caller; a cycle's entry rule is
  // then fixed up here: any rule that can reach itself must never be inlined.
  for (size_t r = 0; r < R; ++r) {
    if (st[r] == 0) visit(static_cast<int32_t>(r));
  }
  for (size_t r = 0; r < R; ++r) {
    if (!inl[r]) continue;
    // Confirm acyclicity from r (inlined rules only call inlined rules, which are acyclic by size).
    for (int32_t q : refs[r]) {
      if (!inl[q]) {
        inl[r] = 0;
        break;
      }
    }
  }
  return inl;
}

}  // namespace

CompiledGrammar::CompiledGrammar(std::shared_ptr<TokenizerInfo> tok_, const std::vector<std::vector<int32_t>>& rules,
                                 int32_t root_, const Limits& limits)
    : tok(std::move(tok_)), root(root_), max_items_per_set(limits.max_items_per_set) {
  const size_t R = rules.size();
  if (root < 0 || static_cast<size_t>(root) >= R) throw DefinitionError("root rule index out of range");
  Deadline deadline{Clock::now() + std::chrono::microseconds(static_cast<int64_t>(limits.max_compile_seconds * 1e6))};
  std::vector<uint8_t> inl = choose_inline(rules, root);

  // Build the automata of the rules reachable from the root through non-inlined references.
  std::vector<Dfa> dfas(R);
  std::vector<uint8_t> built(R, 0);
  std::vector<int32_t> work{root};
  built[root] = 1;
  int64_t nfa_total = 0, dfa_total = 0;
  while (!work.empty()) {
    int32_t r = work.back();
    work.pop_back();
    NfaBuilder nb{rules, inl, limits.max_nfa_states, deadline, {}, &nfa_total};
    int32_t start = nb.fresh();
    nb.self_rule = r;
    nb.self_start = start;
    size_t pc = 0;
    int32_t accept = nb.build(rules[r], pc, start, true);
    if (pc != rules[r].size()) throw DefinitionError("malformed grammar code (trailing data)");
    Determinizer det(nb.n, accept, limits.max_dfa_states, &dfa_total, deadline);
    dfas[r] = det.run(start);
    for (const auto& ds : dfas[r].s) {
      for (const RefEdge& e : ds.refs) {
        if (!built[e.rule]) {
          built[e.rule] = 1;
          work.push_back(e.rule);
        }
      }
    }
  }

  // Productive rules (non-empty language), by fixpoint.
  std::vector<uint8_t> productive(R, 0);
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t r = 0; r < R; ++r) {
      if (!built[r] || productive[r]) continue;
      const auto& s = dfas[r].s;
      std::vector<uint8_t> seen(s.size(), 0);
      std::vector<int32_t> stack{0};
      seen[0] = 1;
      bool ok = false;
      while (!stack.empty() && !ok) {
        int32_t x = stack.back();
        stack.pop_back();
        if (s[x].final) ok = true;
        auto push = [&](int32_t y) {
          if (!seen[y]) {
            seen[y] = 1;
            stack.push_back(y);
          }
        };
        for (const ByteEdge& e : s[x].bytes) push(e.target);
        for (const RefEdge& e : s[x].refs) {
          if (productive[e.rule]) push(e.target);
        }
      }
      if (ok) {
        productive[r] = 1;
        changed = true;
      }
    }
  }
  if (!productive[root]) throw DefinitionError("the grammar's language is empty (no string matches the root rule)");

  // Trim: drop references to empty rules and states that cannot reach acceptance; lay out globally.
  rule_start.assign(R, -1);
  nullable.assign(R, 0);
  std::vector<std::vector<int32_t>> remap(R);
  int32_t next = 0;
  for (size_t r = 0; r < R; ++r) {
    if (!built[r] || !productive[r]) continue;
    auto& s = dfas[r].s;
    for (auto& ds : s) {
      ds.refs.erase(std::remove_if(ds.refs.begin(), ds.refs.end(), [&](const RefEdge& e) { return !productive[e.rule]; }),
                    ds.refs.end());
    }
    std::vector<std::vector<int32_t>> rev(s.size());
    for (size_t x = 0; x < s.size(); ++x) {
      for (const ByteEdge& e : s[x].bytes) rev[e.target].push_back(static_cast<int32_t>(x));
      for (const RefEdge& e : s[x].refs) rev[e.target].push_back(static_cast<int32_t>(x));
    }
    std::vector<uint8_t> live(s.size(), 0);
    std::vector<int32_t> stack;
    for (size_t x = 0; x < s.size(); ++x) {
      if (s[x].final) {
        live[x] = 1;
        stack.push_back(static_cast<int32_t>(x));
      }
    }
    while (!stack.empty()) {
      int32_t x = stack.back();
      stack.pop_back();
      for (int32_t y : rev[x]) {
        if (!live[y]) {
          live[y] = 1;
          stack.push_back(y);
        }
      }
    }
    remap[r].assign(s.size(), -1);
    for (size_t x = 0; x < s.size(); ++x) {
      if (live[x]) remap[r][x] = next++;
    }
    rule_start[r] = remap[r][0];
  }
  states.resize(next);
  for (size_t r = 0; r < R; ++r) {
    if (rule_start[r] < 0) continue;
    const auto& s = dfas[r].s;
    for (size_t x = 0; x < s.size(); ++x) {
      int32_t g = remap[r][x];
      if (g < 0) continue;
      State& st = states[g];
      st.rule = static_cast<int32_t>(r);
      st.final = s[x].final;
      st.byte_begin = static_cast<uint32_t>(byte_edges.size());
      for (const ByteEdge& e : s[x].bytes) {
        int32_t t = remap[r][e.target];
        if (t < 0) continue;
        if (st.byte_end > st.byte_begin || byte_edges.size() > st.byte_begin) {
          ByteEdge& last = byte_edges.back();
          if (last.target == t && last.hi + 1 == e.lo) {
            last.hi = e.hi;
            continue;
          }
        }
        byte_edges.push_back({e.lo, e.hi, t});
      }
      st.byte_end = static_cast<uint32_t>(byte_edges.size());
      st.ref_begin = static_cast<uint32_t>(ref_edges.size());
      for (const RefEdge& e : s[x].refs) {
        int32_t t = remap[r][e.target];
        if (t >= 0 && rule_start[e.rule] >= 0) ref_edges.push_back({e.rule, t});
      }
      st.ref_end = static_cast<uint32_t>(ref_edges.size());
    }
  }

  // Nullable rules: the start reaches acceptance through references to nullable rules only.
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t r = 0; r < R; ++r) {
      if (rule_start[r] < 0 || nullable[r]) continue;
      std::vector<int32_t> stack{rule_start[r]};
      std::vector<int32_t> seen{rule_start[r]};
      bool ok = false;
      while (!stack.empty() && !ok) {
        int32_t x = stack.back();
        stack.pop_back();
        if (states[x].final) ok = true;
        for (uint32_t e = states[x].ref_begin; e < states[x].ref_end; ++e) {
          const RefEdge& re = ref_edges[e];
          if (nullable[re.rule] && std::find(seen.begin(), seen.end(), re.target) == seen.end()) {
            seen.push_back(re.target);
            stack.push_back(re.target);
          }
        }
      }
      if (ok) {
        nullable[r] = 1;
        changed = true;
      }
    }
  }

  compute_follow_sets(limits);
  masks_.reset(new std::atomic<const StateMask*>[states.size()]);
  for (size_t i = 0; i < states.size(); ++i) masks_[i].store(nullptr, std::memory_order_relaxed);
}

void CompiledGrammar::compute_follow_sets(const Limits& limits) {
  Deadline deadline{Clock::now() + std::chrono::microseconds(static_cast<int64_t>(limits.max_compile_seconds * 1e6))};
  const size_t S = states.size();
  std::vector<ByteSet> first(S, ByteSet{});  // bytes readable next from a state, leaving included
  follow.assign(rule_start.size(), ByteSet{});
  for (size_t q = 0; q < S; ++q) {
    const State& st = states[q];
    for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
      for (int b = byte_edges[e].lo; b <= byte_edges[e].hi; ++b) first[q][b >> 5] |= 1u << (b & 31);
    }
  }
  auto merge = [](ByteSet& dst, const ByteSet& src) {
    bool changed = false;
    for (int w = 0; w < 8; ++w) {
      uint32_t v = dst[w] | src[w];
      changed |= v != dst[w];
      dst[w] = v;
    }
    return changed;
  };
  for (bool changed = true; changed;) {
    changed = false;
    deadline.check();
    for (size_t i = S; i-- > 0;) {
      const State& st = states[i];
      for (uint32_t e = st.ref_begin; e < st.ref_end; ++e) {
        const RefEdge& re = ref_edges[e];
        changed |= merge(first[i], first[rule_start[re.rule]]);
        if (nullable[re.rule]) changed |= merge(first[i], first[re.target]);
        changed |= merge(follow[re.rule], first[re.target]);
      }
      if (st.final) changed |= merge(first[i], follow[st.rule]);
    }
  }
  // Reverse search over byte edges from the states that call rules.
  std::vector<std::vector<int32_t>> preds(S);
  for (size_t q = 0; q < S; ++q) {
    for (uint32_t e = states[q].byte_begin; e < states[q].byte_end; ++e) {
      preds[byte_edges[e].target].push_back(static_cast<int32_t>(q));
    }
  }
  reach_call.assign(S, 0);
  std::vector<uint8_t> in_z(S, 0);
  std::vector<int32_t> work;
  for (size_t q = 0; q < S; ++q) {
    if (states[q].ref_end > states[q].ref_begin) {
      in_z[q] = 1;
      work.push_back(static_cast<int32_t>(q));
    }
  }
  while (!work.empty()) {
    int32_t t = work.back();
    work.pop_back();
    for (int32_t q : preds[t]) {
      if (reach_call[q]) continue;
      reach_call[q] = 1;
      if (!in_z[q]) {
        in_z[q] = 1;
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

size_t CompiledGrammar::memory_bytes() const {
  return sizeof(*this) + states.size() * (sizeof(State) + sizeof(void*) + sizeof(ByteSet)) +
         follow.size() * sizeof(ByteSet) + byte_edges.size() * sizeof(ByteEdge) +
         ref_edges.size() * sizeof(RefEdge) + rule_start.size() * 5;
}

}  // namespace grammar
}  // namespace agent_infer
