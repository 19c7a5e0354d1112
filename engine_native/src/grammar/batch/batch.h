// Batch mask fills over many matchers on one process-wide thread pool, and the assembly of
// first-visit walks split across its threads.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "grammar/mask/state_mask.h"
#include "grammar/mask/tokenizer_info.h"

namespace agent_infer {
namespace grammar {

class Matcher;

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
// Tests of the pool's joins: while on, a batch fill that asks for helpers waits (blocked, up to
// 10 s) until a pool thread has joined it before it claims a row, so that a helper takes part
// in every batch however long the machine's load keeps it off a core. Returns the previous value.
bool set_batch_wait_for_helper(bool on);

// together as the unsplit walk builds its own, with `base`'s accepted and uncertain tokens
// (may be null) merged in (grammar/batch/split.cpp).
std::shared_ptr<const StateMask> assemble_parts(const TokenizerInfo& tk,
                                                const std::vector<std::shared_ptr<const StateMask>>& done,
                                                const StateMask* base);

}  // namespace grammar
}  // namespace agent_infer
