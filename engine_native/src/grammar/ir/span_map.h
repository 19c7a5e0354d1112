// The serializer's span map: where each composite IR node's first occurrence was written, so a
// node met again (IR trees share subtrees) is copied instead of walked. Header-only: every lookup
// is inlined into the serializer's walk (grammar/ir/serialize.cpp).
#pragma once

#include <Python.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace agent_infer::ir_serialize {

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

}  // namespace agent_infer::ir_serialize
