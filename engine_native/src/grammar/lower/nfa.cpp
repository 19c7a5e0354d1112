// Lowering, step 1: a rule's program to a Thompson NFA over bytes.
//
// Code point classes become UTF-8 byte-range sequences (surrogates and values above U+10FFFF
// excluded, so the automata accept only valid UTF-8), repeats are expanded (bounded by Limits),
// and references to small finite rules are inlined. Edges are collected as flat (source, edge)
// lists and grouped by source once the rule is complete, so building allocates only while the
// reused buffers grow.
#include <algorithm>
#include <array>
#include <string>

#include "grammar/automaton.h"
#include "grammar/errors.h"
#include "grammar/ir/program.h"
#include "grammar/lower/automata.h"
#include "grammar/lower/nfa_builder.h"
#include "grammar/lower/rule_passes.h"

namespace agent_infer {
namespace grammar {

void throw_unknown_opcode() { throw DefinitionError("malformed grammar code (unknown opcode)"); }

size_t skip_expression(const std::vector<int32_t>& code, size_t pc) {
  switch (code.at(pc)) {
    case kEmpty:
      return pc + 1;
    case kLiteral:
      return pc + 2 + code.at(pc + 1);
    case kClass:
      return pc + 2 + 2 * static_cast<size_t>(code.at(pc + 1));
    case kSeq:
    case kAlt: {
      int32_t n = code.at(pc + 1);
      pc += 2;
      for (int32_t i = 0; i < n; ++i) pc = skip_expression(code, pc);
      return pc;
    }
    case kRepeat:
      return skip_expression(code, pc + 3);
    case kRef:
      return pc + 2;
    case kKeyTrie:
    case kCheck:
      return pc + 2 + static_cast<size_t>(code.at(pc + 1));
    default:
      throw DefinitionError("malformed grammar code (unknown opcode)");
  }
}

namespace {

int utf8_len(uint32_t cp) { return cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4; }

void utf8_encode(uint32_t cp, uint8_t* out) {
  switch (utf8_len(cp)) {
    case 1:
      out[0] = static_cast<uint8_t>(cp);
      break;
    case 2:
      out[0] = static_cast<uint8_t>(0xC0 | (cp >> 6));
      out[1] = static_cast<uint8_t>(0x80 | (cp & 0x3F));
      break;
    case 3:
      out[0] = static_cast<uint8_t>(0xE0 | (cp >> 12));
      out[1] = static_cast<uint8_t>(0x80 | ((cp >> 6) & 0x3F));
      out[2] = static_cast<uint8_t>(0x80 | (cp & 0x3F));
      break;
    default:
      out[0] = static_cast<uint8_t>(0xF0 | (cp >> 18));
      out[1] = static_cast<uint8_t>(0x80 | ((cp >> 12) & 0x3F));
      out[2] = static_cast<uint8_t>(0x80 | ((cp >> 6) & 0x3F));
      out[3] = static_cast<uint8_t>(0x80 | (cp & 0x3F));
  }
}

// States of a tentatively inlined rule's automaton (kInlineIfFits) past which it stays a rule.
constexpr size_t kMaxChainFragment = 1 << 15;

}  // namespace

std::pair<uint32_t, uint32_t>& NfaBuilder::Shared::class_seqs(const int32_t* key, bool* fresh) {
  const int32_t count = key[1];
  uint64_t h = 0x2545F4914F6CDD1Dull ^ static_cast<uint32_t>(count);
  for (int32_t i = 0; i < 2 * count; ++i) h = (h ^ static_cast<uint32_t>(key[2 + i])) * 0x9E3779B97F4A7C15ull;
  h ^= h >> 29;
  if (2 * (class_count + 1) > class_key.size()) {
    // Grow (and start) at half full: rehash every key into a table twice the size.
    std::vector<const int32_t*> keys(std::max<size_t>(64, 2 * class_key.size()), nullptr);
    std::vector<std::pair<uint32_t, uint32_t>> spans(keys.size());
    std::vector<uint64_t> hashes(keys.size());
    for (size_t i = 0; i < class_key.size(); ++i) {
      if (class_key[i] == nullptr) continue;
      size_t j = class_hash[i] & (keys.size() - 1);
      while (keys[j] != nullptr) j = (j + 1) & (keys.size() - 1);
      keys[j] = class_key[i];
      spans[j] = class_span[i];
      hashes[j] = class_hash[i];
    }
    class_key.swap(keys);
    class_span.swap(spans);
    class_hash.swap(hashes);
  }
  const size_t mask = class_key.size() - 1;
  size_t j = h & mask;
  for (; class_key[j] != nullptr; j = (j + 1) & mask) {
    if (class_hash[j] != h || class_key[j][1] != count) continue;
    if (class_key[j] == key ||
        std::equal(key + 2, key + 2 + 2 * static_cast<size_t>(count), class_key[j] + 2)) {
      *fresh = false;
      return class_span[j];
    }
  }
  *fresh = true;
  ++class_count;
  class_key[j] = key;
  class_hash[j] = h;
  class_span[j] = {0, 0};
  return class_span[j];
}

// Splits [lo, hi] until each piece is a product of per-byte ranges of one encoded length.
void NfaBuilder::utf8_split(uint32_t lo, uint32_t hi, std::vector<ByteSeq>& out) {
  if (lo > hi) return;
  if (lo <= 0xDFFF && hi >= 0xD800) {
    if (lo < 0xD800) utf8_split(lo, 0xD7FF, out);
    if (hi > 0xDFFF) utf8_split(0xE000, hi, out);
    return;
  }
  static const uint32_t kMax[3] = {0x7F, 0x7FF, 0xFFFF};
  for (uint32_t m : kMax) {
    if (lo <= m && hi > m) {
      utf8_split(lo, m, out);
      utf8_split(m + 1, hi, out);
      return;
    }
  }
  int n = utf8_len(lo);
  for (int i = 1; i < n; ++i) {
    uint32_t m = (1u << (6 * i)) - 1;
    if ((lo & ~m) != (hi & ~m)) {
      if ((lo & m) != 0) {
        utf8_split(lo, lo | m, out);
        utf8_split((lo | m) + 1, hi, out);
        return;
      }
      if ((hi & m) != m) {
        utf8_split(lo, (hi & ~m) - 1, out);
        utf8_split(hi & ~m, hi, out);
        return;
      }
    }
  }
  uint8_t a[4], b[4];
  utf8_encode(lo, a);
  utf8_encode(hi, b);
  ByteSeq s;
  s.n = n;
  for (int i = 0; i < n; ++i) s.r[i] = {a[i], b[i]};
  out.push_back(s);
}

std::pair<uint32_t, uint32_t> NfaBuilder::class_span(const std::vector<int32_t>& code, size_t pc) {
  // Programs do not change while lowering, so a class's split is memoized by its ranges
  // (an inlined JSON string character is expanded once per caller and repeat copy).
  const int32_t count = code.at(pc + 1);
  std::vector<ByteSeq>& seqs = shared_->seqs;
  if (count < 0 || pc + 2 + 2 * static_cast<size_t>(count) > code.size()) {
    // Malformed: split what is there uncached (at() reports the overrun as it always has).
    const size_t first = seqs.size();
    for (int32_t i = 0; i < count; ++i) {
      utf8_split(static_cast<uint32_t>(code.at(pc + 2 + 2 * i)), static_cast<uint32_t>(code.at(pc + 3 + 2 * i)),
                 seqs);
    }
    return {static_cast<uint32_t>(first), static_cast<uint32_t>(seqs.size())};
  }
  bool fresh_class = false;
  std::pair<uint32_t, uint32_t> span = shared_->class_seqs(&code[pc], &fresh_class);
  if (fresh_class) {
    const size_t first = seqs.size();
    for (int32_t i = 0; i < count; ++i) {
      utf8_split(static_cast<uint32_t>(code.at(pc + 2 + 2 * i)), static_cast<uint32_t>(code.at(pc + 3 + 2 * i)),
                 seqs);
    }
    span = {static_cast<uint32_t>(first), static_cast<uint32_t>(seqs.size())};
    shared_->class_seqs(&code[pc], &fresh_class) = span;
  }
  return span;
}

int32_t NfaBuilder::fresh() {
  if (++total_ > max_states_) {
    throw LimitError("grammar is too large: more than " + std::to_string(max_states_) +
                     " automaton states after expanding repeats");
  }
  deadline_->check();
  return count_++;
}

NfaBuilder::~NfaBuilder() {
  if (!lends_buffers_) return;
  eps_.swap(shared_->spare_eps);
  bytes_.swap(shared_->spare_bytes);
  refs_.swap(shared_->spare_refs);
}

void NfaBuilder::build_rule(int32_t r, Nfa* out) {
  count_ = 0;
  eps_.clear();
  bytes_.clear();
  refs_.clear();
  const int32_t start = fresh();
  self_rule_ = r;
  self_start_ = start;
  size_t pc = 0;
  const int32_t accept = build((*rules_)[r], pc, start, true);
  if (pc != (*rules_)[r].size()) throw DefinitionError("malformed grammar code (trailing data)");
  out->start = start;
  out->accept = accept;
  // Group the edges by source (a counting sort).
  auto group = [&](auto& flat, std::vector<uint32_t>& begin, auto& edges) {
    begin.assign(static_cast<size_t>(count_) + 1, 0);
    for (const auto& fe : flat) ++begin[fe.first + 1];
    for (int32_t s = 0; s < count_; ++s) begin[s + 1] += begin[s];
    edges.resize(flat.size());
    for (const auto& fe : flat) edges[begin[fe.first]++] = fe.second;
    for (int32_t s = count_; s > 0; --s) begin[s] = begin[s - 1];
    begin[0] = 0;
  };
  group(eps_, out->eps_begin, out->eps);
  group(bytes_, out->byte_begin, out->bytes);
  group(refs_, out->ref_begin, out->refs);
}

int32_t NfaBuilder::build(const std::vector<int32_t>& code, size_t& pc, int32_t from, bool tail) {
  if (++depth_ > 2000) throw LimitError("grammar expression nesting is deeper than 2000 levels");
  int32_t end = build_node(code, pc, from, tail);
  --depth_;
  return end;
}

int32_t NfaBuilder::build_node(const std::vector<int32_t>& code, size_t& pc, int32_t from, bool tail) {
  int32_t op = code.at(pc);
  switch (op) {
    case kEmpty:
      ++pc;
      return from;
    case kLiteral: {
      int32_t len = code.at(pc + 1);
      int32_t s = from;
      for (int32_t i = 0; i < len; ++i) {
        int32_t t = fresh();
        uint8_t b = static_cast<uint8_t>(code.at(pc + 2 + i));
        bytes_.push_back({s, ByteEdge{b, b, t}});
        s = t;
      }
      pc += 2 + len;
      return s;
    }
    case kClass: {
      int32_t count = code.at(pc + 1);
      const std::vector<ByteSeq>& seqs = shared_->seqs;
      const std::pair<uint32_t, uint32_t> span = class_span(code, pc);
      pc += 2 + 2 * static_cast<size_t>(count);
      int32_t end = fresh();
      for (uint32_t k = span.first; k < span.second; ++k) {
        const ByteSeq& s = seqs[k];
        int32_t cur = from;
        for (int i = 0; i < s.n; ++i) {
          int32_t t = (i + 1 == s.n) ? end : fresh();
          bytes_.push_back({cur, ByteEdge{s.r[i].first, s.r[i].second, t}});
          cur = t;
        }
      }
      return end;  // an empty class leaves `end` unreachable: the empty language
    }
    case kSeq: {
      int32_t count = code.at(pc + 1);
      pc += 2;
      int32_t s = from;
      for (int32_t i = 0; i < count; ++i) s = build(code, pc, s, tail && i + 1 == count);
      return s;
    }
    case kAlt: {
      int32_t factored = -1;
      if (build_factored_alt(code, pc, from, tail, &factored)) return factored;
      int32_t count = code.at(pc + 1);
      pc += 2;
      int32_t end = fresh();
      for (int32_t i = 0; i < count; ++i) {
        int32_t s = fresh();
        eps_.push_back({from, s});
        int32_t e = build(code, pc, s, tail);
        eps_.push_back({e, end});
      }
      return end;
    }
    case kRepeat: {
      int32_t lo = code.at(pc + 1), hi = code.at(pc + 2);
      size_t child = pc + 3;
      size_t after = skip_expression(code, child);
      int64_t copies = static_cast<int64_t>(lo) + (hi < 0 ? 1 : hi - lo);
      if (copies > max_states_) {
        throw LimitError("repeat {" + std::to_string(lo) + "," + std::to_string(hi) + "} is too large");
      }
      int32_t s = from;
      const bool child_tail = tail && hi == 1;  // x? and x{1} end where the repeat ends
      for (int32_t i = 0; i < lo; ++i) {
        size_t p = child;
        s = build(code, p, s, child_tail);
      }
      if (hi < 0) {
        // A fresh loop state, so the back edge cannot leak into whatever preceded the repeat.
        int32_t loop = fresh();
        eps_.push_back({s, loop});
        size_t p = child;
        int32_t e = build(code, p, loop, false);
        eps_.push_back({e, loop});
        s = loop;
      } else if (hi > lo) {
        int32_t end = fresh();
        for (int32_t i = lo; i < hi; ++i) {
          eps_.push_back({s, end});
          int32_t entry = fresh();
          eps_.push_back({s, entry});
          size_t p = child;
          s = build(code, p, entry, child_tail);
        }
        eps_.push_back({s, end});
        s = end;
      }
      pc = after;
      return s;
    }
    case kRef: {
      int32_t r = code.at(pc + 1);
      pc += 2;
      if (r < 0 || static_cast<size_t>(r) >= rules_->size()) throw DefinitionError("reference to unknown rule");
      if (tail && r == self_rule_) {
        eps_.push_back({from, self_start_});
        return fresh();  // nothing continues from here: the jump's path ends at the rule's end
      }
      const uint8_t how = (*inline_rule_)[r];
      // A tentative inline whose automaton is not in the store, or too large to copy, stays a
      // reference.
      if (how == kInlineIfFits && (fragment_state(r) < 0 || fragment(r).final.size() > kMaxChainFragment)) {
        const int32_t t = fresh();
        refs_.push_back({from, RefEdge{r, t}});
        return t;
      }
      if (how) {
        const Fragment& f = fragment(r);
        if (!f.usable) {
          size_t p = 0;
          int32_t entry = fresh();
          eps_.push_back({from, entry});
          return build((*rules_)[r], p, entry, false);
        }
        // Fragment state i becomes NFA state first + i; its final states lead to a fresh end.
        const size_t n = f.final.size();
        const int32_t first = count_;
        for (size_t i = 0; i < n; ++i) fresh();
        const int32_t end = fresh();
        eps_.push_back({from, first});
        for (size_t i = 0; i < n; ++i) {
          const int32_t s = first + static_cast<int32_t>(i);
          for (uint32_t e = f.begin[i]; e < f.begin[i + 1]; ++e) {
            bytes_.push_back({s, ByteEdge{f.bytes[e].lo, f.bytes[e].hi, first + f.bytes[e].target}});
          }
          if (f.final[i]) eps_.push_back({s, end});
        }
        return end;
      }
      int32_t t = fresh();
      refs_.push_back({from, RefEdge{r, t}});
      return t;
    }
    case kKeyTrie:
      throw DefinitionError("malformed key-trie instruction: it must be a rule's whole body");
    case kCheck:
      throw DefinitionError("malformed run-time check: it must be a rule's whole body");
    default:
      throw DefinitionError("malformed grammar code (unknown opcode)");
  }
}

}  // namespace grammar
}  // namespace agent_infer
