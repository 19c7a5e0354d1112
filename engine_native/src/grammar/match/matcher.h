// The Earley matcher over bytes: accepts tokens, fills next-token masks from the compiled
// grammar's state masks, rolls back, and completes (grammar/match/).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "grammar/compiled_grammar.h"
#include "grammar/errors.h"
#include "grammar/item_map.h"

namespace agent_infer {
namespace grammar {

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
  // end now); false (out untouched) if the matcher is terminated, or if that completion would
  // close a unique array item equal to an earlier one. grammar/match/complete.cpp.
  bool shortest_completion(std::string* out);
  // Whether `data` is accepted from the current state and the grammar can end after it (the
  // matcher is left as it was).
  bool completes(const std::string& data);
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
  // Inline: the mask fill's check (mask_fill.cpp) pops a set per uncertain token it steps into.
  void pop_set() {
    items_.resize(set_begin_.back());
    set_begin_.pop_back();
    if (unique_on_) {
      hist_.pop_back();
      epoch_.pop_back();
      ulex_.pop_back();
    }
    if (bounded_on_) {
      bopen_.resize(bopen_begin_.back());
      bopen_begin_.pop_back();
    }
  }
  void add(int32_t state, int32_t origin, int32_t pos);
  void closure(uint32_t begin, int32_t pos);
  // Run-time checks (grammar/match/verdicts.cpp). closure() records the item rules finishing in
  // the set (done_) and the checks ready to finish (pending_); once nothing else is left to
  // close, decide_check() decides the innermost pending check and, if it passes, completes it
  // (true: the set grew, closure goes on).
  void predict_shadows(int32_t check_rule, int32_t pos);
  bool decide_check(int32_t pos);
  // Whether the last set can lead anywhere: a carrier item reads a byte next, or the root is
  // complete (with checks, a set may hold only shadow items or checks that failed).
  bool last_set_live() const;
  // shortest_completion's search ignoring run-time checks' verdicts (grammar/match/complete.cpp):
  // its text (unless `out` is null) and length; false if the grammar cannot complete.
  bool unchecked_completion(std::string* out, int64_t* cost) const;
  // shortest_completion with run-time checks (grammar/match/complete_checked.cpp): the shortest
  // completion whose checks pass, by iterative deepening over bytes with unchecked_completion's
  // length as the bound below.
  bool checked_completion(std::string* out) const;
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
  bool last_set_can_end() const {
    const CompiledGrammar& g = *g_;
    for (uint32_t k = set_begin_.back(); k < items_.size(); ++k) {
      const Item& it = items_[k];
      if (it.origin == 0 && g.states[it.state].final && g.states[it.state].rule == g.root) return true;
    }
    return false;
  }
  bool any_byte_possible() const;
  // Whether the text so far can still be completed, where a vetoed unique item may leave a set
  // that cannot: inside a unique array, the bytes the grammar forces (blanks skipped outside
  // strings) are read ahead until a choice or the end (grammar/match/unique.cpp).
  bool alive();
  bool zero_exponent(bool* needs_digit) const;

  // Unique array items (grammar/match/unique.cpp); all of it only when the grammar has them.
  // Per set, for the mask's recheck: whether a unique array may be open (from the first marked
  // item predicted until its closing bracket), the JSON lexer context, and the bracket depth
  // inside that array.
  struct UniqueLex {
    uint8_t active = 0;
    uint8_t ctx = 0;
    int32_t depth = 0;
  };
  // The item before the one starting at an offset: its first byte (-1: the item is its array's
  // first) and the canonical form of its value; `epoch`: epoch_ of the byte before the offset when
  // read (a rewrite of the text there since makes it stale).
  struct SiblingLink {
    uint32_t epoch;
    int32_t prev;
    std::string canon;
  };
  void push_unique(uint8_t b);
  const SiblingLink* sibling_link(int32_t start);
  // Whether the item spanning input offsets [origin, pos) equals an earlier item of its array.
  bool repeats_earlier_item(int32_t origin, int32_t pos);
  // Rechecks, with Earley steps that apply the veto, the allowed tokens in which a unique item
  // may complete (JsonTokenClasses); the others keep the mask the automata gave them.
  void recheck_unique(uint32_t* mask, int64_t vw);
  // Max-length strings (grammar/match/bounded.cpp); all of it only when the grammar has them.
  // Per set, the strings that may be open: the offset of the opening quote (the origin of their
  // rule's items), the code points read since, and the decoding context.
  struct BoundedOpen {
    int32_t origin;
    int32_t count;
    uint8_t lex;
  };
  void push_bounded(uint8_t b);
  // Records a max-length string that may open at `pos` (its rule predicted there).
  void open_bounded(int32_t pos) {
    if (bopen_.size() == bopen_begin_.back() || bopen_.back().origin != pos) bopen_.push_back({pos, 0, 0});
  }
  const BoundedOpen* open_string(int32_t origin) const;
  // Whether an item of a max-length rule at `state`, begun at `origin`, can no longer finish its
  // string within the bound.
  bool overruns(int32_t state, int32_t origin) const;
  // Whether a token may overrun an open max-length string from the current set (its count is
  // within a token's length of the bound): mask results then depend on the count.
  bool bounded_near() const;
  // Whether a byte may take an open max-length string of the current set past its bound.
  bool bounded_tight() const;
  // How many of the current set's edge bytes advance() takes (up to 2); *only: one of them.
  int bytes_taken(int* only);
  // Removes from the mask the tokens that overrun an open max-length string, deciding by Earley
  // steps those that only some of the current items' paths overrun.
  void recheck_bounded(uint32_t* mask, int64_t vw);
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
  bool unique_on_ = false;   // g_->has_unique
  bool bounded_on_ = false;  // g_->has_bounded
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
  struct Span {
    int32_t rule, origin;
  };
  std::vector<Span> done_;     // item rules finished in the set being closed
  std::vector<Span> pending_;  // checks (by index) whose carrier finished there, undecided
  std::vector<uint8_t> hist_;    // hist_[i]: the input byte that made set i + 1
  std::vector<uint32_t> epoch_;  // epoch_[i]: a stamp unique to the writing of hist_[i]
  uint32_t epoch_next_ = 0;
  std::vector<UniqueLex> ulex_;  // per set
  std::unordered_map<int32_t, SiblingLink> siblings_;  // by item start offset
  std::string canon_;
  std::vector<BoundedOpen> bopen_;
  std::vector<uint32_t> bopen_begin_;  // per set: its first entry of bopen_
  std::vector<uint32_t> viol_;         // per token id, zero between fills (recheck_bounded)
  std::vector<int32_t> touched_;
  int64_t work_left_ = 0;
  bool per_mask_ = false;
  uint32_t work_at_ = 0;  // the input position the budget was started at (for the error)
  // The name of the call holding the matcher (Use), or null.
  mutable std::atomic<const char*> busy_{nullptr};
};

}  // namespace grammar
}  // namespace agent_infer
