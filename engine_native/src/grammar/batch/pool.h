// Internal interface between the batch-fill pool (grammar/batch/pool.cpp) and the split walks
// (grammar/batch/split.cpp).
#pragma once

#include <cstddef>
#include <functional>

namespace agent_infer {
namespace grammar {

// Threads of the batch fill this thread is working for; 0 outside batch fills.
size_t batch_team_threads();
// Runs part(i) for i < n on this thread and whichever threads of the pool come by; rethrows the
// first part's error. Only inside a batch fill.
void run_parts(size_t n, std::function<void(size_t)> part);
// Calls body(begin, end) over [0, n) in slices of `grain`: spread over the threads of the batch
// fill this thread serves, else all on this thread (one call). Slices must be independent.
void parallel_for(size_t n, size_t grain, const std::function<void(size_t, size_t)>& body);
// Split thresholds (set_split_tuning): minimum live tokens, and fixed part size (0 = automatic).
size_t split_min_tokens();
size_t split_part_tokens();
// Counts one split walk (batch_stats).
void count_split();
// Counts one row whose first visits of several states were spread over the threads (batch_stats).
void count_spread_row();

}  // namespace grammar
}  // namespace agent_infer
