// What one automaton state does with every token (StateMask), and the bitset helpers the mask
// computations share to build, merge and store such classifications.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "grammar/thread_slot.h"

namespace agent_infer {
namespace grammar {

class TokenizerInfo;

// Tokens at sorted positions [begin, end) all leave a loop region (see CompiledGrammar::
// region_of) after `depth` bytes, entering the region's exit state number `exit`; `flag`: the
// rule could already have finished at a position in [1, depth) with the next byte following it.
struct RegionExit {
  int32_t begin, end, depth, exit, flag;
};

// What one automaton state does with every token, in isolation from its context.
struct StateMask {
  std::vector<uint32_t> accepted_bits;  // a full bitset over the vocabulary, or empty
  std::vector<int32_t> accepted_ids;    // used instead when few tokens are accepted
  std::vector<int32_t> uncertain;       // positions in TokenizerInfo::sorted, ascending
  std::vector<RegionExit> exits;        // only in the cached walk of a loop region
  // Only in a union of first-byte pieces (grammar/mask/pieces.cpp): the first bytes whose runs it holds.
  std::array<uint32_t, 8> first_bytes{};
  size_t bytes() const {
    return sizeof(*this) + accepted_bits.capacity() * 4 + accepted_ids.capacity() * 4 + uncertain.capacity() * 4 +
           exits.capacity() * sizeof(RegionExit);
  }
};

// Stores accepted tokens densely or as a sorted id list, whichever is smaller (or densely, while
// a KeepBits is alive on this thread).
void finish_mask(StateMask& out, std::vector<uint32_t>&& bits, size_t n_accepted);
// While one is alive on a thread, finish_mask keeps a walk's accepted tokens as they were
// gathered. A split walk's parts are ORed into one bitset by their assembly, which lists the
// ids once for the whole walk; listing them in each part scanned every part's bitset for nothing.
class KeepBits {
 public:
  KeepBits() : prev_(slot().on) { slot().on = true; }
  ~KeepBits() { slot().on = prev_; }
  KeepBits(const KeepBits&) = delete;
  KeepBits& operator=(const KeepBits&) = delete;
  static bool active() { return slot().on; }

 private:
  struct Flag {
    bool on = false;
  };
  static Flag& slot() { return thread_slot<Flag>(); }
  bool prev_;
};
// ORs listed token ids into a bitset. In a sorted list (as finish_mask writes them) runs of ids
// share a word: each run is gathered in a register and stored once, rather than one
// read-modify-write per id, each waiting on the store before it.
inline void or_ids(uint32_t* bits, const std::vector<int32_t>& ids) {
  if (ids.empty()) return;
  uint32_t w = static_cast<uint32_t>(ids[0]) >> 5, acc = 0;
  for (const int32_t id : ids) {
    const uint32_t u = static_cast<uint32_t>(id);
    if ((u >> 5) != w) {
      bits[w] |= acc;
      w = u >> 5;
      acc = 0;
    }
    acc |= 1u << (u & 31);
  }
  bits[w] |= acc;
}
inline void or_ids(std::vector<uint32_t>& bits, const std::vector<int32_t>& ids) { or_ids(bits.data(), ids); }
// Set bits in words[0, n). The wheel targets baseline x86-64, where __builtin_popcount is a libgcc
// call per word; walks count 4 000 words per part, so this one loop is also built with popcnt and
// picked at load time on CPUs that have it.
size_t count_bits(const uint32_t* words, size_t n);
// The tokens one walk accepts: a bitset over the vocabulary seeded from `base`, or, for a walk of
// fewer live tokens than the bitset has words and no base (a sparse state), an id list, which
// spares zeroing and scanning the bitset (~4 us per walk at 129k tokens) when few are accepted.
class AcceptedSet {
 public:
  AcceptedSet(size_t words, const StateMask* base, size_t live_tokens);
  void add(int32_t id) {
    if (list_) {
      ids_.push_back(id);
    } else {
      bits_[static_cast<size_t>(id) >> 5] |= 1u << (id & 31);
    }
    ++n_;
  }
  // Stores the set into out as finish_mask would.
  void finish(StateMask& out);

 private:
  bool list_;
  size_t words_;
  size_t n_ = 0;
  std::vector<uint32_t> bits_;
  std::vector<int32_t> ids_;
};

// Adds base's uncertain positions (disjoint from out's) to out's, keeping them sorted.
void merge_uncertain(StateMask& out, const StateMask* base);
// 128-bit digest of `data` prefixed by `kind` (17 bytes): the form of every cache key.
std::string digest(const std::string& data, char kind);
// Seeds a walk's accepted bitset with the tokens `base` (if any) accepts; returns their count.
size_t seed_bits(const StateMask* base, std::vector<uint32_t>& bits);
// The piece of a walked mask for the sorted positions [lo, hi) (a first byte's run): the ids of
// the run accepted in `bits` (the walk's accepted tokens as a bitset), in position order, and the
// walk's uncertain positions (and, with `exits`, region exits) inside the run.
std::shared_ptr<StateMask> run_piece(const TokenizerInfo& tk, const std::vector<uint32_t>& bits,
                                     const StateMask& walked, size_t lo, size_t hi, bool exits);
// seed_bits, then without the tokens at `positions` of the sorted token array (`sorted` maps a
// position to its id): the part of a mask that a walk of those tokens recomputes.
size_t seed_bits_except(const StateMask* base, std::vector<uint32_t>& bits, const std::vector<int32_t>& positions,
                        const std::vector<int32_t>& sorted);
// seed_bits without the token ids set in `drop` (a bitmask of `bits.size()` words).
size_t seed_bits_masked(const StateMask* base, std::vector<uint32_t>& bits, const std::vector<uint32_t>& drop);

// Sorts v, which is made of sorted segments beginning at `starts` (ascending), by merging
// them: the piece assemblies append per-byte results in segments, and sorting from scratch cost
// more than the rest of their work on large uncertain lists.
template <class T, class Less>
void merge_segments(std::vector<T>& v, const std::vector<size_t>& starts, Less less) {
  for (size_t k = 1; k < starts.size(); ++k) {
    const size_t mid = std::min(starts[k], v.size());
    const size_t end = k + 1 < starts.size() ? std::min(starts[k + 1], v.size()) : v.size();
    std::inplace_merge(v.begin(), v.begin() + static_cast<long>(mid), v.begin() + static_cast<long>(end), less);
  }
}

}  // namespace grammar
}  // namespace agent_infer
