// Internal interfaces of the lowering (grammar/lower/compile.cpp and its satellites): program -> NFA
// (grammar/lower/nfa.cpp), NFA -> DFA (grammar/lower/determinize.cpp), equal-rule merging
// (grammar/lower/dedupe.cpp), outlining of shared continuations (grammar/lower/outline.cpp). Not used by the
// matcher.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

#include "grammar/grammar.h"

namespace agent_infer {
namespace grammar {

// Throws the DefinitionError for an opcode instruction_length() does not know (out of line, so
// the inline stepper below stays small).
[[noreturn]] void throw_unknown_opcode();

// Length in words of the instruction at `pc` (opcodes and layout in grammar/grammar.h). A rule's program
// is prefix-coded, so stepping by this visits every instruction in pre-order. Inline: every pass
// over the programs (merging, outlining, inlining, NFA building) steps through each word with it.
inline size_t instruction_length(const std::vector<int32_t>& code, size_t pc) {
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
    case kKeyTrie:
      return 2 + static_cast<size_t>(code.at(pc + 1));
    default:
      throw_unknown_opcode();
  }
}

// A key-trie rule (its body is one KEY_TRIE instruction, see grammar/grammar.h).
inline bool is_key_trie(const std::vector<int32_t>& code) { return !code.empty() && code[0] == kKeyTrie; }


// The position after the expression at `pc`.
size_t skip_expression(const std::vector<int32_t>& code, size_t pc);

// Rules whose programs are equal once every reference is replaced by its target's class (the
// coarsest such partition) derive the same language, so their callers can share one automaton.
// If any rules merge, writes the programs with every reference redirected to its class's
// representative (the root for the root's class, else the lowest index) and returns true.
// Returns false (nothing merged, `out` untouched) also when finding the partition costs too much.
bool merge_equal_rules(const std::vector<std::vector<int32_t>>& rules, int32_t root,
                       std::vector<std::vector<int32_t>>* out);

// Replaces each large call-free, repeat-free item of a repeat (a pattern's character class with
// its JSON escapes, under `+` or `{m,n}`) by a reference to an appended rule holding it, one rule
// per distinct item, so the item is lowered once to its minimal automaton and spliced into each
// copy (grammar/lower/hoist.cpp). If anything is hoisted, writes the rules to `out` (which may be
// `rules` itself) and returns true; else leaves `out` untouched and returns false.
bool hoist_repeat_items(const std::vector<std::vector<int32_t>>& rules, std::vector<std::vector<int32_t>>* out);

// Rules to inline into their callers: not recursive, a finite language, small once expanded.
std::vector<uint8_t> choose_inline(const std::vector<std::vector<int32_t>>& rules, int32_t root);

// An inline_rule value: inline the rule if its automaton fits the fragment store (else it stays
// a rule of its own). choose_inline() writes 1 (always inline) and 0.
constexpr uint8_t kInlineIfFits = 2;

// Marks kInlineIfFits the finite, right-linear rules (no recursion, no long repeat, references
// only in tail position) that choose_inline() left separate for their expanded size, where every
// reference to them comes from such rules but at most one (grammar/lower/inline.cpp).
void inline_finite_chains(const std::vector<std::vector<int32_t>>& rules, int32_t root, std::vector<uint8_t>* inl);

// Rewrites Seq(Alt(a..., Ref x), Ref y) (x inlined and big, y separate, the pair met at least
// twice) as Alt(Seq(Alt(a...), Ref y), Ref z) with one appended rule z ::= x y per pair, so x's
// automaton is built once instead of once per occurrence (grammar/lower/outline.cpp). If anything is
// outlined, writes the rules to `out` (which may be `rules` itself), extends `inline_rule` with
// the new rules (not inlined) and returns true; else leaves both untouched and returns false.
bool outline_continuations(const std::vector<std::vector<int32_t>>& rules, std::vector<std::vector<int32_t>>* out,
                           std::vector<uint8_t>* inline_rule);

// The compile-time budget (Limits::max_compile_seconds), checked every 1024 calls.
struct Deadline {
  std::chrono::steady_clock::time_point end;
  int counter = 0;
  void check() {
    if ((++counter & 1023) == 0 && std::chrono::steady_clock::now() > end) {
      throw LimitError("grammar compilation exceeded its time budget");
    }
  }
};

// One rule's Thompson NFA over bytes with rule references, edges grouped by source state.
struct Nfa {
  int32_t start = 0, accept = 0;
  std::vector<uint32_t> eps_begin, byte_begin, ref_begin;  // per state, size states + 1
  std::vector<int32_t> eps;
  std::vector<ByteEdge> bytes;
  std::vector<RefEdge> refs;
  size_t size() const { return eps_begin.empty() ? 0 : eps_begin.size() - 1; }
};

// The automata of all lowered rules, back to back; a rule's states are contiguous, its start
// first, and edge targets are indices into the pool.
struct DfaPool {
  std::vector<uint8_t> final;
  std::vector<uint32_t> byte_begin{0}, ref_begin{0};  // per state, size states + 1
  std::vector<ByteEdge> bytes;
  std::vector<RefEdge> refs;
  size_t size() const { return final.size(); }
  // Empty, keeping the buffers' capacity (reused from rule to rule and grammar to grammar).
  void reset() {
    final.clear();
    byte_begin.assign(1, 0);
    ref_begin.assign(1, 0);
    bytes.clear();
    refs.clear();
  }
};

// Appends the automaton of a key-trie rule to `pool` (minimal, every state reaching acceptance
// once the two rules it calls do) and returns its start state; `num_rules` bounds its references.
// Throws DefinitionError for a malformed instruction (grammar/lower/key_set.cpp).
int32_t lower_key_trie(const std::vector<int32_t>& code, size_t num_rules, DfaPool* pool);

// Doubles an open-addressing table of ids whose live slots carry generation `gen`, and reinserts
// ids first..count-1 by hash_of(id). SetTable and SetTrie grow their tables this way.
template <class HashOf>
void grow_id_table(std::vector<int32_t>* table, std::vector<uint32_t>* table_gen, uint32_t gen, size_t first,
                   size_t count, HashOf hash_of) {
  std::vector<int32_t> grown(table->size() * 2, -1);
  std::vector<uint32_t> grown_gen(grown.size(), 0);
  const size_t mask = grown.size() - 1;
  for (size_t k = first; k < count; ++k) {
    size_t j = static_cast<size_t>(hash_of(k)) & mask;
    while (grown_gen[j] == gen) j = (j + 1) & mask;
    grown[j] = static_cast<int32_t>(k);
    grown_gen[j] = gen;
  }
  table->swap(grown);
  table_gen->swap(grown_gen);
}

// Interned sets of int32 (each a sorted run of members, stored back to back), numbered in the
// order they are inserted and found again through an open-addressing table. clear() starts a new
// numbering and keeps the buffers (stale table slots are told apart by generation).
class SetTable {
 public:
  void clear();
  // The number of the set [data, data + n) whose hash is h, or -1; then *slot is where insert()
  // puts it.
  int32_t find(const int32_t* data, size_t n, uint64_t h, size_t* slot) const;
  // Adds the set find() did not find at `slot`; returns its number.
  int32_t insert(const int32_t* data, size_t n, uint64_t h, size_t slot);
  const int32_t* members(int32_t id) const { return data_.data() + off_[id]; }
  const int32_t* members_end(int32_t id) const { return data_.data() + off_[id + 1]; }
  int32_t size() const { return static_cast<int32_t>(hash_.size()); }
  // Bytes the sets use now (members, offsets, hashes and table).
  size_t bytes_used() const { return data_.size() * 4 + hash_.size() * 12 + table_.size() * 8; }
  size_t retained_bytes() const;

 private:
  std::vector<int32_t> data_;
  std::vector<uint32_t> off_{0};
  std::vector<uint64_t> hash_;
  std::vector<int32_t> table_;  // set numbers, -1 = empty; valid where table_gen_ == gen_
  std::vector<uint32_t> table_gen_;
  uint32_t gen_ = 0;
};

// Hash-consed sets of int32 below a universe fixed per clear(), for the determinizer's large sets.
// A set is a fixed-depth binary tree over 64-member blocks whose empty subtrees are left out and
// whose nodes are interned, so equal sets get the same id and sets that differ in a few blocks
// share every other subtree. A search automaton's states hold all the pattern positions still
// matching (a literal of n characters: sets of 1..n members); stored flat they cost O(n^2) words,
// here O(n log n) nodes.
class SetTrie {
 public:
  // Forgets every set; members of the sets to come are below `universe`.
  void clear(size_t universe);
  // The id (>= 1) of the set [data, data + n): sorted, distinct, n >= 1, each below the universe.
  int32_t intern(const int32_t* data, size_t n);
  // Appends the members of set `id` to *out, in ascending order.
  void members(int32_t id, std::vector<int32_t>* out) const;
  // Ids are below this (node ids and set ids are one numbering).
  int32_t bound() const { return static_cast<int32_t>(x_.size()); }
  // Bytes the nodes and their table use now.
  size_t bytes_used() const { return x_.size() * (sizeof(uint64_t) + sizeof(uint32_t)) + table_.size() * 8; }
  size_t retained_bytes() const;

 private:
  int32_t node(uint64_t x, uint32_t level);
  std::vector<uint64_t> x_;      // per node: a leaf's member bits, or left << 32 | right (0 = empty)
  std::vector<uint32_t> level_;  // per node: 0 for a leaf
  std::vector<int32_t> table_;   // node ids, open addressing; valid where table_gen_ == gen_
  std::vector<uint32_t> table_gen_;
  uint32_t gen_ = 0;
  uint32_t levels_ = 0;  // a set's root is at this level
  std::vector<std::pair<uint32_t, uint64_t>> cur_, next_;  // intern's levels: (index, word or id)
  mutable std::vector<std::pair<int32_t, std::pair<uint32_t, uint32_t>>> walk_;  // members' stack
};

// Working memory of one determinizer run's state sets (flat tables and trie) past which a rule's
// subset construction stops with LimitError.
constexpr size_t kMaxDeterminizeBytes = size_t{256} << 20;

// Subset construction with byte ranges and rule references as the alphabet. Sets of NFA states
// live back to back in one buffer, interned through an open-addressing table; every buffer is
// reused from rule to rule, so determinizing allocates only while its buffers grow.
class Determinizer {
 public:
  Determinizer() = default;
  Determinizer(int64_t max_states, Deadline& deadline) : max_states_(max_states), deadline_(&deadline) {}
  // A fresh state budget for the next runs (the buffers stay).
  void set_limit(int64_t max_states) {
    max_states_ = max_states;
    total_ = 0;
  }
  // Rebinds a kept determinizer to the next grammar's budget and deadline.
  void reset(int64_t max_states, Deadline& deadline) {
    set_limit(max_states);
    deadline_ = &deadline;
  }
  // Bytes its buffers hold (what a kept determinizer retains between grammars).
  size_t retained_bytes() const;
  // Counts states built elsewhere (the fragment store) against the same state budget.
  void charge(int64_t states);
  // Appends the DFA of `nfa` to `pool`; returns the pool index of its start state.
  int32_t run(const Nfa& nfa, DfaPool* pool);

 private:
  void closure(const Nfa& nfa, std::vector<int32_t>& seed);  // into closure_, sorted
  int32_t intern(const Nfa& nfa, DfaPool* pool);              // the set in closure_
  void expand(const Nfa& nfa, int32_t d, DfaPool* pool);
  // Closes targets_ into a set and adds the byte edge [a, b] to it.
  void emit_interval(const Nfa& nfa, int32_t a, int32_t b, size_t first_edge, DfaPool* pool);
  void sweep_edges(const Nfa& nfa, size_t first_edge, DfaPool* pool);
  // closure() + intern() of targets_, memoized per run by the target set: the same few NFA
  // targets (the end of a character class with its loop and exits) are reached from many states
  // and byte intervals, and each closure walks their epsilon edges again.
  int32_t close_intern(const Nfa& nfa, DfaPool* pool);

  int64_t max_states_ = 0;
  int64_t total_ = 0;
  Deadline* deadline_ = nullptr;
  // A sweep was cut short (its state budget ran out): count_in_ must be cleared before reuse.
  bool sweep_dirty_ = false;
  int32_t base_ = 0;
  // The DFA states of the current run: sets of up to kFlatMembers members in sets_, larger ones
  // in trie_. state_ref_[d]: state d's sets_ number, or ~its trie id; flat_state_ / trie_state_
  // map back (trie_state_ is indexed by trie id, -1 where no state).
  static constexpr size_t kFlatMembers = 64;
  SetTable sets_;
  SetTrie trie_;
  std::vector<int32_t> state_ref_, flat_state_, trie_state_, trie_seed_;
  int32_t new_state(DfaPool* pool, int32_t ref);
  uint32_t gen_ = 0;  // per run: one_gen_ entries of earlier runs are stale
  std::vector<uint32_t> mark_;
  std::vector<uint64_t> bits_;  // closure()'s members as bits (all zero between calls)
  uint32_t stamp_ = 0;
  std::vector<int32_t> stack_, closure_, current_, targets_, points_;
  std::vector<uint32_t> by_lo_, by_end_, active_, slot_;  // expand's sweep over byte boundaries
  std::vector<int32_t> count_in_;  // per NFA state: active edges leading to it (zero between sweeps)
  std::vector<ByteEdge> edges_;
  std::vector<RefEdge> ref_pairs_;
  // close_intern's memo: one target (by NFA state, valid where one_gen_ == gen_), and target
  // sets of two or more (seeds_, with the state each closed to in seed_id_; sets of more than
  // kFlatMembers by trie id in trie_seed_, -1 where none).
  std::vector<int32_t> one_id_;
  std::vector<uint32_t> one_gen_;
  SetTable seeds_;
  std::vector<int32_t> seed_id_;
};

// Merges the equivalent states of one rule's trimmed DFA that reach no cycle (see
// grammar/lower/minimize.cpp). Buffers are reused from rule to rule.
class StateMerger {
 public:
  // The rule's states are pool states [b, b + n); live[x]: local state x survived trimming;
  // rule_live[r]: references to rule r survive. rep[x] (local): the lowest-numbered state
  // equivalent to x, for live x; -1 otherwise.
  void run(const DfaPool& pool, uint32_t b, uint32_t n, const std::vector<uint8_t>& live,
           const std::vector<uint8_t>& rule_live, std::vector<int32_t>* rep);

 private:
  void assign_class(const DfaPool& pool, uint32_t b, uint32_t x, const std::vector<uint8_t>& live,
                    const std::vector<uint8_t>& rule_live);
  static constexpr uint32_t kUnseen = ~0u, kDone = ~0u - 1;
  std::vector<int32_t> cls_, class_min_;
  std::vector<uint32_t> index_, low_, stack_;
  std::vector<std::pair<uint32_t, uint32_t>> calls_;
  std::vector<uint32_t> sig_, sig_data_, sig_off_;
  std::vector<uint64_t> sig_hash_;
  std::vector<int32_t> table_;
  std::vector<uint32_t> table_gen_;
  uint32_t gen_ = 0;
};

// A map from 64-bit keys to state ids by open addressing in flat arrays: memoizes the store's
// unions and concatenations without a node allocation per entry.
class PairMemo {
 public:
  // Empty, with room for about `expected` entries before the table grows.
  void clear(size_t expected = 0);
  // The value for key, or -2 if absent.
  int32_t find(uint64_t key) const;
  void insert(uint64_t key, int32_t value);  // key absent
  size_t retained_bytes() const { return keys_.capacity() * 12; }

 private:
  std::vector<uint64_t> keys_;
  std::vector<int32_t> values_;  // -2 = empty slot
  size_t count_ = 0;
};

// The automata of a grammar's inlined rules (finite languages) as one store of acyclic DFA
// states interned by (final, edges), so equal states exist once and the store stays minimal
// (grammar/lower/fragment_store.cpp). States are ids; kDead is the empty language.
class FragmentStore {
 public:
  static constexpr int32_t kDead = -1;
  // Thrown when the state budget or the recursion bound runs out (the caller falls back).
  struct Overflow {};
  // Empty but for the accepting state; keeps the buffers. The hash tables start with room for
  // about `expected_states` states and `expected_unions` unions (rehashing a table as it doubles
  // from small cost a big grammar about a tenth of its store build).
  void reset(size_t expected_states = 0, size_t expected_unions = 0);
  void bind(Deadline* deadline) { deadline_ = deadline; }
  size_t size() const { return final_.size(); }
  size_t retained_bytes() const;  // approximate
  // New states may be created while size() < limit (else Overflow).
  int64_t limit() const { return limit_; }
  void set_limit(int64_t limit) { limit_ = limit; }
  int32_t accept() const { return accept_; }  // the empty string only
  void clear_depth() { depth_ = 0; }          // after an Overflow unwound unite/concat
  // The state with these edges (bytes sorted and disjoint, references by ascending rule, one
  // per rule; both rewritten in place to canonical form). A rule's own automaton may carry
  // references; fragments never do.
  int32_t make(bool final, std::vector<ByteEdge>& edges, std::vector<RefEdge>* refs);
  int32_t reference(int32_t rule, int32_t cont);  // a call of `rule`, then `cont`
  int32_t unite(int32_t a, int32_t b);        // L(a) | L(b)
  int32_t concat(int32_t s, int32_t cont);    // L(s) L(cont)
  // The byte ranges in sequence, then `cont`.
  int32_t chain(const std::pair<uint8_t, uint8_t>* ranges, int n, int32_t cont);
  // The states reachable from `start`, renumbered from 0 (start) in breadth-first order.
  void flatten(int32_t start, std::vector<uint8_t>* final, std::vector<uint32_t>* begin, std::vector<ByteEdge>* bytes);
  // The same, appended to `pool` as a rule's automaton; returns the pool index of its start.
  int32_t flatten_into(int32_t start, DfaPool* pool);

 private:
  static constexpr size_t kMaxDepth = 4000;  // recursion of unite/concat (the C++ stack)
  // At least `need` edges of scratch for recursion depth `depth` (valid until that depth is reused).
  ByteEdge* buffer(size_t depth, size_t need);
  // Drops dead targets and joins adjacent ranges with one target, in place; returns the count.
  static size_t canonical(ByteEdge* edges, size_t count);
  static size_t compact(std::vector<RefEdge>* refs);  // drops dead targets; returns the count
  // The state with these canonical edges (make() without the canonicalizing).
  int32_t intern(bool final, const ByteEdge* edges, size_t n, const RefEdge* refs, size_t m);
  std::vector<RefEdge>& ref_buffer(size_t depth);
  std::vector<uint8_t> final_;
  std::vector<uint32_t> begin_{0};
  std::vector<ByteEdge> edges_;
  std::vector<uint32_t> ref_begin_{0};
  std::vector<RefEdge> refs_;
  std::vector<uint64_t> hash_;
  // Open addressing by signature hash; an entry is the hash's high half above state id + 1 (0 =
  // empty), so a probe passing other states reads no state but the table.
  std::vector<uint64_t> table_;
  PairMemo unions_, concats_;
  std::deque<std::vector<ByteEdge>> bufs_;  // one per recursion depth (a deque: references stay valid)
  std::deque<std::vector<RefEdge>> ref_bufs_;
  std::vector<int32_t> local_, queue_;       // flatten(): local_ is all -1 between calls
  size_t depth_ = 0;
  int64_t limit_ = 0;
  int32_t accept_ = kDead;
  Deadline* deadline_ = nullptr;
};

// Builds rules' NFAs, reusing its buffers from rule to rule.
class NfaBuilder {
 public:
  NfaBuilder(const std::vector<std::vector<int32_t>>& rules, const std::vector<uint8_t>& inline_rule,
             int64_t max_states, Deadline& deadline)
      : rules_(&rules),
        inline_rule_(&inline_rule),
        max_states_(max_states),
        deadline_(&deadline),
        own_shared_(std::make_unique<Shared>()),
        shared_(own_shared_.get()) {}
  struct Shared;
  // A builder whose shared state is kept elsewhere (a LoweringScratch), reset here for this grammar.
  NfaBuilder(const std::vector<std::vector<int32_t>>& rules, const std::vector<uint8_t>& inline_rule,
             int64_t max_states, Deadline& deadline, Shared* shared)
      : rules_(&rules), inline_rule_(&inline_rule), max_states_(max_states), deadline_(&deadline), shared_(shared) {
    size_t words = 0;
    for (const std::vector<int32_t>& code : rules) words += code.size();
    shared_->reset(deadline, words);
    lends_buffers_ = true;
    eps_.swap(shared_->spare_eps);
    bytes_.swap(shared_->spare_bytes);
    refs_.swap(shared_->spare_refs);
  }
  ~NfaBuilder();
  NfaBuilder(const NfaBuilder&) = delete;
  NfaBuilder& operator=(const NfaBuilder&) = delete;
  void build_rule(int32_t r, Nfa* out);
  // Appends rule r's minimal DFA to `pool` straight from its program through the fragment store,
  // for finite programs (references are edges); returns its start's pool index, or -1 where the
  // rule is left to build_rule() and subset construction (grammar/lower/fragment.cpp).
  int32_t lower_in_store(int32_t r, DfaPool* pool);

  // An inlined rule's trimmed, minimized automaton (byte edges only: inlined rules call only
  // inlined rules), spliced into callers instead of re-expanding its program each time.
  struct Fragment {
    bool usable = false;  // false: the program is expanded instead (automaton too large)
    std::vector<uint8_t> final;
    std::vector<uint32_t> begin;  // per state, size states + 1
    std::vector<ByteEdge> bytes;
  };

 private:
  const Fragment& fragment(int32_t r);  // grammar/lower/fragment.cpp
  // The store state of inlined rule r's automaton; -2 where the store cannot hold it (too
  // large, or a program the NFA path must report on).
  int32_t fragment_state(int32_t r);
  // The expression at pc followed by `cont`, in the store (may throw FragmentStore::Overflow).
  int32_t store_eval(const std::vector<int32_t>& code, size_t& pc, int32_t cont);
  // store_eval over a whole program with at most `budget` new store states; -2 when it overflows
  // (depth_ is then reset to `depth_after_overflow`) or stops short.
  int32_t eval_program(const std::vector<int32_t>& code, int64_t budget, int depth_after_overflow);
  std::vector<size_t> seq_pcs_;  // store_eval's Seq children, a stack shared by its recursion
  bool store_refs_ = false;      // store_eval may write references (a rule's own automaton)
  int store_nesting_ = 0;        // fragment_state() calls in progress
  struct ByteSeq {
    int n = 0;
    std::array<std::pair<uint8_t, uint8_t>, 4> r{};
  };
  int32_t fresh();
  // [begin, end) in shared_->seqs: the UTF-8 byte sequences of the class at pc (split once).
  std::pair<uint32_t, uint32_t> class_span(const std::vector<int32_t>& code, size_t pc);
  int32_t build(const std::vector<int32_t>& code, size_t& pc, int32_t from, bool tail);
  int32_t build_node(const std::vector<int32_t>& code, size_t& pc, int32_t from, bool tail);
  // An Alt at pc whose branches share a large last (and first) element, built with one copy of
  // it; false (nothing built, pc unchanged) for any other Alt (grammar/lower/nfa_alt.cpp).
  bool build_factored_alt(const std::vector<int32_t>& code, size_t& pc, int32_t from, bool tail, int32_t* end);
  struct AltBranch {
    size_t begin, end;  // the branch's program words
    uint32_t first, n;  // its n elements start at alt_elems_[first...], alt_elems_[first + n] ends them
    int32_t group;      // branches with the same last element share a group (-1: none)
  };
  std::vector<AltBranch> alt_branches_;  // build_factored_alt's stacks (it nests through build())
  std::vector<size_t> alt_elems_;
  static void utf8_split(uint32_t lo, uint32_t hi, std::vector<ByteSeq>& out);

  // Pointers: a kept nested builder is rebound to the next grammar (fragment()).
  const std::vector<std::vector<int32_t>>* rules_;
  const std::vector<uint8_t>* inline_rule_;
  int64_t max_states_;
  Deadline* deadline_;
  bool lends_buffers_ = false;  // its edge buffers go back to shared_ (spare_*) when it is done
  int64_t total_ = 0;  // states created across all rules (the grammar-size limit)
  int depth_ = 0;      // expression nesting, bounded so deep input cannot overflow the C++ stack
  // A reference to the rule being built in tail position jumps back to its start
  // (R ::= x R | "" is x*), so right recursion costs no parser items.
  int32_t self_rule_ = -1, self_start_ = -1;
  int32_t count_ = 0;
  std::vector<std::pair<int32_t, int32_t>> eps_;
  std::vector<std::pair<int32_t, ByteEdge>> bytes_;
  std::vector<std::pair<int32_t, RefEdge>> refs_;

 public:
  // Shared by a grammar's builders: the top one and those of the fragments themselves (inlined
  // rules inline others), so each class is split and each fragment lowered once per grammar, and
  // fragments reuse one set of work buffers instead of allocating their own.
  struct Shared {
    // Forgets the previous grammar (its programs' addresses and fragments); keeps buffers and
    // builders. program_words (the grammar's total program length) sizes the store's tables.
    void reset(Deadline& deadline, size_t program_words = 0);
    size_t retained_bytes() const;  // approximate
    std::vector<ByteSeq> seqs;  // the byte sequences of every class met, back to back
    // [begin, end) in seqs, by the class's ranges (programs do not change while lowering, so a
    // class's first occurrence keys it): open addressing in flat arrays, one lookup per class
    // expanded. Equal classes in different rules (a JSON string character in every string
    // rule) are split once and share one span.
    std::vector<const int32_t*> class_key;
    std::vector<std::pair<uint32_t, uint32_t>> class_span;
    std::vector<uint64_t> class_hash;
    size_t class_count = 0;
    // The span of the class at `key` (its opcode; the range count and ranges follow, all within
    // the program); *fresh: just added (its span is to be filled in).
    std::pair<uint32_t, uint32_t>& class_seqs(const int32_t* key, bool* fresh);
    // store_eval's automaton of a class (by its span's start) followed by a continuation state:
    // the same class before the same continuation recurs across rules.
    PairMemo class_then;
    std::unordered_map<int32_t, Fragment> fragments;
    FragmentStore store;
    std::vector<int32_t> rule_state;  // fragment_state() per rule: -3 unknown
    std::vector<ByteEdge> class_edges;
    // nested[d]: the builder of fragments met at inlining depth d + 1 (its caller is mid-build).
    std::vector<std::unique_ptr<NfaBuilder>> nested;
    // Determinizing and merging a fragment start once its NFA is complete, nested fragments
    // included, so all depths share these.
    std::unique_ptr<Determinizer> determinizer;
    StateMerger merger;
    Nfa nfa;
    DfaPool pool;
    std::vector<uint32_t> rev_begin, rev, fill, stack;
    std::vector<uint8_t> live;
    std::vector<int32_t> rep, remap;
    // The edge buffers of the grammar's own builder between grammars.
    std::vector<std::pair<int32_t, int32_t>> spare_eps;
    std::vector<std::pair<int32_t, ByteEdge>> spare_bytes;
    std::vector<std::pair<int32_t, RefEdge>> spare_refs;
  };

 private:
  size_t level_ = 0;  // inlining depth: 0 for the grammar's own builder
  std::unique_ptr<Shared> own_shared_;  // set in the grammar's own builder only
  Shared* shared_ = nullptr;
};

// The work buffers of one thread's lowering, kept from grammar to grammar (allocating them
// afresh cost about a tenth of lowering a mid-size schema). Each user resets what it reads before reading
// it, so a grammar's automata never depend on the one lowered before (nor on one that failed).
struct LoweringScratch {
  Nfa nfa;
  DfaPool pool;
  Determinizer determinizer;
  StateMerger merger;
  NfaBuilder::Shared nfa_shared;
  std::vector<int32_t> base, order, work, stack, pending, remap, rep;
  std::vector<uint32_t> count, caller_begin, callers, fill, seen, rev_begin, rev, reached;
  std::vector<uint8_t> built, productive, queued, live, emit, stored;
  size_t retained_bytes() const;  // approximate
};

// Lends the calling thread's LoweringScratch for one lowering (a fresh one if the thread's is
// already lent), and drops the buffers afterwards if a huge grammar left them too large to keep.
class ScratchLease {
 public:
  ScratchLease();
  ~ScratchLease();
  ScratchLease(const ScratchLease&) = delete;
  ScratchLease& operator=(const ScratchLease&) = delete;
  LoweringScratch& operator*() const { return *scratch_; }

 private:
  LoweringScratch* scratch_;
  std::unique_ptr<LoweringScratch> own_;  // when the thread's scratch is in use
};

}  // namespace grammar
}  // namespace agent_infer
