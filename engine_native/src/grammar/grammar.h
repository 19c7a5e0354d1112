// Grammar engine core: byte-level rule automata, an Earley matcher over bytes, and the
// tokenizer-level adaptive token-mask cache. Design notes live in docs/grammar_engine.md.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace agent_infer {
namespace grammar {

// This thread's instance of T. Out of line on purpose: where a thread_local is used inline, GCC
// recomputes its address (a __tls_get_addr call in a shared library) at every use rather than
// keep it in a register, dozens of calls per mask fill.
template <class T>
[[gnu::noinline]] T& thread_slot() {
  thread_local T slot;
  return slot;
}

// Mapped to agent_infer.errors.GrammarLimitError / GrammarDefinitionError by the bindings.
struct LimitError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct DefinitionError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// Mapped to agent_infer.errors.MatcherUsageError: an argument a matcher cannot take (a token id
// outside the vocabulary, a rollback past the start); `argument` names the Python argument.
struct UsageError : std::invalid_argument {
  UsageError(const std::string& message, const char* argument_)
      : std::invalid_argument(message), argument(argument_) {}
  const char* argument;
};
// Mapped to agent_infer.errors.TokenBitmaskError: a bitmask row or width that does not fit.
struct BitmaskError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};
// Mapped to agent_infer.errors.MatcherBusyError: a matcher entered while another call on it
// (another thread's) is still running. `operation` and `running` are the two calls' names.
struct BusyError : std::runtime_error {
  BusyError(const char* operation_, const char* running_)
      : std::runtime_error(std::string("GrammarMatcher.") + operation_ + " was called while " + running_ +
                           " is running on the same matcher in another thread; a matcher serves one thread at a "
                           "time (fork() one per thread, or serialize the calls)"),
        operation(operation_),
        running(running_) {}
  const char* operation;
  const char* running;
};

// Opcodes of the flat IR produced by agent_infer/grammar/compiler.py (_serialize_expr).
//   EMPTY | LITERAL n b0..b(n-1) (UTF-8 bytes) | CLASS n lo0 hi0 .. (normalized code point ranges)
//   SEQ n child.. | ALT n child.. | REPEAT min max(-1 = unbounded) child | REF rule_index
//   | KEY_TRIE n free_rule rest_rule count (len cp0..cp(len-1))..: n payload words; a JSON
//     object key (quotes excluded) that is none of `count` names (sorted, distinct, plain printable
//     ASCII), where
//     a plain character that continues no name is followed by rest_rule and free_rule reads a
//     special character and the rest. Only as a rule's whole body; lowered straight to its
//     automaton (grammar/lower/key_set.cpp).
enum Op : int32_t { kEmpty = 0, kLiteral = 1, kClass = 2, kSeq = 3, kAlt = 4, kRepeat = 5, kRef = 6, kKeyTrie = 7 };

struct ByteEdge {
  uint8_t lo, hi;
  int32_t target;
};
struct RefEdge {
  int32_t rule;
  int32_t target;
};
struct State {
  int32_t rule = 0;
  bool final = false;
  uint32_t byte_begin = 0, byte_end = 0, ref_begin = 0, ref_end = 0;
};

// Tokens at sorted positions [begin, end) all leave a loop region (see CompiledGrammar::
// region_of) after `depth` bytes, entering the region's exit state number `exit`; `flag`: the
// rule could already have finished at a position in [1, depth) with the next byte following it.
struct RegionExit {
  int32_t begin, end, depth, exit, flag;
};

// What one automaton state does with every token, in isolation from its context.
struct StateMask {
  std::vector<uint32_t> accepted_bits;  // a full bitset over the vocabulary, or empty
  std::vector<int32_t> accepted_ids;    // used instead when few tokens are accepted
  std::vector<int32_t> uncertain;       // positions in TokenizerInfo::sorted, ascending
  std::vector<RegionExit> exits;        // only in the cached walk of a loop region
  // Only in a union of first-byte pieces (grammar/mask/pieces.cpp): the first bytes whose runs it holds.
  std::array<uint32_t, 8> first_bytes{};
  size_t bytes() const {
    return sizeof(*this) + accepted_bits.capacity() * 4 + accepted_ids.capacity() * 4 + uncertain.capacity() * 4 +
           exits.capacity() * sizeof(RegionExit);
  }
};

// Stores accepted tokens densely or as a sorted id list, whichever is smaller (or densely, while
// a KeepBits is alive on this thread).
void finish_mask(StateMask& out, std::vector<uint32_t>&& bits, size_t n_accepted);
// While one is alive on a thread, finish_mask keeps a walk's accepted tokens as they were
// gathered. A split walk's parts are ORed into one bitset by their assembly, which lists the
// ids once for the whole walk; listing them in each part scanned every part's bitset for nothing.
class KeepBits {
 public:
  KeepBits() : prev_(slot().on) { slot().on = true; }
  ~KeepBits() { slot().on = prev_; }
  KeepBits(const KeepBits&) = delete;
  KeepBits& operator=(const KeepBits&) = delete;
  static bool active() { return slot().on; }

 private:
  struct Flag {
    bool on = false;
  };
  static Flag& slot() { return thread_slot<Flag>(); }
  bool prev_;
};
// ORs listed token ids into a bitset. In a sorted list (as finish_mask writes them) runs of ids
// share a word: each run is gathered in a register and stored once, rather than one
// read-modify-write per id, each waiting on the store before it.
inline void or_ids(uint32_t* bits, const std::vector<int32_t>& ids) {
  if (ids.empty()) return;
  uint32_t w = static_cast<uint32_t>(ids[0]) >> 5, acc = 0;
  for (const int32_t id : ids) {
    const uint32_t u = static_cast<uint32_t>(id);
    if ((u >> 5) != w) {
      bits[w] |= acc;
      w = u >> 5;
      acc = 0;
    }
    acc |= 1u << (u & 31);
  }
  bits[w] |= acc;
}
inline void or_ids(std::vector<uint32_t>& bits, const std::vector<int32_t>& ids) { or_ids(bits.data(), ids); }
// Set bits in words[0, n). The wheel targets baseline x86-64, where __builtin_popcount is a libgcc
// call per word; walks count 4 000 words per part, so this one loop is also built with popcnt and
// picked at load time on CPUs that have it.
size_t count_bits(const uint32_t* words, size_t n);
// The tokens one walk accepts: a bitset over the vocabulary seeded from `base`, or, for a walk of
// fewer live tokens than the bitset has words and no base (a sparse state), an id list, which
// spares zeroing and scanning the bitset (~4 us per walk at 129k tokens) when few are accepted.
class AcceptedSet {
 public:
  AcceptedSet(size_t words, const StateMask* base, size_t live_tokens);
  void add(int32_t id) {
    if (list_) {
      ids_.push_back(id);
    } else {
      bits_[static_cast<size_t>(id) >> 5] |= 1u << (id & 31);
    }
    ++n_;
  }
  // Stores the set into out as finish_mask would.
  void finish(StateMask& out);

 private:
  bool list_;
  size_t words_;
  size_t n_ = 0;
  std::vector<uint32_t> bits_;
  std::vector<int32_t> ids_;
};

// Adds base's uncertain positions (disjoint from out's) to out's, keeping them sorted.
void merge_uncertain(StateMask& out, const StateMask* base);
// 128-bit digest of `data` prefixed by `kind` (17 bytes): the form of every cache key.
std::string digest(const std::string& data, char kind);
// Seeds a walk's accepted bitset with the tokens `base` (if any) accepts; returns their count.
size_t seed_bits(const StateMask* base, std::vector<uint32_t>& bits);
class TokenizerInfo;
// The piece of a walked mask for the sorted positions [lo, hi) (a first byte's run): the ids of
// the run accepted in `bits` (the walk's accepted tokens as a bitset), in position order, and the
// walk's uncertain positions (and, with `exits`, region exits) inside the run.
std::shared_ptr<StateMask> run_piece(const TokenizerInfo& tk, const std::vector<uint32_t>& bits,
                                     const StateMask& walked, size_t lo, size_t hi, bool exits);
// seed_bits, then without the tokens at `positions` of the sorted token array (`sorted` maps a
// position to its id): the part of a mask that a walk of those tokens recomputes.
size_t seed_bits_except(const StateMask* base, std::vector<uint32_t>& bits, const std::vector<int32_t>& positions,
                        const std::vector<int32_t>& sorted);
// seed_bits without the token ids set in `drop` (a bitmask of `bits.size()` words).
size_t seed_bits_masked(const StateMask* base, std::vector<uint32_t>& bits, const std::vector<uint32_t>& drop);

// The number of characters of `token` if it is JSON string content as it stands (well-formed
// UTF-8, every code point U+0020 or above but '"' and '\\'; a character it ends inside counts as
// one), else SIZE_MAX; *dead_after: the characters before a control byte or a byte no character
// starts with, if the token reaches one as content up to there (else SIZE_MAX)
// (grammar/mask/content.cpp).
size_t content_chars(const std::string& token, size_t* dead_after = nullptr);
// Whether bytes [p, p + n) are well-formed UTF-8 (Unicode Table 3-7; any ASCII byte counts), a
// last character cut short included (grammar/mask/content.cpp).
bool utf8_well_formed(const uint8_t* p, size_t n);

class TokenizerInfo {
 public:
  TokenizerInfo(std::vector<std::string> token_bytes, int32_t vocab_size, std::vector<int32_t> eos_ids);

  int32_t vocab_size;
  int32_t words;  // ceil(vocab_size / 32)
  std::vector<int32_t> eos_ids;
  std::vector<std::string> tokens;  // by id, size vocab_size; empty = never produced by grammar text
  std::vector<int32_t> sorted;      // ids of non-empty tokens, sorted by bytes
  std::vector<uint16_t> lcp;        // lcp[i]: common prefix length of sorted[i-1] and sorted[i]
  // The sorted tokens' bytes back to back (sequential scans instead of pointer chasing).
  std::string sorted_data;
  std::vector<uint32_t> sorted_off;  // size sorted.size() + 1
  const char* sorted_ptr(size_t i) const { return sorted_data.data() + sorted_off[i]; }
  size_t sorted_len(size_t i) const { return sorted_off[i + 1] - sorted_off[i]; }
  // First sorted index after i whose token does not start with the first plen bytes of token i
  // (tokens sharing a prefix are contiguous in sorted order).
  size_t run_end(size_t i, size_t plen) const;
  // The walks' skip over dead siblings: `from` and the tokens after it that share token i's first
  // d bytes are passed over while their byte d is outside `stop` (a 256-bit set); returns the
  // first position, at most `limit`, that leaves that run or reads a byte of `stop` there.
  size_t skip_dead(size_t i, size_t d, size_t from, size_t limit, const std::array<uint32_t, 8>& stop) const;
  std::vector<uint32_t> first_byte_end;
  // short_run_end[p - 2][i] = run_end(i, p) for p = 2..4: the dead prefixes a walk meets are
  // mostly this short, and a table read replaces a galloping search of memcmp calls.
  std::array<std::vector<uint32_t>, 3> short_run_end;
  size_t max_token_len = 0;
  // Tokens longer than this many bytes are "long" for short-token masks (grammar/mask/short_tokens.cpp);
  // long_sorted lists their sorted positions, ascending.
  static constexpr size_t kShortTokenLen = 16;
  std::vector<int32_t> long_sorted;
  // Sorted positions of the tokens longer than kTwinLens[k] bytes, ascending (twin masks,
  // grammar/mask/twin.cpp: a state whose neighbourhood agrees with a computed one up to that depth
  // walks only these).
  static constexpr std::array<size_t, 8> kTwinLens{{6, 8, 10, 12, 16, 24, 32, 64}};
  std::array<std::vector<int32_t>, 8> longer_sorted;
  // The same sets as token-id bitmasks (`words` each): a twin's mask minus them is one AND per word.
  std::array<std::vector<uint32_t>, 8> longer_bits;
  // JSON string content as the tokens spell it (grammar/mask/content.cpp): tokens of well-formed UTF-8
  // whose code points are all U+0020 or above but '"' and '\\', at most kContentChars of them, as
  // an id bitmask (content_bits, content_count of them); the sorted positions of every other
  // token, ascending (content_rest: quotes, escapes, control bytes, split characters, long ones).
  // content_rest_walked: content_rest without the tokens that read a control byte, or a byte no
  // character starts with, after at most kContentChars content characters (dead where a string
  // state has no edge on such bytes).
  static constexpr size_t kContentChars = 16;
  std::vector<uint32_t> content_bits;
  size_t content_count = 0;
  // The content tokens whose first byte is ASCII (depth-1 region walks: the rest of such a token
  // starts at a character boundary).
  std::vector<uint32_t> content_ascii_bits;
  size_t content_ascii_count = 0;
  // content_upto_bits[r]: the content tokens of at most r characters, and their number.
  std::array<std::vector<uint32_t>, kContentChars> content_upto_bits;
  std::array<size_t, kContentChars> content_upto_count{};
  std::vector<int32_t> content_rest, content_rest_walked;
  // content_with[b]: the sorted positions of the content tokens with a character that starts
  // with byte b (an ASCII content byte or a UTF-8 lead byte), ascending. A loop region on which a
  // few characters die or leave (a pattern's '.', U+2028 in an ECMAScript '.') walks only these.
  std::array<std::vector<int32_t>, 256> content_with;
  // content_chars_at[i]: the characters of the content token at sorted position i (else 0).
  std::vector<uint8_t> content_chars_at;
  // Byte groups of each sorted token past its first byte, as a 128-bit set (grammar/mask/region_classes.cpp):
  // bytes 20-7F one group each, control bytes in pairs, bytes 80-FF in eights. A loop region
  // such as `[a-z]+` classifies most tokens from these without a walk.
  static unsigned byte_group(uint8_t b) { return b >= 0x80 ? 16u + ((b - 0x80u) >> 3) : b >= 0x20 ? b : b >> 1u; }
  std::vector<std::array<uint64_t, 2>> tail_groups;
  // utf8_from[i]: bit 0 if token i is well-formed UTF-8 from its first byte, bit 1 from its second
  // (a character it ends inside counts if its bytes so far are well-formed): with a region that
  // keeps every character's sequence among its kept rows, its non-ASCII bytes then stay.
  std::vector<uint8_t> utf8_from;

  // State masks shared by every grammar compiled for this tokenizer, keyed by automaton structure.
  std::shared_ptr<const StateMask> cache_get(const std::string& key);
  std::shared_ptr<const StateMask> cache_put(const std::string& key, std::shared_ptr<const StateMask> mask);
  // Stores `mask` under `key`, replacing an entry (grown unions of first-byte pieces).
  void cache_replace(const std::string& key, std::shared_ptr<const StateMask> mask);
  size_t cache_bytes();
  size_t cache_entries();

 private:
  std::mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<const StateMask>> cache_;
  size_t cache_bytes_ = 0;
};

struct Limits {
  int64_t max_nfa_states = 2000000;
  int64_t max_dfa_states = 500000;
  double max_compile_seconds = 30.0;
  int64_t max_items_per_set = 200000;
  // Matching work (Earley items added plus items of origin sets scanned by completions) allowed
  // for one accepted byte, and for all the Earley steps of one token-mask fill. They bound the
  // cost of ambiguous grammars (`root ::= root root | "a"` is quadratic per byte), whose sets
  // stay small enough for max_items_per_set while completions rescan every earlier set.
  static constexpr int64_t kDefaultWorkPerByte = 1000000;
  static constexpr int64_t kDefaultWorkPerMask = 16000000;
  int64_t max_work_per_byte = kDefaultWorkPerByte;
  int64_t max_work_per_mask = kDefaultWorkPerMask;

  // The limits the Python compiler's arguments stand for (NFA states: 4x the DFA budget).
  static Limits from_args(int64_t max_states, double max_seconds, int64_t max_items,
                          int64_t max_work_byte = kDefaultWorkPerByte, int64_t max_work_mask = kDefaultWorkPerMask) {
    Limits lim;
    lim.max_nfa_states = max_states * 4;
    lim.max_dfa_states = max_states;
    // No budget (inf) is about three years: the deadlines convert seconds to integer microseconds
    // and add them to the clock, which inf or ~2^63 ns would overflow.
    lim.max_compile_seconds = std::min(max_seconds, 1e8);
    lim.max_items_per_set = max_items;
    lim.max_work_per_byte = max_work_byte;
    lim.max_work_per_mask = max_work_mask;
    return lim;
  }
};

class CompiledGrammar {
 public:
  CompiledGrammar(std::shared_ptr<TokenizerInfo> tok, const std::vector<std::vector<int32_t>>& rules,
                  int32_t root, const Limits& limits);
  // The same from programs it may rewrite in place (left in an unspecified state): merging equal
  // rules and outlining then copy no program.
  CompiledGrammar(std::shared_ptr<TokenizerInfo> tok, std::vector<std::vector<int32_t>>&& rules, int32_t root,
                  const Limits& limits);

  std::shared_ptr<TokenizerInfo> tok;
  // Unique per grammar for the process's lifetime: names it in per-thread caches (grammar/mask/pushdown_walk.cpp).
  static uint64_t new_uid();
  const uint64_t uid = new_uid();
  std::vector<State> states;
  std::vector<ByteEdge> byte_edges;
  std::vector<RefEdge> ref_edges;
  std::vector<int32_t> rule_start;  // -1 for rules never used
  std::vector<uint8_t> nullable;
  int32_t root = 0;
  int64_t max_items_per_set = 0;
  int64_t max_work_per_byte = Limits::kDefaultWorkPerByte;  // Limits::max_work_per_byte
  int64_t max_work_per_mask = Limits::kDefaultWorkPerMask;  // Limits::max_work_per_mask
  // Byte sets (256 bits): follow[r] = bytes that may come right after rule r finishes, in any
  // context; escape[q] = bytes that may be read next from state q by leaving its rule's own
  // automaton (calling a rule, or finishing the rule). Over-approximations are safe.
  using ByteSet = std::array<uint32_t, 8>;
  std::vector<ByteSet> follow;
  std::vector<ByteSet> escape;
  // reach_call[q]: a state with rule references is reachable from q through >= 1 byte edge.
  std::vector<uint8_t> reach_call;
  static bool has(const ByteSet& set, uint8_t b) { return (set[b >> 5] >> (b & 31)) & 1u; }
  // ORs into `set` the bytes state q has byte edges for.
  void add_live_bytes(int32_t q, ByteSet& set) const {
    const State& st = states[static_cast<size_t>(q)];
    for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
      for (int x = byte_edges[e].lo; x <= byte_edges[e].hi; ++x) set[static_cast<size_t>(x) >> 5] |= 1u << (x & 31);
    }
  }

  int32_t step(int32_t s, uint8_t b) const {
    const State& st = states[s];
    for (uint32_t e = st.byte_begin; e < st.byte_end; ++e) {
      const ByteEdge& be = byte_edges[e];
      if (b < be.lo) return -1;  // edges are sorted and disjoint
      if (b <= be.hi) return be.target;
    }
    return -1;
  }
  bool scans(int32_t s) const { return states[s].byte_end > states[s].byte_begin; }
  // The token classification of state s (computed on first use, shared through the tokenizer).
  const StateMask& mask_for(int32_t s) const;
  // Whether mask_for(s) is computed already (a fill meeting s costs microseconds).
  bool mask_ready(int32_t s) const { return masks_[s].load(std::memory_order_acquire) != nullptr; }
  // At least 4 096 tokens start with a byte s reads.
  bool dense_start(int32_t s) const;
  // Outcomes of the run-time check of large uncertain sets, keyed by a digest of the parse
  // context the check reads (Matcher::context_key); values: the tokens the check allowed.
  std::shared_ptr<const StateMask> checked_get(const std::string& key) const;
  void checked_put(const std::string& key, std::shared_ptr<const StateMask> allowed) const;
  size_t memory_bytes() const;
  // Shortest completions (grammar/match/complete.cpp), built on first use: per state, the fewest bytes
  // that lead to a final state of its rule (rule references cost their rule's shortest string),
  // and the edge that starts such a string (kind: 0 stop here, 1 byte edge, 2 rule reference).
  struct Completion {
    std::vector<int64_t> dist;
    std::vector<uint8_t> kind;
    std::vector<uint32_t> edge;
  };
  const Completion& completion() const;
  // Appends the shortest string from state s to a final state of its rule (see completion()).
  void append_shortest(int32_t s, std::string& out, int depth) const;

 private:
  mutable std::once_flag completion_once_;
  mutable std::unique_ptr<Completion> completion_;
  void compute_follow_sets(const Limits& limits);
  // The constructors' work; ``own`` holds rewritten programs (it may be ``&rules_in`` itself).
  void lower_rules(const std::vector<std::vector<int32_t>>& rules_in, std::vector<std::vector<int32_t>>* own,
                   const Limits& limits);
  // Canonical description of rule r's automaton (with its callees when `calls`), memoized.
  const std::string& rule_key(int32_t r, bool calls) const;
  std::string structure_key(int32_t s) const;
  // Whether rule r's pushdown digest (rule_key(r, true)) exists or is cheap to build (few
  // states reachable through calls whose digests are missing).
  bool pushdown_keys_ready(int32_t r) const;
  // Rule r's pushdown digest where pushdown_keys_ready(r), else a name that only this grammar
  // uses (its uid and r): keys holding it are never shared with other grammars.
  std::string callee_name(int32_t r) const;
  // Whether rule r's plain key (rule_key(r, false)) exists or is cheap to build (a small rule).
  bool plain_key_cheap(int32_t r) const;

 public:
  // The token walks classify the sorted tokens of each range, all of which share their first
  // `depth` bytes and reach `state` after them; `base` (if any) holds tokens accepted already.
  struct WalkRange {
    size_t begin, end, depth;
    int32_t state;
    uint8_t flag;  // as the walks' flag[depth]
    // Tokens of at most this many bytes are left to the walk's base (a twin's classification of
    // them): walked past for their prefixes, never classified.
    uint16_t min_len = 0;
  };
  // Tokens the ranges can walk past their first byte: the runs of the start state's live first
  // bytes for ranges at depth 0, the whole range otherwise (also what a split walk divides).
  size_t live_tokens(const std::vector<WalkRange>& ranges) const;

 private:
  // Consecutive ranges that walk from one state at depth 0 (a sorted list of token positions cut
  // into blocks of consecutive ones) are one walk with holes: a run of tokens found dead in one
  // block covers the later blocks it reaches, which are then skipped, and the search for dead
  // siblings goes on to the end of the group. Walking each block afresh re-found the same dead
  // first bytes and prefixes once per block: ~1 ms for the long tokens of a twin state.
  class RangeCarry {
   public:
    explicit RangeCarry(const std::vector<WalkRange>& ranges);
    // Where range r's walk starts: past the end of a dead run carried from its group.
    size_t begin(size_t r) const {
      return group_[r] == dead_group_ && dead_end_ > ranges_[r].begin ? dead_end_ : ranges_[r].begin;
    }
    // How far a search for dead siblings from range r may reach: the end of its group.
    size_t limit(size_t r) const { return limit_[r]; }
    // Range r's walk found the tokens before `end` dead (decided).
    void dead(size_t r, size_t end) {
      dead_group_ = group_[r];
      dead_end_ = end;
    }

   private:
    const std::vector<WalkRange>& ranges_;
    std::vector<size_t> group_, limit_;
    size_t dead_group_ = SIZE_MAX, dead_end_ = 0;
  };
  std::shared_ptr<const StateMask> compute_mask(const std::vector<WalkRange>& ranges, const StateMask* base) const;
  // The ranges walking the tokens at `longer` (sorted positions of tokens longer than `cut`
  // bytes) from s, within its live first bytes' runs (grammar/mask/twin.cpp).
  std::vector<WalkRange> longer_ranges(int32_t s, const std::vector<int32_t>& longer, size_t cut) const;
  // For states from which the rule may call other rules mid-token (grammar/mask/pushdown_walk.cpp).
  bool calls_within_reach(int32_t s) const;
  std::shared_ptr<const StateMask> compute_mask_with_calls(const std::vector<WalkRange>& ranges,
                                                           const StateMask* base) const;
  // The plain walk of s, its uncertain tokens then classified by the pushdown walk (the same
  // classification as the pushdown walk alone, for less work; grammar/mask/state_mask.cpp).
  std::shared_ptr<const StateMask> refine_with_calls(int32_t s) const;
  // Parts of a walk split across threads (grammar/batch/pool.cpp). A part walks its ranges as the whole
  // walk would; `resume`: its first range continues the previous part's last one, so the tail of
  // a dead run begun there is skipped (the previous part classified it). The assembled parts
  // equal the unsplit walk's result. nullptr from the pushdown part: it gave up.
  std::shared_ptr<const StateMask> compute_mask_part(const std::vector<WalkRange>& ranges, const StateMask* base,
                                                     bool resume) const;
  std::shared_ptr<const StateMask> compute_mask_with_calls_part(const std::vector<WalkRange>& ranges,
                                                                const StateMask* base, bool resume) const;
  // Runs a large walk in parts on the threads of the batch fill this thread serves, if any;
  // false: not split (the caller walks alone). *out is nullptr if a pushdown part gave up.
  bool split_walk(const std::vector<WalkRange>& ranges, const StateMask* base, bool calls,
                  std::shared_ptr<const StateMask>* out) const;
  // A loop region's transitions as dense rows, built once per walk and shared by its parts: row 0
  // is the start state's; an entry is the target's row, -1 (dead) or -2 - k (exit k of `exits`).
  struct RegionRows {
    std::vector<int32_t> rows;  // 256 per row
    std::vector<uint8_t> final;
  };
  RegionRows region_rows(int32_t start, const std::vector<int32_t>& exits) const;
  // The loop-region walk of s over sorted positions [begin, end) (`resume` as above), and its split.
  std::shared_ptr<const StateMask> compute_region_part(const RegionRows& rr, int32_t s, size_t begin, size_t end,
                                                       bool resume) const;
  bool split_region(int32_t s, const RegionRows& rr, std::shared_ptr<const StateMask>* out) const;
  // The region walk from its content check (grammar/mask/content.cpp region_content_deep): every
  // content token accepted as a whole, only the other tokens walked; nullptr where the check fails.
  // first = 1: over the whole vocabulary with each token's first byte taken as read into s (the
  // content tokens with an ASCII first byte accepted, the tokens starting from byte 80 walked).
  std::shared_ptr<const StateMask> compute_region_content(const RegionRows& rr, int32_t s, size_t first) const;
  // Whether every string of up to kContentChars content characters that starts none of its
  // characters with a byte of *walked stays inside the region from its row 0 (never dies nor
  // exits); *walked is grown to the few start bytes that must be excluded for that (false if
  // there are too many).
  // *whole_chars: every string of up to this many content characters stays inside, whatever
  // bytes start its characters (the depth the check first failed at, before excluding any).
  static bool region_content_deep(const RegionRows& rr, ByteSet* walked, size_t* whole_chars);
  // Whether from every row marked in `kept` every well-formed UTF-8 sequence of a non-ASCII
  // character stays inside the region (never dies nor exits) and ends in a kept row.
  static bool region_keeps_utf8(const RegionRows& rr, const std::vector<uint8_t>& kept);
  // The region walk from byte classes (grammar/mask/region_classes.cpp) over the given sorted runs,
  // entered at depth `first` (0, or 1 with each token's first byte taken as read into s): a token
  // whose byte groups all stay inside from every row is accepted, one that reads a byte dead in
  // every row and none that may leave is rejected, and only the rest is walked. nullptr where
  // more than a quarter of the vocabulary would still be walked.
  std::shared_ptr<const StateMask> region_from_classes(const RegionRows& rr, int32_t s,
                                                       const std::vector<std::pair<size_t, size_t>>& runs,
                                                       size_t first) const;

 public:
  // Test hook: state s's walks (plain, pushdown if it calls, region if in one, and the plain
  // walk of its first-byte runs) computed whole and in parts of `part_tokens` give equal masks.
  bool split_matches_whole(int32_t s, size_t part_tokens) const;
  // Test hook: -1 if s is in no loop region or its region fails the content check, else whether
  // the region walk from the content check (compute_region_content, entered at depth `first`
  // over the whole vocabulary) equals the full region walk.
  int region_content_matches_walk(int32_t s, size_t first) const;
  // Test hook: -1 if s is in no loop region or region_from_classes declines it (entered at depth
  // `first` over the whole vocabulary), else whether it equals the full region walk.
  int region_classes_matches_walk(int32_t s, size_t first) const;

 private:
  // Loop regions (string contents): the strongly connected component of s among the states
  // without rule references (through byte edges), if s lies on a cycle. Fills a digest of
  // the region's canonical serialization and its exit states (targets outside the region, in
  // order of first appearance); false if s has no such region. Memoized per state.
  bool region_of(int32_t s, std::string* key, std::vector<int32_t>* exits) const;
  struct RegionMemo {
    bool found = false;
    std::string key;  // the serialization's digest ('R')
    std::vector<int32_t> exits;
    std::string digest_q;  // its digest of kind 'Q' (region pieces)
  };
  // A digest (kind 'Q') of s's region and its exits, memoized with region_of; false if s has no
  // loop region.
  bool region_digest_q(int32_t s, std::string* qkey, std::vector<int32_t>* exits) const;
  mutable std::mutex region_mu_;
  mutable std::unordered_map<int32_t, RegionMemo> region_memo_;
  // A loop-region state's region walk assembled from depth-1 pieces of its first bytes' targets
  // (grammar/mask/region_pieces.cpp), in the numbering of `exits` (region_of's); nullptr for sparse
  // states.
  std::shared_ptr<const StateMask> region_by_first_byte(int32_t s, const std::vector<int32_t>& exits) const;
  // The region of t walked over the given sorted runs, each run's first byte taken as read
  // into t; exits numbered as in `exits` (region_of's for t).
  std::shared_ptr<const StateMask> walk_region_depth1(int32_t t, const std::vector<int32_t>& exits,
                                                      const std::vector<std::pair<size_t, size_t>>& runs) const;
  // One part of it over t's region table (`resume` as for compute_mask_part), and its split
  // (grammar/batch/split.cpp).
  std::shared_ptr<const StateMask> walk_region_depth1_part(const RegionRows& rr, int32_t t,
                                                           const std::vector<std::pair<size_t, size_t>>& runs,
                                                           bool resume) const;
  bool split_region_depth1(const RegionRows& rr, int32_t t, const std::vector<std::pair<size_t, size_t>>& runs,
                           std::shared_ptr<const StateMask>* out) const;
  // s's loop-region walk; `exits` as region_of(s) lists them (its callers have just asked).
  std::shared_ptr<const StateMask> compute_region(int32_t s, const std::vector<int32_t>& exits) const;
  // The region of t walked with every token's first byte taken as read into t (cached in the
  // tokenizer; grammar/mask/region_pieces.cpp): first-byte pieces of targets inside loop regions.
  // Covers at least the runs of `bytes` (ascending): the whole vocabulary, or those runs alone
  // where they are less than half of it. Fills t's exit states; nullptr if t has no loop region.
  std::shared_ptr<const StateMask> region_at_depth1(int32_t t, std::vector<int32_t>* exits,
                                                    const std::vector<int>& bytes) const;
  // First-byte pieces (grammar/mask/pieces.cpp): a dense state's classification assembled from the
  // classifications of each first-byte run at the byte's target, cached under a key of the
  // target's reachable sub-automaton; nullptr for sparse states (the plain walks are cheap there).
  // cached_only: decline unless the piece of the target most tokens go to is cached already.
  std::shared_ptr<const StateMask> compute_by_first_byte(int32_t s, bool cached_only = false) const;
  bool piece_calls(int32_t t) const;
  // Key of what a walk entering t reads; memoized with the number of states it names.
  std::string local_key(int32_t t) const;
  // Appends state q's part of a neighbourhood key (local_key, short_key): final flag, escape set
  // when `with_escape`, byte edges, and callee digests when `calls`; targets renumbered by `num`.
  void append_state_key(int32_t q, bool calls, bool with_escape, const std::unordered_map<int32_t, int32_t>& num,
                        std::string& ser) const;
  // The same with the numbering in a flat per-state array (short_key's scratch).
  void append_state_key(int32_t q, bool calls, bool with_escape, const std::vector<int32_t>& num_of,
                        std::string& ser) const;
  size_t local_size(int32_t t) const;  // > 512: named by its rule
  // Whether local_key(t) is memoized already; whether what a walk entering t reads is at most
  // 64 states (counted without keying it).
  bool local_key_known(int32_t t) const;
  bool local_small(int32_t t) const;
  // Short-token masks (grammar/mask/short_tokens.cpp): the classification of s's tokens of at most
  // kShortTokenLen bytes depends only on the states within kShortTokenLen - 1 bytes of s, so it
  // is cached under a key of that neighbourhood; positions of a counted repeat (a `maxLength`
  // string) are alike there while their end is farther away, and then walk only long tokens.
  // short_key: empty if the neighbourhood is too large or holds everything reachable from s.
  const std::string& short_key(int32_t s) const;
  // The cached short part plus a walk of the long tokens; nullptr if not cached yet.
  std::shared_ptr<const StateMask> compute_from_short(int32_t s, bool calls) const;
  // The tokens at the sorted positions `listed` walked from s (the others as `base` has them):
  // the plain walk through the list, the pushdown walk (`calls`) by blocks of consecutive ones.
  std::shared_ptr<const StateMask> walk_listed(int32_t s, const std::vector<int32_t>& listed, const StateMask* base,
                                               bool calls) const;
  // Caches the short part of a freshly computed full mask of s (when s has a short key).
  void put_short(int32_t s, const StateMask& full) const;
  mutable std::unordered_map<int32_t, std::string> short_keys_;
  // Twin masks (grammar/mask/twin.cpp): a dense state outside loop regions is classified like an
  // earlier such state whose neighbourhood (as its walk reads it, calls included) agrees with its
  // own up to the length of a token (the positions of a counted repeat far from its end), or
  // takes the classification of the tokens up to the depth they agree on and walks only longer
  // tokens.
  // nullptr: no earlier state agrees far enough. *twin_whole: the twin's mask as it is.
  // whole_only: only a twin agreeing as deep as the longest token (its mask as it is, no walk).
  std::shared_ptr<const StateMask> compute_from_twin(int32_t s, bool* twin_whole, bool whole_only = false) const;
  // Content masks (grammar/mask/content.cpp): a state from which every string of up to kContentChars
  // JSON string-content characters has a path (a free string, a `maxLength` position far from its
  // end) accepts every content token as llguidance's precomputed slices do, and walks only the
  // other tokens (~4 % of a vocabulary). nullptr where that does not hold.
  std::shared_ptr<const StateMask> compute_from_content(int32_t s) const;
  // *ctrl_dead: no control byte (nor 80-C1, F5-FF) is live at a character boundary, and only '"'
  // or '\\' can leave the rule, within reach. *limit: kContentChars, or the fewer characters
  // after which no content character has an edge and nothing but '"' or '\\' leaves the rule
  // (the last positions of a `maxLength` string): longer content tokens all die there.
  bool content_deep(int32_t s, bool* ctrl_dead, size_t* limit) const;
  // Whether q's byte edges cover [lo, hi]; their targets are added to `out` (each once).
  bool range_targets(int32_t q, uint8_t lo, uint8_t hi, std::vector<int32_t>& out) const;
  // Offers s's freshly computed mask as a twin to later states of the same local shape.
  void remember_twin(int32_t s, const std::shared_ptr<const StateMask>& mask) const;
  struct Twin {
    int32_t state;
    std::shared_ptr<const StateMask> mask;
  };
  mutable std::mutex twin_mu_;
  mutable std::unordered_map<uint64_t, std::vector<Twin>> twins_;

  mutable std::mutex local_mu_;
  mutable std::unordered_map<int32_t, std::pair<std::string, size_t>> local_keys_;

  mutable std::unique_ptr<std::atomic<const StateMask*>[]> masks_;
  mutable std::mutex mu_;
  mutable std::vector<std::shared_ptr<const StateMask>> owned_;
  mutable std::mutex checked_mu_;
  mutable std::unordered_map<std::string, std::shared_ptr<const StateMask>> checked_;
  mutable size_t checked_bytes_ = 0;
  mutable std::mutex key_mu_;
  mutable std::vector<std::string> rule_keys_[2];
  mutable std::vector<uint8_t> rule_key_done_[2];
  mutable std::vector<uint8_t> digest_too_large_;  // pushdown_keys_ready's verdicts, by rule
};

struct Item {
  int32_t state;
  int32_t origin;
};

// Sorts a configuration set's items (by state, then origin) and returns a 64-bit digest of them,
// mixed into `seed`: the key under which the pushdown walks intern their sets.
inline uint64_t sort_and_digest(std::vector<Item>& items, uint64_t seed) {
  std::sort(items.begin(), items.end(),
            [](const Item& x, const Item& y) { return x.state != y.state ? x.state < y.state : x.origin < y.origin; });
  uint64_t h = 0x9E3779B97F4A7C15ull ^ seed;
  for (const Item& c : items) {
    h = (h ^ ((static_cast<uint64_t>(static_cast<uint32_t>(c.state)) << 32) | static_cast<uint32_t>(c.origin))) *
        0xff51afd7ed558ccdull;
    h ^= h >> 29;
  }
  return h;
}

// Open-addressing map from 64-bit keys (items) to int32 values, cleared in O(1) by bumping a
// stamp: the walks and the run-time check fill one per mask fill, where node-based containers
// cost an allocation per entry. As a set, `insert` alone is used and the values stay 0.
class ItemMap {
 public:
  // Adds `key` with `value` if absent; true if it was added (an existing value is kept).
  bool insert(uint64_t key, int32_t value = 0) {
    bool found;
    const size_t i = slot(key, &found);
    if (!found) values_[i] = value;
    return !found;
  }
  // Sets the value under `key` (inserting it if absent).
  void put(uint64_t key, int32_t value) {
    bool found;
    values_[slot(key, &found)] = value;
  }
  // The value under `key`, or null.
  int32_t* find(uint64_t key);
  void clear() {
    if (++stamp_ == 0) {
      std::fill(stamps_.begin(), stamps_.end(), 0);
      stamp_ = 1;
    }
    size_ = 0;
  }

 private:
  // The slot holding `key`, claimed for it if it was absent (`found` false).
  size_t slot(uint64_t key, bool* found);
  void grow();
  std::vector<uint64_t> keys_;
  std::vector<int32_t> values_;
  std::vector<uint32_t> stamps_;
  uint32_t stamp_ = 1;
  size_t size_ = 0;
};

// Every mutating call is all-or-nothing: one that throws (a limit, memory) leaves the Earley
// sets, the rollback marks and the termination flag as they were before it.
class Matcher {
 public:
  Matcher(std::shared_ptr<const CompiledGrammar> g, bool terminate_without_eos, int32_t max_rollback);
  Matcher(const Matcher& other);

  // Held for the length of every call from Python (bindings/grammar_bindings.cpp): calls that release the
  // GIL (mask fills, accepts) would otherwise let a second thread resize the Earley sets under
  // them. A second entry throws BusyError instead of waiting: sharing a matcher between threads
  // is a caller bug, and waiting would hide it (and could deadlock on the GIL).
  class Use {
   public:
    Use(const Matcher& m, const char* operation) : m_(&m) {
      const char* running = nullptr;
      if (!m.busy_.compare_exchange_strong(running, operation, std::memory_order_acquire)) {
        throw BusyError(operation, running);
      }
    }
    ~Use() { m_->busy_.store(nullptr, std::memory_order_release); }
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;

   private:
    const Matcher* m_;
  };

  bool accept_token(int32_t id);
  bool accept_bytes(const std::string& bytes);
  // Writes `words` int32 words of the next-token mask; returns true unless every token is allowed.
  // `pending` is pending_visits() when the caller has it at hand (a batch fill), else kUnknown.
  static constexpr uint32_t kUnknown = 0xFFFFFFFFu;
  bool fill_mask(int32_t* row, int64_t words, uint32_t pending = kUnknown);
  // A rough cost class of the next fill_mask: the scanning states of the current set whose masks
  // are not computed yet (each a first visit: up to milliseconds), dense ones weighing more.
  uint32_t pending_visits() const;
  void rollback(int32_t n);
  void reset();
  bool is_terminated() const;
  bool can_terminate() const;
  // Bytes the grammar forces next; must_end says whether the grammar must end right after them.
  std::string forced_bytes(bool* must_end);
  // The shortest bytes that complete the text so far to a string of the grammar ("" when it can
  // end now); false (out untouched) if the matcher is terminated. grammar/match/complete.cpp.
  bool shortest_completion(std::string* out) const;
  // The bytes that may come right after `data` (which must be accepted from the current state);
  // false if `data` is rejected. The matcher is left as it was. grammar/match/complete.cpp.
  bool next_bytes_after(const std::string& data, std::array<uint32_t, 8>* out);
  int32_t num_tokens() const { return static_cast<int32_t>(token_marks_.size()); }
  // Whether accepting `bytes` bytes may take long enough to release the GIL for: the work per
  // byte grows with the current set (completions scan the sets its items began at); releasing
  // costs about as much as a typical accept.
  bool long_step(size_t bytes) const {
    return (items_.size() - set_begin_.back()) * bytes >= kLongStep;
  }
  static constexpr size_t kLongStep = 512;
  // (state, rule, origin, accepted, uncertain) for each scanning item of the current set.
  std::vector<std::array<int64_t, 5>> debug_items() const;
  const std::shared_ptr<const CompiledGrammar>& compiled() const { return g_; }

 private:
  bool advance(uint8_t b);
  void pop_set();
  void add(int32_t state, int32_t origin, int32_t pos);
  void closure(uint32_t begin, int32_t pos);
  // forced_bytes' steps: appends the forced bytes to `out`, advancing the matcher past them.
  void forced_loop(std::string& out, bool* must_end);
  // Starts a work budget (Limits::max_work_per_byte or _per_mask) for the Earley steps that follow.
  void budget(bool per_mask) {
    per_mask_ = per_mask;
    work_at_ = static_cast<uint32_t>(set_begin_.size() - 1);
    work_left_ = per_mask ? g_->max_work_per_mask : g_->max_work_per_byte;
  }
  // Spends `n` units of the budget; throws LimitError once it is spent.
  void spend(int64_t n) {
    work_left_ -= n;
    if (work_left_ < 0) work_exceeded();
  }
  [[noreturn]] void work_exceeded() const;
  // Pops sets until `sets` remain (the state before a failed multi-byte step).
  void pop_to(uint32_t sets) {
    while (set_begin_.size() > sets) pop_set();
  }
  bool last_set_can_end() const;
  bool any_byte_possible() const;
  void check_uncertain(uint32_t* mask);
  // The same check as a memoized pushdown walk (grammar/match/check.cpp); false if it gave up.
  bool check_uncertain_walk(uint32_t* mask);
  // Digest of everything the Earley steps from the current set can read: its items and, through
  // origins, every earlier set that completions may scan (origins renumbered by discovery).
  std::string context_key();

  // Inside a batch fill: the masks of the current set's states met for the first time, computed
  // on the batch's threads (grammar/batch/pool.h parallel_for), when there are several.
  void first_visits_in_parallel(uint32_t pending);

  std::shared_ptr<const CompiledGrammar> g_;
  bool terminate_without_eos_;
  int32_t max_rollback_;
  bool terminated_ = false;
  std::vector<Item> items_;
  std::vector<uint32_t> set_begin_;
  struct Mark {
    uint32_t sets;
    bool terminated;
  };
  std::vector<Mark> token_marks_;  // number of sets before each accepted step
  ItemMap seen_;
  std::vector<uint32_t> state_stamp_;
  uint32_t stamp_ = 0;
  std::vector<int32_t> scratch_;
  std::vector<int32_t> merged_;
  std::vector<uint32_t> allowed_before_;
  std::vector<int32_t> ctx_sets_;
  std::unordered_map<int32_t, int32_t> ctx_ids_;
  int64_t work_left_ = 0;
  bool per_mask_ = false;
  uint32_t work_at_ = 0;  // the input position the budget was started at (for the error)
  // The name of the call holding the matcher (Use), or null.
  mutable std::atomic<const char*> busy_{nullptr};
};

// Sorts v, which is made of sorted segments beginning at `starts` (ascending), by merging
// them: the piece assemblies append per-byte results in segments, and sorting from scratch cost
// more than the rest of their work on large uncertain lists.
template <class T, class Less>
void merge_segments(std::vector<T>& v, const std::vector<size_t>& starts, Less less) {
  for (size_t k = 1; k < starts.size(); ++k) {
    const size_t mid = std::min(starts[k], v.size());
    const size_t end = k + 1 < starts.size() ? std::min(starts[k + 1], v.size()) : v.size();
    std::inplace_merge(v.begin(), v.begin() + static_cast<long>(mid), v.begin() + static_cast<long>(end), less);
  }
}

// The plain walk from s of the tokens at the given sorted positions (ascending; runs of
// consecutive positions share prefixes), on top of `base` (grammar/mask/short_tokens.cpp).
std::shared_ptr<const StateMask> walk_positions(const CompiledGrammar& g, int32_t s,
                                                const std::vector<int32_t>& positions, const StateMask* base);

// Batch mask fill (grammar/batch/pool.cpp): row rows[i] of `data` (`words` int32 words per row) for
// matchers[i], i < n, on up to `threads` threads (0: all) of the process-wide pool, whose size is
// fixed by the first call (`pool_size` threads, 0 = one per core); results[i] as fill_mask.
// A thread out of rows helps with the first-visit walks other rows are running.
void fill_batch(Matcher* const* matchers, const int64_t* rows, size_t n, int32_t* data, int64_t words,
                size_t threads, unsigned pool_size, uint8_t* results);
// Counters since the process started (tests and profiles): walks split across a batch fill's
// threads, batch fills pool threads joined, rows pool threads filled, loops spread over threads,
// joins by a pool thread that found the batch while polling (not woken from sleep), and rows
// whose first visits of several states were computed on several threads.
struct BatchStats {
  uint64_t split_walks, helper_joins, helper_rows, parallel_loops, polled_joins, spread_rows;
};
BatchStats batch_stats();
// Opt-in timeline of batch fills (profiling: benchmarks/profile_batch.py): one event per filled
// row ('r', row index), per part of a split walk or shared loop ('p', part index), per wait of a
// split walk's owner for parts other threads still run ('w', part count) and per batch ('b', row
// count), with the thread's ordinal and steady-clock nanoseconds. Off by default (a
// relaxed load per row); `enable` switches recording on (clearing earlier events) or off.
struct BatchEvent {
  char kind;
  uint32_t index, thread;
  int64_t t0, t1;
};
void batch_trace_enable(bool enable);
std::vector<BatchEvent> batch_trace_take();
// Split thresholds (tests use tiny parts to put part seams everywhere): walks with fewer live
// tokens stay whole; part_tokens 0 = sized by the thread count. Returns the previous values.
std::pair<size_t, size_t> set_split_tuning(size_t min_split_tokens, size_t part_tokens);
// How long a thread of a running batch fill polls before blocking (ns; 0 = block at once).
// Returns the previous value.
int64_t set_batch_spin(int64_t ns);

// The loop-region walk of sorted positions [begin, stop) over a region's rows (grammar/mask/region.cpp),
// each token entered at byte `first` (0, or 1 with its first byte taken as read) in row 0, into
// `bits` and `out` (uncertain positions and exits, appended in walk order; `resume` as for
// compute_mask_part); returns the number of tokens accepted. stack and flag: max_token_len + 1.
size_t walk_region_range(const TokenizerInfo& t, const std::vector<int32_t>& rows, const std::vector<uint8_t>& row_final,
                         const CompiledGrammar::ByteSet& fol, size_t begin, size_t stop, bool resume, size_t first,
                         std::vector<int32_t>& stack, std::vector<uint8_t>& flag, std::vector<uint32_t>& bits,
                         StateMask& out);

// The results of a walk's parts (in walk order, accepted tokens as bitsets or ids, uncounted) put
// together as the unsplit walk builds its own, with `base`'s accepted and uncertain tokens
// (may be null) merged in (grammar/batch/split.cpp).
std::shared_ptr<const StateMask> assemble_parts(const TokenizerInfo& tk,
                                                const std::vector<std::shared_ptr<const StateMask>>& done,
                                                const StateMask* base);

}  // namespace grammar
}  // namespace agent_infer
