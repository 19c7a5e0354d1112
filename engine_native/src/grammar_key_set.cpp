// Key-trie rules lowered straight to their automaton: "a JSON object key other than these names".
//
// An object that allows additional properties accepts any key but its declared names. Written as
// one rule per trie node (json_schema_keys.py), a Kubernetes schema held ~1,700 such rules whose
// lowering (fragment store, equal-rule merging, outlining, FOLLOW sets) was about half of its
// compile. The language is known in closed form, so the front end now sends the names
// (KEY_TRIE, grammar.h) and this file writes the minimal automaton directly: one state per
// distinct trie node (equal subtries interned, so the DFA is minimal), whose edges are
//   a child's character:  that child's state;
//   another plain character (printable ASCII but '"', '/', '\\'):  the gap state, which calls
//         the rest rule (char-key-rest) and then reaches the end state;
//   a call of the free rule (char-key-free ::= char-special char-key-rest):  the end state.
// A node accepts unless it ends a name; the end state accepts. Special characters (escapes,
// non-ASCII) go through a rule of their own that also reads the rest of the key, exactly as the
// node-by-node tries did once outlined (grammar_outline.cpp): a token such as `中文` then ends
// inside that rule's call and is classified once, where a call of char-special alone (which
// may end after one character) left every such token uncertain, checked again at every key.
// The language is the one json_schema_keys._node_body spells node by node (its Python
// expansion, KeySet.items, is what the tests compare against).
#include <algorithm>
#include <unordered_map>
#include <vector>

#include "grammar.h"
#include "grammar_lower.h"

namespace agent_infer {
namespace grammar {

namespace {

bool plain(int32_t cp) { return cp >= 0x20 && cp <= 0x7E && cp != 0x22 && cp != 0x2F && cp != 0x5C; }

struct TrieNode {
  bool ends = false;
  std::vector<std::pair<int32_t, int32_t>> children;  // (code point, node), code point order
};

struct KeyHash {
  size_t operator()(const std::vector<int32_t>& key) const {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ key.size();
    for (int32_t x : key) h = (h ^ static_cast<uint32_t>(x)) * 0x100000001B3ull;
    return static_cast<size_t>(h ^ (h >> 29));
  }
};

}  // namespace

int32_t lower_key_trie(const std::vector<int32_t>& code, size_t num_rules, DfaPool* pool) {
  auto bad = [](const char* what) -> DefinitionError {
    return DefinitionError(std::string("malformed key-trie instruction: ") + what);
  };
  if (code.size() < 5 || code[0] != kKeyTrie || code[1] < 3 || static_cast<size_t>(code[1]) != code.size() - 2) {
    throw bad("it must be a rule's whole body");
  }
  const int32_t free = code[2], rest = code[3], count = code[4];
  if (free < 0 || rest < 0 || static_cast<size_t>(free) >= num_rules || static_cast<size_t>(rest) >= num_rules) {
    throw DefinitionError("reference to unknown rule");
  }
  if (count < 0) throw bad("negative name count");

  // The prefix tree of the names (node 0 is the root; a child always has a larger index).
  std::vector<TrieNode> trie(1);
  size_t pc = 5;
  for (int32_t i = 0; i < count; ++i) {
    if (pc >= code.size()) throw bad("names past its end");
    const int32_t len = code[pc++];
    if (len < 0 || static_cast<size_t>(len) > code.size() - pc) throw bad("a name past its end");
    int32_t node = 0;
    for (int32_t k = 0; k < len; ++k) {
      const int32_t cp = code[pc++];
      if (!plain(cp)) throw bad("a name character that is not plain printable ASCII");
      auto& ch = trie[node].children;
      auto it = std::lower_bound(ch.begin(), ch.end(), std::make_pair(cp, INT32_MIN));
      if (it != ch.end() && it->first == cp) {
        node = it->second;
      } else {
        const int32_t fresh = static_cast<int32_t>(trie.size());
        ch.insert(it, {cp, fresh});
        trie.emplace_back();
        node = fresh;
      }
    }
    trie[node].ends = true;
  }
  if (pc != code.size()) throw bad("words after its last name");

  // Intern equal subtries, children first (reverse creation order): canon[n] is n's class.
  const int32_t N = static_cast<int32_t>(trie.size());
  std::vector<int32_t> canon(N), rep;  // rep[c]: a node of class c
  std::unordered_map<std::vector<int32_t>, int32_t, KeyHash> classes;
  classes.reserve(static_cast<size_t>(N));
  std::vector<int32_t> key;
  for (int32_t n = N - 1; n >= 0; --n) {
    key.assign(1, trie[n].ends ? 1 : 0);
    for (const auto& [cp, child] : trie[n].children) {
      key.push_back(cp);
      key.push_back(canon[child]);
    }
    auto [it, added] = classes.emplace(key, static_cast<int32_t>(rep.size()));
    if (added) rep.push_back(n);
    canon[n] = it->second;
  }

  // States in breadth-first order from the root's class (the rule's start comes first), then the
  // gap state and the end state.
  const int32_t C = static_cast<int32_t>(rep.size());
  std::vector<int32_t> local(C, -1), order;
  order.reserve(C);
  local[canon[0]] = 0;
  order.push_back(canon[0]);
  for (size_t q = 0; q < order.size(); ++q) {
    for (const auto& [cp, child] : trie[rep[order[q]]].children) {
      if (local[canon[child]] < 0) {
        local[canon[child]] = static_cast<int32_t>(order.size());
        order.push_back(canon[child]);
      }
    }
  }
  const int32_t base = static_cast<int32_t>(pool->size());
  const int32_t gap = base + C, end = gap + 1;
  for (int32_t c : order) {
    const TrieNode& node = trie[rep[c]];
    pool->final.push_back(node.ends ? 0 : 1);
    // Byte edges in byte order: runs of plain characters that are no child go to the gap state.
    int32_t run = -1;
    auto close_run = [&](int32_t upto) {
      if (run >= 0) pool->bytes.push_back({static_cast<uint8_t>(run), static_cast<uint8_t>(upto), gap});
      run = -1;
    };
    size_t k = 0;
    for (int32_t b = 0x20; b <= 0x7E; ++b) {
      if (k < node.children.size() && node.children[k].first == b) {
        close_run(b - 1);
        pool->bytes.push_back({static_cast<uint8_t>(b), static_cast<uint8_t>(b), base + local[canon[node.children[k].second]]});
        ++k;
      } else if (!plain(b)) {
        close_run(b - 1);
      } else if (run < 0) {
        run = b;
      }
    }
    close_run(0x7E);
    pool->refs.push_back({free, end});
    pool->byte_begin.push_back(static_cast<uint32_t>(pool->bytes.size()));
    pool->ref_begin.push_back(static_cast<uint32_t>(pool->refs.size()));
  }
  pool->final.push_back(0);  // gap: the rest of the key follows
  pool->refs.push_back({rest, end});
  pool->byte_begin.push_back(static_cast<uint32_t>(pool->bytes.size()));
  pool->ref_begin.push_back(static_cast<uint32_t>(pool->refs.size()));
  pool->final.push_back(1);  // end
  pool->byte_begin.push_back(static_cast<uint32_t>(pool->bytes.size()));
  pool->ref_begin.push_back(static_cast<uint32_t>(pool->refs.size()));
  return base;
}

}  // namespace grammar
}  // namespace agent_infer
