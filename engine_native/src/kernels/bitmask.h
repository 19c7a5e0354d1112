#pragma once
// The CPU bitmask kernel's row primitive (defined in kernels/bitmask.cpp), shared with the engine
// step's fill (grammar/batch/step_fill.cpp), which masks its rows itself.
#include <cstdint>

namespace agent_infer {
// Sets row[t] to -inf for every token t < vocab whose bit is clear in `words` (n_words int32
// words; tokens at or past 32 * n_words are masked too).
void apply_bitmask_row(float* row, int64_t vocab, const int32_t* words, int64_t n_words);
}  // namespace agent_infer
