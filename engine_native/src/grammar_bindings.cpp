// Grammar matcher bindings: owned by the grammar core (see docs/grammar_engine.md).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <condition_variable>
#include <functional>
#include <thread>

#include "bindings.h"
#include "grammar.h"

namespace nb = nanobind;

namespace agent_infer {
namespace {

using grammar::CompiledGrammar;
using grammar::Matcher;
using grammar::TokenizerInfo;
using Mask = nb::ndarray<int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

// One process-wide pool for batch mask fills; workers pull row indices from a shared counter.
class Pool {
 public:
  explicit Pool(unsigned n) {
    for (unsigned i = 0; i < n; ++i) workers_.emplace_back([this] { loop(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& w : workers_) w.join();
  }
  size_t size() const { return workers_.size(); }

  // Runs fn(i) for i in [0, n) on up to `threads` threads (the caller included).
  void run(size_t n, size_t threads, const std::function<void(size_t)>& fn) {
    std::atomic<size_t> next{0};
    std::exception_ptr error;
    std::mutex err_mu;
    auto body = [&] {
      for (size_t i; (i = next.fetch_add(1)) < n;) {
        try {
          fn(i);
        } catch (...) {
          std::lock_guard<std::mutex> lock(err_mu);
          if (!error) error = std::current_exception();
        }
      }
    };
    size_t helpers = std::min(threads > 0 ? threads - 1 : 0, std::min(workers_.size(), n > 0 ? n - 1 : 0));
    std::atomic<size_t> pending{helpers};
    std::mutex done_mu;
    std::condition_variable done_cv;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t h = 0; h < helpers; ++h) {
        tasks_.push_back([&] {
          body();
          if (pending.fetch_sub(1) == 1) {
            std::lock_guard<std::mutex> l(done_mu);
            done_cv.notify_all();
          }
        });
      }
    }
    cv_.notify_all();
    body();
    std::unique_lock<std::mutex> lock(done_mu);
    done_cv.wait(lock, [&] { return pending.load() == 0; });
    if (error) std::rethrow_exception(error);
  }

 private:
  void loop() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
        if (stop_ && tasks_.empty()) return;
        task = std::move(tasks_.back());
        tasks_.pop_back();
      }
      task();
    }
  }
  std::vector<std::thread> workers_;
  std::vector<std::function<void()>> tasks_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
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

void check_width(const Mask& mask, const TokenizerInfo& tok) {
  if (static_cast<int64_t>(mask.shape(1)) < tok.words) {
    throw std::invalid_argument("bitmask rows have " + std::to_string(mask.shape(1)) + " words but the vocabulary of " +
                                std::to_string(tok.vocab_size) + " tokens needs " + std::to_string(tok.words));
  }
}

void check_row(const Mask& mask, int64_t index) {
  if (index < 0 || index >= static_cast<int64_t>(mask.shape(0))) {
    throw std::out_of_range("bitmask row " + std::to_string(index) + " is outside the bitmask's " +
                            std::to_string(mask.shape(0)) + " rows");
  }
}

void translate_errors(const std::exception_ptr& p, void*) {
  const char* cls = nullptr;
  std::string msg;
  try {
    std::rethrow_exception(p);
  } catch (const grammar::LimitError& e) {
    cls = "GrammarLimitError";
    msg = e.what();
  } catch (const grammar::DefinitionError& e) {
    cls = "GrammarDefinitionError";
    msg = e.what();
  }
  nb::object type = nb::module_::import_("agent_infer.errors").attr(cls);
  PyErr_SetString(type.ptr(), msg.c_str());
}

}  // namespace

void register_grammar(nb::module_& m) {
  nb::register_exception_translator(&translate_errors);

  nb::class_<TokenizerInfo>(m, "TokenizerInfo")
      .def(
          "__init__",
          [](TokenizerInfo* self, const std::vector<nb::bytes>& toks, int32_t vocab_size, std::vector<int32_t> eos) {
            std::vector<std::string> v;
            v.reserve(toks.size());
            for (const nb::bytes& b : toks) v.emplace_back(b.c_str(), b.size());
            new (self) TokenizerInfo(std::move(v), vocab_size, std::move(eos));
          },
          nb::arg("token_bytes"), nb::arg("vocab_size"), nb::arg("eos_ids"))
      .def_ro("vocab_size", &TokenizerInfo::vocab_size)
      .def_ro("eos_ids", &TokenizerInfo::eos_ids)
      .def("cache_bytes", &TokenizerInfo::cache_bytes)
      .def("cache_entries", &TokenizerInfo::cache_entries);

  nb::class_<CompiledGrammar>(m, "CompiledGrammar")
      .def(
          "__init__",
          [](CompiledGrammar* self, std::shared_ptr<TokenizerInfo> tok, const std::vector<std::vector<int32_t>>& rules,
             int32_t root, int64_t max_states, double max_seconds, int64_t max_items) {
            grammar::Limits lim;
            lim.max_nfa_states = max_states * 4;
            lim.max_dfa_states = max_states;
            lim.max_compile_seconds = max_seconds;
            lim.max_items_per_set = max_items;
            nb::gil_scoped_release release;
            new (self) CompiledGrammar(std::move(tok), rules, root, lim);
          },
          nb::arg("tokenizer"), nb::arg("rules"), nb::arg("root"), nb::arg("max_states"), nb::arg("max_seconds"),
          nb::arg("max_items"))
      .def("memory_bytes", &CompiledGrammar::memory_bytes)
      .def_prop_ro("num_states", [](const CompiledGrammar& g) { return g.states.size(); });

  nb::class_<Matcher>(m, "GrammarMatcher")
      .def(
          "__init__",
          [](Matcher* self, std::shared_ptr<CompiledGrammar> g, bool terminate_without_eos, int32_t max_rollback) {
            new (self) Matcher(std::move(g), terminate_without_eos, max_rollback);
          },
          nb::arg("compiled"), nb::arg("terminate_without_eos"), nb::arg("max_rollback"))
      .def("accept_token", &Matcher::accept_token)
      .def("accept_bytes", [](Matcher& mt, nb::bytes b) { return mt.accept_bytes(std::string(b.c_str(), b.size())); })
      .def(
          "fill_next_token_bitmask",
          [](Matcher& mt, Mask mask, int64_t index) {
            check_row(mask, index);
            check_width(mask, *mt.compiled()->tok);
            int64_t words = static_cast<int64_t>(mask.shape(1));
            int32_t* row = mask.data() + index * words;
            nb::gil_scoped_release release;
            return mt.fill_mask(row, words);
          },
          nb::arg("bitmask"), nb::arg("index") = 0)
      .def("rollback", &Matcher::rollback)
      .def("reset", &Matcher::reset)
      .def("fork", [](const Matcher& mt) { return new Matcher(mt); })
      .def("is_terminated", &Matcher::is_terminated)
      .def("can_terminate", &Matcher::can_terminate)
      .def("num_tokens", &Matcher::num_tokens)
      .def("debug_items", &Matcher::debug_items)
      .def("forced_bytes", [](Matcher& mt) {
        bool must_end = false;
        std::string s = mt.forced_bytes(&must_end);
        return std::make_pair(nb::bytes(s.data(), s.size()), must_end);
      });

  m.def(
      "fill_next_token_bitmask_batch",
      [](std::vector<Matcher*> matchers, Mask mask, std::vector<int64_t> indices, int32_t num_threads,
         int32_t pool_size) {
        for (int64_t idx : indices) check_row(mask, idx);
        for (Matcher* mt : matchers) {
          if (!mt) throw std::invalid_argument("matcher is None");
          check_width(mask, *mt->compiled()->tok);
        }
        if (indices.size() != matchers.size()) throw std::invalid_argument("indices and matchers differ in length");
        const int64_t words = static_cast<int64_t>(mask.shape(1));
        int32_t* data = mask.data();
        std::vector<uint8_t> results(matchers.size(), 0);
        {
          nb::gil_scoped_release release;
          Pool& p = pool(static_cast<unsigned>(pool_size));
          size_t threads = num_threads > 0 ? static_cast<size_t>(num_threads) : p.size() + 1;
          p.run(matchers.size(), threads, [&](size_t i) {
            results[i] = matchers[i]->fill_mask(data + indices[i] * words, words) ? 1 : 0;
          });
        }
        std::vector<bool> out(results.begin(), results.end());
        return out;
      },
      nb::arg("matchers"), nb::arg("bitmask"), nb::arg("indices"), nb::arg("num_threads"), nb::arg("pool_size"));
}

}  // namespace agent_infer
