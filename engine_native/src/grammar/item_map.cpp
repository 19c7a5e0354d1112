// ItemMap (grammar/item_map.h): open addressing with linear probing over flat arrays.
#include "grammar/item_map.h"

#include <algorithm>

namespace agent_infer {
namespace grammar {

namespace {
inline size_t mix(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdull;
  k ^= k >> 33;
  return static_cast<size_t>(k);
}
}  // namespace

size_t ItemMap::slot(uint64_t key, bool* found) {
  if ((size_ + 1) * 2 > keys_.size()) grow();
  const size_t mask = keys_.size() - 1;
  for (size_t i = mix(key) & mask;; i = (i + 1) & mask) {
    if (stamps_[i] != stamp_) {
      stamps_[i] = stamp_;
      keys_[i] = key;
      ++size_;
      *found = false;
      return i;
    }
    if (keys_[i] == key) {
      *found = true;
      return i;
    }
  }
}

int32_t* ItemMap::find(uint64_t key) {
  if (keys_.empty()) return nullptr;
  const size_t mask = keys_.size() - 1;
  for (size_t i = mix(key) & mask;; i = (i + 1) & mask) {
    if (stamps_[i] != stamp_) return nullptr;
    if (keys_[i] == key) return &values_[i];
  }
}

void ItemMap::grow() {
  std::vector<uint64_t> old_keys;
  std::vector<int32_t> old_values;
  std::vector<uint32_t> old_stamps;
  old_keys.swap(keys_);
  old_values.swap(values_);
  old_stamps.swap(stamps_);
  const size_t cap = std::max<size_t>(64, old_keys.size() * 2);
  keys_.assign(cap, 0);
  values_.assign(cap, 0);
  stamps_.assign(cap, 0);
  const size_t mask = cap - 1;
  for (size_t j = 0; j < old_keys.size(); ++j) {
    if (old_stamps[j] != stamp_) continue;
    for (size_t i = mix(old_keys[j]) & mask;; i = (i + 1) & mask) {
      if (stamps_[i] != stamp_) {
        stamps_[i] = stamp_;
        keys_[i] = old_keys[j];
        values_[i] = old_values[j];
        break;
      }
    }
  }
}

}  // namespace grammar
}  // namespace agent_infer
