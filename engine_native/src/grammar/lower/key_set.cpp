// Key-trie rules lowered straight to their automaton: "a JSON object key other than these names".
//
// An object that allows additional properties accepts any key but its declared names. Written as
// one rule per trie node, a Kubernetes schema holds ~1,700 such rules whose lowering (fragment
// store, equal-rule merging, outlining, FOLLOW sets) is about half of its compile. The language
// is known in closed form, so the front end sends the names
// (KEY_TRIE, grammar/ir/program.h) and this file writes the minimal automaton directly: one state per
// distinct trie node (equal subtries interned, so the DFA is minimal), whose edges are
//   a child's character:  that child's state;
//   another plain character (printable ASCII but '"', '/', '\\'):  the gap state, which calls
//         the rest rule (char-key-rest) and then reaches the end state;
//   a call of the free rule (char-key-free ::= char-special char-key-rest):  the end state.
// A node accepts unless it ends a name; the end state accepts. Special characters (escapes,
// non-ASCII) go through a rule of their own that also reads the rest of the key, exactly as the
// node-by-node tries do once outlined (grammar/lower/outline.cpp): a token such as `中文` then ends
// inside that rule's call and is classified once, where a call of char-special alone (which
// may end after one character) would leave every such token uncertain, checked again at every key.
// The language is the one json_schema.keys.complement_keys._node_body spells node by node (its Python
// expansion, KeySet.items, is what the tests compare against).
#include <algorithm>
#include <array>
#include <string>
#include <utility>
#include <vector>

#include "grammar/errors.h"
#include "grammar/ir/program.h"
#include "grammar/lower/automata.h"
#include "grammar/thread_slot.h"

namespace agent_infer {
namespace grammar {

namespace {

bool plain(int32_t cp) { return cp >= 0x20 && cp <= 0x7E && cp != 0x22 && cp != 0x2F && cp != 0x5C; }

// Plain printable ASCII as byte ranges, in byte order.
constexpr std::array<std::pair<int32_t, int32_t>, 4> kPlain{{{0x20, 0x21}, {0x23, 0x2E}, {0x30, 0x5B}, {0x5D, 0x7E}}};

// Buffers kept per thread from trie to trie: a Kubernetes schema lowers ~90 tries of ~50 nodes,
// where a vector per node (and per interned key) would make allocation most of the cost.
struct KeyTrieScratch {
  std::vector<int32_t> keys;        // interned nodes back to back: ends, then (code point, class)...
  std::vector<uint32_t> key_at;     // class -> offset of its key in `keys` (size classes + 1)
  std::vector<int32_t> slots;       // open addressing over classes (-1 empty)
  std::vector<int32_t> pending;     // (code point, class) pairs of the open nodes' closed children
  std::vector<uint32_t> open_at;    // per depth of the open path: where its children start
  std::vector<int32_t> open_cp;     // per depth: the code point of the edge into it
  std::vector<uint8_t> open_ends;   // per depth: whether it ends a name
};

uint64_t hash_words(const int32_t* w, size_t n) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ n;
  for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<uint32_t>(w[i])) * 0x100000001B3ull;
  return h ^ (h >> 29);
}

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
  KeyTrieScratch& sc = thread_slot<KeyTrieScratch>();
  sc.keys.clear();
  sc.key_at.assign(1, 0);
  sc.pending.clear();
  // Every node is a prefix of a name: at most one per name character, plus the root.
  size_t slot_count = 16;
  while (slot_count < 2 * (code.size() + 1)) slot_count <<= 1;
  sc.slots.assign(slot_count, -1);
  const size_t mask = slot_count - 1;

  // The node at `depth` of the open path is complete: intern it (ends, then its children's
  // (code point, class) pairs from `pending`), drop its children and return its class.
  auto close = [&](size_t depth) -> int32_t {
    const uint32_t from = sc.open_at[depth];
    const size_t key_start = sc.keys.size();
    sc.keys.push_back(sc.open_ends[depth]);
    sc.keys.insert(sc.keys.end(), sc.pending.begin() + from, sc.pending.end());
    sc.pending.resize(from);
    const size_t n = sc.keys.size() - key_start;
    const int32_t* key = sc.keys.data() + key_start;
    for (size_t i = hash_words(key, n) & mask;; i = (i + 1) & mask) {
      const int32_t c = sc.slots[i];
      if (c < 0) {
        const int32_t fresh = static_cast<int32_t>(sc.key_at.size() - 1);
        sc.slots[i] = fresh;
        sc.key_at.push_back(static_cast<uint32_t>(sc.keys.size()));
        return fresh;
      }
      const uint32_t at = sc.key_at[c], len = sc.key_at[c + 1] - at;
      if (len == n && std::equal(key, key + n, sc.keys.data() + at)) {
        sc.keys.resize(key_start);
        return c;
      }
    }
  };
  // Names arrive sorted and distinct (Daciuk et al.'s construction of the minimal acyclic
  // automaton): the previous name's path stays open, and the nodes below the prefix it shares
  // with the next name are complete, children before parents.
  sc.open_at.assign(1, 0);
  sc.open_cp.assign(1, -1);
  sc.open_ends.assign(1, 0);
  size_t pc = 5, prev_at = 0, prev_len = 0;
  for (int32_t i = 0; i < count; ++i) {
    if (pc >= code.size()) throw bad("names past its end");
    const int32_t len = code[pc++];
    if (len < 0 || static_cast<size_t>(len) > code.size() - pc) throw bad("a name past its end");
    const size_t at = pc;
    pc += static_cast<size_t>(len);
    size_t common = 0;
    const size_t m = std::min(prev_len, static_cast<size_t>(len));
    while (common < m && code[prev_at + common] == code[at + common]) ++common;
    if (i > 0 && (common == static_cast<size_t>(len) ||
                  (common < prev_len && code[at + common] < code[prev_at + common]))) {
      throw bad("names must be sorted and distinct");
    }
    for (size_t d = prev_len; d > common; --d) {
      const int32_t cls = close(d);
      sc.pending.push_back(sc.open_cp[d]);
      sc.pending.push_back(cls);
    }
    sc.open_at.resize(common + 1);
    sc.open_cp.resize(common + 1);
    sc.open_ends.resize(common + 1);
    for (size_t d = common; d < static_cast<size_t>(len); ++d) {
      const int32_t cp = code[at + d];
      if (!plain(cp)) throw bad("a name character that is not plain printable ASCII");
      sc.open_at.push_back(static_cast<uint32_t>(sc.pending.size()));
      sc.open_cp.push_back(cp);
      sc.open_ends.push_back(0);
    }
    sc.open_ends[static_cast<size_t>(len)] = 1;
    prev_at = at;
    prev_len = static_cast<size_t>(len);
  }
  if (pc != code.size()) throw bad("words after its last name");
  for (size_t d = prev_len; d > 0; --d) {
    const int32_t cls = close(d);
    sc.pending.push_back(sc.open_cp[d]);
    sc.pending.push_back(cls);
  }
  const int32_t root = close(0);

  // Classes come children first, so the root is the last: state = base + (root - class) puts
  // the rule's start first. Then the gap state and the end state.
  const int32_t base = static_cast<int32_t>(pool->size());
  const int32_t gap = base + root + 1, end = gap + 1;
  for (int32_t c = root; c >= 0; --c) {
    const int32_t* key = sc.keys.data() + sc.key_at[c];
    const size_t pairs = (sc.key_at[c + 1] - sc.key_at[c] - 1) / 2;
    pool->final.push_back(key[0] ? 0 : 1);
    // Byte edges in byte order: each child's character to its state, the plain runs between
    // them to the gap state.
    size_t k = 0;
    for (const auto& [lo, hi] : kPlain) {
      int32_t from = lo;
      for (; k < pairs && key[1 + 2 * k] <= hi; ++k) {
        const int32_t cp = key[1 + 2 * k];
        if (from < cp) pool->bytes.push_back({static_cast<uint8_t>(from), static_cast<uint8_t>(cp - 1), gap});
        pool->bytes.push_back({static_cast<uint8_t>(cp), static_cast<uint8_t>(cp), base + (root - key[2 + 2 * k])});
        from = cp + 1;
      }
      if (from <= hi) pool->bytes.push_back({static_cast<uint8_t>(from), static_cast<uint8_t>(hi), gap});
    }
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
