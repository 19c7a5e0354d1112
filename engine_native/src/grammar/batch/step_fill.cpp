#include "grammar/batch/step_fill.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>

#include "grammar/batch/batch.h"
#include "kernels/bitmask.h"

namespace agent_infer {
namespace grammar {
namespace {

void check_row(int64_t num_rows, int64_t row) {
  if (row < 0 || row >= num_rows) {
    throw BitmaskError("bitmask row " + std::to_string(row) + " is outside the bitmask's " + std::to_string(num_rows) +
                       " rows");
  }
}

}  // namespace

StepFill::StepFill(std::vector<Matcher*> plain, std::vector<int64_t> rows, std::vector<Chain> chains, int32_t* data,
                   int64_t num_rows, int64_t words, size_t threads, size_t cached_threads, unsigned pool_size)
    : plain_(std::move(plain)),
      rows_(std::move(rows)),
      chains_(std::move(chains)),
      data_(data),
      words_(words),
      threads_(threads),
      cached_threads_(cached_threads),
      pool_size_(pool_size) {
  if (data_ == nullptr) throw BitmaskError("bitmask has no data");
  if (rows_.size() != plain_.size()) {
    throw BitmaskError(std::to_string(plain_.size()) + " matchers but " + std::to_string(rows_.size()) + " rows");
  }
  std::vector<const Matcher*> matchers(plain_.begin(), plain_.end());
  std::vector<int64_t> targets(rows_);
  for (int64_t r : rows_) check_row(num_rows, r);
  num_rows_ = num_rows;
  for (const Chain& c : chains_) {
    matchers.push_back(c.matcher);
    for (size_t j = 0; j <= c.draft.size(); ++j) {
      check_row(num_rows, c.first_row + static_cast<int64_t>(j));
      targets.push_back(c.first_row + static_cast<int64_t>(j));
    }
  }
  for (const Matcher* m : matchers) {
    if (!m) throw UsageError("matcher is None", "matchers");
    const TokenizerInfo& tok = *m->compiled()->tok;
    if (words_ < tok.words) {
      throw BitmaskError("bitmask rows have " + std::to_string(words_) + " words but the vocabulary of " +
                         std::to_string(tok.vocab_size) + " tokens needs " + std::to_string(tok.words));
    }
  }
  // Two threads must never fill one matcher, nor write one row.
  std::sort(matchers.begin(), matchers.end());
  if (std::adjacent_find(matchers.begin(), matchers.end()) != matchers.end()) {
    throw UsageError("the same matcher appears twice in one step's fill", "matchers");
  }
  order_ = targets;
  std::sort(targets.begin(), targets.end());
  if (std::adjacent_find(targets.begin(), targets.end()) != targets.end()) {
    throw BitmaskError("two matchers of one step's fill write the same bitmask row");
  }
  for (int64_t r = 0, k = 0; r < num_rows; ++r) {
    if (k < static_cast<int64_t>(targets.size()) && targets[static_cast<size_t>(k)] == r) {
      ++k;
    } else {
      others_.push_back(r);
    }
  }
  uses_.reserve(matchers.size());
  for (const Matcher* m : matchers) uses_.push_back(std::make_unique<Matcher::Use>(*m, "fill (engine step)"));
  results_.assign(targets.size(), 0);
}

void StepFill::fill_chain(const Chain& c, uint8_t* results) {
  Matcher& m = *c.matcher;
  int32_t accepted = 0;
  try {
    for (size_t j = 0; j <= c.draft.size(); ++j) {
      results[j] = m.fill_mask(data_ + (c.first_row + static_cast<int64_t>(j)) * words_, words_) ? 1 : 0;
      if (j == c.draft.size()) break;
      if (!m.accept_token(c.draft[j])) {
        // The draft was cut to what the grammar accepts before the step: the matcher changed since.
        throw UsageError("the grammar rejected draft token " + std::to_string(c.draft[j]) + " (position " +
                             std::to_string(j) + ") that it accepted when the draft was made",
                         "drafts");
      }
      ++accepted;
    }
  } catch (...) {
    if (accepted) m.rollback(accepted);
    throw;
  }
  if (accepted) m.rollback(accepted);
}

void StepFill::run() {
  const auto start = std::chrono::steady_clock::now();
  for (int64_t r : others_) std::memset(data_ + r * words_, 0xFF, static_cast<size_t>(words_) * 4);
  try {
    if (!plain_.empty()) {
      size_t team = threads_;
      if (team != cached_threads_ && plain_.size() > 1) {
        const bool first_visits =
            std::any_of(plain_.begin(), plain_.end(), [](const Matcher* m) { return m->pending_visits() > 0; });
        if (!first_visits) team = cached_threads_;
      }
      fill_batch(plain_.data(), rows_.data(), plain_.size(), data_, words_, team, pool_size_, results_.data());
    }
    size_t at = plain_.size();
    for (const Chain& c : chains_) {
      fill_chain(c, results_.data() + at);
      at += c.draft.size() + 1;
    }
  } catch (...) {
    error_ = std::current_exception();
  }
  seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  uses_.clear();  // the matchers are the caller's again before it can see the fill done
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

void StepFill::block() {
  if (done()) return;
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return done(); });
}

void StepFill::wait() {
  block();
  if (error_) std::rethrow_exception(error_);
}

void StepFill::apply(float* logits, int64_t batch, int64_t vocab) {
  wait();
  if (num_rows_ > batch) {
    throw BitmaskError("the bitmask has " + std::to_string(num_rows_) + " rows but the logits only " +
                       std::to_string(batch));
  }
  for (size_t i = 0; i < order_.size(); ++i) {
    if (results_[i]) apply_bitmask_row(logits + order_[i] * vocab, vocab, data_ + order_[i] * words_, words_);
  }
}

FillThread::FillThread() { thread_ = std::thread([this] { loop(); }); }

FillThread::~FillThread() { stop(); }

bool FillThread::submit(std::shared_ptr<StepFill> fill) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return false;
    queue_.push_back(std::move(fill));
  }
  cv_.notify_one();
  return true;
}

void FillThread::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

void FillThread::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, nothing left
    std::shared_ptr<StepFill> fill = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    fill->run();
    fill.reset();
    lock.lock();
  }
}

}  // namespace grammar
}  // namespace agent_infer
