// Grammar matcher bindings: owned by the grammar core (see docs/grammar_engine.md).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#if defined(__unix__) || defined(__APPLE__)
#include <fcntl.h>
#include <unistd.h>
#define AGENT_INFER_HAVE_DEV_ZERO 1
#endif

#include <algorithm>
#include <cerrno>
#include <optional>

#include "bindings/bindings.h"
#include "grammar/batch/batch.h"
#include "grammar/compiled_grammar.h"
#include "grammar/errors.h"
#include "grammar/mask/tokenizer_info.h"
#include "grammar/match/matcher.h"

namespace nb = nanobind;

namespace agent_infer {
namespace {

using grammar::CompiledGrammar;
using grammar::Matcher;
using grammar::TokenizerInfo;
using Mask = nb::ndarray<int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

void check_width(int64_t words, const TokenizerInfo& tok) {
  if (words < tok.words) {
    throw grammar::BitmaskError("bitmask rows have " + std::to_string(words) + " words but the vocabulary of " +
                                std::to_string(tok.vocab_size) + " tokens needs " + std::to_string(tok.words));
  }
}
void check_width(const Mask& mask, const TokenizerInfo& tok) { check_width(static_cast<int64_t>(mask.shape(1)), tok); }

void check_row(int64_t rows, int64_t index) {
  if (index < 0 || index >= rows) {
    throw grammar::BitmaskError("bitmask row " + std::to_string(index) + " is outside the bitmask's " +
                            std::to_string(rows) + " rows");
  }
}
void check_row(const Mask& mask, int64_t index) { check_row(static_cast<int64_t>(mask.shape(0)), index); }

// The test hooks' arguments: a state of the grammar, and a walk depth of 0 or 1.
void check_state(const CompiledGrammar& g, int32_t state) {
  if (state < 0 || static_cast<size_t>(state) >= g.states.size()) {
    throw std::out_of_range("state " + std::to_string(state) + " is outside the grammar's " +
                            std::to_string(g.states.size()) + " states");
  }
}
void check_first(size_t first) {
  if (first > 1) throw std::invalid_argument("first must be 0 or 1, not " + std::to_string(first));
}

// Whether [address, address + nbytes) may be written, asked of the kernel: reading /dev/zero into
// it fails with EFAULT on read-only pages (a read-only file mapping) where a store would kill the
// process. Zeroes the range: only rows about to be filled are asked. True if it cannot tell.
bool pages_writable(uintptr_t address, int64_t nbytes) {
#ifndef AGENT_INFER_HAVE_DEV_ZERO
  return true;
#else
  static const int zero_fd = open("/dev/zero", O_RDONLY | O_CLOEXEC);
  if (zero_fd < 0) return true;
  char* p = reinterpret_cast<char*>(address);
  while (nbytes > 0) {
    const ssize_t got = read(zero_fd, p, static_cast<size_t>(std::min<int64_t>(nbytes, int64_t{1} << 20)));
    if (got < 0) {
      if (errno == EINTR) continue;
      return errno != EFAULT;
    }
    if (got == 0) return true;
    p += got;
    nbytes -= got;
  }
  return true;
#endif
}

// Refuses a row of memory torch did not allocate (`foreign`) that may not be written.
void check_writable(bool foreign, int32_t* row, int64_t words) {
  if (foreign && !pages_writable(reinterpret_cast<uintptr_t>(row), words * 4)) {
    throw grammar::BitmaskError(
        "the token bitmask is read-only memory (a tensor over a read-only mapping, e.g. torch.from_numpy of a "
        "read-only np.memmap)");
  }
}

// One batch fill after the checks both bitmask paths share; `indices` null means rows 0..n-1.
nb::list fill_batch_checked(const std::vector<Matcher*>& matchers, int32_t* data, int64_t rows, int64_t words,
                            const std::optional<std::vector<int64_t>>& indices, int32_t num_threads,
                            int32_t pool_size, bool foreign = false) {
  const size_t n = matchers.size();
  std::vector<int64_t> own;
  if (!indices) {
    own.resize(n);
    for (size_t i = 0; i < n; ++i) own[i] = static_cast<int64_t>(i);
  } else if (indices->size() != n) {
    throw grammar::BitmaskError(std::to_string(n) + " matchers but " + std::to_string(indices->size()) + " indices");
  }
  const std::vector<int64_t>& idx = indices ? *indices : own;
  for (int64_t i : idx) check_row(rows, i);
  for (Matcher* mt : matchers) {
    if (!mt) throw grammar::UsageError("matcher is None", "matchers");
    check_width(words, *mt->compiled()->tok);
  }
  // Two threads must never fill one matcher (its state would race).
  std::vector<Matcher*> sorted(matchers);
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
    throw grammar::UsageError("the same matcher appears twice in one batch fill", "matchers");
  }
  for (int64_t i : idx) check_writable(foreign, data + i * words, words);
  // Every matcher is busy until the whole batch is done: its rows run on pool threads.
  std::vector<std::unique_ptr<Matcher::Use>> uses;
  uses.reserve(n);
  for (Matcher* mt : matchers) uses.push_back(std::make_unique<Matcher::Use>(*mt, "fill_next_token_bitmask_batch"));
  std::vector<uint8_t> results(n, 0);
  {
    nb::gil_scoped_release release;
    grammar::fill_batch(matchers.data(), idx.data(), n, data, words,
                        num_threads > 0 ? static_cast<size_t>(num_threads) : 0,
                        static_cast<unsigned>(std::max(pool_size, 0)), results.data());
  }
  nb::list out;
  for (uint8_t r : results) out.append(nb::bool_(r != 0));
  return out;
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
  } catch (const grammar::UsageError& e) {
    nb::object type = nb::module_::import_("agent_infer.errors").attr("MatcherUsageError");
    nb::object argument = e.argument ? nb::cast(e.argument) : nb::object(nb::none());
    nb::object err = type(e.what(), nb::arg("argument") = argument);
    PyErr_SetObject(type.ptr(), err.ptr());
    return;
  } catch (const grammar::BitmaskError& e) {
    cls = "TokenBitmaskError";
    msg = e.what();
  } catch (const grammar::BusyError& e) {
    nb::object type = nb::module_::import_("agent_infer.errors").attr("MatcherBusyError");
    nb::object err = type(e.what(), nb::arg("operation") = e.operation, nb::arg("running") = e.running);
    PyErr_SetObject(type.ptr(), err.ptr());
    return;
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
             int32_t root, int64_t max_states, double max_seconds, int64_t max_items, int64_t max_work_byte,
             int64_t max_work_mask) {
            const grammar::Limits lim =
                grammar::Limits::from_args(max_states, max_seconds, max_items, max_work_byte, max_work_mask);
            nb::gil_scoped_release release;
            new (self) CompiledGrammar(std::move(tok), rules, root, lim);
          },
          nb::arg("tokenizer"), nb::arg("rules"), nb::arg("root"), nb::arg("max_states"), nb::arg("max_seconds"),
          nb::arg("max_items"), nb::arg("max_work_per_byte") = grammar::Limits::kDefaultWorkPerByte,
          nb::arg("max_work_per_mask") = grammar::Limits::kDefaultWorkPerMask)
      .def("memory_bytes", &CompiledGrammar::memory_bytes)
      .def(
          "split_matches_whole",
          [](const CompiledGrammar& g, int32_t state, size_t part_tokens) {
            check_state(g, state);
            nb::gil_scoped_release release;
            return g.masks().split_matches_whole(state, part_tokens);
          },
          nb::arg("state"), nb::arg("part_tokens"))
      .def(
          "region_content_matches_walk",
          [](const CompiledGrammar& g, int32_t state, size_t first) {
            check_state(g, state);
            check_first(first);
            nb::gil_scoped_release release;
            return g.masks().region_content_matches_walk(state, first);
          },
          nb::arg("state"), nb::arg("first") = 0)
      .def(
          "region_classes_matches_walk",
          [](const CompiledGrammar& g, int32_t state, size_t first) {
            check_state(g, state);
            check_first(first);
            nb::gil_scoped_release release;
            return g.masks().region_classes_matches_walk(state, first);
          },
          nb::arg("state"), nb::arg("first"))
      .def_prop_ro("num_states", [](const CompiledGrammar& g) { return g.states.size(); });

  // Every method holds a Matcher::Use for the call (concurrent use raises MatcherBusyError).
  nb::class_<Matcher>(m, "GrammarMatcher")
      .def(
          "__init__",
          [](Matcher* self, std::shared_ptr<CompiledGrammar> g, bool terminate_without_eos, int32_t max_rollback) {
            new (self) Matcher(std::move(g), terminate_without_eos, max_rollback);
          },
          nb::arg("compiled"), nb::arg("terminate_without_eos"), nb::arg("max_rollback"))
      .def("accept_token",
           [](Matcher& mt, int32_t id) {
             Matcher::Use use(mt, "accept_token");
             const TokenizerInfo& t = *mt.compiled()->tok;
             if (id < 0 || id >= t.vocab_size || !mt.long_step(t.tokens[id].size())) return mt.accept_token(id);
             nb::gil_scoped_release release;
             return mt.accept_token(id);
           })
      .def("accept_bytes",
           [](Matcher& mt, nb::bytes b) {
             Matcher::Use use(mt, "accept_string");
             std::string data(b.c_str(), b.size());
             if (!mt.long_step(data.size())) return mt.accept_bytes(data);
             nb::gil_scoped_release release;
             return mt.accept_bytes(data);
           })
      .def(
          "fill_next_token_bitmask",
          [](Matcher& mt, Mask mask, int64_t index, bool foreign) {
            Matcher::Use use(mt, "fill_next_token_bitmask");
            check_row(mask, index);
            check_width(mask, *mt.compiled()->tok);
            int64_t words = static_cast<int64_t>(mask.shape(1));
            int32_t* row = mask.data() + index * words;
            nb::gil_scoped_release release;
            check_writable(foreign, row, words);
            return mt.fill_mask(row, words);
          },
          // noconvert: a converted array would be a copy, and the fill would never reach the caller.
          nb::arg("bitmask").noconvert(), nb::arg("index") = 0, nb::arg("foreign") = false)
      .def(
          "fill_next_token_bitmask_at",
          // The fast path for C-contiguous int32 CPU tensors, checked by the Python wrapper
          // (matcher.py _tensor_rows), which also keeps the tensor alive during the call:
          // importing a torch tensor through DLPack costs ~2 us, more than a cached fill.
          // `foreign`: torch did not allocate the memory, so the row's pages are checked first.
          [](Matcher& mt, uintptr_t address, int64_t rows, int64_t words, bool foreign, int64_t index) {
            Matcher::Use use(mt, "fill_next_token_bitmask");
            check_row(rows, index);
            check_width(words, *mt.compiled()->tok);
            if (address == 0) throw grammar::BitmaskError("bitmask has no data");
            int32_t* row = reinterpret_cast<int32_t*>(address) + index * words;
            nb::gil_scoped_release release;
            check_writable(foreign, row, words);
            return mt.fill_mask(row, words);
          },
          nb::arg("address"), nb::arg("rows"), nb::arg("words"), nb::arg("foreign"), nb::arg("index"))
      .def("rollback",
           [](Matcher& mt, int32_t n) {
             Matcher::Use use(mt, "rollback");
             mt.rollback(n);
           })
      .def("reset",
           [](Matcher& mt) {
             Matcher::Use use(mt, "reset");
             mt.reset();
           })
      .def("fork",
           [](const Matcher& mt) {
             Matcher::Use use(mt, "fork");
             return new Matcher(mt);
           })
      .def("is_terminated",
           [](const Matcher& mt) {
             Matcher::Use use(mt, "is_terminated");
             return mt.is_terminated();
           })
      .def("can_terminate",
           [](const Matcher& mt) {
             Matcher::Use use(mt, "can_terminate");
             return mt.can_terminate();
           })
      .def("num_tokens",
           [](const Matcher& mt) {
             Matcher::Use use(mt, "num_accepted_steps");
             return mt.num_tokens();
           })
      .def("debug_items",
           [](const Matcher& mt) {
             Matcher::Use use(mt, "debug_items");
             return mt.debug_items();
           })
      .def("forced_bytes",
           [](Matcher& mt) {
             Matcher::Use use(mt, "find_forced_bytes");
             bool must_end = false;
             std::string s = mt.forced_bytes(&must_end);
             return std::make_pair(nb::bytes(s.data(), s.size()), must_end);
           })
      .def("next_bytes_after",
           [](Matcher& mt, nb::bytes b) -> nb::object {
             Matcher::Use use(mt, "forced_tokens");  // its only caller
             std::array<uint32_t, 8> set;
             if (!mt.next_bytes_after(std::string(b.c_str(), b.size()), &set)) return nb::none();
             std::vector<int> out;
             for (int x = 0; x < 256; ++x) {
               if ((set[x >> 5] >> (x & 31)) & 1u) out.push_back(x);
             }
             return nb::cast(out);
           })
      .def("shortest_completion", [](Matcher& mt) -> nb::object {
        Matcher::Use use(mt, "shortest_completion");
        std::string s;
        if (!mt.shortest_completion(&s)) return nb::none();
        return nb::bytes(s.data(), s.size());
      });

  m.def(
      "fill_next_token_bitmask_batch",
      [](const std::vector<Matcher*>& matchers, Mask mask, std::optional<std::vector<int64_t>> indices,
         int32_t num_threads, int32_t pool_size, bool foreign) {
        return fill_batch_checked(matchers, mask.data(), static_cast<int64_t>(mask.shape(0)),
                                  static_cast<int64_t>(mask.shape(1)), indices, num_threads, pool_size, foreign);
      },
      nb::arg("matchers"), nb::arg("bitmask").noconvert(), nb::arg("indices").none(), nb::arg("num_threads"),
      nb::arg("pool_size"), nb::arg("foreign") = false);
  m.def(
      "fill_next_token_bitmask_batch_at",
      // The batch twin of GrammarMatcher.fill_next_token_bitmask_at (the wrapper checked the
      // tensor and keeps it alive).
      [](const std::vector<Matcher*>& matchers, uintptr_t address, int64_t rows, int64_t words, bool foreign,
         std::optional<std::vector<int64_t>> indices, int32_t num_threads, int32_t pool_size) {
        if (address == 0) throw grammar::BitmaskError("bitmask has no data");
        return fill_batch_checked(matchers, reinterpret_cast<int32_t*>(address), rows, words, indices, num_threads,
                                  pool_size, foreign);
      },
      nb::arg("matchers"), nb::arg("address"), nb::arg("rows"), nb::arg("words"), nb::arg("foreign"),
      nb::arg("indices").none(), nb::arg("num_threads"), nb::arg("pool_size"));
  m.def(
      "grammar_batch_stats",
      [] {
        const grammar::BatchStats st = grammar::batch_stats();
        nb::dict out;
        out["split_walks"] = st.split_walks;
        out["helper_joins"] = st.helper_joins;
        out["helper_rows"] = st.helper_rows;
        out["parallel_loops"] = st.parallel_loops;
        out["polled_joins"] = st.polled_joins;
        out["spread_rows"] = st.spread_rows;
        return out;
      },
      "Process-wide counters of batch fills: walks split across threads, pool-thread joins and rows, "
      "first-visit loops (piece building, region digests) spread over the threads, and joins by a pool thread "
      "that found the batch while polling instead of being woken, and rows whose first visits of several states "
      "were spread over the threads.");
  m.def(
      "grammar_batch_trace",
      [](std::optional<bool> enable) {
        if (enable) grammar::batch_trace_enable(*enable);
        nb::list out;
        for (const grammar::BatchEvent& e : grammar::batch_trace_take()) {
          out.append(nb::make_tuple(std::string(1, e.kind), e.index, e.thread, e.t0, e.t1));
        }
        return out;
      },
      nb::arg("enable") = nb::none(),
      "Batch-fill timeline: returns and clears the recorded (kind, index, thread, t0_ns, t1_ns) events, kind "
      "'r' row, 'p' part of a split walk or shared loop, 'b' whole batch (index = rows); enable=True/False "
      "starts (clearing) or stops recording.");
  m.def("grammar_batch_spin", &grammar::set_batch_spin, nb::arg("ns"),
        "Set how long threads of a running batch fill poll before blocking (ns, 0 = never); returns the old value.");
  m.def("grammar_batch_wait_for_helper", &grammar::set_batch_wait_for_helper, nb::arg("on"),
        "Tests: batch fills that ask for helpers wait until a pool thread joined before claiming rows (on=True); "
        "returns the old value.");
  m.def("grammar_split_tuning", &grammar::set_split_tuning, nb::arg("min_split_tokens"), nb::arg("part_tokens"),
        "Set the split thresholds of batch-fill walks (part_tokens 0 = by thread count); returns the old ones.");
}

}  // namespace agent_infer
