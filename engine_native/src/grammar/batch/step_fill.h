// One engine step's token-mask fill, run on a native thread while the forward pass runs (or on
// the caller): no Python runs on the filling thread, so the step's own thread never waits for the
// GIL to come back from it, and a row that restricts nothing is reported so the engine skips it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "grammar/match/matcher.h"

namespace agent_infer {
namespace grammar {

// The rows of distinct matchers, filled as one batch (grammar/batch/pool.cpp), then draft chains:
// a matcher's mask after each prefix of its draft (rows first_row .. first_row + draft size), the
// matcher walked along the draft and rolled back. The bitmask's other rows are set to allow
// every token, so a reused bitmask needs no reset. Construction checks the arguments and holds
// every matcher busy (Matcher::Use) until the fill has run, so a concurrent call on one of them
// raises BusyError instead of racing the fill.
class StepFill {
 public:
  struct Chain {
    Matcher* matcher;
    int64_t first_row;
    std::vector<int32_t> draft;
  };
  // `threads` caps the batch's team (0: the whole pool) when some row meets a state for the first
  // time; `cached_threads` when every row's masks are cached (a fill of microseconds per row, where
  // waking pool threads costs more than it saves and takes cores from the forward pass).
  StepFill(std::vector<Matcher*> plain, std::vector<int64_t> rows, std::vector<Chain> chains, int32_t* data,
           int64_t num_rows, int64_t words, size_t threads, size_t cached_threads, unsigned pool_size);
  StepFill(const StepFill&) = delete;
  StepFill& operator=(const StepFill&) = delete;

  // Fills every row once; errors are kept for wait(). Call once.
  void run();
  // Blocks until run() has ended.
  void block();
  // block(), then rethrows run()'s first error.
  void wait();
  bool done() const { return done_.load(std::memory_order_acquire); }
  // Per plain row, then per chain row in order: whether the row restricts anything (false: every
  // token allowed). Valid once done.
  const std::vector<uint8_t>& results() const { return results_; }
  // Seconds run() took.
  double seconds() const { return seconds_; }
  // Waits for the fill, then sets to -inf the disallowed tokens of every row that restricts
  // something in float32 logits [batch, vocab] (bitmask row r onto logits row r); rethrows the
  // fill's error. Rows that allow every token are not touched.
  void apply(float* logits, int64_t batch, int64_t vocab);

 private:
  void fill_chain(const Chain& c, uint8_t* results);

  std::vector<Matcher*> plain_;
  std::vector<int64_t> rows_;
  std::vector<Chain> chains_;
  std::vector<int64_t> order_;   // every filled row in results() order
  std::vector<int64_t> others_;  // the bitmask's other rows: set to allow everything
  int32_t* data_;
  int64_t num_rows_ = 0;
  int64_t words_;
  size_t threads_, cached_threads_;
  unsigned pool_size_;
  std::vector<std::unique_ptr<Matcher::Use>> uses_;
  std::vector<uint8_t> results_;
  std::exception_ptr error_;
  double seconds_ = 0.0;
  std::atomic<bool> done_{false};
  std::mutex mu_;
  std::condition_variable cv_;
};

// One thread that runs submitted fills in order: fills of consecutive steps never overlap.
class FillThread {
 public:
  FillThread();
  ~FillThread();
  FillThread(const FillThread&) = delete;
  FillThread& operator=(const FillThread&) = delete;
  // Queues `fill`; false once stopped (the fill is not run).
  bool submit(std::shared_ptr<StepFill> fill);
  // Runs the fills already queued, then ends the thread. Idempotent.
  void stop();

 private:
  void loop();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<StepFill>> queue_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace grammar
}  // namespace agent_infer
