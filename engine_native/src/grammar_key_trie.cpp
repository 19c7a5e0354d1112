// Key tries ("any key but these names") built natively: the work of
// agent_infer.grammar.json_schema_keys.ComplementKeys.start without a Python call per trie node.
//
// A Kubernetes schema asks for ~90 tries of ~35 nodes each; interning them in Python was about a
// third of its front end. Here the trie is built the same way (a minimal acyclic automaton from
// sorted words, Daciuk et al.: nodes interned children first, each child in code point order), so
// the rules arrive in the Python builder's order with the same shapes. A node's rule body is a
// ``KeyNode`` (json_schema_key_trie.py): an Alt that holds only (ends a name, child code points,
// child rule names) and builds its branches when Python asks for them; grammar_serialize.cpp
// writes its program straight from that spec.
#include "grammar_key_trie.h"

#include <nanobind/nanobind.h>

#include <charconv>
#include <cstdint>
#include <stdexcept>
#include <unordered_map>
#include <utility>
#include <vector>

namespace nb = nanobind;

namespace agent_infer {
namespace {

// A node's identity: whether it ends a name, then (code point, child id) per child.
using NodeKey = std::vector<int64_t>;

struct NodeKeyHash {
  size_t operator()(const NodeKey& key) const noexcept {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ key.size();
    for (int64_t x : key) {
      h ^= static_cast<uint64_t>(x) + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    }
    return static_cast<size_t>(h);
  }
};

// One interned node: its id (never reused, so names never clash), rule name and rule body, and
// the serial of the last builder that added its rule to its grammar.
struct Node {
  int64_t id;
  PyObject* name;  // owned
  PyObject* body;  // owned
  uint64_t owner = 0;
};

// Nodes by key for the whole process, so the next grammar with an apiVersion/kind/metadata object
// reuses names and bodies; bounded, and emptied by clear_key_tries (clear_grammar_caches).
class NodeTable {
 public:
  Node* find(const NodeKey& key) {
    auto it = map_.find(key);
    return it == map_.end() ? nullptr : &it->second;
  }

  // Takes the references to ``name`` and ``body``.
  Node& insert(const NodeKey& key, int64_t id, PyObject* name, PyObject* body) {
    if (map_.size() >= kMaxNodes) clear();
    return map_.emplace(key, Node{id, name, body}).first->second;
  }

  void clear() {
    for (auto& [key, node] : map_) {
      Py_DECREF(node.name);
      Py_DECREF(node.body);
    }
    map_.clear();
  }

  size_t size() const { return map_.size(); }
  int64_t next_id() { return next_id_++; }
  uint64_t next_owner() { return ++owners_; }

 private:
  static constexpr size_t kMaxNodes = size_t{1} << 16;
  std::unordered_map<NodeKey, Node, NodeKeyHash> map_;
  int64_t next_id_ = 0;
  uint64_t owners_ = 0;  // builder serials handed out (0: none)
};

NodeTable& node_table() {
  static NodeTable* table = new NodeTable();  // never freed: no decref after the interpreter is gone
  return *table;
}

struct Kid {
  uint32_t cp;
  int64_t id;
  PyObject* name;  // borrowed: a key of the builder's rules dict
};

// A node as its parent sees it.
struct Made {
  int64_t id;
  PyObject* name;  // borrowed, as Kid::name
};

// The trie nodes of one grammar, added to its rules dict as tries need them.
class KeyTrieBuilder {
 public:
  KeyTrieBuilder(nb::dict rules, nb::object node_cls, nb::object leaf_body, int64_t max_rules)
      : rules_(std::move(rules)),
        cls_(std::move(node_cls)),
        leaf_(std::move(leaf_body)),
        max_rules_(max_rules),
        serial_(node_table().next_owner()) {}

  KeyTrieBuilder(const KeyTrieBuilder&) = delete;
  KeyTrieBuilder& operator=(const KeyTrieBuilder&) = delete;

  // The start rule's name for keys outside ``names`` (sorted, distinct str); None when the grammar
  // would exceed ``max_rules`` rules.
  nb::object start(nb::tuple names) {
    std::vector<Open> path(1);
    std::vector<uint32_t> prev, word;
    const Py_ssize_t n = static_cast<Py_ssize_t>(names.size());
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* s = PyTuple_GET_ITEM(names.ptr(), i);
      if (!PyUnicode_Check(s)) throw nb::type_error("key trie names must be str");
      const int kind = PyUnicode_KIND(s);
      const void* data = PyUnicode_DATA(s);
      const Py_ssize_t len = PyUnicode_GET_LENGTH(s);
      word.resize(static_cast<size_t>(len));
      for (Py_ssize_t j = 0; j < len; ++j) word[static_cast<size_t>(j)] = PyUnicode_READ(kind, data, j);
      size_t p = 0;
      const size_t m = std::min(word.size(), prev.size());
      while (p < m && word[p] == prev[p]) ++p;
      if (!close(path, p)) return nb::none();
      for (size_t j = p; j < word.size(); ++j) path.push_back(Open{word[j], false, {}});
      path.back().ends = true;
      prev.swap(word);
    }
    if (!close(path, 0)) return nb::none();
    Made root{};
    if (!intern(path[0].ends, path[0].kids, root)) return nb::none();
    return nb::borrow(root.name);
  }

 private:
  struct Open {
    uint32_t cp;
    bool ends;
    std::vector<Kid> kids;
  };

  // Intern the open nodes below ``depth``, children first.
  bool close(std::vector<Open>& path, size_t depth) {
    while (path.size() > depth + 1) {
      Open node = std::move(path.back());
      path.pop_back();
      Made made{};
      if (!intern(node.ends, node.kids, made)) return false;
      path.back().kids.push_back(Kid{node.cp, made.id, made.name});
    }
    return true;
  }

  // The node's (id, name) in ``made``, its rule added to this grammar; false over the rule limit.
  bool intern(bool ends, const std::vector<Kid>& kids, Made& made) {
    key_.clear();
    key_.push_back(ends ? 1 : 0);
    for (const Kid& k : kids) {
      key_.push_back(k.cp);
      key_.push_back(k.id);
    }
    NodeTable& table = node_table();
    Node* node = table.find(key_);
    // A node this builder added already (its serial is on it) is in the rules dict: nothing to
    // do. Builders interleave (a sub-grammar's, while the main one is open), so a node last
    // added by another may still be in this grammar: the dict answers.
    if (node != nullptr && (node->owner == serial_ || PyDict_Contains(rules_.ptr(), node->name) == 1)) {
      node->owner = serial_;
      made = Made{node->id, node->name};
      return true;
    }
    if (node == nullptr) {
      const int64_t id = table.next_id();
      // "char-key-n<id>": ids are unique for the process, so names never clash.
      char text[40] = "char-key-n";
      const auto end = std::to_chars(text + 10, text + sizeof(text), id).ptr;
      nb::object name = nb::steal(PyUnicode_FromStringAndSize(text, end - text));
      if (!name.is_valid()) throw nb::python_error();
      nb::object body = (ends && kids.empty()) ? leaf_ : make_body(ends, kids);
      node = &table.insert(key_, id, name.release().ptr(), body.release().ptr());
    }
    if (PyDict_GET_SIZE(rules_.ptr()) >= max_rules_) return false;
    if (PyDict_SetItem(rules_.ptr(), node->name, node->body) != 0) throw nb::python_error();
    node->owner = serial_;
    made = Made{node->id, node->name};
    return true;
  }

  // KeyNode((ends, cp0, name0, cp1, name1, ...)).
  nb::object make_body(bool ends, const std::vector<Kid>& kids) {
    nb::object spec = nb::steal(PyTuple_New(static_cast<Py_ssize_t>(1 + 2 * kids.size())));
    if (!spec.is_valid()) throw nb::python_error();
    PyObject* flag = ends ? Py_True : Py_False;
    Py_INCREF(flag);
    PyTuple_SET_ITEM(spec.ptr(), 0, flag);
    for (size_t i = 0; i < kids.size(); ++i) {
      PyObject* cp = PyLong_FromUnsignedLong(kids[i].cp);
      if (cp == nullptr) throw nb::python_error();
      PyTuple_SET_ITEM(spec.ptr(), static_cast<Py_ssize_t>(1 + 2 * i), cp);
      Py_INCREF(kids[i].name);
      PyTuple_SET_ITEM(spec.ptr(), static_cast<Py_ssize_t>(2 + 2 * i), kids[i].name);
    }
    // What KeyNode(spec) does, without running its __init__: allocate, then set the slot
    // (the generic setattr, past the frozen dataclass's __setattr__).
    PyTypeObject* type = reinterpret_cast<PyTypeObject*>(cls_.ptr());
    nb::object node = nb::steal(type->tp_alloc(type, 0));
    if (!node.is_valid() || PyObject_GenericSetAttr(node.ptr(), spec_name(), spec.ptr()) != 0) {
      throw nb::python_error();
    }
    return node;
  }

  static PyObject* spec_name() {
    static PyObject* name = PyUnicode_InternFromString("_spec");  // interned for the process
    return name;
  }

  nb::dict rules_;
  nb::object cls_;
  nb::object leaf_;
  int64_t max_rules_;
  // This builder's mark on the nodes it added. Ids are never reused, so if the process table is
  // emptied meanwhile (another thread clearing the caches), later nodes get new rules and the
  // ones already here stay valid (the rules dict keeps their names alive).
  uint64_t serial_;
  NodeKey key_;
};

}  // namespace

void register_grammar_key_trie(nb::module_& m) {
  nb::class_<KeyTrieBuilder>(m, "KeyTrieBuilder",
                             "The key-trie rules of one grammar (json_schema_key_trie.NativeComplementKeys).")
      .def(nb::init<nb::dict, nb::object, nb::object, int64_t>(), nb::arg("rules"), nb::arg("node_cls"),
           nb::arg("leaf_body"), nb::arg("max_rules"))
      .def("start", &KeyTrieBuilder::start, nb::arg("names"),
           "The start rule's name for keys outside ``names`` (sorted, distinct), its nodes added to "
           "``rules``; None when that would exceed ``max_rules`` rules.");
  m.def(
      "clear_key_tries", [] { node_table().clear(); },
      "Forget the process-wide key-trie nodes (the next grammars build theirs cold).");
  m.def(
      "key_trie_nodes", [] { return node_table().size(); },
      "How many key-trie nodes the process-wide table holds.");
}

}  // namespace agent_infer
