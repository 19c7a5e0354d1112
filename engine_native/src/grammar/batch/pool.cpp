// Batch mask fills on one process-wide thread pool, and the helping that lets first-visit walks
// of one row run on several threads (the walks' cutting and assembly: grammar/batch/split.cpp).
//
// A batch fill hands the rows of distinct matchers to the pool's threads, which claim them from
// a shared counter. Once its states are cached a row costs microseconds, but a row that meets a
// state for the first time may walk most of the sorted vocabulary (0.5-3 ms for 129k tokens),
// and a step cannot end before its slowest row. Such a walk is published as a job of parts:
// threads of the batch that run out of rows, and idle pool threads, claim parts from an atomic
// counter.
#include "grammar/batch/pool.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "grammar/batch/batch.h"
#include "grammar/batch/trace.h"
#include "grammar/match/matcher.h"

namespace agent_infer {
namespace grammar {
namespace {

// Walks with fewer live tokens stay on their thread: a split costs a bitset per part, the merge
// and waking the helpers, which only pays off for walks of hundreds of microseconds.
constexpr size_t kMinSplitTokens = 16384;
std::atomic<size_t> g_min_split_tokens{kMinSplitTokens};
std::atomic<size_t> g_part_tokens{0};

struct Batch;

// The batch fill this thread is working for (walks started here may split).
thread_local const Batch* t_batch = nullptr;

// How long a thread of the pool polls before it blocks: for the parts of a split walk it waits
// on, for the last rows of the batch it called, for the next walk to help with while its batch
// runs, and for the next batch when batch fills have been arriving less than this far apart.
// Blocking costs a wake-up of 40-350 us on this project's virtual machines (a sleeping vCPU is
// woken by an interrupt through the hypervisor), longer than most of these waits; a thread polls
// between batches only while they come back to back, so a caller that fills masks once per
// forward pass of milliseconds never has a polling thread competing with its forward pass.
constexpr int64_t kSpinNs = 1000000;
std::atomic<int64_t> g_spin_ns{kSpinNs};
std::atomic<int> g_batches_running{0};  // batch fills in progress
std::atomic<int> g_jobs_listed{0};      // split walks published and not yet retired
std::atomic<uint64_t> g_jobs_published{0};  // split walks published, ever
std::atomic<uint64_t> g_batches_listed{0};  // batch fills that asked for helpers, ever
std::atomic<int64_t> g_last_batch_end{0};   // steady-clock ns when the last such batch returned
std::atomic<int64_t> g_last_batch_gap{0};   // ns between the two last such batches
std::atomic<bool> g_wait_for_helper{false};  // set_batch_wait_for_helper

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}
// Polls `ready` for up to `budget` ns (default g_spin_ns); true once it holds.
template <class Ready>
bool spin_until(Ready ready, int64_t budget = -1) {
  if (budget < 0) budget = g_spin_ns.load(std::memory_order_relaxed);
  if (budget <= 0) return ready();
  const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(budget);
  for (;;) {
    for (int k = 0; k < 64; ++k) {
      if (ready()) return true;
      cpu_relax();
    }
    if (std::chrono::steady_clock::now() >= until) return ready();
  }
}

// One split walk: parts claimed from a counter by whichever threads come by.
class Job {
 public:
  Job(const Batch* team, size_t parts, std::function<void(size_t)> run)
      : team(team), n_(parts), run_(std::move(run)) {}
  const Batch* const team;  // the batch fill whose row started the walk
  // Claims and runs parts until none is left unclaimed.
  void help() {
    // This thread works for the job's batch meanwhile: a part's own walks may split in turn.
    struct Serve {
      explicit Serve(const Batch* b) : prev(t_batch) { t_batch = b; }
      ~Serve() { t_batch = prev; }
      const Batch* prev;
    } serve(team);
    for (size_t i; (i = next_.fetch_add(1, std::memory_order_relaxed)) < n_;) {
      try {
        TraceScope trace('p', i);
        run_(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!error_) error_ = std::current_exception();
      }
      if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_) {
        std::lock_guard<std::mutex> lock(mu_);
        cv_.notify_all();
      }
    }
  }
  bool open() const { return next_.load(std::memory_order_relaxed) < n_; }
  // Waits for the parts other threads claimed; rethrows the first part's error.
  void wait() {
    spin_until([&] { return done_.load(std::memory_order_acquire) == n_; });
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_.load(std::memory_order_acquire) == n_; });
    if (error_) std::rethrow_exception(error_);
  }

 private:
  const size_t n_;
  // Called for claimed parts only: a thread arriving after the walk ended claims nothing.
  std::function<void(size_t)> run_;
  std::atomic<size_t> next_{0}, done_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  std::exception_ptr error_;
};

std::atomic<uint64_t> g_split_walks{0}, g_helper_joins{0}, g_helper_rows{0}, g_parallel_loops{0}, g_polled_joins{0},
    g_spread_rows{0};

// One batch fill, on its caller's stack. Pool threads join it while it is listed and has rows
// left; the caller waits only for threads that joined, never for one that has not woken yet
// (on a loaded machine a wake-up can take longer than the whole batch).
struct Batch {
  Batch(Matcher* const* m, const int64_t* r, size_t count, int32_t* d, int64_t w, uint8_t* res, size_t t,
        const uint32_t* o, size_t costly, const uint32_t* p)
      : matchers(m), rows(r), n(count), data(d), words(w), results(res), threads(t), order(o), costly(costly),
        pending(p), ends(static_cast<uint64_t>(count)) {}
  Matcher* const* matchers;
  const int64_t* rows;
  size_t n;
  int32_t* data;
  int64_t words;
  uint8_t* results;
  size_t threads;  // the caller included
  const uint32_t* order;  // rows in claiming order (null: 0..n-1)
  const size_t costly;    // leading rows of `order` with first visits pending
  const uint32_t* pending;  // each row's pending_visits() (null: not computed)
  size_t joined = 0;  // pool threads that joined (pool mutex)
  std::atomic<size_t> active{0};  // joined pool threads still filling rows (changed under the pool mutex)
  // The unclaimed rows [front, back) of the claiming order, as front << 32 | back. The caller
  // claims from the front and pool threads from the back (costly rows from the front, by every
  // thread): a row stays on the core that filled it the step before (its bitmask row, matcher
  // and masks in that core's cache), since only the few rows at the meeting point change sides.
  std::atomic<uint64_t> ends;
  std::mutex err_mu;
  std::exception_ptr error;

  bool rows_left() const {
    const uint64_t e = ends.load(std::memory_order_relaxed);
    return (e >> 32) < (e & 0xFFFFFFFFu);
  }
  bool wants_helper() const { return joined + 1 < threads && rows_left(); }
  // The next row in claiming order for this thread, or n when none is left.
  size_t claim(bool from_back) {
    uint64_t e = ends.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t f = e >> 32, b = e & 0xFFFFFFFFu;
      if (f >= b) return n;
      const bool back = from_back && f >= costly;
      const uint64_t next = back ? (f << 32) | (b - 1) : ((f + 1) << 32) | b;
      if (ends.compare_exchange_weak(e, next, std::memory_order_relaxed)) return static_cast<size_t>(back ? b - 1 : f);
    }
  }
  // Returns the number of rows this thread filled.
  size_t fill_rows(bool from_back) {
    const Batch* prev = t_batch;
    t_batch = this;
    size_t filled = 0;
    for (size_t k; (k = claim(from_back)) < n; ++filled) {
      const size_t i = order ? order[k] : k;
      try {
        TraceScope trace('r', i);
        const uint32_t cost = pending ? pending[i] : Matcher::kUnknown;
        results[i] = matchers[i]->fill_mask(data + rows[i] * words, words, cost) ? 1 : 0;
      } catch (...) {
        std::lock_guard<std::mutex> lock(err_mu);
        if (!error) error = std::current_exception();
      }
    }
    t_batch = prev;
    return filled;
  }
};

// Worker threads that join batch fills and help with split walks.
class Pool {
 public:
  explicit Pool(unsigned n) {
    for (unsigned i = 0; i < n; ++i) workers_.emplace_back([this] { loop(); });
  }
  size_t size() const { return workers_.size(); }

  // Fills the batch's rows on this thread and on pool threads that join in time.
  void run(Batch& b) {
    const bool helpers = b.threads > 1 && b.n > 1 && !workers_.empty();
    struct Running {
      Running() { g_batches_running.fetch_add(1, std::memory_order_relaxed); }
      ~Running() { g_batches_running.fetch_sub(1, std::memory_order_relaxed); }
    } running;
    struct Gap {
      explicit Gap(bool on) : on(on) {
        if (!on) return;
        const int64_t last = g_last_batch_end.load(std::memory_order_relaxed);
        if (last > 0) g_last_batch_gap.store(now_ns() - last, std::memory_order_relaxed);
      }
      ~Gap() {
        if (on) g_last_batch_end.store(now_ns(), std::memory_order_relaxed);
      }
      bool on;
    } gap(helpers);
    if (helpers) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        batches_.push_back(&b);  // capacity kept: a batch allocates nothing here
        g_batches_listed.fetch_add(1, std::memory_order_release);
      }
      for (size_t k = 1; k < b.threads; ++k) work_cv_.notify_one();
      if (g_wait_for_helper.load(std::memory_order_relaxed)) {
        std::unique_lock<std::mutex> lock(mu_);
        done_cv_.wait_for(lock, std::chrono::seconds(10), [&] { return b.joined > 0; });
      }
    }
    b.fill_rows(false);
    if (!helpers) {
      finish_jobs(b);
      return;
    }
    std::unique_lock<std::mutex> lock(mu_);
    batches_.erase(std::find(batches_.begin(), batches_.end(), &b));
    // Out of rows: help the split walks of rows still running, until every joined thread is done.
    for (;;) {
      std::shared_ptr<Job> job = open_job(&b);
      if (job) {
        lock.unlock();
        job->help();
        job.reset();
        lock.lock();
        continue;
      }
      if (b.active.load(std::memory_order_relaxed) == 0) return;
      // The joined threads are filling their last rows: poll rather than sleep through a wake-up.
      lock.unlock();
      spin_until([&] {
        return b.active.load(std::memory_order_acquire) == 0 || g_jobs_listed.load(std::memory_order_acquire) > 0;
      });
      lock.lock();
      if (b.active.load(std::memory_order_relaxed) == 0 || open_job(&b)) continue;
      done_cv_.wait(lock);
    }
  }
  void publish(const std::shared_ptr<Job>& job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back(job);
      g_jobs_listed.fetch_add(1, std::memory_order_release);
      g_jobs_published.fetch_add(1, std::memory_order_release);
    }
    work_cv_.notify_all();
    done_cv_.notify_all();  // a batch caller waiting for its last rows can help
  }
  void retire(const Job* job) {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.erase(std::find_if(jobs_.begin(), jobs_.end(), [&](const auto& j) { return j.get() == job; }));
    g_jobs_listed.fetch_sub(1, std::memory_order_release);
  }

 private:
  // A batch filled on its caller alone may still have published walks (idle pool threads help).
  void finish_jobs(const Batch& b) {
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::lock_guard<std::mutex> lock(mu_);
        job = open_job(&b);
      }
      if (!job) return;
      job->help();
    }
  }
  // An open job (of `team` only, if given); mu_ held.
  std::shared_ptr<Job> open_job(const Batch* team) const {
    for (const auto& j : jobs_) {
      if (j->open() && (!team || j->team == team)) return j;
    }
    return nullptr;
  }
  // A pool thread out of work polls while the batch it served runs, and then while the next one
  // is due soon; `lock` (the pool mutex) is released if it polled (returns true), else kept.
  bool poll_for_work(std::unique_lock<std::mutex>& lock) {
    const int64_t spin = g_spin_ns.load(std::memory_order_relaxed);
    const int64_t gap = g_last_batch_gap.load(std::memory_order_relaxed);
    // Between batches, poll for up to twice the last gap between batches, if that was short.
    const int64_t between = gap > 0 && gap <= spin ? std::min(spin, 2 * gap + 20000) : 0;
    const bool in_batch = g_batches_running.load(std::memory_order_relaxed) > 0;
    if (spin <= 0 || (!in_batch && between == 0)) return false;
    const uint64_t jobs = g_jobs_published.load(std::memory_order_relaxed);
    const uint64_t batches = g_batches_listed.load(std::memory_order_relaxed);
    lock.unlock();
    auto news = [&] {
      return g_jobs_published.load(std::memory_order_acquire) != jobs ||
             g_batches_listed.load(std::memory_order_acquire) != batches;
    };
    if (in_batch) spin_until([&] { return news() || g_batches_running.load(std::memory_order_relaxed) == 0; });
    if (!news() && between > 0) spin_until(news, between);
    return true;
  }
  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    bool polled = false;  // polled since it last took work (found what it takes next while polling)
    for (;;) {
      // Parts of split walks first: another thread's row waits for them.
      if (std::shared_ptr<Job> job = open_job(nullptr)) {
        lock.unlock();
        job->help();
        job.reset();
        lock.lock();
        polled = false;
        continue;
      }
      Batch* b = nullptr;
      for (Batch* c : batches_) {
        if (c->wants_helper()) {
          b = c;
          break;
        }
      }
      if (!b) {
        // Poll once before sleeping (a thread woken for a batch that had ended meanwhile, too: in
        // a loop of small fills the next one is due before a wake-up would arrive).
        if (!polled && poll_for_work(lock)) {
          polled = true;
          lock.lock();
          continue;
        }
        polled = false;
        work_cv_.wait(lock);
        continue;
      }
      ++b->joined;
      ++b->active;
      if (g_wait_for_helper.load(std::memory_order_relaxed)) done_cv_.notify_all();
      lock.unlock();
      g_helper_joins.fetch_add(1, std::memory_order_relaxed);
      if (polled) g_polled_joins.fetch_add(1, std::memory_order_relaxed);
      g_helper_rows.fetch_add(b->fill_rows(true), std::memory_order_relaxed);
      lock.lock();
      polled = false;
      if (b->active.fetch_sub(1, std::memory_order_acq_rel) == 1) done_cv_.notify_all();
    }
  }
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable work_cv_;  // pool threads wait here for batches and jobs
  std::condition_variable done_cv_;  // batch callers wait here for joined threads
  std::vector<Batch*> batches_;
  std::vector<std::shared_ptr<Job>> jobs_;
};

std::mutex g_pool_mu;
Pool* g_pool = nullptr;  // leaked on purpose: joining threads during interpreter exit can deadlock

Pool& pool(unsigned want) {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  if (!g_pool) {
    unsigned n = want > 0 ? want : std::max(1u, std::thread::hardware_concurrency());
    g_pool = new Pool(n > 1 ? n - 1 : 0);
  }
  return *g_pool;
}

}  // namespace

size_t batch_team_threads() { return t_batch ? t_batch->threads : 0; }

void run_parts(size_t n, std::function<void(size_t)> part) {
  auto job = std::make_shared<Job>(t_batch, n, std::move(part));
  Pool& p = pool(0);  // exists: this thread serves a batch fill
  p.publish(job);
  job->help();
  p.retire(job.get());
  TraceScope trace('w', n);
  job->wait();
}

void parallel_for(size_t n, size_t grain, const std::function<void(size_t, size_t)>& body) {
  const size_t parts = grain == 0 ? 1 : (n + grain - 1) / grain;
  if (parts < 2 || !t_batch || t_batch->threads < 2) {
    if (n > 0) body(0, n);
    return;
  }
  g_parallel_loops.fetch_add(1, std::memory_order_relaxed);
  run_parts(parts, [&](size_t k) { body(k * grain, std::min(n, (k + 1) * grain)); });
}

size_t split_min_tokens() { return g_min_split_tokens.load(std::memory_order_relaxed); }
size_t split_part_tokens() { return g_part_tokens.load(std::memory_order_relaxed); }
void count_split() { g_split_walks.fetch_add(1, std::memory_order_relaxed); }
void count_spread_row() { g_spread_rows.fetch_add(1, std::memory_order_relaxed); }

BatchStats batch_stats() {
  return {g_split_walks.load(std::memory_order_relaxed), g_helper_joins.load(std::memory_order_relaxed),
          g_helper_rows.load(std::memory_order_relaxed), g_parallel_loops.load(std::memory_order_relaxed),
          g_polled_joins.load(std::memory_order_relaxed), g_spread_rows.load(std::memory_order_relaxed)};
}

int64_t set_batch_spin(int64_t ns) { return g_spin_ns.exchange(ns); }

bool set_batch_wait_for_helper(bool on) { return g_wait_for_helper.exchange(on); }

std::pair<size_t, size_t> set_split_tuning(size_t min_split_tokens, size_t part_tokens) {
  return {g_min_split_tokens.exchange(min_split_tokens), g_part_tokens.exchange(part_tokens)};
}

void fill_batch(Matcher* const* matchers, const int64_t* rows, size_t n, int32_t* data, int64_t words,
                size_t threads, unsigned pool_size, uint8_t* results) {
  Pool& p = pool(pool_size);
  const size_t team = threads == 0 ? p.size() + 1 : std::min(threads, p.size() + 1);
  // Rows about to meet states for the first time go first: such a row may run for milliseconds,
  // partly on one thread only, and the other threads fill the cheap rows meanwhile instead of
  // waiting for it at the end of the step (longest-first scheduling).
  std::vector<uint32_t> order, pending;
  size_t costly = 0;
  if (team > 1 && n > 1) {
    std::vector<std::pair<uint32_t, uint32_t>> cost;  // (pending first visits, row), costly rows only
    pending.resize(n);
    for (size_t i = 0; i < n; ++i) {
      pending[i] = matchers[i]->pending_visits();
      if (pending[i]) cost.emplace_back(pending[i], static_cast<uint32_t>(i));
    }
    if (!cost.empty()) {
      std::stable_sort(cost.begin(), cost.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
      order.reserve(n);
      for (const auto& c : cost) order.push_back(c.second);
      costly = cost.size();
      std::vector<uint8_t> listed(n, 0);
      for (const auto& c : cost) listed[c.second] = 1;
      for (size_t i = 0; i < n; ++i) {
        if (!listed[i]) order.push_back(static_cast<uint32_t>(i));
      }
    }
  }
  Batch batch(matchers, rows, n, data, words, results, team, order.empty() ? nullptr : order.data(), costly,
              pending.empty() ? nullptr : pending.data());
  {
    TraceScope trace('b', n);
    p.run(batch);
  }
  if (batch.error) std::rethrow_exception(batch.error);
}

}  // namespace grammar
}  // namespace agent_infer
