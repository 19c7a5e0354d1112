#include "grammar/batch/trace.h"

#include <chrono>
#include <mutex>
#include <vector>

#include "grammar/batch/batch.h"

namespace agent_infer {
namespace grammar {

std::atomic<bool> g_trace_on{false};

namespace {

std::mutex g_trace_mu;
std::vector<BatchEvent> g_trace;
std::atomic<uint32_t> g_thread_ordinals{0};

uint32_t thread_ordinal() {
  thread_local const uint32_t ordinal = g_thread_ordinals.fetch_add(1, std::memory_order_relaxed);
  return ordinal;
}

}  // namespace

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void trace_record(char kind, uint32_t index, int64_t t0) {
  const BatchEvent e{kind, index, thread_ordinal(), t0, now_ns()};
  std::lock_guard<std::mutex> lock(g_trace_mu);
  g_trace.push_back(e);
}

void batch_trace_enable(bool enable) {
  std::lock_guard<std::mutex> lock(g_trace_mu);
  if (enable) g_trace.clear();
  g_trace_on.store(enable, std::memory_order_relaxed);
}

std::vector<BatchEvent> batch_trace_take() {
  std::lock_guard<std::mutex> lock(g_trace_mu);
  std::vector<BatchEvent> out;
  out.swap(g_trace);
  return out;
}

}  // namespace grammar
}  // namespace agent_infer
