// Key tries ("any key but these names") built natively: the work of
// agent_infer.grammar.frontends.json_schema.keys.complement_keys.ComplementKeys.start without a Python
// call per trie node.
//
// A Kubernetes schema asks for ~90 tries of ~35 nodes each; interning them in Python would be
// about a third of its front end. Here the trie is built the same way (a minimal acyclic automaton from
// sorted words, Daciuk et al.: nodes interned children first, each child in code point order), so
// the rules arrive in the Python builder's order with the same shapes. A node's rule body is a
// ``KeyNode`` (agent_infer/grammar/ir/nodes.py): an IR node that holds only (ends a name, child code points,
// child rule names) and builds its branches when Python asks for them; grammar/ir/serialize.cpp
// writes its program straight from that spec.
#include "grammar/ir/key_trie.h"

#include <nanobind/nanobind.h>
#include <structmember.h>

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <stdexcept>
#include <utility>
#include <vector>

namespace nb = nanobind;

namespace agent_infer {
namespace {

// A node's identity: whether it ends a name, then (code point, child id) per child.
using NodeKey = std::vector<int64_t>;

uint64_t node_key_hash(const NodeKey& key) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ key.size();
  for (int64_t x : key) {
    h ^= static_cast<uint64_t>(x) + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
  }
  return h;
}

// One interned node: its id (never reused, so names never clash), rule name and rule body, and
// the serial of the last builder that added its rule to its grammar.
struct Node {
  int64_t id;
  PyObject* name;  // owned
  PyObject* body;  // owned
  uint64_t owner = 0;
  uint32_t key_at = 0, key_len = 0;  // the key: NodeTable::keys_[key_at, key_at + key_len)
};

// Nodes by key for the whole process, so the next grammar with an apiVersion/kind/metadata object
// reuses names and bodies; bounded, and emptied by clear_key_tries (clear_grammar_caches).
// Open addressing over one array of nodes and one of key words: a Kubernetes schema interns
// ~1,800 nodes in ~4,300 lookups, where a map of vector keys paid two allocations per node and a
// pointer chase per lookup (a third of this builder's time).
class NodeTable {
 public:
  // The node with ``key`` (``hash`` = node_key_hash(key)), or nullptr. Valid until the next insert.
  Node* find(const NodeKey& key, uint64_t hash) {
    if (slots_.empty()) return nullptr;
    const size_t mask = slots_.size() - 1;
    for (size_t i = hash & mask;; i = (i + 1) & mask) {
      const Slot& slot = slots_[i];
      if (slot.node == 0) return nullptr;
      if (slot.hash != hash) continue;
      Node& node = nodes_[slot.node - 1];
      if (node.key_len == key.size() && std::equal(key.begin(), key.end(), keys_.begin() + node.key_at)) return &node;
    }
  }

  // Takes the references to ``name`` and ``body``. Valid until the next insert.
  Node& insert(const NodeKey& key, uint64_t hash, int64_t id, PyObject* name, PyObject* body) {
    if (nodes_.size() >= kMaxNodes) clear();
    if (2 * (nodes_.size() + 1) > slots_.size()) grow();
    Node node{id, name, body};
    node.key_at = static_cast<uint32_t>(keys_.size());
    node.key_len = static_cast<uint32_t>(key.size());
    keys_.insert(keys_.end(), key.begin(), key.end());
    nodes_.push_back(node);
    place(hash, static_cast<uint32_t>(nodes_.size()));
    return nodes_.back();
  }

  void clear() {
    for (Node& node : nodes_) {
      Py_DECREF(node.name);
      Py_DECREF(node.body);
    }
    nodes_.clear();
    keys_.clear();
    std::fill(slots_.begin(), slots_.end(), Slot{});
  }

  size_t size() const { return nodes_.size(); }
  int64_t next_id() { return next_id_++; }
  uint64_t next_owner() { return ++owners_; }

 private:
  struct Slot {
    uint64_t hash = 0;
    uint32_t node = 0;  // index into nodes_ plus one; 0: empty
  };

  void place(uint64_t hash, uint32_t node) {
    const size_t mask = slots_.size() - 1;
    size_t i = hash & mask;
    while (slots_[i].node != 0) i = (i + 1) & mask;
    slots_[i] = Slot{hash, node};
  }

  void grow() {
    std::vector<Slot> old;
    old.swap(slots_);
    slots_.assign(std::max<size_t>(1024, 2 * old.size()), Slot{});
    for (const Slot& slot : old) {
      if (slot.node != 0) place(slot.hash, slot.node);
    }
  }

  static constexpr size_t kMaxNodes = size_t{1} << 16;
  std::vector<Slot> slots_;  // a power of two, at most half full
  std::vector<Node> nodes_;
  std::vector<int64_t> keys_;
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
        serial_(node_table().next_owner()),
        spec_offset_(slot_offset(cls_.ptr())) {}

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
    const uint64_t hash = node_key_hash(key_);
    Node* node = table.find(key_, hash);
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
      node = &table.insert(key_, hash, id, name.release().ptr(), body.release().ptr());
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
    // The spec holds only a bool, ints and strs: it can be in no reference cycle. CPython
    // untracks such tuples itself, but only in the first collection that visits them, and that
    // collection (the first allocation after the compile's GC pause) would otherwise walk every
    // spec and node of the grammar.
    if (PyObject_IS_GC(spec.ptr())) PyObject_GC_UnTrack(spec.ptr());
    // What KeyNode(spec) does, without running its __init__: allocate, then set the slot
    // (the generic setattr, past the frozen dataclass's __setattr__).
    PyTypeObject* type = reinterpret_cast<PyTypeObject*>(cls_.ptr());
    nb::object node = nb::steal(type->tp_alloc(type, 0));
    if (!node.is_valid()) throw nb::python_error();
    if (spec_offset_ > 0) {
      // The slot's storage, as its member descriptor's setter writes it (tp_alloc zeroed it).
      *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(node.ptr()) + spec_offset_) = spec.release().ptr();
    } else if (PyObject_GenericSetAttr(node.ptr(), spec_name(), spec.ptr()) != 0) {
      throw nb::python_error();
    }
    // Acyclic too: a node refers to its spec and, once Python reads its branches, to IR nodes
    // built from the spec, none of which can refer back to it (IR nodes are immutable trees).
    if (PyObject_IS_GC(node.ptr())) PyObject_GC_UnTrack(node.ptr());
    return node;
  }

  // The offset of the ``_spec`` slot in instances of ``cls`` (a plain object member), or 0: set
  // it through PyObject_GenericSetAttr then.
  static Py_ssize_t slot_offset(PyObject* cls) {
    if (!PyType_Check(cls)) return 0;
    PyObject* d = _PyType_Lookup(reinterpret_cast<PyTypeObject*>(cls), spec_name());  // borrowed
    if (d == nullptr || Py_TYPE(d) != &PyMemberDescr_Type) return 0;
    const PyMemberDef* member = reinterpret_cast<PyMemberDescrObject*>(d)->d_member;
    return (member->type == T_OBJECT_EX && !(member->flags & READONLY)) ? member->offset : 0;
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
  Py_ssize_t spec_offset_;
  NodeKey key_;
};

}  // namespace

void register_grammar_key_trie(nb::module_& m) {
  nb::class_<KeyTrieBuilder>(m, "KeyTrieBuilder",
                             "The key-trie rules of one grammar (json_schema.keys.key_trie.NativeComplementKeys).")
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
