// Opt-in profile of where mask time goes (first-visit walks by kind, keys, run-time checks).
// Off by default: a disabled scope costs one relaxed atomic load. Timing is exclusive (a nested
// scope's time is not charged to its parent) and per thread; the bindings read and reset it.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <ctime>

namespace agent_infer {
namespace grammar {
namespace profile {

enum Kind : int {
  kStateKey = 0,   // structure_key + tokenizer cache lookup of a first-seen state
  kShortKey,       // the 15-byte neighbourhood key (grammar/mask/short_tokens.cpp)
  kLocalKey,       // first-byte piece keys (grammar/mask/pieces.cpp)
  kRegionWalk,     // shared loop-region walk (once per tokenizer and string syntax)
  kRegionExits,    // walks of a region state's exit runs
  kShortFill,      // cached short part + walk of the long tokens
  kPutShort,       // storing the short part of a fresh full mask
  kPieces,         // first-byte pieces: choosing targets, ORing cached pieces, splitting walks
  kPiecesWalk,     // first-byte pieces: walks of the runs without a cached piece
  kFullCalls,      // full pushdown walk of a dense or sparse state
  kFullPlain,      // full plain walk
  kCheckWalk,      // run-time pushdown check of uncertain tokens
  kCheckEarley,    // run-time Earley check of uncertain tokens
  kContextKey,     // parse-context digest for memoized checks
  kTwin,           // twin masks: neighbourhood comparisons and the walks of longer tokens
  kContent,        // content masks: the string-content check and the walk of the other tokens
  kCount
};

extern std::atomic<bool> enabled;

struct Counters {
  std::array<uint64_t, kCount> ns{};
  std::array<uint64_t, kCount> calls{};
  int current = -1;
  uint64_t since = 0;
};
Counters& counters();

// Thread CPU time: the profile is read next to process CPU time on shared machines.
inline uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

// Charges the time until its end to `kind`, pausing the enclosing scope meanwhile.
class Scope {
 public:
  explicit Scope(Kind kind) : on_(enabled.load(std::memory_order_relaxed)) {
    if (!on_) return;
    Counters& c = counters();
    const uint64_t t = now_ns();
    if (c.current >= 0) c.ns[static_cast<size_t>(c.current)] += t - c.since;
    prev_ = c.current;
    c.current = kind;
    c.since = t;
    ++c.calls[kind];
  }
  ~Scope() {
    if (!on_) return;
    Counters& c = counters();
    const uint64_t t = now_ns();
    c.ns[static_cast<size_t>(c.current)] += t - c.since;
    c.current = prev_;
    c.since = t;
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  bool on_;
  int prev_ = -1;
};

const char* name(int kind);

}  // namespace profile
}  // namespace grammar
}  // namespace agent_infer
