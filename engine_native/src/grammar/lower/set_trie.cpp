// SetTrie (see grammar/lower/set_table.h): hash-consed fixed-depth trees over 64-member blocks.
#include <algorithm>

#include "grammar/lower/set_table.h"

namespace agent_infer {
namespace grammar {

namespace {

uint64_t hash_node(uint64_t x, uint32_t level) {
  uint64_t h = (x ^ (uint64_t{level} << 58)) * 0x9E3779B97F4A7C15ull;
  return h ^ (h >> 31);
}

}  // namespace

void SetTrie::clear(size_t universe) {
  x_.assign(1, 0);  // node 0: the empty subtree
  level_.assign(1, 0);
  if (table_.empty()) {
    table_.assign(64, -1);
    table_gen_.assign(64, 0);
  }
  if (++gen_ == 0) {
    std::fill(table_gen_.begin(), table_gen_.end(), 0);
    gen_ = 1;
  }
  levels_ = 0;
  for (size_t blocks = (universe + 63) / 64; (size_t{1} << levels_) < blocks;) ++levels_;
}

int32_t SetTrie::node(uint64_t x, uint32_t level) {
  const uint64_t h = hash_node(x, level);
  const size_t mask = table_.size() - 1;
  size_t i = static_cast<size_t>(h) & mask;
  for (; table_gen_[i] == gen_; i = (i + 1) & mask) {
    const int32_t id = table_[i];
    if (x_[id] == x && level_[id] == level) return id;
  }
  const int32_t id = static_cast<int32_t>(x_.size());
  x_.push_back(x);
  level_.push_back(level);
  table_[i] = id;
  table_gen_[i] = gen_;
  if (x_.size() * 2 > table_.size()) {
    // Every node belongs to the current numbering (clear() drops them all), so all are rehashed.
    grow_id_table(&table_, &table_gen_, gen_, 1, x_.size(),
                  [this](size_t k) { return hash_node(x_[k], level_[k]); });
  }
  return id;
}

int32_t SetTrie::intern(const int32_t* data, size_t n) {
  cur_.clear();
  for (size_t k = 0; k < n; ++k) {
    const uint32_t block = static_cast<uint32_t>(data[k]) >> 6;
    if (cur_.empty() || cur_.back().first != block) cur_.emplace_back(block, 0);
    cur_.back().second |= uint64_t{1} << (data[k] & 63);
  }
  for (auto& [block, word] : cur_) word = static_cast<uint64_t>(node(word, 0));
  for (uint32_t level = 1; level <= levels_; ++level) {
    next_.clear();
    for (size_t k = 0; k < cur_.size(); ++k) {
      const uint32_t index = cur_[k].first;
      uint64_t left = 0, right = 0;
      if ((index & 1) == 0) {
        left = cur_[k].second;
        if (k + 1 < cur_.size() && cur_[k + 1].first == index + 1) right = cur_[++k].second;
      } else {
        right = cur_[k].second;
      }
      next_.emplace_back(index >> 1, static_cast<uint64_t>(node(left << 32 | right, level)));
    }
    cur_.swap(next_);
  }
  return static_cast<int32_t>(cur_[0].second);
}

void SetTrie::members(int32_t id, std::vector<int32_t>* out) const {
  walk_.clear();
  walk_.push_back({id, {levels_, 0}});
  while (!walk_.empty()) {
    const auto [x, where] = walk_.back();
    const auto [level, index] = where;
    walk_.pop_back();
    if (level == 0) {
      for (uint64_t word = x_[x]; word != 0; word &= word - 1) {
        out->push_back(static_cast<int32_t>(index << 6 | static_cast<uint32_t>(__builtin_ctzll(word))));
      }
      continue;
    }
    const int32_t left = static_cast<int32_t>(x_[x] >> 32), right = static_cast<int32_t>(x_[x] & 0xFFFFFFFFu);
    if (right != 0) walk_.push_back({right, {level - 1, index << 1 | 1}});  // popped after the left
    if (left != 0) walk_.push_back({left, {level - 1, index << 1}});
  }
}

size_t SetTrie::retained_bytes() const {
  auto bytes = [](const auto& v) { return v.capacity() * sizeof(v[0]); };
  return bytes(x_) + bytes(level_) + bytes(table_) + bytes(table_gen_) + bytes(cur_) + bytes(next_) + bytes(walk_);
}

}  // namespace grammar
}  // namespace agent_infer
