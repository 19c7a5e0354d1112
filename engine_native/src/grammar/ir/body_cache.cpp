// The cache of shared rule bodies' programs (see grammar/ir/body_cache.h).
#include "grammar/ir/body_cache.h"

#include <cstddef>

#include "grammar/ir/program.h"

namespace agent_infer {

BodyCache::BodyCache() { map_.reserve(4096); }

const CachedBody* BodyCache::find(PyObject* body) const {
  auto it = map_.find(body);
  return it == map_.end() ? nullptr : &it->second;
}

bool BodyCache::write(const CachedBody& entry, PyObject* index, std::vector<int32_t>& out) const {
  auto first = words_.begin() + static_cast<std::ptrdiff_t>(entry.begin);
  out.assign(first, first + static_cast<std::ptrdiff_t>(entry.size));
  for (uint32_t i = entry.refs_begin; i < entry.refs_begin + entry.refs_size; ++i) {
    PyObject* v = PyDict_GetItemWithError(index, refs_[i].second);  // borrowed
    if (v == nullptr) return false;
    long r = PyLong_AsLong(v);
    if (r == -1 && PyErr_Occurred()) return false;
    out[refs_[i].first] = static_cast<int32_t>(r);
  }
  return true;
}

void BodyCache::insert(PyObject* body, const std::vector<int32_t>& program,
                       const std::vector<std::pair<uint32_t, PyObject*>>& refs) {
  if (words_.size() + program.size() > kMaxWords || map_.size() >= kMaxEntries) clear();
  CachedBody entry{static_cast<uint32_t>(words_.size()), static_cast<uint32_t>(program.size()),
                   static_cast<uint32_t>(refs_.size()), static_cast<uint32_t>(refs.size())};
  words_.insert(words_.end(), program.begin(), program.end());
  for (const auto& ref : refs) {
    Py_INCREF(ref.second);
    refs_.push_back(ref);
  }
  Py_INCREF(body);
  map_.emplace(body, entry);
}

void BodyCache::clear() {
  for (auto& ref : refs_) Py_DECREF(ref.second);
  for (auto& [body, entry] : map_) Py_DECREF(body);
  map_.clear();
  words_.clear();
  refs_.clear();
}

BodyCache& body_cache() {
  static BodyCache* cache = new BodyCache();
  return *cache;
}

bool find_refs(const std::vector<int32_t>& program, const std::vector<PyObject*>& rule_names,
               std::vector<std::pair<uint32_t, PyObject*>>& refs) {
  size_t p = 0;
  const size_t n = program.size();
  while (p < n) {
    switch (program[p]) {
      case grammar::kEmpty:
        p += 1;
        break;
      case grammar::kLiteral:
        if (p + 1 >= n) return false;
        p += 2 + static_cast<size_t>(program[p + 1]);
        break;
      case grammar::kClass:
        if (p + 1 >= n) return false;
        p += 2 + 2 * static_cast<size_t>(program[p + 1]);
        break;
      case grammar::kSeq:
      case grammar::kAlt:
        p += 2;
        break;
      case grammar::kRepeat:
        p += 3;
        break;
      case grammar::kRef: {
        if (p + 1 >= n) return false;
        int32_t rule = program[p + 1];
        if (rule < 0 || static_cast<size_t>(rule) >= rule_names.size()) return false;
        refs.emplace_back(static_cast<uint32_t>(p + 1), rule_names[static_cast<size_t>(rule)]);
        p += 2;
        break;
      }
      default:
        return false;
    }
  }
  return p == n;
}

}  // namespace agent_infer
