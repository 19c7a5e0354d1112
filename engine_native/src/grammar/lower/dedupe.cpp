// Merging of equal rules before lowering.
//
// A JSON Schema front end emits one rule per subschema occurrence, so a schema whose definitions
// are used in many places (Kubernetes: 5 000+ rules) holds many copies of each. Lowering every
// copy costs time linear in the copies and multiplies the automaton states the matcher and the
// mask cache carry. Equal rules are found by partition refinement: start with one class, split
// a class whenever its members' programs differ once each reference is replaced by the class of
// its target, and re-check the callers of every rule that changed class. The fixpoint is the
// coarsest partition in which class members have equal programs up to classes, which makes the
// quotient grammar derive the same language for every rule (references map class to class).
#include <algorithm>
#include <numeric>
#include <utility>

#include "grammar/ir/program.h"
#include "grammar/lower/rule_passes.h"

namespace agent_infer {
namespace grammar {

bool merge_equal_rules(const std::vector<std::vector<int32_t>>& rules, int32_t root,
                       std::vector<std::vector<int32_t>>* out) {
  const size_t R = rules.size();
  if (R < 2 || root < 0 || static_cast<size_t>(root) >= R) return false;
  // Reference operand positions per rule (CSR), and the callers of each rule (CSR).
  std::vector<uint32_t> ref_begin(R + 1, 0), ref_pos;
  std::vector<uint32_t> caller_begin(R + 1, 0), callers;
  size_t total_words = 0;
  for (size_t r = 0; r < R; ++r) {
    const std::vector<int32_t>& code = rules[r];
    total_words += code.size();
    for (size_t pc = 0; pc < code.size(); pc += instruction_length(code, pc)) {
      // Operand positions of references: a REF's one, a KEY_TRIE's two (its special and rest
      // rules), a CHECK's item rules.
      size_t first = pc + 1, last = pc + 1;
      if (code[pc] == kKeyTrie) {
        first = pc + 2;
        last = pc + 3;
      } else if (code[pc] == kCheck) {
        first = check_items_at(code, pc);
        last = pc + 1 + static_cast<size_t>(code.at(pc + 1));
        if (first > last) continue;
      } else if (code[pc] != kRef) {
        continue;
      }
      for (size_t at = first; at <= last; ++at) {
        // Malformed references are reported by the lowering itself; merging just stands aside.
        if (at >= code.size() || code[at] < 0 || static_cast<size_t>(code[at]) >= R) return false;
        ref_pos.push_back(static_cast<uint32_t>(at));
        ++caller_begin[code[at] + 1];
      }
    }
    ref_begin[r + 1] = static_cast<uint32_t>(ref_pos.size());
  }
  for (size_t r = 0; r < R; ++r) caller_begin[r + 1] += caller_begin[r];
  callers.resize(ref_pos.size());
  // callee[k]: the target of reference k (rule r's are callee[ref_begin[r], ref_begin[r + 1])).
  std::vector<int32_t> callee(ref_pos.size());
  {
    std::vector<uint32_t> fill(caller_begin.begin(), caller_begin.end() - 1);
    for (size_t r = 0; r < R; ++r) {
      for (uint32_t k = ref_begin[r]; k < ref_begin[r + 1]; ++k) {
        callee[k] = rules[r][ref_pos[k]];
        callers[fill[callee[k]]++] = static_cast<uint32_t>(r);
      }
    }
  }

  // The partition: class c's members are elems[seg_begin[c], seg_end[c]) (pos[r]: r's index in
  // elems). A class is re-checked only through its touched members, those whose callees changed
  // class since it was last checked: the others still share one key. When a class splits, its
  // largest part keeps the class and only the members of the others change class (Hopcroft's
  // rule), so a chain of N rules costs O(N) checks instead of re-keying the whole class N times.
  std::vector<int32_t> cls(R, 0), elems(R);
  std::vector<uint32_t> pos(R), seg_begin{0}, seg_end{static_cast<uint32_t>(R)};
  std::iota(elems.begin(), elems.end(), 0);
  std::iota(pos.begin(), pos.end(), 0u);
  // Touched members of class c: a list through touched_next from touched_head[c] (-1 ends it).
  std::vector<int32_t> touched_head{0}, touched_next(R);
  for (size_t r = 0; r < R; ++r) touched_next[r] = r + 1 < R ? static_cast<int32_t>(r + 1) : -1;
  std::vector<uint8_t> is_touched(R, 1), queued{1};
  std::vector<int32_t> queue{0};
  // Splitting a long chain of classes re-checks its callers once per link; past this budget the
  // partition is abandoned (merging is an optimization, the unmerged grammar is equally exact).
  const size_t budget = 64 * total_words + 4096;
  size_t work = 0;
  // The first round splits the single initial class by the programs with every reference
  // masked (all rules are in class 0), so afterwards the members of a class differ at most in
  // their references' targets: later rounds key and compare a rule by its callees' classes alone,
  // a few words per rule instead of its whole program (which the first round read once).
  bool by_callees = false;
  // Two words per multiply: the chain of dependent multiplies, not the loads, bounds this loop
  // (it runs over every word of every rule at least once). Only equality of keys matters here
  // (same_key confirms), and the classes come out the same whatever the hash.
  auto key_hash = [&](int32_t r) {
    if (by_callees) {
      uint64_t h = 1469598103934665603ull;
      for (uint32_t k = ref_begin[r]; k < ref_begin[r + 1]; ++k) {
        h = (h ^ static_cast<uint32_t>(cls[callee[k]])) * 1099511628211ull;
      }
      h ^= h >> 29;
      work += ref_begin[r + 1] - ref_begin[r] + 1;
      return h;
    }
    const std::vector<int32_t>& code = rules[r];
    uint64_t h = 1469598103934665603ull ^ code.size();
    uint32_t k = ref_begin[r];
    const uint32_t k_end = ref_begin[r + 1];
    uint32_t next_ref = k < k_end ? ref_pos[k] : ~0u;
    uint64_t pending = 0;
    for (size_t i = 0; i < code.size(); ++i) {
      uint32_t w = static_cast<uint32_t>(code[i]);
      if (i == next_ref) {
        w = static_cast<uint32_t>(cls[code[i]]) ^ 0x80000000u;
        next_ref = ++k < k_end ? ref_pos[k] : ~0u;
      }
      if (i & 1) {
        h = (h ^ (pending | (static_cast<uint64_t>(w) << 32))) * 1099511628211ull;
      } else {
        pending = w;
      }
    }
    if (code.size() & 1) h = (h ^ pending) * 1099511628211ull;
    h ^= h >> 29;
    work += code.size() + 1;
    return h;
  };
  auto same_key = [&](int32_t a, int32_t b) {
    if (by_callees) {
      const uint32_t n = ref_begin[a + 1] - ref_begin[a];
      if (ref_begin[b + 1] - ref_begin[b] != n) return false;
      for (uint32_t k = 0; k < n; ++k) {
        if (cls[callee[ref_begin[a] + k]] != cls[callee[ref_begin[b] + k]]) return false;
      }
      work += n;
      return true;
    }
    const std::vector<int32_t>& x = rules[a];
    const std::vector<int32_t>& y = rules[b];
    if (x.size() != y.size()) return false;
    uint32_t k = ref_begin[a];
    for (size_t i = 0; i < x.size(); ++i) {
      if (k < ref_begin[a + 1] && ref_pos[k] == i) {
        if (cls[x[i]] != cls[y[i]]) return false;
        ++k;
      } else if (x[i] != y[i]) {
        return false;
      }
    }
    work += x.size();
    return true;
  };

  std::vector<std::pair<uint64_t, int32_t>> keyed;
  std::vector<int32_t> t_list, order;                // order: the touched part, regrouped
  std::vector<int32_t> group_first, group_of;        // a group's first member; keyed[k]'s group
  std::vector<uint32_t> group_at;                    // where each group starts in elems
  std::vector<std::pair<uint32_t, uint32_t>> parts;  // [begin, end) in elems after regrouping
  for (size_t qi = 0; qi < queue.size(); ++qi) {
    by_callees = qi > 0;
    const int32_t c = queue[qi];
    queued[c] = 0;
    t_list.clear();
    for (int32_t r = touched_head[c]; r >= 0; r = touched_next[r]) t_list.push_back(r);
    touched_head[c] = -1;
    for (int32_t r : t_list) is_touched[r] = 0;
    const uint32_t b = seg_begin[c], e = seg_end[c];
    if (e - b < 2) continue;
    // Move the touched members to the end of the segment: [b, mid) untouched, [mid, e) touched.
    uint32_t mid = e;
    for (int32_t r : t_list) {
      --mid;
      const int32_t other = elems[mid];
      const uint32_t pr = pos[r];
      elems[pr] = other;
      pos[other] = pr;
      elems[mid] = r;
      pos[r] = mid;
    }
    keyed.clear();
    for (uint32_t i = mid; i < e; ++i) keyed.push_back({key_hash(elems[i]), elems[i]});
    if (work > budget) return false;
    std::sort(keyed.begin(), keyed.end());
    // Groups of equal keys among the touched members; a group equal to the untouched members'
    // key joins them (it goes first in `order`, right after the untouched part).
    const bool has_untouched = mid > b;
    const int32_t u = has_untouched ? elems[b] : -1;
    const uint64_t u_hash = has_untouched ? key_hash(u) : 0;
    order.clear();
    parts.clear();
    group_first.clear();
    group_of.assign(keyed.size(), -1);
    for (size_t i = 0; i < keyed.size();) {
      size_t j = i;
      while (j < keyed.size() && keyed[j].first == keyed[i].first) ++j;
      const size_t first_group = group_first.size();
      for (size_t k = i; k < j; ++k) {
        const int32_t r = keyed[k].second;
        if (has_untouched && keyed[k].first == u_hash && same_key(u, r)) {
          order.push_back(r);
          continue;
        }
        size_t g = first_group;
        while (g < group_first.size() && !same_key(group_first[g], r)) ++g;
        if (g == group_first.size()) group_first.push_back(r);
        group_of[k] = static_cast<int32_t>(g);
      }
      i = j;
    }
    const size_t G = group_first.size();
    if (G == 0 || (!has_untouched && G == 1)) continue;  // no split
    uint32_t at = mid;
    for (int32_t r : order) {
      elems[at] = r;
      pos[r] = at++;
    }
    if (at > b) parts.push_back({b, at});
    // The groups after it, each contiguous (a counting sort of the touched members by group).
    group_at.assign(G + 1, 0);
    for (int32_t g : group_of) {
      if (g >= 0) ++group_at[g + 1];
    }
    group_at[0] = at;
    for (size_t g = 0; g < G; ++g) group_at[g + 1] += group_at[g];
    for (size_t g = 0; g < G; ++g) parts.push_back({group_at[g], group_at[g + 1]});
    for (size_t k = 0; k < keyed.size(); ++k) {
      if (group_of[k] < 0) continue;
      const int32_t r = keyed[k].second;
      elems[group_at[group_of[k]]] = r;
      pos[r] = group_at[group_of[k]]++;
    }
    size_t keep = 0;
    for (size_t k = 1; k < parts.size(); ++k) {
      if (parts[k].second - parts[k].first > parts[keep].second - parts[keep].first) keep = k;
    }
    seg_begin[c] = parts[keep].first;
    seg_end[c] = parts[keep].second;
    const size_t first_new = seg_begin.size();
    for (size_t k = 0; k < parts.size(); ++k) {
      if (k == keep) continue;
      const int32_t nc = static_cast<int32_t>(seg_begin.size());
      seg_begin.push_back(parts[k].first);
      seg_end.push_back(parts[k].second);
      touched_head.push_back(-1);
      queued.push_back(0);
      for (uint32_t i = parts[k].first; i < parts[k].second; ++i) cls[elems[i]] = nc;
    }
    // Only after every member has its final class: a caller's class is the one to re-check.
    for (size_t nc = first_new; nc < seg_begin.size(); ++nc) {
      for (uint32_t i = seg_begin[nc]; i < seg_end[nc]; ++i) {
        const int32_t r = elems[i];
        for (uint32_t k = caller_begin[r]; k < caller_begin[r + 1]; ++k) {
          const int32_t q = static_cast<int32_t>(callers[k]);
          if (is_touched[q]) continue;
          is_touched[q] = 1;
          touched_next[q] = touched_head[cls[q]];
          touched_head[cls[q]] = q;
          if (!queued[cls[q]]) {
            queued[cls[q]] = 1;
            queue.push_back(cls[q]);
          }
        }
      }
    }
  }
  const size_t C = seg_begin.size();
  if (C == R) return false;

  std::vector<int32_t> rep(C);
  for (size_t c = 0; c < C; ++c) rep[c] = *std::min_element(elems.begin() + seg_begin[c], elems.begin() + seg_end[c]);
  rep[cls[root]] = root;
  // In place when ``out`` is ``rules`` (every read of the programs is done by now).
  if (out != &rules) out->assign(rules.begin(), rules.end());
  for (size_t r = 0; r < R; ++r) {
    std::vector<int32_t>& code = (*out)[r];
    for (uint32_t k = ref_begin[r]; k < ref_begin[r + 1]; ++k) code[ref_pos[k]] = rep[cls[code[ref_pos[k]]]];
  }
  return true;
}

}  // namespace grammar
}  // namespace agent_infer
