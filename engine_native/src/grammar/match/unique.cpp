// Unique array items at run time: the veto on a marked item's completion (Matcher::closure calls
// repeats_earlier_item), the earlier items read back from the text, JSON values in canonical form,
// and the per-tokenizer token classes the mask fill rechecks (Matcher::recheck_unique).
#include "grammar/match/unique.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "grammar/compiled_grammar.h"
#include "grammar/errors.h"
#include "grammar/mask/tokenizer_info.h"
#include "grammar/match/matcher.h"

namespace agent_infer {
namespace grammar {

namespace {
// The forced bytes alive() reads ahead at most (a forced tail in JSON is a literal's rest, closing
// brackets, a declared key): past this many the item counts as alive.
constexpr size_t kMaxForcedLookahead = 4096;
}  // namespace

namespace unique {

namespace {

constexpr int64_t kMaxExponent = 1000000000000000;  // 10^15

class Canon {
 public:
  Canon(const uint8_t* p, size_t n, std::string* out) : p_(p), end_(p + n), out_(out) {}

  void value(int depth) {
    if (depth > kMaxDepth) {
      throw LimitError("a unique array item is nested deeper than " + std::to_string(kMaxDepth) + " levels");
    }
    skip_ws();
    if (p_ >= end_) return;
    const uint8_t c = *p_;
    if (c == '"') {
      std::string s;
      string(&s);
      out_->push_back('s');
      put_len(s.size());
      out_->append(s);
    } else if (c == '[') {
      ++p_;
      out_->push_back('[');
      skip_ws();
      if (p_ < end_ && *p_ == ']') {
        ++p_;
      } else {
        while (p_ < end_) {
          value(depth + 1);
          skip_ws();
          if (p_ < end_ && *p_ == ',') {
            ++p_;
            continue;
          }
          if (p_ < end_ && *p_ == ']') ++p_;
          break;
        }
      }
      out_->push_back(']');
    } else if (c == '{') {
      ++p_;
      object(depth);
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      number();
    } else {
      // null, true, false: the first letter decides (a forced tail may be cut off).
      out_->push_back(static_cast<char>(c));
      while (p_ < end_ && *p_ >= 'a' && *p_ <= 'z') ++p_;
    }
  }

 private:
  void skip_ws() {
    while (p_ < end_ && is_ws(*p_)) ++p_;
  }

  void put_len(size_t n) {
    const uint32_t v = static_cast<uint32_t>(n);
    out_->append(reinterpret_cast<const char*>(&v), sizeof(v));
  }

  void object(int depth) {
    std::vector<std::pair<std::string, std::string>> members;
    std::string* saved = out_;
    skip_ws();
    while (p_ < end_ && *p_ == '"') {
      std::string key;
      string(&key);
      skip_ws();
      if (p_ < end_ && *p_ == ':') ++p_;
      std::string val;
      out_ = &val;
      value(depth + 1);
      out_ = saved;
      members.emplace_back(std::move(key), std::move(val));
      skip_ws();
      if (p_ < end_ && *p_ == ',') {
        ++p_;
        skip_ws();
        continue;
      }
      break;
    }
    if (p_ < end_ && *p_ == '}') ++p_;
    // Sorted by key; of equal keys the last one stays (stable sort, then keep each run's last).
    std::stable_sort(members.begin(), members.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    out_->push_back('{');
    for (size_t i = 0; i < members.size(); ++i) {
      if (i + 1 < members.size() && members[i + 1].first == members[i].first) continue;
      put_len(members[i].first.size());
      out_->append(members[i].first);
      out_->append(members[i].second);
    }
    out_->push_back('}');
  }

  static int hex(uint8_t b) {
    if (b >= '0' && b <= '9') return b - '0';
    if (b >= 'a' && b <= 'f') return b - 'a' + 10;
    if (b >= 'A' && b <= 'F') return b - 'A' + 10;
    return -1;
  }

  // Four hex digits after `\u`; -1 if they are not there.
  int32_t unit() {
    if (end_ - p_ < 4) return -1;
    int32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      const int h = hex(p_[i]);
      if (h < 0) return -1;
      v = v * 16 + h;
    }
    p_ += 4;
    return v;
  }

  static void put_utf8(uint32_t cp, std::string* s) {
    if (cp < 0x80) {
      s->push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      s->push_back(static_cast<char>(0xC0 | (cp >> 6)));
      s->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      s->push_back(static_cast<char>(0xE0 | (cp >> 12)));
      s->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      s->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      s->push_back(static_cast<char>(0xF0 | (cp >> 18)));
      s->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      s->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      s->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }

  // The decoded bytes of the string at p_ (its opening quote): raw UTF-8 is kept as it is, each
  // escape becomes the UTF-8 of its code point (a surrogate pair one code point; a lone
  // surrogate its 3-byte form, equal only to itself).
  void string(std::string* s) {
    ++p_;
    while (p_ < end_ && *p_ != '"') {
      if (*p_ != '\\') {
        s->push_back(static_cast<char>(*p_++));
        continue;
      }
      ++p_;
      if (p_ >= end_) break;
      const uint8_t e = *p_++;
      switch (e) {
        case 'b':
          s->push_back('\b');
          break;
        case 'f':
          s->push_back('\f');
          break;
        case 'n':
          s->push_back('\n');
          break;
        case 'r':
          s->push_back('\r');
          break;
        case 't':
          s->push_back('\t');
          break;
        case 'u': {
          int32_t u = unit();
          if (u < 0) break;
          if (u >= 0xD800 && u <= 0xDBFF && end_ - p_ >= 6 && p_[0] == '\\' && p_[1] == 'u') {
            const uint8_t* back = p_;
            p_ += 2;
            const int32_t low = unit();
            if (low >= 0xDC00 && low <= 0xDFFF) {
              put_utf8(0x10000 + ((static_cast<uint32_t>(u) - 0xD800) << 10) + (static_cast<uint32_t>(low) - 0xDC00), s);
              break;
            }
            p_ = back;
          }
          put_utf8(static_cast<uint32_t>(u), s);
          break;
        }
        default:
          s->push_back(static_cast<char>(e));  // " \ /
      }
    }
    if (p_ < end_) ++p_;
  }

  // An exact decimal: the significant digits without leading or trailing zeros and the power
  // of ten that scales them (0 for zero, whatever its sign or spelling).
  void number() {
    bool neg = false;
    if (*p_ == '-') {
      neg = true;
      ++p_;
    }
    std::string digits;
    int64_t scale = 0;
    while (p_ < end_ && *p_ >= '0' && *p_ <= '9') digits.push_back(static_cast<char>(*p_++));
    if (p_ < end_ && *p_ == '.') {
      ++p_;
      while (p_ < end_ && *p_ >= '0' && *p_ <= '9') {
        digits.push_back(static_cast<char>(*p_++));
        --scale;
      }
    }
    if (p_ < end_ && (*p_ == 'e' || *p_ == 'E')) {
      ++p_;
      bool eneg = false;
      if (p_ < end_ && (*p_ == '+' || *p_ == '-')) eneg = *p_++ == '-';
      int64_t e = 0;
      while (p_ < end_ && *p_ >= '0' && *p_ <= '9') {
        e = e * 10 + (*p_++ - '0');
        if (e > kMaxExponent) throw LimitError("a unique array item has a number exponent beyond 10^15");
      }
      scale += eneg ? -e : e;
    }
    size_t first = 0;
    while (first < digits.size() && digits[first] == '0') ++first;
    size_t last = digits.size();
    while (last > first && digits[last - 1] == '0') {
      --last;
      ++scale;
    }
    out_->push_back('#');
    if (first == last) {
      out_->push_back('0');
    } else {
      if (neg) out_->push_back('-');
      out_->append(digits, first, last - first);
      out_->push_back('e');
      out_->append(std::to_string(scale));
    }
    out_->push_back(';');
  }

  const uint8_t* p_;
  const uint8_t* end_;
  std::string* out_;
};

// Whether the quote at text[q] is escaped (an odd run of backslashes before it).
bool escaped(const uint8_t* text, int64_t q) {
  int64_t n = 0;
  while (q - 1 - n >= 0 && text[q - 1 - n] == '\\') ++n;
  return (n & 1) != 0;
}

// The opening quote of the string whose closing quote is text[q]: inside a JSON string every
// quote is escaped, so it is the nearest unescaped quote before.
int64_t string_start(const uint8_t* text, int64_t q) {
  for (int64_t k = q - 1; k >= 0; --k) {
    if (text[k] == '"' && !escaped(text, k)) return k;
  }
  return -1;
}

bool scalar_byte(uint8_t b) {
  return (b >= '0' && b <= '9') || (b >= 'a' && b <= 'z') || (b >= 'A' && b <= 'Z') || b == '.' || b == '+' || b == '-';
}

}  // namespace

void canonical_value(const uint8_t* p, size_t n, std::string* out) {
  out->clear();
  Canon(p, n, out).value(0);
}

int64_t value_start(const uint8_t* text, int64_t last) {
  if (last < 0) return -1;
  const uint8_t c = text[last];
  if (c == '"') return string_start(text, last);
  if (c == '}' || c == ']') {
    int64_t depth = 0;
    for (int64_t k = last; k >= 0; --k) {
      const uint8_t b = text[k];
      if (b == '"') {
        k = string_start(text, k);
        if (k < 0) return -1;
        continue;
      }
      if (b == '}' || b == ']') ++depth;
      if (b == '{' || b == '[') {
        if (--depth == 0) return k;
      }
    }
    return -1;
  }
  if (!scalar_byte(c)) return -1;
  int64_t k = last;
  while (k > 0 && scalar_byte(text[k - 1])) --k;
  return k;
}

}  // namespace unique

JsonTokenClasses build_json_token_classes(const TokenizerInfo& t) {
  using namespace unique;
  JsonTokenClasses out;
  const size_t words = static_cast<size_t>(t.words);
  for (auto& bits : out.may_complete) bits.assign(words, 0);
  out.with_comma.assign(words, 0);
  out.pos_of.assign(static_cast<size_t>(t.vocab_size), -1);
  for (size_t i = 0; i < t.sorted.size(); ++i) out.pos_of[static_cast<size_t>(t.sorted[i])] = static_cast<int32_t>(i);
  for (int32_t id = 0; id < t.vocab_size; ++id) {
    const std::string& tok = t.tokens[static_cast<size_t>(id)];
    const uint32_t bit = 1u << (id & 31);
    const size_t w = static_cast<size_t>(id) >> 5;
    if (tok.find(',') != std::string::npos) out.with_comma[w] |= bit;
    for (uint8_t c0 = 0; c0 < kLexContexts; ++c0) {
      // Read from inside a string: safe while no quote closes it. From outside: safe only as
      // blanks, an opening quote and string content that stays open (a quote never follows a
      // completed value in JSON, so such a token cannot have completed one before it).
      bool safe = true;
      uint8_t c = c0;
      size_t k = 0;
      if (c0 == kOut) {
        while (k < tok.size() && is_ws(static_cast<uint8_t>(tok[k]))) ++k;
        if (k == tok.size() || tok[k] != '"') {
          safe = false;
        } else {
          c = kStr;
          ++k;
        }
      }
      for (; safe && k < tok.size(); ++k) {
        const uint8_t b = static_cast<uint8_t>(tok[k]);
        if (c == kStr && b == '"') safe = false;
        c = lex_step(c, b);
      }
      if (!safe) out.may_complete[c0][w] |= bit;
    }
  }
  return out;
}

const JsonTokenClasses& TokenizerInfo::json_token_classes() const {
  std::call_once(json_classes_once_, [this] {
    json_classes_ = std::make_shared<const JsonTokenClasses>(build_json_token_classes(*this));
  });
  return *json_classes_;
}

// -- the matcher's side -----------------------------------------------------------------------

void Matcher::push_unique(uint8_t b) {
  hist_.push_back(b);
  epoch_.push_back(++epoch_next_);
  UniqueLex u = ulex_.back();
  if (u.active) {
    if (u.ctx == unique::kOut) {
      if (b == '[' || b == '{') {
        ++u.depth;
      } else if (b == ']' || b == '}') {
        if (--u.depth < 0) u.active = 0;
      }
    }
    u.ctx = unique::lex_step(u.ctx, b);
  }
  ulex_.push_back(u);
}

const Matcher::SiblingLink* Matcher::sibling_link(int32_t start) {
  if (start <= 0 || start > static_cast<int32_t>(hist_.size())) return nullptr;
  const uint32_t stamp = epoch_[static_cast<size_t>(start) - 1];
  auto found = siblings_.find(start);
  if (found != siblings_.end() && found->second.epoch == stamp) return &found->second;
  // The text before an item of a JSON array is `[` or `,`, with blanks around: a `,` follows
  // the item before, read back to its first byte.
  SiblingLink link{stamp, -1, {}};
  const uint8_t* text = hist_.data();
  int64_t i = start - 1;
  while (i >= 0 && unique::is_ws(text[i])) --i;
  if (i >= 0 && text[i] == ',') {
    int64_t j = i - 1;
    while (j >= 0 && unique::is_ws(text[j])) --j;
    const int64_t s = unique::value_start(text, j);
    if (s >= 0) {
      spend(j + 1 - s);
      unique::canonical_value(text + s, static_cast<size_t>(j + 1 - s), &link.canon);
      link.prev = static_cast<int32_t>(s);
    }
  }
  return &(siblings_[start] = std::move(link));
}

bool Matcher::repeats_earlier_item(int32_t origin, int32_t pos) {
  spend(pos - origin);
  unique::canonical_value(hist_.data() + origin, static_cast<size_t>(pos - origin), &canon_);
  for (const SiblingLink* link = sibling_link(origin); link != nullptr && link->prev >= 0;
       link = sibling_link(link->prev)) {
    spend(1);
    if (link->canon == canon_) return true;
  }
  return false;
}

// Whether the input ends inside a number whose mantissa is zero and which has begun its
// exponent (`0e`, `-0.0E+1`): the exponent's digits and sign then change nothing of the value.
// *needs_digit: the exponent has no digit yet, so one must follow.
bool Matcher::zero_exponent(bool* needs_digit) const {
  size_t k = hist_.size();
  while (k > 0 && unique::number_byte(hist_[k - 1])) --k;
  bool seen_e = false, zero = false;
  *needs_digit = true;
  for (size_t i = k; i < hist_.size(); ++i) {
    const uint8_t b = hist_[i];
    if (b == 'e' || b == 'E') {
      if (seen_e) return false;
      seen_e = true;
    } else if (!seen_e) {
      if (b >= '1' && b <= '9') return false;
      if (b == '0') zero = true;
    } else {
      *needs_digit = !(b >= '0' && b <= '9');
    }
  }
  return seen_e && zero;
}

bool Matcher::alive() {
  if (last_set_can_end()) return true;
  if (!ulex_.back().active) return any_byte_possible();
  // Forced bytes up to a choice: a begun item with a choice left has unused values left (the
  // front end admits only item schemas where it does), while a forced tail may end in a vetoed
  // completion. Bytes that change no value are no choice: blanks outside strings (optional in
  // every layout that allows a choice of them), and the exponent of a zero.
  const CompiledGrammar& g = *g_;
  const uint32_t base = static_cast<uint32_t>(set_begin_.size());
  bool ok = true;
  try {
    for (size_t step = 0; step < kMaxForcedLookahead; ++step) {
      if (last_set_can_end()) break;
      const bool in_string = ulex_.back().ctx != unique::kOut;
      bool needs_digit = false;
      const bool zero_exp = !in_string && zero_exponent(&needs_digit);
      auto neutral = [&](int b) {
        if (in_string) return false;
        if (unique::is_ws(static_cast<uint8_t>(b))) return true;
        return zero_exp && ((b >= '0' && b <= '9') || b == '+' || b == '-');
      };
      int other = -1, spare = -1, choices = 0;
      for (uint32_t k = set_begin_.back(); k < items_.size() && choices < 2; ++k) {
        const State& st = g.states[items_[k].state];
        for (uint32_t e = st.byte_begin; e < st.byte_end && choices < 2; ++e) {
          for (int b = g.byte_edges[e].lo; b <= g.byte_edges[e].hi && choices < 2; ++b) {
            if (neutral(b)) {
              if (spare < 0 || b == '0') spare = b;
            } else if (b != other) {
              choices = other < 0 ? 1 : 2;
              if (other < 0) other = b;
            }
          }
        }
      }
      if (choices >= 2) break;
      // A zero's exponent with its digits read and no way on: more digits leave it as it is.
      const int next = other >= 0 ? other : (zero_exp && !needs_digit ? -1 : spare);
      if (next < 0 || !advance(static_cast<uint8_t>(next))) {
        ok = false;
        break;
      }
    }
  } catch (...) {
    pop_to(base);
    throw;
  }
  pop_to(base);
  return ok;
}

void Matcher::recheck_unique(uint32_t* mask, int64_t vw) {
  const TokenizerInfo& t = *g_->tok;
  const JsonTokenClasses& cls = t.json_token_classes();
  const UniqueLex& u = ulex_.back();
  const uint32_t* may = u.active ? cls.may_complete[u.ctx].data() : cls.with_comma.data();
  scratch_.clear();
  for (int64_t w = 0; w < vw; ++w) {
    uint32_t hit = mask[w] & may[w];
    if (hit == 0) continue;
    mask[w] &= ~hit;
    while (hit != 0) {
      const int b = __builtin_ctz(hit);
      hit &= hit - 1;
      const int32_t pos = cls.pos_of[static_cast<size_t>(w * 32 + b)];
      if (pos >= 0) scratch_.push_back(pos);
    }
  }
  if (scratch_.empty()) return;
  std::sort(scratch_.begin(), scratch_.end());
  check_uncertain(mask);
}

}  // namespace grammar
}  // namespace agent_infer
