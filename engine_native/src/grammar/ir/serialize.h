// Declarations shared by the IR serializer's translation units: the packed writer
// (grammar/ir/serialize.cpp), the reference checks (grammar/ir/ref_check.cpp) and their Python bindings
// (bindings/serialize_bindings.cpp). Internal to the extension; the engine's API is grammar/compiled_grammar.h and
// grammar/match/matcher.h.
#pragma once

#include <nanobind/nanobind.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace agent_infer::ir_serialize {

namespace nb = nanobind;

using Program = std::vector<int32_t>;

struct Kinds {
  PyObject* empty;
  PyObject* literal;
  PyObject* cls;
  PyObject* seq;
  PyObject* alt;
  PyObject* repeat;
  PyObject* ref;
  PyObject* key_node = nullptr;  // ir.nodes.KeyNode, when the caller passes it
  PyObject* key_set = nullptr;   // ir.nodes.KeySet (a whole key trie), likewise
  PyObject* unique = nullptr;    // ir.nodes.UniqueItem (a whole rule body), likewise
  PyObject* bounded = nullptr;   // ir.nodes.BoundedString (a whole rule body), likewise
  PyObject* check = nullptr;     // ir.nodes.Check (a run-time check), likewise
};

// The IR node classes in the order ir.NODE_KINDS lists them (7, 8 with KeyNode, 9 with KeySet, 10
// with UniqueItem, 11 with BoundedString, 12 with Check).
inline Kinds kinds_from(const nb::tuple& kinds, const char* who) {
  const size_t n = kinds.size();
  if (n < 7 || n > 12) {
    throw std::invalid_argument(std::string(who) +
                                " needs the 7 IR node classes (and KeyNode, KeySet, UniqueItem, BoundedString, Check)");
  }
  PyObject* t = kinds.ptr();
  Kinds k{PyTuple_GET_ITEM(t, 0), PyTuple_GET_ITEM(t, 1), PyTuple_GET_ITEM(t, 2), PyTuple_GET_ITEM(t, 3),
          PyTuple_GET_ITEM(t, 4), PyTuple_GET_ITEM(t, 5), PyTuple_GET_ITEM(t, 6)};
  if (n >= 8) k.key_node = PyTuple_GET_ITEM(t, 7);
  if (n >= 9) k.key_set = PyTuple_GET_ITEM(t, 8);
  if (n >= 10) k.unique = PyTuple_GET_ITEM(t, 9);
  if (n >= 11) k.bounded = PyTuple_GET_ITEM(t, 10);
  if (n == 12) k.check = PyTuple_GET_ITEM(t, 11);
  return k;
}

struct Names {
  PyObject* items = PyUnicode_InternFromString("items");
  PyObject* text = PyUnicode_InternFromString("text");
  PyObject* ranges = PyUnicode_InternFromString("ranges");
  PyObject* negated = PyUnicode_InternFromString("negated");
  PyObject* item = PyUnicode_InternFromString("item");
  PyObject* min = PyUnicode_InternFromString("min");
  PyObject* max = PyUnicode_InternFromString("max");
  PyObject* max_length = PyUnicode_InternFromString("max_length");
  PyObject* name = PyUnicode_InternFromString("name");
  PyObject* spec = PyUnicode_InternFromString("_spec");
  PyObject* key_names = PyUnicode_InternFromString("_names");
  // json_schema.keys.complement_keys.SPECIAL_RULE and SINK_RULE, which every key-trie node's gap branch calls.
  PyObject* special_rule = PyUnicode_InternFromString("char-special");
  PyObject* sink_rule = PyUnicode_InternFromString("char-key-rest");
  // json_schema.keys.complement_keys.FREE_RULE (char-special, then char-key-rest), which a KeySet's nodes call.
  PyObject* free_rule = PyUnicode_InternFromString("char-key-free");
  PyObject* carriers = PyUnicode_InternFromString("carriers");
  PyObject* accept = PyUnicode_InternFromString("accept");
  PyObject* product = PyUnicode_InternFromString("product");
};

inline const Names& names() {
  static const Names* n = new Names();  // interned for the process, never freed
  return *n;
}

// Rule programs kept on the native side between serialization and compilation.
struct SerializedRules {
  std::vector<Program> programs;
};

// Programs of all rules; the bodies of rules named ``shared_prefix``... go through the body cache.
// std::nullopt: the Python serializer must decide (see grammar/ir/serialize.cpp).
// With ``untrack_pairs`` (the grammar's (name, body) pairs), a successful call also untracks the
// walked IR and the pairs from the cyclic GC (see grammar/ir/serialize.cpp).
std::optional<SerializedRules> serialize_all(nb::list bodies, nb::dict index, nb::tuple kinds,
                                             std::optional<nb::str> shared_prefix,
                                             std::optional<nb::tuple> untrack_pairs);

// Programs of ``bodies`` given the rule index, with no body cache (``serialize_rules``).
std::optional<std::vector<Program>> serialize_rules(nb::list bodies, nb::dict index, nb::tuple kinds);

// Whether every reference under ``bodies`` names a rule in ``defined``, in any order (the usual
// case, so leaves are checked inline and never stacked): 1 yes, 0 no, -1 leave it to Python.
int all_refs_defined(PyObject* bodies, PyObject* defined, const Kinds& k);

// Grammar validation's walk (ir/references.py, first_undefined_ref): rules in order, each pre-order with the last
// child first, composite nodes met before skipped. Returns -1 when every reference is defined,
// the rule index of the first undefined one (its name in ``missing``), or -2: leave it to Python.
Py_ssize_t first_missing_ref(PyObject* bodies, PyObject* defined, const Kinds& k, PyObject*& missing);

}  // namespace agent_infer::ir_serialize
