#pragma once
// The native kernels' shared thread pool (defined in kernels/parallel.cpp).
#include <cstddef>
#include <functional>

namespace agent_infer {
// Run fn(i) for i in [0, n) on up to `threads` threads, the caller included. Items are claimed
// dynamically, so results must not depend on which thread runs an item.
void parallel_for(int threads, size_t n, const std::function<void(size_t)>& fn);
}  // namespace agent_infer
