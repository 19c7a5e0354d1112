// Outlining of shared continuations before lowering.
//
// "Any key but these names" tries are one rule per node, and every node spells its free branch
// as Seq(Alt(class, Ref char-special), Ref char-key-rest): a plain character or one of the
// escapes (\uXXXX, UTF-8 sequences...), then the rest of a free key. char-special is small and
// finite, so it is inlined, and each of a Kubernetes schema's ~1 700 nodes would carry its own
// copy of its automaton (~20 of the node's ~26 states: two thirds of all the grammar's states).
// By distributivity, Seq(Alt(a..., Ref x), Ref y) derives what Alt(Seq(Alt(a...), Ref y), Ref z)
// does with z ::= Seq(Ref x, Ref y), and z is one rule shared by every occurrence of (x, y): one
// copy of x's automaton per grammar instead of one per node. Only pairs that occur at least
// twice are outlined, y must be a separate rule (a reference to an inlined y would be copied
// into z's callers anyway) and not the rule itself (a tail self-reference is a loop, kept as
// such), and x must be big enough for a copy to matter.
#include <unordered_map>
#include <utility>

#include "grammar/errors.h"
#include "grammar/ir/program.h"
#include "grammar/lower/rule_passes.h"

namespace agent_infer {
namespace grammar {
namespace {

constexpr size_t kMinOutlinedProgram = 16;  // x's program words: below this a copy costs little
constexpr int kMaxDepth = 2000;

// Skips the expression at `pc`; returns the position after it. Nesting is bounded as in the NFA
// builder, so deep input cannot overflow the C++ stack.
size_t skip(const std::vector<int32_t>& code, size_t pc, int depth = 0) {
  if (depth > kMaxDepth) throw LimitError("grammar expression nesting is deeper than 2000 levels");
  const int32_t op = code.at(pc);
  if (op == kSeq || op == kAlt) {
    const int32_t n = code.at(pc + 1);
    pc += 2;
    for (int32_t i = 0; i < n; ++i) pc = skip(code, pc, depth + 1);
    return pc;
  }
  if (op == kRepeat) return skip(code, pc + 3, depth + 1);
  return pc + instruction_length(code, pc);
}

class Outliner {
 public:
  Outliner(const std::vector<std::vector<int32_t>>& rules, const std::vector<uint8_t>& inl) : rules_(rules), inl_(inl) {}

  // The (x, y) of the Alt at `alt` followed by the Ref at `next` in a Seq of rule `self`, if the
  // pair has the outlinable shape: exactly one alternative is a reference to an inlined rule x.
  bool match(const std::vector<int32_t>& code, size_t alt, size_t next, int32_t self, std::pair<int32_t, int32_t>* xy) const {
    if (code.at(alt) != kAlt || next >= code.size() || code[next] != kRef) return false;
    const int32_t y = code.at(next + 1);
    if (y == self || inl_[y]) return false;
    const int32_t n = code[alt + 1];
    if (n < 2) return false;
    int32_t x = -1;
    size_t pc = alt + 2;
    for (int32_t i = 0; i < n; ++i) {
      if (code.at(pc) == kRef && inl_[code.at(pc + 1)] && rules_[code[pc + 1]].size() >= kMinOutlinedProgram) {
        if (x >= 0) return false;
        x = code[pc + 1];
      }
      pc = skip(code, pc);
    }
    if (x < 0) return false;
    *xy = {x, y};
    return true;
  }

  // Visits every Seq child pair (Alt, Ref) of rule r; fn(alt_pc, next_pc).
  template <typename Fn>
  void each_pair(const std::vector<int32_t>& code, Fn&& fn) const {
    for (size_t pc = 0; pc < code.size(); pc += instruction_length(code, pc)) {
      if (code[pc] != kSeq) continue;
      const int32_t n = code.at(pc + 1);
      size_t child = pc + 2;
      for (int32_t i = 0; i + 1 < n; ++i) {
        const size_t next = skip(code, child);
        fn(child, next);
        child = next;
      }
    }
  }

  // Counts the pairs; true if some pair occurs twice or more.
  bool worthwhile() {
    matched_.assign(rules_.size(), 0);
    for (size_t r = 0; r < rules_.size(); ++r) {
      each_pair(rules_[r], [&](size_t alt, size_t next) {
        std::pair<int32_t, int32_t> xy;
        if (match(rules_[r], alt, next, static_cast<int32_t>(r), &xy)) {
          ++uses_[xy];
          matched_[r] = 1;
        }
      });
    }
    bool any = false;
    for (const auto& [xy, n] : uses_) any |= n >= 2;
    return any;
  }

  // Rewrites `rules` (a copy of the rules counted) in place, appending the outlined rules.
  void rewrite(std::vector<std::vector<int32_t>>* rules) {
    rules_ref_ = rules;
    const size_t R = rules->size();
    for (size_t r = 0; r < R; ++r) {
      if (!matched_[r]) continue;  // most rules hold no pair at all: no second scan for them
      bool hit = false;
      each_pair(rules_[r], [&](size_t alt, size_t next) {
        std::pair<int32_t, int32_t> xy;
        hit |= match(rules_[r], alt, next, static_cast<int32_t>(r), &xy) && uses_[xy] >= 2;
      });
      if (!hit) continue;
      std::vector<int32_t> out;
      out.reserve(rules_[r].size() + 8);
      size_t pc = 0;
      copy(static_cast<int32_t>(r), pc, out);
      (*rules)[r].swap(out);
    }
  }

 private:
  // Copies the expression at `pc` of rule r to `out`, outlining matching pairs of its Seqs.
  // Reads the program through rules_[r] each time: appending outlined rules may move it.
  void copy(int32_t r, size_t& pc, std::vector<int32_t>& out, int depth = 0) {
    if (depth > kMaxDepth) throw LimitError("grammar expression nesting is deeper than 2000 levels");
    const int32_t op = rules_[r].at(pc);
    if (op == kAlt) {
      const int32_t n = rules_[r].at(pc + 1);
      out.push_back(kAlt);
      out.push_back(n);
      pc += 2;
      for (int32_t i = 0; i < n; ++i) copy(r, pc, out, depth + 1);
      return;
    }
    if (op == kRepeat) {
      const size_t len = instruction_length(rules_[r], pc);
      out.insert(out.end(), rules_[r].begin() + pc, rules_[r].begin() + pc + len);
      pc += len;
      copy(r, pc, out, depth + 1);
      return;
    }
    if (op != kSeq) {
      const size_t len = instruction_length(rules_[r], pc);
      out.insert(out.end(), rules_[r].begin() + pc, rules_[r].begin() + pc + len);
      pc += len;
      return;
    }
    const int32_t n = rules_[r].at(pc + 1);
    out.push_back(kSeq);
    const size_t count_at = out.size();
    out.push_back(n);
    pc += 2;
    for (int32_t i = 0; i < n; ++i) {
      std::pair<int32_t, int32_t> xy;
      if (i + 1 < n) {
        const size_t next = skip(rules_[r], pc);
        if (match(rules_[r], pc, next, r, &xy) && uses_[xy] >= 2) {
          // Alt(Seq(Alt(the other alternatives), Ref y), Ref z): two children become one.
          const int32_t alts = rules_[r][pc + 1];
          out.insert(out.end(), {kAlt, 2, kSeq, 2});
          if (alts > 2) out.insert(out.end(), {kAlt, alts - 1});
          size_t a = pc + 2;
          for (int32_t k = 0; k < alts; ++k) {
            if (rules_[r][a] == kRef && rules_[r][a + 1] == xy.first) {
              a += 2;
            } else {
              copy(r, a, out, depth + 1);
            }
          }
          out.insert(out.end(), {kRef, xy.second, kRef, outlined(xy)});
          pc = next + 2;
          ++i;
          --out[count_at];
          continue;
        }
      }
      copy(r, pc, out, depth + 1);
    }
  }

  int32_t outlined(const std::pair<int32_t, int32_t>& xy) {
    auto [it, fresh] = rule_of_.try_emplace(xy, static_cast<int32_t>(rules_ref_->size()));
    if (fresh) rules_ref_->push_back({kSeq, 2, kRef, xy.first, kRef, xy.second});
    return it->second;
  }

  // Read from rules_ (the programs as counted; rule r is rewritten only after it is copied, and
  // outlined rules are appended past the originals), written to *rules_ref_.
  const std::vector<std::vector<int32_t>>& rules_;
  std::vector<std::vector<int32_t>>* rules_ref_ = nullptr;
  const std::vector<uint8_t>& inl_;
  // Lookups only (new rules are numbered in the order copy() meets them), so hashed maps do.
  struct PairHash {
    size_t operator()(const std::pair<int32_t, int32_t>& p) const {
      const uint64_t k =
          (static_cast<uint64_t>(static_cast<uint32_t>(p.first)) << 32) | static_cast<uint32_t>(p.second);
      return static_cast<size_t>((k ^ (k >> 29)) * 0x9E3779B97F4A7C15ull >> 16);
    }
  };
  std::unordered_map<std::pair<int32_t, int32_t>, int, PairHash> uses_;
  std::unordered_map<std::pair<int32_t, int32_t>, int32_t, PairHash> rule_of_;
  std::vector<uint8_t> matched_;  // rule r holds at least one outlinable pair
};

}  // namespace

bool outline_continuations(const std::vector<std::vector<int32_t>>& rules, std::vector<std::vector<int32_t>>* out,
                           std::vector<uint8_t>* inline_rule) {
  Outliner outliner(rules, *inline_rule);
  if (!outliner.worthwhile()) return false;
  if (out != &rules) *out = rules;
  outliner.rewrite(out);
  inline_rule->resize(out->size(), 0);  // outlined rules call a separate rule: never inlined
  return true;
}

}  // namespace grammar
}  // namespace agent_infer
