// Serialization of IR grammars (agent_infer/grammar/ir.py) to the flat per-rule programs of
// grammar.h (enum Op), the work of agent_infer.grammar.compiler.serialize_grammar done without a
// Python call per node. It writes exactly what the Python serializer writes; anything it does not
// handle the same way (a foreign node type, a literal with a lone surrogate, an unknown rule name,
// repeat bounds beyond int32, a non-tuple item list) makes it return None, and the caller runs the
// Python serializer, which produces the program or the precise error.
//
// Key-trie nodes (json_schema_key_trie.KeyNode, the 8th node class when the caller passes it)
// hold only a spec; their programs are written from it (write_key_node), the same words the
// Python serializer gives the Alt the node stands for.
//
// ``serialize_packed`` keeps the programs native (SerializedRules) and ``compile_serialized`` lowers
// them from there: a Kubernetes schema's ~90k program words then never become Python ints, which
// cost about as much as the walk itself, once out of the serializer and once back into the compiler.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "bindings.h"
#include "grammar.h"
#include "grammar_body_cache.h"
#include "grammar_key_trie.h"

namespace nb = nanobind;

namespace agent_infer {
namespace {

using Program = std::vector<int32_t>;
constexpr int64_t kMaxCodepoint = 0x10FFFF;
constexpr int64_t kInt32Max = 2147483647;

// Owns one reference; Python C API calls below return new references.
struct Owned {
  PyObject* p = nullptr;
  explicit Owned(PyObject* o) : p(o) {}
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;
  ~Owned() { Py_XDECREF(p); }
};

struct Kinds {
  PyObject* empty;
  PyObject* literal;
  PyObject* cls;
  PyObject* seq;
  PyObject* alt;
  PyObject* repeat;
  PyObject* ref;
  PyObject* key_node = nullptr;  // json_schema_key_trie.KeyNode, when the caller passes it
};

// The IR node classes in the order compiler._KINDS lists them (7, or 8 with KeyNode).
Kinds kinds_from(const nb::tuple& kinds, const char* who) {
  const size_t n = kinds.size();
  if (n != 7 && n != 8) throw std::invalid_argument(std::string(who) + " needs the 7 IR node classes (and KeyNode)");
  PyObject* t = kinds.ptr();
  Kinds k{PyTuple_GET_ITEM(t, 0), PyTuple_GET_ITEM(t, 1), PyTuple_GET_ITEM(t, 2), PyTuple_GET_ITEM(t, 3),
          PyTuple_GET_ITEM(t, 4), PyTuple_GET_ITEM(t, 5), PyTuple_GET_ITEM(t, 6)};
  if (n == 8) k.key_node = PyTuple_GET_ITEM(t, 7);
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
  PyObject* name = PyUnicode_InternFromString("name");
  PyObject* spec = PyUnicode_InternFromString("_spec");
  // json_schema_keys.SPECIAL_RULE and SINK_RULE, which every key-trie node's gap branch calls.
  PyObject* special_rule = PyUnicode_InternFromString("char-special");
  PyObject* sink_rule = PyUnicode_InternFromString("char-key-rest");
};

const Names& names() {
  static const Names* n = new Names();  // interned for the process, never freed
  return *n;
}

// Where a composite node's first occurrence was written: rule, start, end.
struct Span {
  uint32_t rule;
  uint32_t start;
  uint32_t end;
};

// Spans by node address, open addressing in flat arrays: a big grammar has ~2*10^4 composite
// nodes, and a node-based map paid an allocation and a free for each.
class SpanMap {
 public:
  SpanMap() : keys_(1024, nullptr), vals_(1024) {}

  const Span* find(PyObject* key) const {
    for (size_t i = slot(key);; i = (i + 1) & (keys_.size() - 1)) {
      if (keys_[i] == key) return &vals_[i];
      if (keys_[i] == nullptr) return nullptr;
    }
  }

  // Keeps the first span of a key inserted twice (as emplace did).
  void insert(PyObject* key, Span span) {
    if (2 * (count_ + 1) > keys_.size()) grow();
    size_t i = slot(key);
    while (keys_[i] != nullptr) {
      if (keys_[i] == key) return;
      i = (i + 1) & (keys_.size() - 1);
    }
    keys_[i] = key;
    vals_[i] = span;
    ++count_;
  }

 private:
  size_t slot(PyObject* key) const {
    uint64_t x = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(key)) * 0x9E3779B97F4A7C15ull;
    return static_cast<size_t>(x >> 20) & (keys_.size() - 1);
  }

  void grow() {
    std::vector<PyObject*> keys(keys_.size() * 2, nullptr);
    std::vector<Span> vals(keys.size());
    keys.swap(keys_);
    vals.swap(vals_);
    count_ = 0;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (keys[i] != nullptr) insert(keys[i], vals[i]);
    }
  }

  std::vector<PyObject*> keys_;
  std::vector<Span> vals_;
  size_t count_ = 0;
};

class Serializer {
 public:
  Serializer(const Kinds& kinds, PyObject* index) : k_(kinds), index_(index) {}

  // Appends the program of ``node`` to programs[rule]; false: the Python path must decide.
  bool emit(PyObject* root, uint32_t rule, std::vector<Program>& programs) {
    const Names& nm = names();
    Program& out = programs[rule];
    // Work items: a node to write, or (finish != nullptr) the end of a composite node's span.
    struct Item {
      PyObject* node;
      PyObject* finish;
      uint32_t start;
    };
    std::vector<Item> stack{{root, nullptr, 0}};
    std::vector<PyObject*> kids;
    while (!stack.empty()) {
      Item it = stack.back();
      stack.pop_back();
      if (it.finish != nullptr) {
        spans_.insert(it.finish, Span{rule, it.start, static_cast<uint32_t>(out.size())});
        continue;
      }
      PyObject* node = it.node;
      PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(node));
      if (type == k_.literal) {
        Owned text(PyObject_GetAttr(node, nm.text));
        if (text.p == nullptr || !PyUnicode_Check(text.p)) return fail();
        Py_ssize_t size = 0;
        const char* data = PyUnicode_AsUTF8AndSize(text.p, &size);
        if (data == nullptr) return fail();  // a lone surrogate: the Python path raises
        out.push_back(grammar::kLiteral);
        out.push_back(static_cast<int32_t>(size));
        for (Py_ssize_t i = 0; i < size; ++i) out.push_back(static_cast<unsigned char>(data[i]));
      } else if (type == k_.ref) {
        Owned name(PyObject_GetAttr(node, nm.name));
        if (name.p == nullptr) return fail();
        PyObject* i = PyDict_GetItemWithError(index_, name.p);  // borrowed
        if (i == nullptr) return fail();
        long v = PyLong_AsLong(i);
        if (v == -1 && PyErr_Occurred()) return fail();
        out.push_back(grammar::kRef);
        out.push_back(static_cast<int32_t>(v));
      } else if (type == k_.cls) {
        if (!write_class(node, out)) return fail();
      } else if (type == k_.empty) {
        out.push_back(grammar::kEmpty);
      } else if (type == k_.key_node && k_.key_node != nullptr) {
        const int done = write_key_node(node, out);
        if (done < 0) return fail();
        if (done == 0) {
          // A child that is not plain printable ASCII: its edge needs escapes, so the node's own
          // branches (json_schema_keys._node_body, cached on the node) are written as an Alt.
          Owned items(PyObject_GetAttr(node, nm.items));
          if (items.p == nullptr || !PyTuple_CheckExact(items.p)) return fail();
          Py_ssize_t n = PyTuple_GET_SIZE(items.p);
          out.push_back(grammar::kAlt);
          out.push_back(static_cast<int32_t>(n));
          // The node keeps its items tuple (and so every item) alive.
          for (Py_ssize_t i = n - 1; i >= 0; --i) stack.push_back({PyTuple_GET_ITEM(items.p, i), nullptr, 0});
        }
      } else if (type == k_.seq || type == k_.alt || type == k_.repeat) {
        if (const Span* hit = spans_.find(node)) {
          const Span s = *hit;
          // Resize first, then copy: the source may be ``out`` itself (an earlier part of it).
          size_t at = out.size();
          out.resize(at + (s.end - s.start));
          const Program& from = programs[s.rule];
          std::copy(from.begin() + s.start, from.begin() + s.end, out.begin() + static_cast<std::ptrdiff_t>(at));
          continue;
        }
        uint32_t start = static_cast<uint32_t>(out.size());
        stack.push_back({nullptr, node, start});
        if (type == k_.repeat) {
          Owned lo(PyObject_GetAttr(node, nm.min));
          Owned hi(PyObject_GetAttr(node, nm.max));
          Owned item(PyObject_GetAttr(node, nm.item));
          if (lo.p == nullptr || hi.p == nullptr || item.p == nullptr) return fail();
          int64_t min = 0, max = -1;
          if (!bound(lo.p, min)) return fail();
          if (hi.p != Py_None && !bound(hi.p, max)) return fail();
          out.push_back(grammar::kRepeat);
          out.push_back(static_cast<int32_t>(min));
          out.push_back(static_cast<int32_t>(max));
          stack.push_back({item.p, nullptr, 0});  // kept alive by the node
        } else {
          Owned items(PyObject_GetAttr(node, nm.items));
          if (items.p == nullptr || !PyTuple_CheckExact(items.p)) return fail();
          Py_ssize_t n = PyTuple_GET_SIZE(items.p);
          out.push_back(type == k_.seq ? grammar::kSeq : grammar::kAlt);
          out.push_back(static_cast<int32_t>(n));
          for (Py_ssize_t i = n - 1; i >= 0; --i) stack.push_back({PyTuple_GET_ITEM(items.p, i), nullptr, 0});
        }
      } else {
        return fail();  // subclasses and foreign nodes
      }
    }
    return true;
  }

 private:
  bool fail() {
    PyErr_Clear();
    return false;
  }

  // The rule index of ``name``; -1 (Python error set or not) when it has none.
  int64_t rule_index(PyObject* name) {
    PyObject* i = PyDict_GetItemWithError(index_, name);  // borrowed
    if (i == nullptr) return -1;
    long v = PyLong_AsLong(i);
    return (v == -1 && PyErr_Occurred()) ? -1 : v;
  }

  static bool plain_cp(long cp) { return cp >= 0x20 && cp <= 0x7E && cp != 0x22 && cp != 0x2F && cp != 0x5C; }

  // The program json_schema_keys._node_body gives a trie node whose children are all plain
  // printable ASCII (so the gap branch comes first and holds every special code point):
  //   gap:   Seq((Alt((CharClass(<plain part of the gaps>), Ref(char-special))), Ref(char-key-rest)))
  //   edges: Seq((CharClass(((cp, cp),)), Ref(child))) per child, in code point order
  //   then Empty unless the node ends a name.
  // 1 written, 0 not such a node (nothing written), -1 malformed.
  int write_key_node(PyObject* node, Program& out) {
    const Names& nm = names();
    Owned spec(PyObject_GetAttr(node, nm.spec));
    if (spec.p == nullptr || !PyTuple_CheckExact(spec.p)) return -1;
    const Py_ssize_t size = PyTuple_GET_SIZE(spec.p);
    if (size < 1 || size % 2 != 1) return -1;
    const int ends = PyObject_IsTrue(PyTuple_GET_ITEM(spec.p, 0));
    if (ends < 0) return -1;
    const Py_ssize_t n = (size - 1) / 2;
    cps_.clear();
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* v = PyTuple_GET_ITEM(spec.p, 1 + 2 * i);
      if (!PyLong_CheckExact(v)) return -1;
      long cp = PyLong_AsLong(v);
      if (cp == -1 && PyErr_Occurred()) return -1;
      if (!plain_cp(cp) || (!cps_.empty() && cp <= cps_.back())) return 0;
      cps_.push_back(cp);
    }
    if (special_ < 0) {
      special_ = rule_index(nm.special_rule);
      sink_ = rule_index(nm.sink_rule);
      if (special_ < 0 || sink_ < 0) return -1;
    }
    // The gaps between the children (and around them), cut to plain ASCII: _plain_part.
    merged_.clear();
    auto add_plain = [&](int64_t lo, int64_t hi) {
      if (hi < 0x20 || lo > 0x7E) return;
      lo = std::max<int64_t>(lo, 0x20);
      hi = std::min<int64_t>(hi, 0x7E);
      for (int64_t x : {0x22, 0x2F, 0x5C}) {
        if (lo <= x && x <= hi) {
          if (lo < x) push_merged(lo, x - 1);
          lo = x + 1;
        }
      }
      if (lo <= hi) push_merged(lo, hi);
    };
    int64_t next = 0;
    for (long cp : cps_) {
      if (cp > next) add_plain(next, cp - 1);
      next = cp + 1;
    }
    add_plain(next, kMaxCodepoint);
    out.push_back(grammar::kAlt);
    out.push_back(static_cast<int32_t>(1 + n + (ends != 0 ? 0 : 1)));
    out.push_back(grammar::kSeq);
    out.push_back(2);
    if (!merged_.empty()) {
      out.push_back(grammar::kAlt);
      out.push_back(2);
      out.push_back(grammar::kClass);
      out.push_back(static_cast<int32_t>(merged_.size()));
      for (const auto& [lo, hi] : merged_) {
        out.push_back(static_cast<int32_t>(lo));
        out.push_back(static_cast<int32_t>(hi));
      }
    }
    out.push_back(grammar::kRef);
    out.push_back(static_cast<int32_t>(special_));
    out.push_back(grammar::kRef);
    out.push_back(static_cast<int32_t>(sink_));
    for (Py_ssize_t i = 0; i < n; ++i) {
      const int64_t child = rule_index(PyTuple_GET_ITEM(spec.p, 2 + 2 * i));
      if (child < 0) return -1;
      const int32_t cp = static_cast<int32_t>(cps_[static_cast<size_t>(i)]);
      out.insert(out.end(), {grammar::kSeq, 2, grammar::kClass, 1, cp, cp, grammar::kRef, static_cast<int32_t>(child)});
    }
    if (ends == 0) out.push_back(grammar::kEmpty);
    return 1;
  }

  // Appends [lo, hi] to merged_, joined with the last range when adjacent (CharClass.normalized).
  void push_merged(int64_t lo, int64_t hi) {
    if (!merged_.empty() && lo <= merged_.back().second + 1) {
      merged_.back().second = std::max(merged_.back().second, hi);
    } else {
      merged_.emplace_back(lo, hi);
    }
  }

  static bool bound(PyObject* v, int64_t& out) {
    if (!PyLong_CheckExact(v)) return false;
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow != 0 || (x == -1 && PyErr_Occurred()) || x < 0 || x > kInt32Max) return false;
    out = x;
    return true;
  }

  // CharClass.normalized(): sorted, merged, complemented when negated.
  bool write_class(PyObject* node, Program& out) {
    const Names& nm = names();
    Owned ranges(PyObject_GetAttr(node, nm.ranges));
    Owned negated(PyObject_GetAttr(node, nm.negated));
    if (ranges.p == nullptr || negated.p == nullptr || !PyTuple_CheckExact(ranges.p)) return false;
    int neg = PyObject_IsTrue(negated.p);
    if (neg < 0) return false;
    pairs_.clear();
    Py_ssize_t n = PyTuple_GET_SIZE(ranges.p);
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* pr = PyTuple_GET_ITEM(ranges.p, i);
      if (!PyTuple_CheckExact(pr) || PyTuple_GET_SIZE(pr) != 2) return false;
      int64_t lo = 0, hi = 0;
      if (!codepoint(PyTuple_GET_ITEM(pr, 0), lo) || !codepoint(PyTuple_GET_ITEM(pr, 1), hi)) return false;
      pairs_.emplace_back(lo, hi);
    }
    std::sort(pairs_.begin(), pairs_.end());
    merged_.clear();
    for (const auto& [lo, hi] : pairs_) {
      if (!merged_.empty() && lo <= merged_.back().second + 1) {
        merged_.back().second = std::max(merged_.back().second, hi);
      } else {
        merged_.emplace_back(lo, hi);
      }
    }
    if (neg != 0) {
      pairs_.clear();
      int64_t next = 0;
      for (const auto& [lo, hi] : merged_) {
        if (lo > next) pairs_.emplace_back(next, lo - 1);
        next = hi + 1;
      }
      if (next <= kMaxCodepoint) pairs_.emplace_back(next, kMaxCodepoint);
      merged_.swap(pairs_);
    }
    out.push_back(grammar::kClass);
    out.push_back(static_cast<int32_t>(merged_.size()));
    for (const auto& [lo, hi] : merged_) {
      out.push_back(static_cast<int32_t>(lo));
      out.push_back(static_cast<int32_t>(hi));
    }
    return true;
  }

  static bool codepoint(PyObject* v, int64_t& out) {
    if (!PyLong_CheckExact(v)) return false;
    long x = PyLong_AsLong(v);
    if (x == -1 && PyErr_Occurred()) return false;
    if (x < 0 || x > kMaxCodepoint) return false;
    out = x;
    return true;
  }

  const Kinds& k_;
  PyObject* index_;
  SpanMap spans_;
  std::vector<std::pair<int64_t, int64_t>> pairs_, merged_;
  std::vector<long> cps_;
  int64_t special_ = -1, sink_ = -1;  // rule indices, looked up at the first key-trie node
};

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
    if (type == k.seq || type == k.alt || type == k.repeat) return 3;
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

// Grammar validation's walk (ir.py, _undefined_ref): rules in order, each pre-order with the last
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
      } else if (type == k.seq || type == k.alt) {
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

// Rule programs kept on the native side between serialization and compilation.
struct SerializedRules {
  std::vector<Program> programs;
};

// Programs of all rules; the bodies of rules named ``shared_prefix``... go through the body cache.
std::optional<SerializedRules> serialize_all(nb::list bodies, nb::dict index, nb::tuple kinds,
                                             std::optional<nb::str> shared_prefix) {
  const Kinds k = kinds_from(kinds, "serialize_packed");
  size_t n = bodies.size();
  SerializedRules out;
  out.programs.resize(n);
  Serializer ser(k, index.ptr());
  // Rule index -> name (borrowed from ``index``), and which rules' bodies are process-wide.
  std::vector<PyObject*> rule_names;
  std::vector<uint8_t> shared;
  if (shared_prefix.has_value() && PyDict_Size(index.ptr()) == static_cast<Py_ssize_t>(n)) {
    rule_names.assign(n, nullptr);
    shared.assign(n, 0);
    PyObject* prefix = shared_prefix->ptr();
    Py_ssize_t pos = 0;
    PyObject *name = nullptr, *value = nullptr;
    while (PyDict_Next(index.ptr(), &pos, &name, &value)) {
      long r = PyLong_AsLong(value);
      if (r < 0 || static_cast<size_t>(r) >= n || !PyUnicode_Check(name)) {
        PyErr_Clear();
        return std::nullopt;
      }
      rule_names[static_cast<size_t>(r)] = name;
      int starts = static_cast<int>(PyUnicode_Tailmatch(name, prefix, 0, PY_SSIZE_T_MAX, -1));
      if (starts < 0) {
        PyErr_Clear();
        return std::nullopt;
      }
      shared[static_cast<size_t>(r)] = static_cast<uint8_t>(starts);
    }
    for (PyObject* name : rule_names) {
      if (name == nullptr) return std::nullopt;  // two names for one index: the Python path decides
    }
  }
  BodyCache& cache = body_cache();
  std::vector<std::pair<uint32_t, PyObject*>> refs;
  for (size_t r = 0; r < n; ++r) {
    PyObject* body = PyList_GET_ITEM(bodies.ptr(), static_cast<Py_ssize_t>(r));
    // Key-trie nodes are written from their spec, which costs no more than a cache hit.
    const bool cached = !shared.empty() && shared[r] != 0 && reinterpret_cast<PyObject*>(Py_TYPE(body)) != k.key_node;
    if (cached) {
      if (const CachedBody* hit = cache.find(body)) {
        if (!cache.write(*hit, index.ptr(), out.programs[r])) {
          PyErr_Clear();
          return std::nullopt;  // a rule this body calls is missing: the Python path reports it
        }
        continue;
      }
    }
    if (!ser.emit(body, static_cast<uint32_t>(r), out.programs)) return std::nullopt;
    if (cached) {
      refs.clear();
      if (find_refs(out.programs[r], rule_names, refs)) cache.insert(body, out.programs[r], refs);
    }
  }
  return out;
}

}  // namespace

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
  m.def("serialize_packed", &serialize_all, nb::arg("bodies"), nb::arg("index"), nb::arg("kinds"),
        nb::arg("shared_prefix").none() = nb::none(),
        "serialize_rules, with the programs kept native (SerializedRules); None where the Python "
        "serializer must decide. Bodies of rules whose names start with ``shared_prefix`` are IR "
        "objects shared across grammars: their programs are cached by object, indices by name.");

  m.def(
      "compile_serialized",
      [](std::shared_ptr<grammar::TokenizerInfo> tok, const SerializedRules& rules, int32_t root, int64_t max_states,
         double max_seconds, int64_t max_items) {
        const grammar::Limits lim = grammar::Limits::from_args(max_states, max_seconds, max_items);
        nb::gil_scoped_release release;
        return std::make_shared<grammar::CompiledGrammar>(std::move(tok), rules.programs, root, lim);
      },
      nb::arg("tokenizer"), nb::arg("rules"), nb::arg("root"), nb::arg("max_states"), nb::arg("max_seconds"),
      nb::arg("max_items"), "CompiledGrammar(tokenizer, rules, ...) from SerializedRules.");


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
      [](nb::list bodies, nb::dict index, nb::tuple kinds) -> std::optional<std::vector<Program>> {
        const Kinds k = kinds_from(kinds, "serialize_rules");
        size_t n = bodies.size();
        std::vector<Program> programs(n);
        Serializer ser(k, index.ptr());
        for (size_t r = 0; r < n; ++r) {
          PyObject* body = PyList_GET_ITEM(bodies.ptr(), static_cast<Py_ssize_t>(r));
          if (!ser.emit(body, static_cast<uint32_t>(r), programs)) return std::nullopt;
        }
        return programs;
      },
      nb::arg("bodies"), nb::arg("index"), nb::arg("kinds"),
      "Flat programs of rule bodies (IR nodes) given the rule index; None where the Python "
      "serializer must decide (it writes the same programs and raises the precise errors).");
}

}  // namespace agent_infer
