// The process-wide cache of rule programs for IR bodies that front ends share across grammars
// (grammar/ir/serialize.cpp's serialize_packed). Only used with the GIL held.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

namespace agent_infer {

// The program of a rule body that lives for the process (a JSON string character, a key-trie node:
// front ends share those IR objects across grammars), with where its rule indices go. Keyed by the
// body object, which the cache keeps alive (so the address names that immutable tree); the indices
// are written from the rule names, since each grammar numbers its rules itself. Words and
// references live in two arenas, so filling the cache costs no allocation per body.
struct CachedBody {
  uint32_t begin, size;            // in BodyCache::words_
  uint32_t refs_begin, refs_size;  // in BodyCache::refs_: (word offset, rule name)
};

class BodyCache {
 public:
  BodyCache();

  const CachedBody* find(PyObject* body) const;

  // Writes body's program to ``out`` with rule indices from ``index``; false if a name is missing
  // (a Python error may be set).
  bool write(const CachedBody& entry, PyObject* index, std::vector<int32_t>& out) const;

  // Takes references to ``body`` and the names in ``refs``.
  void insert(PyObject* body, const std::vector<int32_t>& program,
              const std::vector<std::pair<uint32_t, PyObject*>>& refs);

  // Drops every entry and its references (a cold start for benchmarks; memory pressure).
  void clear();

 private:
  static constexpr size_t kMaxWords = size_t{1} << 22;  // 16 MiB of program words
  static constexpr size_t kMaxEntries = size_t{1} << 16;

  std::unordered_map<PyObject*, CachedBody> map_;
  std::vector<int32_t> words_;
  std::vector<std::pair<uint32_t, PyObject*>> refs_;
};

// The cache (never freed, so no Python object is released after the interpreter is gone).
BodyCache& body_cache();

// Where the rule indices of ``program`` are (it is prefix-coded: grammar/ir/program.h), with the names of
// the rules they point at; false for a malformed program.
bool find_refs(const std::vector<int32_t>& program, const std::vector<PyObject*>& rule_names,
               std::vector<std::pair<uint32_t, PyObject*>>& refs);

}  // namespace agent_infer
