// The tokenizer's tables for token masks: the vocabulary sorted by bytes (it acts as a trie), the
// per-length and JSON string-content subsets the mask strategies walk, and the process-wide
// cache of state masks shared by every grammar compiled for this tokenizer.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "grammar/mask/state_mask.h"

namespace agent_infer {
namespace grammar {

// The number of characters of `token` if it is JSON string content as it stands (well-formed
// UTF-8, every code point U+0020 or above but '"' and '\\'; a character it ends inside counts as
// one), else SIZE_MAX; *dead_after: the characters before a control byte or a byte no character
// starts with, if the token reaches one as content up to there (else SIZE_MAX)
// (grammar/mask/content.cpp).
size_t content_chars(const std::string& token, size_t* dead_after = nullptr);
// Whether bytes [p, p + n) are well-formed UTF-8 (Unicode Table 3-7; any ASCII byte counts), a
// last character cut short included (grammar/mask/content.cpp).
bool utf8_well_formed(const uint8_t* p, size_t n);

struct JsonTokenClasses;  // grammar/match/unique.h

class TokenizerInfo {
 public:
  TokenizerInfo(std::vector<std::string> token_bytes, int32_t vocab_size, std::vector<int32_t> eos_ids);

  int32_t vocab_size;
  int32_t words;  // ceil(vocab_size / 32)
  std::vector<int32_t> eos_ids;
  std::vector<std::string> tokens;  // by id, size vocab_size; empty = never produced by grammar text
  std::vector<int32_t> sorted;      // ids of non-empty tokens, sorted by bytes
  std::vector<uint16_t> lcp;        // lcp[i]: common prefix length of sorted[i-1] and sorted[i]
  // The sorted tokens' bytes back to back (sequential scans instead of pointer chasing).
  std::string sorted_data;
  std::vector<uint32_t> sorted_off;  // size sorted.size() + 1
  const char* sorted_ptr(size_t i) const { return sorted_data.data() + sorted_off[i]; }
  size_t sorted_len(size_t i) const { return sorted_off[i + 1] - sorted_off[i]; }
  // First sorted index after i whose token does not start with the first plen bytes of token i
  // (tokens sharing a prefix are contiguous in sorted order).
  size_t run_end(size_t i, size_t plen) const;
  // The walks' skip over dead siblings: `from` and the tokens after it that share token i's first
  // d bytes are passed over while their byte d is outside `stop` (a 256-bit set); returns the
  // first position, at most `limit`, that leaves that run or reads a byte of `stop` there.
  size_t skip_dead(size_t i, size_t d, size_t from, size_t limit, const std::array<uint32_t, 8>& stop) const;
  std::vector<uint32_t> first_byte_end;
  // short_run_end[p - 2][i] = run_end(i, p) for p = 2..4: the dead prefixes a walk meets are
  // mostly this short, and a table read replaces a galloping search of memcmp calls.
  std::array<std::vector<uint32_t>, 3> short_run_end;
  size_t max_token_len = 0;
  // Tokens longer than this many bytes are "long" for short-token masks (grammar/mask/short_tokens.cpp);
  // long_sorted lists their sorted positions, ascending.
  static constexpr size_t kShortTokenLen = 16;
  std::vector<int32_t> long_sorted;
  // Sorted positions of the tokens longer than kTwinLens[k] bytes, ascending (twin masks,
  // grammar/mask/twin.cpp: a state whose neighbourhood agrees with a computed one up to that depth
  // walks only these).
  static constexpr std::array<size_t, 8> kTwinLens{{6, 8, 10, 12, 16, 24, 32, 64}};
  std::array<std::vector<int32_t>, 8> longer_sorted;
  // The same sets as token-id bitmasks (`words` each): a twin's mask minus them is one AND per word.
  std::array<std::vector<uint32_t>, 8> longer_bits;
  // JSON string content as the tokens spell it (grammar/mask/content.cpp): tokens of well-formed UTF-8
  // whose code points are all U+0020 or above but '"' and '\\', at most kContentChars of them, as
  // an id bitmask (content_bits, content_count of them); the sorted positions of every other
  // token, ascending (content_rest: quotes, escapes, control bytes, split characters, long ones).
  // content_rest_walked: content_rest without the tokens that read a control byte, or a byte no
  // character starts with, after at most kContentChars content characters (dead where a string
  // state has no edge on such bytes).
  static constexpr size_t kContentChars = 16;
  std::vector<uint32_t> content_bits;
  size_t content_count = 0;
  // The content tokens whose first byte is ASCII (depth-1 region walks: the rest of such a token
  // starts at a character boundary).
  std::vector<uint32_t> content_ascii_bits;
  size_t content_ascii_count = 0;
  // content_upto_bits[r]: the content tokens of at most r characters, and their number.
  std::array<std::vector<uint32_t>, kContentChars> content_upto_bits;
  std::array<size_t, kContentChars> content_upto_count{};
  std::vector<int32_t> content_rest, content_rest_walked;
  // content_with[b]: the sorted positions of the content tokens with a character that starts
  // with byte b (an ASCII content byte or a UTF-8 lead byte), ascending. A loop region on which a
  // few characters die or leave (a pattern's '.', U+2028 in an ECMAScript '.') walks only these.
  std::array<std::vector<int32_t>, 256> content_with;
  // content_chars_at[i]: the characters of the content token at sorted position i (else 0).
  std::vector<uint8_t> content_chars_at;
  // Byte groups of each sorted token past its first byte, as a 128-bit set (grammar/mask/region_classes.cpp):
  // bytes 20-7F one group each, control bytes in pairs, bytes 80-FF in eights. A loop region
  // such as `[a-z]+` classifies most tokens from these without a walk.
  static unsigned byte_group(uint8_t b) { return b >= 0x80 ? 16u + ((b - 0x80u) >> 3) : b >= 0x20 ? b : b >> 1u; }
  std::vector<std::array<uint64_t, 2>> tail_groups;
  // utf8_from[i]: bit 0 if token i is well-formed UTF-8 from its first byte, bit 1 from its second
  // (a character it ends inside counts if its bytes so far are well-formed): with a region that
  // keeps every character's sequence among its kept rows, its non-ASCII bytes then stay.
  std::vector<uint8_t> utf8_from;

  // State masks shared by every grammar compiled for this tokenizer, keyed by automaton structure.
  std::shared_ptr<const StateMask> cache_get(const std::string& key);
  std::shared_ptr<const StateMask> cache_put(const std::string& key, std::shared_ptr<const StateMask> mask);
  // Stores `mask` under `key`, replacing an entry (grown unions of first-byte pieces).
  void cache_replace(const std::string& key, std::shared_ptr<const StateMask> mask);
  size_t cache_bytes();
  size_t cache_entries();
  // The tokens a unique array item's completion may hide in, by JSON lexer context (built on
  // first use by a grammar with unique items, grammar/match/unique.cpp).
  const JsonTokenClasses& json_token_classes() const;

 private:
  mutable std::once_flag json_classes_once_;
  mutable std::shared_ptr<const JsonTokenClasses> json_classes_;
  std::mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<const StateMask>> cache_;
  size_t cache_bytes_ = 0;
};

}  // namespace grammar
}  // namespace agent_infer
