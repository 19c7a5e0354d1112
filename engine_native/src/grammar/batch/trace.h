// The opt-in batch-fill timeline (BatchEvent, grammar/batch/batch.h): the scope that records one
// row, part, wait or batch, and the clock it reads.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace agent_infer {
namespace grammar {

// Steady-clock nanoseconds.
int64_t now_ns();

extern std::atomic<bool> g_trace_on;
// Appends one event ending now (the calling thread's ordinal).
void trace_record(char kind, uint32_t index, int64_t t0);

// Times one row, part or batch when tracing is on (a relaxed load otherwise).
class TraceScope {
 public:
  TraceScope(char kind, size_t index)
      : kind_(kind), index_(static_cast<uint32_t>(index)), t0_(g_trace_on.load(std::memory_order_relaxed) ? now_ns() : 0) {}
  ~TraceScope() {
    if (t0_ != 0) trace_record(kind_, index_, t0_);
  }
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;

 private:
  char kind_;
  uint32_t index_;
  int64_t t0_;
};

}  // namespace grammar
}  // namespace agent_infer
