// Python bindings of the IR serializer: ``serialize_packed`` / ``serialize_rules`` (the programs),
// ``SerializedRules`` and ``compile_serialized`` (programs kept native into the compiler),
// ``first_missing_ref`` and ``clear_body_cache``.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/vector.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <utility>
#include <vector>

#include "bindings/bindings.h"
#include "grammar/compiled_grammar.h"
#include "grammar/ir/body_cache.h"
#include "grammar/ir/key_trie.h"
#include "grammar/ir/serialize.h"
#include "grammar/mask/tokenizer_info.h"

namespace nb = nanobind;

namespace agent_infer {

using ir_serialize::first_missing_ref;
using ir_serialize::Kinds;
using ir_serialize::Program;
using ir_serialize::serialize_all;
using ir_serialize::SerializedRules;

void register_grammar_serialize(nb::module_& m) {
  register_grammar_key_trie(m);
  nb::class_<SerializedRules>(m, "SerializedRules",
                              "Rule programs written by serialize_packed, kept native for compile_serialized.")
      .def("__len__", [](const SerializedRules& s) { return s.programs.size(); })
      .def(
          "programs", [](const SerializedRules& s) { return s.programs; },
          "The programs as lists of ints (what serialize_rules returns).")
      .def(
          "tobytes",
          [](const SerializedRules& s) {
            // Rule count, each program's length, then every word: int32 in native byte order.
            std::vector<int32_t> flat;
            size_t words = 0;
            for (const Program& p : s.programs) words += p.size();
            flat.reserve(1 + s.programs.size() + words);
            flat.push_back(static_cast<int32_t>(s.programs.size()));
            for (const Program& p : s.programs) flat.push_back(static_cast<int32_t>(p.size()));
            for (const Program& p : s.programs) flat.insert(flat.end(), p.begin(), p.end());
            return nb::bytes(reinterpret_cast<const char*>(flat.data()), flat.size() * sizeof(int32_t));
          },
          "Rule count, program lengths and words as int32 bytes (what the compile-cache key hashes).");

  m.def(
      "clear_body_cache", [] { body_cache().clear(); },
      "Forget the cached programs of shared rule bodies (the next serializations run cold).");
  m.def(
      "serialize_packed",
      [](nb::list bodies, nb::dict index, nb::tuple kinds, std::optional<nb::str> shared_prefix) {
        return serialize_all(std::move(bodies), std::move(index), std::move(kinds), std::move(shared_prefix),
                             std::nullopt);
      },
      nb::arg("bodies"), nb::arg("index"), nb::arg("kinds"), nb::arg("shared_prefix").none() = nb::none(),
      "serialize_rules, with the programs kept native (SerializedRules); None where the Python "
      "serializer must decide. Bodies of rules whose names start with ``shared_prefix`` are IR "
      "objects shared across grammars: their programs are cached by object, indices by name.");

  m.def(
      "serialize_grammar_packed",
      [](nb::object rules, nb::object root, nb::tuple kinds, std::optional<nb::str> shared_prefix) -> nb::object {
        // The rule index (name -> position, the last of equal names winning, as the Python
        // dict comprehension builds it) and the bodies, read off the (name, body) pairs here:
        // in Python the two comprehensions cost ~0.3 ms of a Kubernetes schema's compile.
        nb::object seq = nb::steal(PySequence_Fast(rules.ptr(), "rules must be a sequence"));
        if (!seq.is_valid()) throw nb::python_error();
        const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
        PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
        nb::dict index;
        nb::list bodies = nb::steal<nb::list>(PyList_New(n));
        if (!bodies.is_valid()) throw nb::python_error();
        for (Py_ssize_t i = 0; i < n; ++i) {
          PyObject* pair = items[i];
          if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2 ||
              !PyUnicode_CheckExact(PyTuple_GET_ITEM(pair, 0))) {
            return nb::none();  // the Python path decides (and reports)
          }
          nb::object at = nb::steal(PyLong_FromSsize_t(i));
          if (!at.is_valid() || PyDict_SetItem(index.ptr(), PyTuple_GET_ITEM(pair, 0), at.ptr()) != 0) {
            throw nb::python_error();
          }
          PyObject* body = PyTuple_GET_ITEM(pair, 1);
          Py_INCREF(body);
          PyList_SET_ITEM(bodies.ptr(), i, body);
        }
        PyObject* root_at = PyDict_GetItemWithError(index.ptr(), root.ptr());  // borrowed
        if (root_at == nullptr) {
          PyErr_Clear();
          return nb::none();
        }
        std::optional<nb::tuple> pairs;
        if (PyTuple_CheckExact(rules.ptr())) pairs = nb::borrow<nb::tuple>(rules);
        std::optional<SerializedRules> out = serialize_all(bodies, index, kinds, shared_prefix, pairs);
        if (!out.has_value()) return nb::none();
        return nb::make_tuple(nb::cast(std::move(*out), nb::rv_policy::move), nb::borrow(root_at));
      },
      nb::arg("rules"), nb::arg("root"), nb::arg("kinds"), nb::arg("shared_prefix").none() = nb::none(),
      "serialize_packed over a grammar's (name, body) pairs: (SerializedRules, root index), the "
      "rule index built here; also untracks the walked IR (see serialize_packed). None where the "
      "Python serializer must decide.");

  m.def(
      "compile_serialized",
      [](std::shared_ptr<grammar::TokenizerInfo> tok, SerializedRules& rules, int32_t root, int64_t max_states,
         double max_seconds, int64_t max_items, int64_t max_work_byte, int64_t max_work_mask) {
        const grammar::Limits lim =
            grammar::Limits::from_args(max_states, max_seconds, max_items, max_work_byte, max_work_mask);
        // The compile takes the programs over (rewriting them as it merges and outlines rules):
        // ``rules`` is empty afterwards, whether the compile succeeds or raises.
        std::vector<Program> programs = std::move(rules.programs);
        rules.programs.clear();
        nb::gil_scoped_release release;
        return std::make_shared<grammar::CompiledGrammar>(std::move(tok), std::move(programs), root, lim);
      },
      nb::arg("tokenizer"), nb::arg("rules"), nb::arg("root"), nb::arg("max_states"), nb::arg("max_seconds"),
      nb::arg("max_items"), nb::arg("max_work_per_byte") = grammar::Limits::kDefaultWorkPerByte,
      nb::arg("max_work_per_mask") = grammar::Limits::kDefaultWorkPerMask,
      "CompiledGrammar(tokenizer, rules, ...) from SerializedRules, which it consumes (empty afterwards).");


  m.def(
      "first_missing_ref",
      [](nb::list bodies, nb::set defined, nb::tuple kinds) -> nb::object {
        if (kinds.size() != 7) throw std::invalid_argument("first_missing_ref needs the 7 IR node classes");
        PyObject* t = kinds.ptr();
        Kinds k{PyTuple_GET_ITEM(t, 0), PyTuple_GET_ITEM(t, 1), PyTuple_GET_ITEM(t, 2), PyTuple_GET_ITEM(t, 3),
                PyTuple_GET_ITEM(t, 4), PyTuple_GET_ITEM(t, 5), PyTuple_GET_ITEM(t, 6)};
        PyObject* missing = nullptr;
        Py_ssize_t r = first_missing_ref(bodies.ptr(), defined.ptr(), k, missing);
        if (r == -1) return nb::none();
        if (r == -2) return nb::bool_(false);
        return nb::make_tuple(r, nb::steal(missing));
      },
      nb::arg("bodies"), nb::arg("defined"), nb::arg("kinds"),
      "The first undefined rule reference as (rule index, name), None if there is none, or False "
      "where the Python walk must decide (node types it does not know).");

  m.def(
      "serialize_rules",
      &ir_serialize::serialize_rules,
      nb::arg("bodies"), nb::arg("index"), nb::arg("kinds"),
      "Flat programs of rule bodies (IR nodes) given the rule index; None where the Python "
      "serializer must decide (it writes the same programs and raises the precise errors).");
}

}  // namespace agent_infer
