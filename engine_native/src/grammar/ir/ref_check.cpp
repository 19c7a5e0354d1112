// Reference checks over IR rule bodies without a Python call per node: whether every ``Ref`` names
// a defined rule, and (grammar validation's walk) the first one that does not.
#include <nanobind/nanobind.h>

#include <unordered_set>
#include <vector>

#include "grammar/ir/serialize.h"

namespace agent_infer::ir_serialize {

// Whether every reference under ``bodies`` names a rule in ``defined``, in any order (the usual
// case, so leaves are checked inline and never stacked): 1 yes, 0 no, -1 leave it to Python.
int all_refs_defined(PyObject* bodies, PyObject* defined, const Kinds& k) {
  const Names& nm = names();
  std::unordered_set<PyObject*> visited;
  std::vector<PyObject*> stack;
  // 0 leaf, 1 defined ref, 2 undefined ref, 3 composite to walk, -1 unknown or error.
  auto classify = [&](PyObject* node) -> int {
    PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(node));
    if (type == k.literal || type == k.cls || type == k.empty) return 0;
    if (type == k.ref) {
      PyObject* name = PyObject_GetAttr(node, nm.name);
      if (name == nullptr) return -1;
      int in = PySet_Contains(defined, name);
      Py_DECREF(name);
      return in < 0 ? -1 : (in == 1 ? 1 : 2);
    }
    if (type == k.seq || type == k.alt || type == k.repeat || (k.check != nullptr && type == k.check)) return 3;
    return -1;
  };
  Py_ssize_t n = PyList_GET_SIZE(bodies);
  for (Py_ssize_t r = 0; r < n; ++r) {
    PyObject* body = PyList_GET_ITEM(bodies, r);
    int c = classify(body);
    if (c == 3) {
      if (visited.insert(body).second) stack.push_back(body);
    } else if (c != 0 && c != 1) {
      return c == 2 ? 0 : -1;
    }
    while (!stack.empty()) {
      PyObject* node = stack.back();
      stack.pop_back();
      bool repeat = reinterpret_cast<PyObject*>(Py_TYPE(node)) == k.repeat;
      PyObject* kids = PyObject_GetAttr(node, repeat ? nm.item : nm.items);
      if (kids == nullptr) return -1;
      if (repeat) {
        c = classify(kids);
        if (c == 3 && visited.insert(kids).second) stack.push_back(kids);
        Py_DECREF(kids);  // the node keeps it alive
        if (c == 2 || c < 0) return c == 2 ? 0 : -1;
        continue;
      }
      if (!PyTuple_CheckExact(kids)) {
        Py_DECREF(kids);
        return -1;
      }
      for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kids); ++i) {
        PyObject* kid = PyTuple_GET_ITEM(kids, i);
        c = classify(kid);
        if (c == 3) {
          if (visited.insert(kid).second) stack.push_back(kid);
        } else if (c == 2 || c < 0) {
          Py_DECREF(kids);
          return c == 2 ? 0 : -1;
        }
      }
      Py_DECREF(kids);
    }
  }
  return 1;
}

// Grammar validation's walk (ir/references.py, first_undefined_ref): rules in order, each pre-order with the last
// child first, composite nodes met before skipped. Returns -1 when every reference is defined,
// the rule index of the first undefined one (its name in ``missing``), or -2: leave it to Python.
Py_ssize_t first_missing_ref(PyObject* bodies, PyObject* defined, const Kinds& k, PyObject*& missing) {
  int all = all_refs_defined(bodies, defined, k);
  if (all < 0) {
    PyErr_Clear();
    return -2;
  }
  if (all == 1) return -1;
  const Names& nm = names();
  std::unordered_set<PyObject*> visited;
  std::vector<PyObject*> stack;
  Py_ssize_t n = PyList_GET_SIZE(bodies);
  for (Py_ssize_t r = 0; r < n; ++r) {
    stack.assign(1, PyList_GET_ITEM(bodies, r));
    while (!stack.empty()) {
      PyObject* node = stack.back();
      stack.pop_back();
      PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(node));
      if (type == k.ref) {
        PyObject* name = PyObject_GetAttr(node, nm.name);
        if (name == nullptr) {
          PyErr_Clear();
          return -2;
        }
        int in = PySet_Contains(defined, name);
        if (in < 0) {
          Py_DECREF(name);
          PyErr_Clear();
          return -2;
        }
        if (in == 0) {
          missing = name;  // new reference, handed to the caller
          return r;
        }
        Py_DECREF(name);
      } else if (type == k.seq || type == k.alt || (k.check != nullptr && type == k.check)) {
        if (!visited.insert(node).second) continue;
        PyObject* items = PyObject_GetAttr(node, nm.items);
        if (items == nullptr || !PyTuple_CheckExact(items)) {
          Py_XDECREF(items);
          PyErr_Clear();
          return -2;
        }
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(items); ++i) stack.push_back(PyTuple_GET_ITEM(items, i));
        Py_DECREF(items);  // the node keeps the tuple and its items alive
      } else if (type == k.repeat) {
        if (!visited.insert(node).second) continue;
        PyObject* item = PyObject_GetAttr(node, nm.item);
        if (item == nullptr) {
          PyErr_Clear();
          return -2;
        }
        stack.push_back(item);
        Py_DECREF(item);
      } else if (type != k.literal && type != k.cls && type != k.empty) {
        return -2;  // subclasses and foreign nodes
      }
    }
  }
  return -1;
}

}  // namespace agent_infer::ir_serialize
