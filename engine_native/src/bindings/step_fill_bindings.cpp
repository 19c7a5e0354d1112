// Bindings of the engine step's mask fill (grammar/batch/step_fill.h), used by
// agent_infer/engine/mask_filler.py.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <memory>
#include <tuple>

#include "bindings/bindings.h"
#include "grammar/batch/step_fill.h"

namespace nb = nanobind;

namespace agent_infer {
namespace {

using grammar::FillThread;
using grammar::Matcher;
using grammar::StepFill;
using Logits = nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

// The Python-facing fill: the native fill plus references that keep its matchers and bitmask
// alive until it has run, whatever Python drops first.
class StepFillHandle {
 public:
  StepFillHandle(std::shared_ptr<StepFill> fill, std::vector<nb::object> keep)
      : fill_(std::move(fill)), keep_(std::move(keep)) {}
  ~StepFillHandle() {
    // A fill still queued or running writes into the objects kept here: they outlive it. The
    // fill never needs the GIL, so waiting with it held cannot deadlock.
    if (submitted_) fill_->block();
  }
  // Runs the fill here unless a thread has it, then waits for it; rethrows its error.
  void finish() {
    if (!submitted_ && !ran_) {
      ran_ = true;
      nb::gil_scoped_release release;
      fill_->run();
    } else if (!fill_->done()) {
      nb::gil_scoped_release release;
      fill_->block();
    }
    fill_->wait();
  }
  std::shared_ptr<StepFill> fill_;
  std::vector<nb::object> keep_;
  bool submitted_ = false;
  bool ran_ = false;
};

nb::list results_of(const StepFill& fill) {
  nb::list out;
  for (uint8_t r : fill.results()) out.append(nb::bool_(r != 0));
  return out;
}

}  // namespace

void register_step_fill(nb::module_& m) {
  nb::class_<StepFillHandle>(m, "StepFill",
                             "One engine step's mask fill: rows of distinct matchers as a batch, then draft chains "
                             "(the rows after each draft prefix). Checks its arguments and holds the matchers busy "
                             "until it has run.")
      .def(
          "__init__",
          [](StepFillHandle* self, const std::vector<nb::object>& matchers, std::vector<int64_t> rows,
             const std::vector<std::tuple<nb::object, int64_t, std::vector<int32_t>>>& chains, nb::object bitmask,
             uintptr_t address, int64_t num_rows, int64_t words, int32_t threads, int32_t cached_threads,
             int32_t pool_size) {
            std::vector<nb::object> keep(matchers);
            std::vector<Matcher*> plain;
            plain.reserve(matchers.size());
            for (const nb::object& o : matchers) plain.push_back(nb::cast<Matcher*>(o));
            std::vector<StepFill::Chain> native_chains;
            native_chains.reserve(chains.size());
            for (const auto& [o, first, draft] : chains) {
              native_chains.push_back({nb::cast<Matcher*>(o), first, draft});
              keep.push_back(o);
            }
            keep.push_back(bitmask);
            auto fill = std::make_shared<StepFill>(std::move(plain), std::move(rows), std::move(native_chains),
                                                   reinterpret_cast<int32_t*>(address), num_rows, words,
                                                   static_cast<size_t>(std::max(threads, 0)),
                                                   static_cast<size_t>(std::max(cached_threads, 0)),
                                                   static_cast<unsigned>(std::max(pool_size, 0)));
            new (self) StepFillHandle(std::move(fill), std::move(keep));
          },
          nb::arg("matchers"), nb::arg("rows"), nb::arg("chains"), nb::arg("bitmask"), nb::arg("address"),
          nb::arg("num_rows"), nb::arg("words"), nb::arg("threads"), nb::arg("cached_threads"),
          nb::arg("pool_size"))
      .def(
          "finish",
          [](StepFillHandle& h) {
            h.finish();
            return results_of(*h.fill_);
          },
          "Run the fill here if it was not submitted, else wait for it (the GIL released either way); returns "
          "each row's 'restricts something' flag (plain rows, then chain rows), or raises the fill's error.")
      .def(
          "apply_cpu",
          [](StepFillHandle& h, Logits logits) {
            h.finish();
            nb::gil_scoped_release release;
            h.fill_->apply(logits.data(), static_cast<int64_t>(logits.shape(0)), static_cast<int64_t>(logits.shape(1)));
          },
          nb::arg("logits").noconvert(),
          "finish(), then mask float32 logits [batch, vocab] in place with the rows that restrict something.")
      .def_prop_ro("done", [](const StepFillHandle& h) { return h.fill_->done(); })
      .def_prop_ro("seconds", [](const StepFillHandle& h) { return h.fill_->seconds(); });

  nb::class_<FillThread>(m, "FillThread", "A native thread that runs submitted StepFills in order.")
      .def(nb::init<>())
      .def(
          "submit",
          [](FillThread& t, StepFillHandle& h) {
            if (h.submitted_ || h.ran_) throw std::logic_error("this fill has already been submitted or run");
            h.submitted_ = t.submit(h.fill_);
            return h.submitted_;
          },
          nb::arg("fill"), "Queue the fill; False (not queued) once the thread has been stopped.")
      .def(
          "stop",
          [](FillThread& t) {
            nb::gil_scoped_release release;
            t.stop();
          },
          "Run the fills already queued, then end the thread.");
}

}  // namespace agent_infer
