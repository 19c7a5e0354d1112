// The native kernels' shared thread pool (declared in kernels/parallel.h).
#include "kernels/parallel.h"

#include <immintrin.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace agent_infer {
namespace {

// A small persistent pool. Not OpenMP: torch's OpenMP workers would busy-wait against ours. Work is
// a list of chunks claimed from one atomic counter, so on a loaded machine a worker that is not
// scheduled in time costs nothing: the caller simply claims the remaining chunks itself. (Which
// thread computes a chunk never changes its bits.) The counter carries the job's generation in its
// high 32 bits so a late worker cannot claim a chunk of a newer job with a stale job pointer.

class Pool {
 public:
  ~Pool() { resize(0); }

  // Run fn(c) for c in [0, chunks) on up to `threads` threads (the caller included).
  void run(int threads, size_t chunks, const std::function<void(size_t)>& fn) {
    if (threads <= 1 || chunks <= 1) {
      for (size_t c = 0; c < chunks; ++c) fn(c);
      return;
    }
    std::lock_guard<std::mutex> call_guard(call_mu_);  // one parallel call at a time
    if (static_cast<int>(workers_.size()) < threads - 1) resize(threads - 1);
    const uint64_t gen = (counter_.load(std::memory_order_relaxed) >> 32) + 1;
    {
      // Workers read a job's fields under this lock together with its generation, so a late
      // worker never pairs one job's generation with another job's chunk count.
      std::lock_guard<std::mutex> lk(mu_);
      job_ = &fn;
      total_ = chunks;
      wanted_ = threads - 1;
      done_.store(0, std::memory_order_relaxed);
      counter_.store(gen << 32, std::memory_order_release);
    }
    cv_.notify_all();
    size_t mine = 0;
    for (size_t c; (c = claim(gen, chunks)) < chunks; ++mine) fn(c);
    done_.fetch_add(mine, std::memory_order_acq_rel);
    // Only chunks already claimed by running workers remain: a short wait.
    for (int spins = 0; done_.load(std::memory_order_acquire) != chunks; ++spins) {
      if (spins < 1000)
        _mm_pause();
      else
        std::this_thread::yield();
    }
  }

 private:
  // Next chunk of job `gen`, or `chunks` when none is left (or the job is no longer current).
  size_t claim(uint64_t gen, size_t chunks) {
    uint64_t v = counter_.load(std::memory_order_acquire);
    for (;;) {
      if ((v >> 32) != gen || (v & 0xffffffffu) >= chunks) return chunks;
      if (counter_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel, std::memory_order_acquire))
        return static_cast<size_t>(v & 0xffffffffu);
    }
  }

  void resize(int n) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
    stop_ = false;
    for (int i = 0; i < n; ++i) workers_.emplace_back([this, i] { loop(i); });
  }

  void loop(int index) {
    uint64_t seen = counter_.load(std::memory_order_acquire) >> 32;
    for (;;) {
      // Decode issues ~120 calls per step microseconds apart: spin a little before sleeping.
      for (int spins = 0; spins < 500 && (counter_.load(std::memory_order_acquire) >> 32) == seen; ++spins)
        _mm_pause();
      uint64_t gen;
      const std::function<void(size_t)>* job;
      size_t chunks;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || (counter_.load(std::memory_order_acquire) >> 32) != seen; });
        if (stop_) return;
        gen = counter_.load(std::memory_order_acquire) >> 32;
        job = job_;
        chunks = total_;
        if (index >= wanted_) chunks = 0;
      }
      seen = gen;
      // A claim of `gen` succeeds only while job `gen` is unfinished, so `job` is still alive.
      size_t mine = 0;
      for (size_t c; (c = claim(gen, chunks)) < chunks; ++mine) (*job)(c);
      if (mine) done_.fetch_add(mine, std::memory_order_acq_rel);
    }
  }

  std::mutex call_mu_, mu_;
  std::condition_variable cv_;
  std::vector<std::thread> workers_;
  bool stop_ = false;
  const std::function<void(size_t)>* job_ = nullptr;  // job_, total_, wanted_: guarded by mu_
  size_t total_ = 0;
  int wanted_ = 0;
  std::atomic<size_t> done_{0};
  std::atomic<uint64_t> counter_{0};  // generation << 32 | next chunk
};

Pool& pool() {
  static Pool p;
  return p;
}

}  // namespace

void parallel_for(int threads, size_t n, const std::function<void(size_t)>& fn) { pool().run(threads, n, fn); }

}  // namespace agent_infer
