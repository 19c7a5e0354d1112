// Serialization of IR grammars (agent_infer/grammar/ir/) to the flat per-rule programs of
// grammar/ir/program.h (enum Op): the one serializer on the compile path (compile/serialize.py),
// without a Python call per node. Anything it does not take as is (a node type outside NODE_KINDS,
// a literal with a lone surrogate, an unknown rule name, repeat bounds beyond int32, a non-tuple
// item list) makes it return None; the caller then rebuilds the grammar from the declared node
// kinds, or raises the precise error, and calls it again. Key-trie nodes (KeyNode, KeySet in
// ir/nodes.py) hold only a spec; write_key_node writes the words of the alternation a KeyNode
// stands for. tests/support/python_serializer.py writes the same programs, as the tests' oracle.
//
// ``serialize_packed`` keeps the programs native (SerializedRules) for ``compile_serialized``: a
// Kubernetes schema's ~90k program words never become Python ints (converting them costs about
// as much as the walk itself, once out of the serializer and once back into the compiler).
//
// serialize_all also takes the IR it walked out of the cyclic garbage collector's sight
// (PyObject_GC_UnTrack), as CPython does for tuples and dicts that can hold no cycle: nodes of
// the exact IR classes are immutable trees (only bool and int-tuple caches are set afterwards),
// so reference counting alone frees them. Grammars are built with collection paused
// (gc_pause.py); without this the first collection after a compile walks every node of the
// grammar: ~8,000 objects, up to a millisecond, on a Kubernetes schema.
#include <nanobind/nanobind.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "grammar/ir/body_cache.h"
#include "grammar/ir/program.h"
#include "grammar/ir/serialize.h"
#include "grammar/ir/span_map.h"
#include "grammar/item_map.h"

namespace agent_infer::ir_serialize {
namespace {

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

class Serializer {
 public:
  Serializer(const Kinds& kinds, PyObject* index) : k_(kinds), index_(index) {}

  // Record the objects emit() walks, for untrack_walked().
  void record_walked() { record_ = true; }

  // Untracks every node (and item tuple) the successful emit() calls walked; false (nothing
  // untracked) when one of them may hold something other than IR (a rule name that is not a str).
  bool untrack_walked() {
    if (!acyclic_) return false;
    for (PyObject* o : walked_) {
      if (PyObject_IS_GC(o)) PyObject_GC_UnTrack(o);  // untracking an untracked object is a no-op
    }
    return true;
  }

  // Appends the program of ``node`` to programs[rule]; false: the Python path must decide.
  bool emit(PyObject* root, uint32_t rule, std::vector<Program>& programs) {
    // Written into one reused buffer, then copied out at its exact size: a rule's program grown
    // in place paid several reallocations, and the work stack one allocation per rule.
    if (!emit_into(root, rule, programs)) return false;
    programs[rule].assign(out_.begin(), out_.end());
    return true;
  }

 private:
  // Work items: a node to write, or (finish != nullptr) the end of a composite node's span.
  struct Item {
    PyObject* node;
    PyObject* finish;
    uint32_t start;
  };

  bool emit_into(PyObject* root, uint32_t rule, const std::vector<Program>& programs) {
    const Names& nm = names();
    Program& out = out_;
    out.clear();
    std::vector<Item>& stack = stack_;
    stack.clear();
    // A node written before (shared IR objects) is copied from its first span; resize first, then
    // copy: the source may be ``out`` itself (an earlier part of it).
    auto copy_span = [&](const Span s) {
      const size_t at = out.size();
      out.resize(at + (s.end - s.start));
      const Program& from = s.rule == rule ? out : programs[s.rule];
      std::copy(from.begin() + s.start, from.begin() + s.end, out.begin() + static_cast<std::ptrdiff_t>(at));
    };
    stack.push_back({root, nullptr, 0});
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
        if (record_) walked_.push_back(node);
        Owned text(PyObject_GetAttr(node, nm.text));
        if (text.p == nullptr || !PyUnicode_Check(text.p)) return fail();
        if (!PyUnicode_CheckExact(text.p)) acyclic_ = false;
        Py_ssize_t size = 0;
        const char* data = PyUnicode_AsUTF8AndSize(text.p, &size);
        if (data == nullptr) return fail();  // a lone surrogate: the Python path raises
        out.push_back(grammar::kLiteral);
        out.push_back(static_cast<int32_t>(size));
        for (Py_ssize_t i = 0; i < size; ++i) out.push_back(static_cast<unsigned char>(data[i]));
      } else if (type == k_.ref) {
        if (record_) walked_.push_back(node);
        Owned name(PyObject_GetAttr(node, nm.name));
        if (name.p == nullptr) return fail();
        if (!PyUnicode_CheckExact(name.p)) acyclic_ = false;
        PyObject* i = PyDict_GetItemWithError(index_, name.p);  // borrowed
        if (i == nullptr) return fail();
        long v = PyLong_AsLong(i);
        if (v == -1 && PyErr_Occurred()) return fail();
        out.push_back(grammar::kRef);
        out.push_back(static_cast<int32_t>(v));
      } else if (type == k_.cls) {
        // Classes are shared nodes too (encoded edge heads, hex digits): the first write is
        // copied from then on instead of read, sorted and merged again.
        if (const Span* hit = spans_.find(node)) {
          copy_span(*hit);
          continue;
        }
        if (record_) walked_.push_back(node);
        const uint32_t start = static_cast<uint32_t>(out.size());
        if (!write_class(node, out)) return fail();
        spans_.insert(node, Span{rule, start, static_cast<uint32_t>(out.size())});
      } else if (type == k_.empty) {
        if (record_) walked_.push_back(node);
        out.push_back(grammar::kEmpty);
      } else if (type == k_.key_node && k_.key_node != nullptr) {
        const int done = write_key_node(node, out);
        if (done < 0) return fail();
        if (done == 0) {
          // A child that is not plain printable ASCII: its edge needs escapes, so the node's own
          // branches (complement_keys._node_body, cached on the node) are written as an Alt.
          Owned items(PyObject_GetAttr(node, nm.items));
          if (items.p == nullptr || !PyTuple_CheckExact(items.p)) return fail();
          Py_ssize_t n = PyTuple_GET_SIZE(items.p);
          out.push_back(grammar::kAlt);
          out.push_back(static_cast<int32_t>(n));
          // The node keeps its items tuple (and so every item) alive.
          for (Py_ssize_t i = n - 1; i >= 0; --i) stack.push_back({PyTuple_GET_ITEM(items.p, i), nullptr, 0});
        }
      } else if (type == k_.unique && k_.unique != nullptr) {
        // Only as a whole rule body (UNIQUE's contract); nested, the Python path reports it.
        if (node != root) return fail();
        if (record_) walked_.push_back(node);
        Owned item(PyObject_GetAttr(node, nm.item));
        if (item.p == nullptr) return fail();
        out.push_back(grammar::kUnique);
        stack.push_back({item.p, nullptr, 0});  // kept alive by the node
      } else if (type == k_.bounded && k_.bounded != nullptr) {
        // Only as a whole rule body (MAX_LENGTH's contract); nested, the Python path reports it.
        if (node != root) return fail();
        if (record_) walked_.push_back(node);
        Owned item(PyObject_GetAttr(node, nm.item));
        Owned n(PyObject_GetAttr(node, nm.max_length));
        if (item.p == nullptr || n.p == nullptr) return fail();
        int64_t max_length = 0;
        if (!bound(n.p, max_length)) return fail();
        out.push_back(grammar::kMaxLength);
        out.push_back(static_cast<int32_t>(max_length));
        stack.push_back({item.p, nullptr, 0});  // kept alive by the node
      } else if (type == k_.key_set && k_.key_set != nullptr) {
        // Only as a whole rule body (KEY_TRIE's contract); nested, the Python path expands it.
        if (node != root || !write_key_set(node, out)) return fail();
        if (record_) walked_.push_back(node);  // its names: a tuple of str, untracked with it below
      } else if (type == k_.check && k_.check != nullptr) {
        // Only as a whole rule body (CHECK's contract); nested, the Python path raises.
        if (node != root || !write_check(node, out)) return fail();
        if (record_) walked_.push_back(node);
      } else if (type == k_.seq || type == k_.alt || type == k_.repeat) {
        if (const Span* hit = spans_.find(node)) {
          copy_span(*hit);
          continue;
        }
        if (record_) walked_.push_back(node);
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
          if (record_) walked_.push_back(items.p);  // kept alive by the node
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

  // The program json_schema.keys.complement_keys._node_body gives a trie node whose children are all plain
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
    // The gaps between the children (and around them), cut to plain ASCII: json_schema.keys.complement_keys.plain_part.
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

  // KEY_TRIE from a KeySet's names (a tuple of str, each plain printable ASCII; grammar/ir/program.h), with
  // the char-key-free and char-key-rest rules it calls. false: malformed, or a rule is missing.
  bool write_key_set(PyObject* node, Program& out) {
    const Names& nm = names();
    Owned names_tuple(PyObject_GetAttr(node, nm.key_names));
    if (names_tuple.p == nullptr || !PyTuple_CheckExact(names_tuple.p)) return false;
    if (record_) walked_.push_back(names_tuple.p);  // kept alive by the node
    if (free_ < 0) {
      free_ = rule_index(nm.free_rule);
      rest_ = rule_index(nm.sink_rule);
      if (free_ < 0 || rest_ < 0) return false;
    }
    const Py_ssize_t count = PyTuple_GET_SIZE(names_tuple.p);
    const size_t head = out.size();
    out.insert(out.end(), {grammar::kKeyTrie, 0, static_cast<int32_t>(free_), static_cast<int32_t>(rest_),
                           static_cast<int32_t>(count)});
    for (Py_ssize_t i = 0; i < count; ++i) {
      PyObject* name = PyTuple_GET_ITEM(names_tuple.p, i);
      if (!PyUnicode_CheckExact(name) || PyUnicode_KIND(name) != PyUnicode_1BYTE_KIND) return false;
      const Py_ssize_t len = PyUnicode_GET_LENGTH(name);
      const Py_UCS1* data = PyUnicode_1BYTE_DATA(name);
      out.push_back(static_cast<int32_t>(len));
      for (Py_ssize_t j = 0; j < len; ++j) {
        if (!plain_cp(data[j])) return false;
        out.push_back(data[j]);
      }
    }
    if (out.size() - head - 2 > static_cast<size_t>(INT32_MAX)) return false;
    out[head + 1] = static_cast<int32_t>(out.size() - head - 2);
    return true;
  }

  // CHECK from a Check's items (a tuple of Ref), carriers and accepted signatures (grammar/ir/
  // program.h). false: malformed (the Python path raises the precise error), or a rule is missing.
  bool write_check(PyObject* node, Program& out) {
    const Names& nm = names();
    Owned items(PyObject_GetAttr(node, nm.items));
    Owned carriers(PyObject_GetAttr(node, nm.carriers));
    Owned accept(PyObject_GetAttr(node, nm.accept));
    Owned product(PyObject_GetAttr(node, nm.product));
    if (items.p == nullptr || carriers.p == nullptr || accept.p == nullptr || product.p == nullptr ||
        !PyTuple_CheckExact(items.p) || !PyTuple_CheckExact(accept.p) || !PyLong_CheckExact(carriers.p) ||
        !PyBool_Check(product.p)) {
      return false;
    }
    if (record_) walked_.push_back(items.p);
    const Py_ssize_t n = PyTuple_GET_SIZE(items.p);
    const long c = PyLong_AsLong(carriers.p);
    if (n < 1 || n > 16 || c < 1 || c > n) return false;
    const Py_ssize_t count = PyTuple_GET_SIZE(accept.p);
    const int32_t flags = product.p == Py_True ? grammar::kCheckProduct : 0;
    out.insert(out.end(), {grammar::kCheck, static_cast<int32_t>(3 + count + n), static_cast<int32_t>(n),
                           static_cast<int32_t>(c) | flags, static_cast<int32_t>(count)});
    long prev = -1;
    for (Py_ssize_t i = 0; i < count; ++i) {
      PyObject* v = PyTuple_GET_ITEM(accept.p, i);
      if (!PyLong_CheckExact(v)) return false;
      const long sig = PyLong_AsLong(v);
      if (sig <= prev || sig >= (1L << n)) return false;
      prev = sig;
      out.push_back(static_cast<int32_t>(sig));
    }
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* item = PyTuple_GET_ITEM(items.p, i);
      if (reinterpret_cast<PyObject*>(Py_TYPE(item)) != k_.ref) return false;
      if (record_) walked_.push_back(item);
      Owned name(PyObject_GetAttr(item, nm.name));
      if (name.p == nullptr) return false;
      const int64_t rule = rule_index(name.p);
      if (rule < 0) return false;
      out.push_back(static_cast<int32_t>(rule));
    }
    return true;
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
    if (!PyBool_Check(negated.p)) acyclic_ = false;
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
  Program out_;
  std::vector<Item> stack_;
  std::vector<std::pair<int64_t, int64_t>> pairs_, merged_;
  std::vector<long> cps_;
  int64_t special_ = -1, sink_ = -1;  // rule indices, looked up at the first key-trie node
  int64_t free_ = -1, rest_ = -1;     // likewise at the first KeySet
  bool record_ = false;
  bool acyclic_ = true;
  std::vector<PyObject*> walked_;  // borrowed: the grammar keeps them alive during the call
};

bool is_ir_node(const Kinds& k, PyObject* o) {
  PyObject* t = reinterpret_cast<PyObject*>(Py_TYPE(o));
  return t == k.literal || t == k.ref || t == k.seq || t == k.alt || t == k.repeat || t == k.cls || t == k.empty ||
         (k.key_node != nullptr && t == k.key_node) || (k.key_set != nullptr && t == k.key_set) ||
         (k.unique != nullptr && t == k.unique) || (k.bounded != nullptr && t == k.bounded) ||
         (k.check != nullptr && t == k.check);
}

}  // namespace

// Programs of all rules; the bodies of rules named ``shared_prefix``... go through the body cache.
std::optional<SerializedRules> serialize_all(nb::list bodies, nb::dict index, nb::tuple kinds,
                                             std::optional<nb::str> shared_prefix,
                                             std::optional<nb::tuple> untrack_pairs) {
  const Kinds k = kinds_from(kinds, "serialize_packed");
  size_t n = bodies.size();
  SerializedRules out;
  out.programs.resize(n);
  Serializer ser(k, index.ptr());
  if (untrack_pairs.has_value()) ser.record_walked();
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
    // Key tries and their nodes are written from their names or spec: no dearer than a cache hit.
    const PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(body));
    const bool cached = !shared.empty() && shared[r] != 0 && type != k.key_node && type != k.key_set &&
                         type != k.unique && type != k.bounded && type != k.check;
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
  if (untrack_pairs.has_value() && ser.untrack_walked()) {
    // The (name, body) pairs: a str and a body of an exact IR class (every body was serialized,
    // walked or written from the cache of shared IR constants).
    PyObject* pairs = untrack_pairs->ptr();
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(pairs); ++i) {
      PyObject* pair = PyTuple_GET_ITEM(pairs, i);
      if (PyTuple_CheckExact(pair) && PyTuple_GET_SIZE(pair) == 2 && PyUnicode_CheckExact(PyTuple_GET_ITEM(pair, 0)) &&
          is_ir_node(k, PyTuple_GET_ITEM(pair, 1))) {
        PyObject_GC_UnTrack(pair);
      }
    }
  }
  return out;
}

std::optional<std::vector<Program>> serialize_rules(nb::list bodies, nb::dict index, nb::tuple kinds) {
  const Kinds k = kinds_from(kinds, "serialize_rules");
  size_t n = bodies.size();
  std::vector<Program> programs(n);
  Serializer ser(k, index.ptr());
  for (size_t r = 0; r < n; ++r) {
    PyObject* body = PyList_GET_ITEM(bodies.ptr(), static_cast<Py_ssize_t>(r));
    if (!ser.emit(body, static_cast<uint32_t>(r), programs)) return std::nullopt;
  }
  return programs;
}

}  // namespace agent_infer::ir_serialize
