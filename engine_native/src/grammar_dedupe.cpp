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

#include "grammar.h"
#include "grammar_lower.h"

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
      if (code[pc] != kRef) continue;
      // Malformed references are reported by the lowering itself; merging just stands aside.
      if (pc + 1 >= code.size() || code[pc + 1] < 0 || static_cast<size_t>(code[pc + 1]) >= R) return false;
      ref_pos.push_back(static_cast<uint32_t>(pc + 1));
      ++caller_begin[code[pc + 1] + 1];
    }
    ref_begin[r + 1] = static_cast<uint32_t>(ref_pos.size());
  }
  for (size_t r = 0; r < R; ++r) caller_begin[r + 1] += caller_begin[r];
  callers.resize(ref_pos.size());
  {
    std::vector<uint32_t> fill(caller_begin.begin(), caller_begin.end() - 1);
    for (size_t r = 0; r < R; ++r) {
      for (uint32_t k = ref_begin[r]; k < ref_begin[r + 1]; ++k) {
        callers[fill[rules[r][ref_pos[k]]]++] = static_cast<uint32_t>(r);
      }
    }
  }

  std::vector<int32_t> cls(R, 0);
  std::vector<std::vector<int32_t>> members(1);
  members[0].resize(R);
  std::iota(members[0].begin(), members[0].end(), 0);
  std::vector<int32_t> queue{0};
  std::vector<uint8_t> queued{1};
  // Splitting a long chain of classes re-checks its callers once per link; past this budget the
  // partition is abandoned (merging is an optimization, the unmerged grammar is equally exact).
  const size_t budget = 64 * total_words + 4096;
  size_t work = 0;

  auto key_hash = [&](int32_t r) {
    const std::vector<int32_t>& code = rules[r];
    uint64_t h = 1469598103934665603ull ^ code.size();
    uint32_t k = ref_begin[r];
    for (size_t i = 0; i < code.size(); ++i) {
      uint32_t w = static_cast<uint32_t>(code[i]);
      if (k < ref_begin[r + 1] && ref_pos[k] == i) {
        w = static_cast<uint32_t>(cls[code[i]]) ^ 0x80000000u;
        ++k;
      }
      h = (h ^ w) * 1099511628211ull;
    }
    work += code.size() + 1;
    return h;
  };
  auto same_key = [&](int32_t a, int32_t b) {
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
  std::vector<std::vector<int32_t>> groups;
  for (size_t qi = 0; qi < queue.size(); ++qi) {
    const int32_t c = queue[qi];
    queued[c] = 0;
    if (members[c].size() < 2) continue;
    keyed.clear();
    for (int32_t r : members[c]) keyed.push_back({key_hash(r), r});
    if (work > budget) return false;
    std::sort(keyed.begin(), keyed.end());
    groups.clear();
    for (size_t i = 0; i < keyed.size();) {
      size_t j = i;
      while (j < keyed.size() && keyed[j].first == keyed[i].first) ++j;
      const size_t first_group = groups.size();
      for (size_t k = i; k < j; ++k) {
        const int32_t r = keyed[k].second;
        size_t g = first_group;
        while (g < groups.size() && !same_key(groups[g][0], r)) ++g;
        if (g == groups.size()) groups.emplace_back();
        groups[g].push_back(r);
      }
      i = j;
    }
    if (groups.size() == 1) continue;
    members[c] = std::move(groups[0]);
    const size_t first_new = members.size();
    for (size_t g = 1; g < groups.size(); ++g) {
      for (int32_t r : groups[g]) cls[r] = static_cast<int32_t>(members.size());
      members.push_back(std::move(groups[g]));
      queued.push_back(0);
    }
    // Only after every member has its final class: a caller's class is the one to re-check.
    for (size_t nc = first_new; nc < members.size(); ++nc) {
      for (int32_t r : members[nc]) {
        for (uint32_t k = caller_begin[r]; k < caller_begin[r + 1]; ++k) {
          const int32_t q = cls[callers[k]];
          if (!queued[q]) {
            queued[q] = 1;
            queue.push_back(q);
          }
        }
      }
    }
    // The members that kept class c changed nothing their callers see; the split-off ones did.
  }
  if (members.size() == R) return false;

  std::vector<int32_t> rep(members.size());
  for (size_t c = 0; c < members.size(); ++c) rep[c] = *std::min_element(members[c].begin(), members[c].end());
  rep[cls[root]] = root;
  out->assign(rules.begin(), rules.end());
  for (size_t r = 0; r < R; ++r) {
    std::vector<int32_t>& code = (*out)[r];
    for (uint32_t k = ref_begin[r]; k < ref_begin[r + 1]; ++k) code[ref_pos[k]] = rep[cls[code[ref_pos[k]]]];
  }
  return true;
}

}  // namespace grammar
}  // namespace agent_infer
