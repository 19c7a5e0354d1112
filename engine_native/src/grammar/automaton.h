// The lowered grammar's representation: one deterministic byte automaton per rule, its states
// and edges stored flat (CompiledGrammar, grammar/compiled_grammar.h, holds them).
#pragma once

#include <array>
#include <cstdint>

namespace agent_infer {
namespace grammar {

struct ByteEdge {
  uint8_t lo, hi;
  int32_t target;
};
struct RefEdge {
  int32_t rule;
  int32_t target;
};
struct State {
  int32_t rule = 0;
  bool final = false;
  uint32_t byte_begin = 0, byte_end = 0, ref_begin = 0, ref_end = 0;
};

// A set of bytes (256 bits).
using ByteSet = std::array<uint32_t, 8>;
inline bool has(const ByteSet& set, uint8_t b) { return (set[b >> 5] >> (b & 31)) & 1u; }

}  // namespace grammar
}  // namespace agent_infer
