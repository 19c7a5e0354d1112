// The mask component of a compiled grammar (MaskStrategies): how each automaton state's token
// classification is built, and the caches that keep it.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "grammar/automaton.h"
#include "grammar/mask/state_mask.h"
#include "grammar/mask/tokenizer_info.h"

namespace agent_infer {
namespace grammar {

class CompiledGrammar;

// The token-mask component of a compiled grammar: for each automaton state, the classification of
// every token (accepted, rejected, uncertain), computed on first use and cached per grammar and,
// under keys of the automaton's structure, across grammars in the tokenizer. It picks a strategy
// per state (state_mask.cpp): a loop region's shared walk (region*.cpp), JSON string content
// (content.cpp), a twin state's mask (twin.cpp), first-byte pieces (pieces.cpp), short-token masks
// (short_tokens.cpp), and otherwise the plain or the pushdown walk (state_mask.cpp,
// pushdown_walk.cpp), split across a batch fill's threads when large (grammar/batch/split.cpp).
class MaskStrategies {
 public:
  explicit MaskStrategies(const CompiledGrammar& g) : g_(g) {}
  MaskStrategies(const MaskStrategies&) = delete;
  MaskStrategies& operator=(const MaskStrategies&) = delete;
  // Makes room for the masks of `num_states` states, none computed yet (once the automata exist).
  void reset(size_t num_states);

  // The token classification of state s (computed on first use, shared through the tokenizer).
  const StateMask& mask_for(int32_t s) const;
  // Stores m as state s's classification unless another thread stored one first; returns it.
  const StateMask& keep(int32_t s, std::shared_ptr<const StateMask> m) const;
  // The classification of a state whose rule a run-time check affects (RuntimeChecks::affected).
  std::shared_ptr<const StateMask> checked_walk(int32_t s, bool calls) const;
  // Whether mask_for(s) is computed already.
  bool mask_ready(int32_t s) const { return state_masks_[s].load(std::memory_order_acquire) != nullptr; }
  // At least 4 096 tokens start with a byte s reads.
  bool dense_start(int32_t s) const;
  // Outcomes of the run-time check of large uncertain sets, keyed by a digest of the parse
  // context the check reads (Matcher::context_key); values: the tokens the check allowed.
  std::shared_ptr<const StateMask> checked_get(const std::string& key) const;
  void checked_put(const std::string& key, std::shared_ptr<const StateMask> allowed) const;

 private:
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
  // siblings goes on to the end of the group. Walking each block afresh would re-find the same
  // dead first bytes and prefixes once per block: ~1 ms for the long tokens of a twin state.
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

  mutable std::unique_ptr<std::atomic<const StateMask*>[]> state_masks_;
  mutable std::mutex mu_;
  mutable std::vector<std::shared_ptr<const StateMask>> owned_;
  mutable std::mutex checked_mu_;
  mutable std::unordered_map<std::string, std::shared_ptr<const StateMask>> checked_;
  mutable size_t checked_bytes_ = 0;
  mutable std::mutex key_mu_;
  mutable std::vector<std::string> rule_keys_[2];
  mutable std::vector<uint8_t> rule_key_done_[2];
  mutable std::vector<uint8_t> digest_too_large_;  // pushdown_keys_ready's verdicts, by rule
  const CompiledGrammar& g_;
};

// The plain walk from s of the tokens at the given sorted positions (ascending; runs of
// consecutive positions share prefixes), on top of `base` (grammar/mask/short_tokens.cpp).
std::shared_ptr<const StateMask> walk_positions(const CompiledGrammar& g, int32_t s,
                                                const std::vector<int32_t>& positions, const StateMask* base);

// The loop-region walk of sorted positions [begin, stop) over a region's rows (grammar/mask/region.cpp),
// each token entered at byte `first` (0, or 1 with its first byte taken as read) in row 0, into
// `bits` and `out` (uncertain positions and exits, appended in walk order; `resume` as for
// compute_mask_part); returns the number of tokens accepted. stack and flag: max_token_len + 1.
size_t walk_region_range(const TokenizerInfo& t, const std::vector<int32_t>& rows, const std::vector<uint8_t>& row_final,
                         const ByteSet& fol, size_t begin, size_t stop, bool resume, size_t first,
                         std::vector<int32_t>& stack, std::vector<uint8_t>& flag, std::vector<uint32_t>& bits,
                         StateMask& out);

}  // namespace grammar
}  // namespace agent_infer
