// Interned sets of int32 for the subset construction: flat tables (SetTable, determinize.cpp) and
// hash-consed tries over 64-member blocks for large sets (SetTrie, set_trie.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace agent_infer {
namespace grammar {

// Doubles an open-addressing table of ids whose live slots carry generation `gen`, and reinserts
// ids first..count-1 by hash_of(id). SetTable and SetTrie grow their tables this way.
template <class HashOf>
void grow_id_table(std::vector<int32_t>* table, std::vector<uint32_t>* table_gen, uint32_t gen, size_t first,
                   size_t count, HashOf hash_of) {
  std::vector<int32_t> grown(table->size() * 2, -1);
  std::vector<uint32_t> grown_gen(grown.size(), 0);
  const size_t mask = grown.size() - 1;
  for (size_t k = first; k < count; ++k) {
    size_t j = static_cast<size_t>(hash_of(k)) & mask;
    while (grown_gen[j] == gen) j = (j + 1) & mask;
    grown[j] = static_cast<int32_t>(k);
    grown_gen[j] = gen;
  }
  table->swap(grown);
  table_gen->swap(grown_gen);
}

// Interned sets of int32 (each a sorted run of members, stored back to back), numbered in the
// order they are inserted and found again through an open-addressing table. clear() starts a new
// numbering and keeps the buffers (stale table slots are told apart by generation).
class SetTable {
 public:
  void clear();
  // The number of the set [data, data + n) whose hash is h, or -1; then *slot is where insert()
  // puts it.
  int32_t find(const int32_t* data, size_t n, uint64_t h, size_t* slot) const;
  // Adds the set find() did not find at `slot`; returns its number.
  int32_t insert(const int32_t* data, size_t n, uint64_t h, size_t slot);
  const int32_t* members(int32_t id) const { return data_.data() + off_[id]; }
  const int32_t* members_end(int32_t id) const { return data_.data() + off_[id + 1]; }
  int32_t size() const { return static_cast<int32_t>(hash_.size()); }
  // Bytes the sets use now (members, offsets, hashes and table).
  size_t bytes_used() const { return data_.size() * 4 + hash_.size() * 12 + table_.size() * 8; }
  size_t retained_bytes() const;

 private:
  std::vector<int32_t> data_;
  std::vector<uint32_t> off_{0};
  std::vector<uint64_t> hash_;
  std::vector<int32_t> table_;  // set numbers, -1 = empty; valid where table_gen_ == gen_
  std::vector<uint32_t> table_gen_;
  uint32_t gen_ = 0;
};

// Hash-consed sets of int32 below a universe fixed per clear(), for the determinizer's large sets.
// A set is a fixed-depth binary tree over 64-member blocks whose empty subtrees are left out and
// whose nodes are interned, so equal sets get the same id and sets that differ in a few blocks
// share every other subtree. A search automaton's states hold all the pattern positions still
// matching (a literal of n characters: sets of 1..n members); stored flat they cost O(n^2) words,
// here O(n log n) nodes.
class SetTrie {
 public:
  // Forgets every set; members of the sets to come are below `universe`.
  void clear(size_t universe);
  // The id (>= 1) of the set [data, data + n): sorted, distinct, n >= 1, each below the universe.
  int32_t intern(const int32_t* data, size_t n);
  // Appends the members of set `id` to *out, in ascending order.
  void members(int32_t id, std::vector<int32_t>* out) const;
  // Ids are below this (node ids and set ids are one numbering).
  int32_t bound() const { return static_cast<int32_t>(x_.size()); }
  // Bytes the nodes and their table use now.
  size_t bytes_used() const { return x_.size() * (sizeof(uint64_t) + sizeof(uint32_t)) + table_.size() * 8; }
  size_t retained_bytes() const;

 private:
  int32_t node(uint64_t x, uint32_t level);
  std::vector<uint64_t> x_;      // per node: a leaf's member bits, or left << 32 | right (0 = empty)
  std::vector<uint32_t> level_;  // per node: 0 for a leaf
  std::vector<int32_t> table_;   // node ids, open addressing; valid where table_gen_ == gen_
  std::vector<uint32_t> table_gen_;
  uint32_t gen_ = 0;
  uint32_t levels_ = 0;  // a set's root is at this level
  std::vector<std::pair<uint32_t, uint64_t>> cur_, next_;  // intern's levels: (index, word or id)
  mutable std::vector<std::pair<int32_t, std::pair<uint32_t, uint32_t>>> walk_;  // members' stack
};

}  // namespace grammar
}  // namespace agent_infer
