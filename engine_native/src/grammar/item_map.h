// Earley items (automaton state, origin) and the flat map the matcher's check and the pushdown
// token walks key their configuration sets with.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace agent_infer {
namespace grammar {

struct Item {
  int32_t state;
  int32_t origin;
};

// Sorts a configuration set's items (by state, then origin) and returns a 64-bit digest of them,
// mixed into `seed`: the key under which the pushdown walks intern their sets.
inline uint64_t sort_and_digest(std::vector<Item>& items, uint64_t seed) {
  std::sort(items.begin(), items.end(),
            [](const Item& x, const Item& y) { return x.state != y.state ? x.state < y.state : x.origin < y.origin; });
  uint64_t h = 0x9E3779B97F4A7C15ull ^ seed;
  for (const Item& c : items) {
    h = (h ^ ((static_cast<uint64_t>(static_cast<uint32_t>(c.state)) << 32) | static_cast<uint32_t>(c.origin))) *
        0xff51afd7ed558ccdull;
    h ^= h >> 29;
  }
  return h;
}

// Open-addressing map from 64-bit keys (items) to int32 values, cleared in O(1) by bumping a
// stamp: the walks and the run-time check fill one per mask fill, where node-based containers
// cost an allocation per entry. As a set, `insert` alone is used and the values stay 0.
class ItemMap {
 public:
  // Adds `key` with `value` if absent; true if it was added (an existing value is kept).
  bool insert(uint64_t key, int32_t value = 0) {
    bool found;
    const size_t i = slot(key, &found);
    if (!found) values_[i] = value;
    return !found;
  }
  // Sets the value under `key` (inserting it if absent).
  void put(uint64_t key, int32_t value) {
    bool found;
    values_[slot(key, &found)] = value;
  }
  // The value under `key`, or null.
  int32_t* find(uint64_t key);
  void clear() {
    if (++stamp_ == 0) {
      std::fill(stamps_.begin(), stamps_.end(), 0);
      stamp_ = 1;
    }
    size_ = 0;
  }

 private:
  // The slot holding `key`, claimed for it if it was absent (`found` false).
  size_t slot(uint64_t key, bool* found);
  void grow();
  std::vector<uint64_t> keys_;
  std::vector<int32_t> values_;
  std::vector<uint32_t> stamps_;
  uint32_t stamp_ = 1;
  size_t size_ = 0;
};

}  // namespace grammar
}  // namespace agent_infer
