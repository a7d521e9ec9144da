#include "grammar/automaton.h"

#include <algorithm>
#include <bitset>
#include <climits>
#include <map>
#include <optional>
#include <queue>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace epd::grammar {

namespace {

using ByteSet = std::bitset<256>;
constexpr int64_t kInfDist = INT64_MAX / 4;
constexpr size_t kMaxNfaStates = 50000;
constexpr int kMaxGroupDepth = 64;
// Subset construction work (NFA states visited over all closures): bounds compile time.
constexpr size_t kMaxDeterminizeWork = 20000000;
constexpr int kMaxRepeat = 1000;

// Regex syntax tree.
struct Re {
  enum Kind { kEmpty, kSet, kCat, kAlt, kRep, kBol, kEol, kLook } kind = kEmpty;
  ByteSet set;
  std::vector<Re> kids;
  int min = 0, max = 0;  // kRep (max -1 = unbounded)
  bool neg = false;      // kLook: (?!
};

Re Set(const ByteSet& s) { return Re{.kind = Re::kSet, .set = s}; }
Re Range(int lo, int hi) {
  ByteSet s;
  for (int c = lo; c <= hi; ++c) s.set(static_cast<size_t>(c));
  return Set(s);
}
Re Cat(std::vector<Re> kids) { return Re{.kind = Re::kCat, .kids = std::move(kids)}; }
Re Alt(std::vector<Re> kids) { return Re{.kind = Re::kAlt, .kids = std::move(kids)}; }
Re Rep(Re r, int min, int max) {
  return Re{.kind = Re::kRep, .kids = {std::move(r)}, .min = min, .max = max};
}

// Non-ASCII code point ranges (inclusive, >= 0x80).
using Ranges = std::vector<std::pair<uint32_t, uint32_t>>;
constexpr uint32_t kMaxCp = 0x10FFFF;

uint32_t Utf8Len(uint32_t cp) { return cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4; }

std::vector<uint8_t> Encode(uint32_t cp) {
  const uint32_t n = Utf8Len(cp);
  if (n == 1) return {static_cast<uint8_t>(cp)};
  std::vector<uint8_t> out(n);
  for (uint32_t k = n - 1; k > 0; --k) {
    out[k] = static_cast<uint8_t>(0x80 | (cp & 0x3F));
    cp >>= 6;
  }
  static const uint8_t kLead[] = {0, 0, 0xC0, 0xE0, 0xF0};
  out[0] = static_cast<uint8_t>(kLead[n] | cp);
  return out;
}

// The UTF-8 byte-range sequences for code points lo..hi (no surrogates), as in RE2 / Rust's
// utf8-ranges: split at encoding lengths, then until only the lead byte's range is partial.
void Utf8Sequences(uint32_t lo, uint32_t hi, std::vector<Re>* out) {
  if (lo > hi) return;
  if (lo <= 0xDFFF && hi >= 0xD800) {
    if (lo < 0xD800) Utf8Sequences(lo, 0xD7FF, out);
    if (hi > 0xDFFF) Utf8Sequences(0xE000, hi, out);
    return;
  }
  for (uint32_t b : {0x7Fu, 0x7FFu, 0xFFFFu}) {
    if (lo <= b && hi > b) {
      Utf8Sequences(lo, b, out);
      Utf8Sequences(b + 1, hi, out);
      return;
    }
  }
  const uint32_t n = Utf8Len(lo);
  for (uint32_t k = 1; k < n; ++k) {
    const uint32_t m = (1u << (6 * k)) - 1;
    if ((lo & ~m) != (hi & ~m)) {
      if ((lo & m) != 0) {
        Utf8Sequences(lo, lo | m, out);
        Utf8Sequences((lo | m) + 1, hi, out);
        return;
      }
      if ((hi & m) != m) {
        Utf8Sequences(lo, (hi & ~m) - 1, out);
        Utf8Sequences(hi & ~m, hi, out);
        return;
      }
    }
  }
  const std::vector<uint8_t> a = Encode(lo), b = Encode(hi);
  std::vector<Re> bytes;
  for (size_t k = 0; k < a.size(); ++k) bytes.push_back(Range(a[k], b[k]));
  out->push_back(bytes.size() == 1 ? bytes[0] : Cat(std::move(bytes)));
}

// One character: an ASCII byte in `ascii` or a code point in `wide` (the grammar's strings
// then drop the characters they never write: CompileRegex intersects with AnyText).
Re Char(const ByteSet& ascii, const Ranges& wide) {
  std::vector<Re> alts = {Set(ascii)};
  for (const auto& [lo, hi] : wide) Utf8Sequences(lo, hi, &alts);
  return Alt(std::move(alts));
}
const Ranges kAllWide = {{0x80, kMaxCp}};

// [0x80, kMaxCp] minus `r`.
Ranges Complement(Ranges r) {
  std::sort(r.begin(), r.end());
  Ranges out;
  uint32_t next = 0x80;
  for (const auto& [lo, hi] : r) {
    if (lo > next) out.push_back({next, lo - 1});
    next = std::max(next, hi + 1);
  }
  if (next <= kMaxCp) out.push_back({next, kMaxCp});
  return out;
}

ByteSet AsciiAll() {
  ByteSet s;
  for (int c = 0; c < 128; ++c) s.set(static_cast<size_t>(c));
  return s;
}
Re AnyChar() { return Char(AsciiAll(), kAllWide); }

// The code point at the start of `s` (valid UTF-8 from the JSON text), its length in *n.
uint32_t DecodeUtf8(std::string_view s, size_t* n) {
  const uint8_t c = static_cast<uint8_t>(s[0]);
  const size_t len = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
  uint32_t cp = len == 1 ? c : c & (0x3F >> (len - 1));
  for (size_t k = 1; k < len && k < s.size(); ++k)
    cp = (cp << 6) | (static_cast<uint8_t>(s[k]) & 0x3F);
  *n = std::min(len, s.size());
  return cp;
}

std::string Utf8(uint32_t cp) {
  std::string out;
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return out;
}

Re Bytes(std::string_view s) {
  std::vector<Re> kids;
  for (char ch : s) {
    ByteSet b;
    b.set(static_cast<uint8_t>(ch));
    kids.push_back(Set(b));
  }
  return kids.size() == 1 ? kids[0] : Cat(std::move(kids));
}

class Parser {
 public:
  explicit Parser(std::string_view p) : p_(p) {}

  absl::StatusOr<Re> Parse() {
    Re r = Alternation();
    if (!err_.ok()) return err_;
    if (i_ < p_.size()) Fail("unbalanced ')'");
    if (!err_.ok()) return err_;
    return r;
  }

 private:
  void Fail(std::string_view why) {
    if (err_.ok()) {
      err_ = absl::InvalidArgumentError(absl::StrCat(
          "pattern '", std::string(p_), "': ", std::string(why), " (at offset ", i_, ")"));
    }
  }
  bool More() const { return i_ < p_.size() && err_.ok(); }
  char Peek() const { return p_[i_]; }

  Re Alternation() {
    std::vector<Re> alts = {Concatenation()};
    while (More() && Peek() == '|') {
      ++i_;
      alts.push_back(Concatenation());
    }
    return alts.size() == 1 ? alts[0] : Alt(std::move(alts));
  }

  Re Concatenation() {
    std::vector<Re> items;
    while (More() && Peek() != '|' && Peek() != ')') items.push_back(Quantified());
    return Cat(std::move(items));
  }

  Re Quantified() {
    Re atom = Atom();
    while (More()) {
      const char c = Peek();
      int min = 0, max = 0;
      if (c == '*') {
        min = 0, max = -1, ++i_;
      } else if (c == '+') {
        min = 1, max = -1, ++i_;
      } else if (c == '?') {
        min = 0, max = 1, ++i_;
      } else if (c == '{' && Braces(&min, &max)) {
      } else {
        break;
      }
      if (atom.kind == Re::kBol || atom.kind == Re::kEol || atom.kind == Re::kLook) {
        Fail("quantified anchor or lookahead");
        return atom;
      }
      if (atom.kind == Re::kRep) {
        Fail("nested quantifier");
        return atom;
      }
      if (More() && Peek() == '?') ++i_;  // lazy: the same language
      atom = Rep(std::move(atom), min, max);
    }
    return atom;
  }

  // {n} {n,} {n,m}; false (nothing consumed) when the brace is a literal.
  bool Braces(int* min, int* max) {
    size_t j = i_ + 1;
    auto num = [&](int* v) {
      const size_t s = j;
      long long x = 0;
      while (j < p_.size() && p_[j] >= '0' && p_[j] <= '9') {
        x = std::min<long long>(x * 10 + (p_[j] - '0'), INT_MAX);
        ++j;
      }
      *v = static_cast<int>(x);
      return j > s;
    };
    if (!num(min)) return false;
    *max = *min;
    if (j < p_.size() && p_[j] == ',') {
      ++j;
      if (!num(max)) *max = -1;
    }
    if (j >= p_.size() || p_[j] != '}') return false;
    i_ = j + 1;
    if (*min > kMaxRepeat || *max > kMaxRepeat) {
      Fail(absl::StrCat("repetition count above ", kMaxRepeat));
    } else if (*max >= 0 && *max < *min) {
      Fail("repetition {n,m} with m < n");
    }
    return true;
  }

  Re Atom() {
    const char c = Peek();
    ++i_;
    switch (c) {
      case '^':
        return Re{.kind = Re::kBol};
      case '$':
        return Re{.kind = Re::kEol};
      case '.': {
        ByteSet a = AsciiAll();
        a.reset('\n');
        a.reset('\r');
        return Char(a, Complement({{0x2028, 0x2029}}));  // JavaScript's line terminators
      }
      case '[':
        return Class();
      case '(':
        return Group();
      case '\\': {
        ByteSet set;
        bool neg = false;
        std::string lit;
        if (!Escape(false, &set, &neg, &lit)) return Re{};
        if (!lit.empty()) return Bytes(lit);
        return neg ? Char(AsciiAll() & ~set, kAllWide) : Set(set);
      }
      case '*':
      case '+':
      case '?':
        Fail("nothing to repeat");
        return Re{};
      default: {
        // A literal character, with its UTF-8 continuation bytes.
        std::string lit(1, c);
        while (i_ < p_.size() && (static_cast<uint8_t>(p_[i_]) & 0xC0) == 0x80) lit += p_[i_++];
        return Bytes(lit);
      }
    }
  }

  Re Group() {
    if (++depth_ > kMaxGroupDepth) {
      Fail(absl::StrCat("groups nested deeper than ", kMaxGroupDepth));
      return Re{};
    }
    struct Leave {
      int* d;
      ~Leave() { --*d; }
    } leave{&depth_};
    Re::Kind kind = Re::kCat;
    bool neg = false;
    if (i_ < p_.size() && Peek() == '?') {
      const std::string_view rest = p_.substr(i_);
      if (rest.starts_with("?:")) {
        i_ += 2;
      } else if (rest.starts_with("?=") || rest.starts_with("?!")) {
        kind = Re::kLook;
        neg = rest[1] == '!';
        i_ += 2;
      } else if (rest.starts_with("?<=") || rest.starts_with("?<!")) {
        Fail("lookbehind (?<= / (?<! is not supported");
        return Re{};
      } else if (rest.starts_with("?<") || rest.starts_with("?P<")) {
        const size_t close = p_.find('>', i_);
        if (close == std::string_view::npos) {
          Fail("unterminated group name");
          return Re{};
        }
        i_ = close + 1;
      } else {
        Fail("unsupported group syntax (?");
        return Re{};
      }
    }
    Re body = Alternation();
    if (!More() || Peek() != ')') {
      Fail("missing ')'");
      return Re{};
    }
    ++i_;
    if (kind == Re::kLook) return Re{.kind = Re::kLook, .kids = {std::move(body)}, .neg = neg};
    return body;
  }

  // After '\': a class escape (set / neg), or a literal (lit). False on an unsupported escape.
  bool Escape(bool in_class, ByteSet* set, bool* neg, std::string* lit) {
    if (i_ >= p_.size()) {
      Fail("trailing '\\'");
      return false;
    }
    const char c = p_[i_++];
    auto range = [&](int lo, int hi) {
      for (int x = lo; x <= hi; ++x) set->set(static_cast<size_t>(x));
    };
    switch (c) {
      case 'd':
      case 'D':
        range('0', '9');
        *neg = c == 'D';
        return true;
      case 'w':
      case 'W':
        range('0', '9'), range('a', 'z'), range('A', 'Z'), set->set('_');
        *neg = c == 'W';
        return true;
      case 's':
      case 'S':
        for (char x : std::string_view(" \t\n\r\f\v")) set->set(static_cast<uint8_t>(x));
        *neg = c == 'S';
        return true;
      case 't':
        lit->assign(1, '\t');
        return true;
      case 'n':
        lit->assign(1, '\n');
        return true;
      case 'r':
        lit->assign(1, '\r');
        return true;
      case 'f':
        lit->assign(1, '\f');
        return true;
      case 'v':
        lit->assign(1, '\v');
        return true;
      case '0':
        lit->assign(1, '\0');
        return true;
      case 'b':
        if (in_class) {
          lit->assign(1, '\b');
          return true;
        }
        Fail("word boundary \\b is not supported");
        return false;
      case 'x':
      case 'u': {
        const int n = c == 'x' ? 2 : 4;
        if (i_ + static_cast<size_t>(n) > p_.size()) {
          Fail("short \\x / \\u escape");
          return false;
        }
        uint32_t cp = 0;
        for (int k = 0; k < n; ++k) {
          const char h = p_[i_++];
          int v = -1;
          if (h >= '0' && h <= '9') v = h - '0';
          if (h >= 'a' && h <= 'f') v = h - 'a' + 10;
          if (h >= 'A' && h <= 'F') v = h - 'A' + 10;
          if (v < 0) {
            Fail("bad hex digit in escape");
            return false;
          }
          cp = cp * 16 + static_cast<uint32_t>(v);
        }
        if (cp >= 0xD800 && cp <= 0xDFFF) {
          Fail("surrogate \\u escape");
          return false;
        }
        *lit = Utf8(cp);
        return true;
      }
      default:
        if ((c >= '1' && c <= '9') || c == 'k') {
          Fail("backreferences are not supported");
          return false;
        }
        if (c == 'p' || c == 'P') {
          Fail("unicode property escapes \\p{...} are not supported");
          return false;
        }
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
          Fail(absl::StrCat("unsupported escape \\", std::string(1, c)));
          return false;
        }
        lit->assign(1, c);
        return true;
    }
  }

  Re Class() {
    bool negated = false;
    if (i_ < p_.size() && Peek() == '^') {
      negated = true;
      ++i_;
    }
    ByteSet set;
    Ranges wide;
    auto add = [&](uint32_t lo, uint32_t hi) {
      for (uint32_t x = lo; x <= std::min(hi, 0x7Fu); ++x) set.set(x);
      if (hi >= 0x80) wide.push_back({std::max(lo, 0x80u), hi});
    };
    while (true) {
      if (i_ >= p_.size()) {
        Fail("missing ']'");
        return Re{};
      }
      if (Peek() == ']') break;  // (first: [] is the empty class, as in JavaScript)
      // One member: a char (or escape), maybe the start of a range.
      int64_t lo = -1;
      if (!Member(&set, &lo)) return Re{};
      if (lo >= 0 && i_ + 1 < p_.size() && Peek() == '-' && p_[i_ + 1] != ']') {
        ++i_;
        int64_t hi = -1;
        ByteSet dummy;
        if (!Member(&dummy, &hi)) return Re{};
        if (hi < 0 || hi < lo) {
          Fail("bad class range");
          return Re{};
        }
        add(static_cast<uint32_t>(lo), static_cast<uint32_t>(hi));
      } else if (lo >= 0) {
        add(static_cast<uint32_t>(lo), static_cast<uint32_t>(lo));
      }
    }
    ++i_;  // ']'
    if (negated) return Char(AsciiAll() & ~set, Complement(wide));
    return Char(set, wide);
  }

  // A class member: a single character (*single, its code point) or a class escape merged into
  // `set`.
  bool Member(ByteSet* set, int64_t* single) {
    if (p_[i_] == '\\') {
      ++i_;
      ByteSet s;
      bool neg = false;
      std::string lit;
      if (!Escape(true, &s, &neg, &lit)) return false;
      if (!lit.empty()) {
        size_t n = 0;
        *single = DecodeUtf8(lit, &n);
        return true;
      }
      if (neg) {
        Fail("negated class escape (\\D \\W \\S) inside [...] is not supported");
        return false;
      }
      *set |= s;
      return true;
    }
    size_t n = 0;
    *single = DecodeUtf8(p_.substr(i_), &n);
    i_ += n;
    return true;
  }

  std::string_view p_;
  size_t i_ = 0;
  int depth_ = 0;
  absl::Status err_;
};

// Thompson NFA: each state has at most one byte-set edge and some epsilon edges.
struct Nfa {
  struct State {
    int set = -1, to = -1;
    std::vector<int> eps;
  };
  std::vector<State> states;
  std::vector<ByteSet> sets;
  bool overflow = false;
  int New() {
    if (states.size() >= kMaxNfaStates) overflow = true;
    states.emplace_back();
    return static_cast<int>(states.size()) - 1;
  }
  // A fragment for `r`: returns {start, end}.
  std::pair<int, int> Emit(const Re& r) {
    if (overflow) {
      const int s = New();
      return {s, s};
    }
    switch (r.kind) {
      case Re::kSet: {
        const int s = New(), e = New();
        sets.push_back(r.set);
        states[static_cast<size_t>(s)].set = static_cast<int>(sets.size()) - 1;
        states[static_cast<size_t>(s)].to = e;
        return {s, e};
      }
      case Re::kCat: {
        const int s = New();
        int cur = s;
        for (const Re& k : r.kids) {
          if (overflow) break;
          auto [ks, ke] = Emit(k);
          states[static_cast<size_t>(cur)].eps.push_back(ks);
          cur = ke;
        }
        return {s, cur};
      }
      case Re::kAlt: {
        const int s = New(), e = New();
        for (const Re& k : r.kids) {
          auto [ks, ke] = Emit(k);
          states[static_cast<size_t>(s)].eps.push_back(ks);
          states[static_cast<size_t>(ke)].eps.push_back(e);
        }
        return {s, e};
      }
      case Re::kRep: {
        const int s = New();
        int cur = s;
        for (int k = 0; k < r.min && !overflow; ++k) {
          auto [ks, ke] = Emit(r.kids[0]);
          states[static_cast<size_t>(cur)].eps.push_back(ks);
          cur = ke;
        }
        if (r.max < 0) {
          auto [ks, ke] = Emit(r.kids[0]);
          const int e = New();
          states[static_cast<size_t>(cur)].eps.push_back(ks);
          states[static_cast<size_t>(cur)].eps.push_back(e);
          states[static_cast<size_t>(ke)].eps.push_back(cur);
          return {s, e};
        }
        const int e = New();
        for (int k = r.min; k < r.max && !overflow; ++k) {
          auto [ks, ke] = Emit(r.kids[0]);
          states[static_cast<size_t>(cur)].eps.push_back(ks);
          states[static_cast<size_t>(cur)].eps.push_back(e);
          cur = ke;
        }
        states[static_cast<size_t>(cur)].eps.push_back(e);
        return {s, e};
      }
      default: {
        const int s = New();
        return {s, s};
      }
    }
  }
};

absl::StatusOr<WideDfa> Determinize(const Re& r, size_t max_states) {
  Nfa nfa;
  const auto fragment = nfa.Emit(r);
  const int start = fragment.first, accept = fragment.second;
  if (nfa.overflow) {
    return absl::InvalidArgumentError(
        absl::StrCat("pattern expands to more than ", kMaxNfaStates, " automaton states"));
  }
  size_t work = 0;
  auto closure = [&](std::vector<int> set) {
    std::vector<char> seen(nfa.states.size(), 0);
    std::vector<int> stack = set, out;
    for (int s : set) seen[static_cast<size_t>(s)] = 1;
    while (!stack.empty()) {
      const int s = stack.back();
      stack.pop_back();
      out.push_back(s);
      ++work;
      for (int t : nfa.states[static_cast<size_t>(s)].eps) {
        if (!seen[static_cast<size_t>(t)]) {
          seen[static_cast<size_t>(t)] = 1;
          stack.push_back(t);
        }
      }
    }
    // Only states with a byte edge (or the accepting one) matter for identity.
    std::vector<int> key;
    for (int s : out) {
      if (nfa.states[static_cast<size_t>(s)].set >= 0 || s == accept) key.push_back(s);
    }
    std::sort(key.begin(), key.end());
    return key;
  };
  WideDfa d;
  std::map<std::vector<int>, int32_t> ids;
  std::vector<std::vector<int>> pending;
  auto id_of = [&](std::vector<int> key) -> int32_t {
    auto it = ids.find(key);
    if (it != ids.end()) return it->second;
    const bool acc = std::binary_search(key.begin(), key.end(), accept);
    const int32_t id = d.Add(acc);
    ids.emplace(key, id);
    pending.push_back(std::move(key));
    return id;
  };
  d.start = id_of(closure({start}));
  for (size_t k = 0; k < pending.size(); ++k) {
    if (d.size() > max_states) {
      return absl::InvalidArgumentError(
          absl::StrCat("pattern compiles to more than ", max_states, " states"));
    }
    if (work > kMaxDeterminizeWork) {
      return absl::InvalidArgumentError("pattern is too complex to compile");
    }
    const std::vector<int> cur = pending[k];
    std::array<std::vector<int>, 256> targets;
    for (int s : cur) {
      const Nfa::State& st = nfa.states[static_cast<size_t>(s)];
      if (st.set < 0) continue;
      const ByteSet& bs = nfa.sets[static_cast<size_t>(st.set)];
      for (int c = 0; c < 256; ++c) {
        if (bs.test(static_cast<size_t>(c))) targets[static_cast<size_t>(c)].push_back(st.to);
      }
    }
    std::map<std::vector<int>, int32_t> local;
    for (int c = 0; c < 256; ++c) {
      auto& t = targets[static_cast<size_t>(c)];
      if (t.empty()) continue;
      auto it = local.find(t);
      int32_t id;
      if (it != local.end()) {
        id = it->second;
      } else {
        id = id_of(closure(t));
        local.emplace(t, id);
      }
      d.next[k][static_cast<size_t>(c)] = id;
    }
  }
  return d;
}

bool HasAssertion(const Re& r) {
  if (r.kind == Re::kBol || r.kind == Re::kEol || r.kind == Re::kLook) return true;
  for (const Re& k : r.kids) {
    if (HasAssertion(k)) return true;
  }
  return false;
}

}  // namespace

absl::StatusOr<WideDfa> CompileRegex(std::string_view pattern, size_t max_states) {
  auto parsed = Parser(pattern).Parse();
  if (!parsed.ok()) return parsed.status();
  std::vector<Re> alts;
  if (parsed->kind == Re::kAlt) {
    alts = parsed->kids;
  } else {
    alts.push_back(*parsed);
  }
  auto fail = [&](std::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("pattern '", std::string(pattern), "': ", std::string(why)));
  };
  std::optional<WideDfa> result;
  for (Re& alt : alts) {
    std::vector<Re> items;
    if (alt.kind == Re::kCat) {
      items = alt.kids;
    } else {
      items.push_back(alt);
    }
    size_t b = 0, e = items.size();
    const bool bol = b < e && items[b].kind == Re::kBol;
    if (bol) ++b;
    std::vector<Re> looks;
    while (bol && b < e && items[b].kind == Re::kLook) looks.push_back(items[b++]);
    const bool eol = e > b && items[e - 1].kind == Re::kEol;
    if (eol) --e;
    std::vector<Re> body;
    if (!bol) body.push_back(Rep(AnyChar(), 0, -1));
    for (size_t k = b; k < e; ++k) {
      if (HasAssertion(items[k])) {
        return fail(
            "anchors are supported only at the start / end of an alternative, and lookahead "
            "(?= (?! only right after a leading ^");
      }
      body.push_back(items[k]);
    }
    if (!eol) body.push_back(Rep(AnyChar(), 0, -1));
    auto d = Determinize(Cat(std::move(body)), max_states);
    if (!d.ok()) return d.status();
    for (const Re& look : looks) {
      if (HasAssertion(look.kids[0])) return fail("anchors inside a lookahead");
      auto l = Determinize(Cat({look.kids[0], Rep(AnyChar(), 0, -1)}), max_states);
      if (!l.ok()) return l.status();
      d = Product(*d, *l, look.neg ? ProductOp::kAndNot : ProductOp::kAnd, max_states);
      if (!d.ok()) return d.status();
    }
    if (result) {
      auto u = Product(*result, *d, ProductOp::kOr, max_states);
      if (!u.ok()) return u.status();
      result = *std::move(u);
    } else {
      result = *std::move(d);
    }
  }
  // Whatever the pattern says, the text is UTF-8 the grammar's strings allow.
  return Product(*result, AnyText(), ProductOp::kAnd, max_states);
}

WideDfa AnyText() {
  WideDfa d;
  for (int k = 0; k < 4; ++k) d.Add(k == 0);
  for (int c = 0; c < 0x80; ++c) d.next[0][static_cast<size_t>(c)] = 0;
  for (int c = 0xC2; c <= 0xDF; ++c) d.next[0][static_cast<size_t>(c)] = 1;
  for (int c = 0xE1; c <= 0xEF; ++c) {
    if (c != 0xED) d.next[0][static_cast<size_t>(c)] = 2;
  }
  for (int c = 0xF1; c <= 0xF3; ++c) d.next[0][static_cast<size_t>(c)] = 3;
  for (int k = 1; k < 4; ++k) {
    for (int c = 0x80; c <= 0xBF; ++c)
      d.next[static_cast<size_t>(k)][static_cast<size_t>(c)] = k - 1;
  }
  return d;
}

WideDfa LengthDfa(int64_t min, int64_t max) {
  const int64_t bound = max >= 0 ? max : min;
  WideDfa d;
  for (int64_t k = 0; k <= bound; ++k) d.Add(k >= min);
  for (int64_t k = 0; k <= bound; ++k) {
    auto& row = d.next[static_cast<size_t>(k)];
    for (int c = 0; c < 256; ++c) {
      if ((c & 0xC0) == 0x80) {
        row[static_cast<size_t>(c)] = static_cast<int32_t>(k);
      } else if (k + 1 <= bound) {
        row[static_cast<size_t>(c)] = static_cast<int32_t>(k + 1);
      } else if (max < 0) {
        row[static_cast<size_t>(c)] = static_cast<int32_t>(bound);
      }
    }
  }
  return d;
}

WideDfa WordsDfa(const std::vector<std::string>& words) {
  WideDfa d;
  d.Add(false);
  for (const std::string& w : words) {
    int32_t s = 0;
    for (char ch : w) {
      const uint8_t c = static_cast<uint8_t>(ch);
      if (d.next[static_cast<size_t>(s)][c] < 0) {
        const int32_t t = d.Add(false);
        d.next[static_cast<size_t>(s)][c] = t;
      }
      s = d.next[static_cast<size_t>(s)][c];
    }
    d.accept[static_cast<size_t>(s)] = 1;
  }
  return d;
}

absl::StatusOr<WideDfa> MultipleOfDfa(const std::string& int_digits, const std::string& frac_digits,
                                      size_t max_states) {
  std::string digits = int_digits + frac_digits;
  digits.erase(0, std::min(digits.find_first_not_of('0'), digits.size()));
  if (digits.empty()) return absl::InvalidArgumentError("multipleOf must be above 0");
  const int s = static_cast<int>(frac_digits.size());
  if (digits.size() > 7 || std::stoll(digits) * (s + 4) > static_cast<long long>(max_states)) {
    return absl::InvalidArgumentError(absl::StrCat("multipleOf ", int_digits,
                                                   frac_digits.empty() ? "" : ".", frac_digits,
                                                   " needs more than ", max_states, " states"));
  }
  const int64_t p = std::stoll(digits);
  auto scaled_zero = [&](int64_t r, int shift) {
    for (int k = 0; k < shift; ++k) r = (r * 10) % p;
    return r == 0;
  };
  WideDfa d;
  std::map<std::tuple<int, int64_t, int>, int32_t> ids;
  std::vector<std::tuple<int, int64_t, int>> pending;
  auto id_of = [&](int phase, int64_t r, int j) {
    auto key = std::make_tuple(phase, r, j);
    auto it = ids.find(key);
    if (it != ids.end()) return it->second;
    bool acc = false;
    if (phase == 2) acc = scaled_zero(r, s);
    if (phase == 4) acc = scaled_zero(r, s - j);
    if (phase == 5) acc = r == 0;
    const int32_t id = d.Add(acc);
    ids.emplace(key, id);
    pending.push_back(key);
    return id;
  };
  d.start = id_of(0, 0, 0);
  for (size_t k = 0; k < pending.size(); ++k) {
    auto [phase, r, j] = pending[k];
    auto set = [&](char c, int32_t to) { d.next[k][static_cast<uint8_t>(c)] = to; };
    for (int dg = 0; dg <= 9; ++dg) {
      const char c = static_cast<char>('0' + dg);
      const int64_t r2 = (r * 10 + dg) % p;
      if (phase <= 2) set(c, id_of(2, r2, 0));
      if (phase == 3 || phase == 4) {
        const int jj = phase == 3 ? 0 : j;
        if (jj < s) {
          set(c, id_of(4, r2, jj + 1));
        } else if (dg == 0) {
          set(c, id_of(5, r, 0));
        }
      }
      if (phase == 5 && dg == 0) set(c, id_of(5, r, 0));
    }
    if (phase == 0) set('-', id_of(1, 0, 0));
    if (phase == 2) set('.', id_of(3, r, 0));
  }
  return d;
}

absl::StatusOr<WideDfa> Product(const WideDfa& a, const WideDfa& b, ProductOp op,
                                size_t max_states) {
  WideDfa d;
  std::unordered_map<int64_t, int32_t> ids;
  std::vector<std::pair<int32_t, int32_t>> pending;
  auto accepting = [&](int32_t x, int32_t y) {
    const bool ax = x >= 0 && a.accept[static_cast<size_t>(x)];
    const bool by = y >= 0 && b.accept[static_cast<size_t>(y)];
    switch (op) {
      case ProductOp::kAnd:
        return ax && by;
      case ProductOp::kOr:
        return ax || by;
      case ProductOp::kAndNot:
        return ax && !by;
    }
    return false;
  };
  auto id_of = [&](int32_t x, int32_t y) {
    const int64_t key = (static_cast<int64_t>(x + 1) << 32) | static_cast<uint32_t>(y + 1);
    auto it = ids.find(key);
    if (it != ids.end()) return it->second;
    const int32_t id = d.Add(accepting(x, y));
    ids.emplace(key, id);
    pending.emplace_back(x, y);
    return id;
  };
  d.start = id_of(a.start, b.start);
  for (size_t k = 0; k < pending.size(); ++k) {
    if (d.size() > max_states) {
      return absl::InvalidArgumentError(
          absl::StrCat("constraint compiles to more than ", max_states, " states"));
    }
    const auto [x, y] = pending[k];
    for (int c = 0; c < 256; ++c) {
      const int32_t nx = x < 0 ? -1 : a.next[static_cast<size_t>(x)][static_cast<size_t>(c)];
      const int32_t ny = y < 0 ? -1 : b.next[static_cast<size_t>(y)][static_cast<size_t>(c)];
      bool dead = false;
      switch (op) {
        case ProductOp::kAnd:
          dead = nx < 0 || ny < 0;
          break;
        case ProductOp::kOr:
          dead = nx < 0 && ny < 0;
          break;
        case ProductOp::kAndNot:
          dead = nx < 0;
          break;
      }
      if (!dead) d.next[k][static_cast<size_t>(c)] = id_of(nx, ny);
    }
  }
  return d;
}

Dfa Finalize(const WideDfa& w, bool json_string) {
  const size_t n = w.size();
  auto writable = [&](int c) {
    return !json_string || c >= 0x20 || c == '\b' || c == '\f' || c == '\n' || c == '\r' ||
           c == '\t';
  };
  auto cost = [&](int c) -> int64_t {
    return json_string && (c == '"' || c == '\\' || c < 0x20) ? 2 : 1;
  };
  // Reverse Dijkstra from the accepting states.
  std::vector<std::vector<std::pair<int32_t, int64_t>>> rev(n);
  for (size_t s = 0; s < n; ++s) {
    for (int c = 0; c < 256; ++c) {
      const int32_t t = w.next[s][static_cast<size_t>(c)];
      if (t >= 0 && writable(c)) rev[static_cast<size_t>(t)].emplace_back(s, cost(c));
    }
  }
  std::vector<int64_t> dist(n, kInfDist);
  using Item = std::pair<int64_t, int32_t>;
  std::priority_queue<Item, std::vector<Item>, std::greater<>> q;
  for (size_t s = 0; s < n; ++s) {
    if (w.accept[s]) {
      dist[s] = 0;
      q.emplace(0, static_cast<int32_t>(s));
    }
  }
  while (!q.empty()) {
    auto [d, s] = q.top();
    q.pop();
    if (d > dist[static_cast<size_t>(s)]) continue;
    for (auto [p, c] : rev[static_cast<size_t>(s)]) {
      if (d + c < dist[static_cast<size_t>(p)]) {
        dist[static_cast<size_t>(p)] = d + c;
        q.emplace(d + c, p);
      }
    }
  }
  Dfa out;
  if (n == 0 || dist[static_cast<size_t>(w.start)] >= kInfDist) return out;
  // Renumber the live states reachable from the start (start = 0).
  std::vector<int32_t> id(n, -1);
  std::vector<int32_t> order = {w.start};
  id[static_cast<size_t>(w.start)] = 0;
  for (size_t k = 0; k < order.size(); ++k) {
    for (int c = 0; c < 256; ++c) {
      const int32_t t = w.next[static_cast<size_t>(order[k])][static_cast<size_t>(c)];
      if (t < 0 || !writable(c) || dist[static_cast<size_t>(t)] >= kInfDist) continue;
      if (id[static_cast<size_t>(t)] < 0) {
        id[static_cast<size_t>(t)] = static_cast<int32_t>(order.size());
        order.push_back(t);
      }
    }
  }
  const size_t m = order.size();
  auto target = [&](size_t k, int c) -> int32_t {
    const int32_t t = w.next[static_cast<size_t>(order[k])][static_cast<size_t>(c)];
    if (t < 0 || !writable(c) || dist[static_cast<size_t>(t)] >= kInfDist) return -1;
    return id[static_cast<size_t>(t)];
  };
  std::map<std::vector<int32_t>, uint8_t> classes;
  std::vector<std::vector<int32_t>> columns;
  for (int c = 0; c < 256; ++c) {
    std::vector<int32_t> col(m);
    for (size_t k = 0; k < m; ++k) col[k] = target(k, c);
    auto it = classes.find(col);
    if (it == classes.end()) {
      it = classes.emplace(col, static_cast<uint8_t>(columns.size())).first;
      columns.push_back(col);
    }
    out.class_of[static_cast<size_t>(c)] = it->second;
  }
  out.nclasses = static_cast<int32_t>(columns.size());
  out.next.assign(m * columns.size(), -1);
  for (size_t k = 0; k < m; ++k) {
    for (size_t cl = 0; cl < columns.size(); ++cl)
      out.next[k * columns.size() + cl] = columns[cl][k];
  }
  out.accept.resize(m);
  out.dist.resize(m);
  for (size_t k = 0; k < m; ++k) {
    out.accept[k] = w.accept[static_cast<size_t>(order[k])];
    out.dist[k] = dist[static_cast<size_t>(order[k])];
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Numeric ranges as regex text.

namespace {

int CmpInt(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return a.size() < b.size() ? -1 : 1;
  return a < b ? -1 : (a > b ? 1 : 0);
}
int CmpDec(const DecBound& a, const DecBound& b) {  // magnitudes
  const int c = CmpInt(a.ip, b.ip);
  if (c != 0) return c;
  return a.fp < b.fp ? -1 : (a.fp > b.fp ? 1 : 0);
}
std::string IncInt(std::string s) {
  int i = static_cast<int>(s.size()) - 1;
  while (i >= 0 && s[static_cast<size_t>(i)] == '9') s[static_cast<size_t>(i--)] = '0';
  if (i < 0) return "1" + s;
  ++s[static_cast<size_t>(i)];
  return s;
}
std::string DecInt(std::string s) {  // s > 0
  int i = static_cast<int>(s.size()) - 1;
  while (s[static_cast<size_t>(i)] == '0') s[static_cast<size_t>(i--)] = '9';
  --s[static_cast<size_t>(i)];
  if (s.size() > 1 && s[0] == '0') s.erase(0, 1);
  return s;
}
std::string DigitClass(int lo, int hi) {
  if (lo == hi) return std::string(1, static_cast<char>('0' + lo));
  return absl::StrCat("[", std::string(1, static_cast<char>('0' + lo)), "-",
                      std::string(1, static_cast<char>('0' + hi)), "]");
}
std::string Group(const std::vector<std::string>& alts) {
  if (alts.size() == 1) return alts[0];
  return absl::StrCat("(?:", absl::StrJoin(alts, "|"), ")");
}

// Equal-length digit strings a <= b.
std::string EqLen(const std::string& a, const std::string& b) {
  if (a.empty()) return "";
  if (a[0] == b[0]) return std::string(1, a[0]) + EqLen(a.substr(1), b.substr(1));
  const size_t rest = a.size() - 1;
  const bool a_zeros = a.find_first_not_of('0', 1) == std::string::npos;
  const bool b_nines = b.find_first_not_of('9', 1) == std::string::npos;
  const std::string any = rest == 0 ? "" : absl::StrCat("[0-9]{", rest, "}");
  std::vector<std::string> alts;
  int lo = a[0] - '0', hi = b[0] - '0';
  if (!a_zeros) {
    alts.push_back(std::string(1, a[0]) + EqLen(a.substr(1), std::string(rest, '9')));
    ++lo;
  }
  if (!b_nines) --hi;
  if (lo <= hi) alts.push_back(DigitClass(lo, hi) + any);
  if (!b_nines) alts.push_back(std::string(1, b[0]) + EqLen(std::string(rest, '0'), b.substr(1)));
  return Group(alts);
}

// Canonical integers in [a, b] (b empty: up to `k` digits).
std::optional<std::string> IntRange(const std::string& a, const std::string& b, int k) {
  if (!b.empty() && CmpInt(a, b) > 0) return std::nullopt;
  const size_t la = a.size(), lb = b.empty() ? static_cast<size_t>(k) : b.size();
  if (la > lb) return std::nullopt;
  const std::string top = b.empty() ? std::string(lb, '9') : b;
  if (la == lb) return EqLen(a, top);
  std::vector<std::string> alts = {EqLen(a, std::string(la, '9'))};
  if (la + 1 <= lb - 1) alts.push_back(absl::StrCat("[1-9][0-9]{", la, ",", lb - 2, "}"));
  alts.push_back(EqLen("1" + std::string(lb - 1, '0'), top));
  return Group(alts);
}

struct FracSet {
  bool empty_ok = false;
  std::optional<std::string> nonempty;  // regex for nonempty digit strings
};

// Fraction digit strings s with 0.af (<|<=) 0.s (<|<=) 0.bf, each bound optional.
FracSet Frac(const std::string& af, bool aex, bool has_lo, const std::string& bf, bool bex,
             bool has_hi) {
  if (has_lo && af.empty() && !aex) has_lo = false;
  if (!has_lo && !has_hi) return {true, "[0-9]+"};
  if (has_lo && !has_hi && af.empty()) return {false, "0*[1-9][0-9]*"};
  if (!has_lo && has_hi && bf.empty()) return bex ? FracSet{} : FracSet{true, "0+"};
  if (has_lo && has_hi && af.empty() && bf.empty()) return {};
  FracSet out;
  out.empty_ok = !has_lo && (!has_hi || !bf.empty() || !bex);
  const int lo0 = has_lo ? (af.empty() ? 0 : af[0] - '0') : -1;
  const int hi0 = has_hi ? (bf.empty() ? 0 : bf[0] - '0') : 10;
  const std::string ar = af.empty() ? "" : af.substr(1), br = bf.empty() ? "" : bf.substr(1);
  std::vector<std::string> alts;
  auto follow = [&](int d, const FracSet& sub) {
    const std::string dg(1, static_cast<char>('0' + d));
    if (sub.nonempty && sub.empty_ok)
      alts.push_back(absl::StrCat(dg, "(?:", *sub.nonempty, ")?"));
    else if (sub.nonempty)
      alts.push_back(dg + *sub.nonempty);
    else if (sub.empty_ok)
      alts.push_back(dg);
  };
  if (lo0 + 1 <= hi0 - 1) alts.push_back(DigitClass(lo0 + 1, hi0 - 1) + "[0-9]*");
  if (has_lo && has_hi && lo0 == hi0) {
    follow(lo0, Frac(ar, aex, true, br, bex, true));
  } else {
    if (has_lo && lo0 <= 9) follow(lo0, Frac(ar, aex, true, "", false, false));
    if (has_hi && hi0 >= 0 && hi0 <= 9) follow(hi0, Frac("", false, false, br, bex, true));
  }
  if (!alts.empty()) out.nonempty = Group(alts);
  return out;
}

std::optional<std::string> FracPart(const FracSet& f) {
  if (f.nonempty && f.empty_ok) return absl::StrCat("(?:\\.", *f.nonempty, ")?");
  if (f.nonempty) return absl::StrCat("\\.", *f.nonempty);
  if (f.empty_ok) return std::string();
  return std::nullopt;
}

// Magnitudes in [lo, hi] (hi absent: unbounded).
std::optional<std::string> NonNeg(const DecBound& lo, const DecBound& hi, bool integer, int k) {
  if (hi.present) {
    const int c = CmpDec(lo, hi);
    if (c > 0 || (c == 0 && (lo.exclusive || hi.exclusive))) return std::nullopt;
  }
  if (integer) return IntRange(lo.ip, hi.present ? hi.ip : "", k);
  std::vector<std::string> alts;
  auto add = [&](const std::string& ip, const FracSet& f) {
    if (auto p = FracPart(f)) alts.push_back(ip + *p);
  };
  if (hi.present && lo.ip == hi.ip) {
    add(lo.ip, Frac(lo.fp, lo.exclusive, true, hi.fp, hi.exclusive, true));
  } else {
    if (static_cast<int>(lo.ip.size()) <= k)
      add(lo.ip, Frac(lo.fp, lo.exclusive, true, "", false, false));
    const std::string mid_hi = hi.present ? (hi.ip == "0" ? "" : DecInt(hi.ip)) : "";
    if (!hi.present || hi.ip != "0") {
      if (auto mid = IntRange(IncInt(lo.ip), mid_hi, k);
          mid && (hi.present ? !mid_hi.empty() : true)) {
        alts.push_back(*mid + "(?:\\.[0-9]+)?");
      }
    }
    if (hi.present) add(hi.ip, Frac("", false, false, hi.fp, hi.exclusive, true));
  }
  if (alts.empty()) return std::nullopt;
  return Group(alts);
}

}  // namespace

std::string NumberRangeRegex(const DecBound& lo, const DecBound& hi, bool integer,
                             int max_int_digits) {
  std::vector<std::string> alts;
  const DecBound zero{.present = true};
  // x >= 0
  if (!(hi.present && hi.neg)) {
    const DecBound mlo = lo.present && !lo.neg ? lo : zero;
    if (auto r = NonNeg(mlo, hi, integer, max_int_digits)) alts.push_back(*r);
  }
  // x < 0: "-" and a magnitude above 0.
  if (!lo.present || lo.neg) {
    DecBound mlo = hi.present && hi.neg ? hi : DecBound{.present = true, .exclusive = true};
    if (integer && mlo.ip == "0") mlo = DecBound{.present = true, .ip = "1"};
    DecBound mhi = lo;  // absent when lo is absent
    mlo.neg = mhi.neg = false;
    if (auto r = NonNeg(mlo, mhi, integer, max_int_digits)) alts.push_back("-" + *r);
  }
  if (alts.empty()) return "";
  return absl::StrCat("^", Group(alts), "$");
}

int CompareDecimal(const DecBound& a, const DecBound& b) {
  if (a.neg != b.neg) return a.neg ? -1 : 1;
  const int c = CmpDec(a, b);
  return a.neg ? -c : c;
}

bool ParseDecimal(std::string_view t, DecBound* out) {
  DecBound d;
  d.present = true;
  size_t i = 0;
  if (i < t.size() && t[i] == '-') d.neg = true, ++i;
  std::string digits;
  int point = -1;
  for (; i < t.size() && t[i] != 'e' && t[i] != 'E'; ++i) {
    if (t[i] == '.') {
      point = static_cast<int>(digits.size());
    } else if (t[i] >= '0' && t[i] <= '9') {
      digits += t[i];
    } else {
      return false;
    }
  }
  if (digits.empty()) return false;
  if (point < 0) point = static_cast<int>(digits.size());
  if (i < t.size()) {
    const long long e = std::strtoll(std::string(t.substr(i + 1)).c_str(), nullptr, 10);
    if (e > 400 || e < -400) return false;
    point += static_cast<int>(e);
  }
  while (point < 0) digits.insert(digits.begin(), '0'), ++point;
  while (point > static_cast<int>(digits.size())) digits += '0';
  d.ip = digits.substr(0, static_cast<size_t>(point));
  d.fp = digits.substr(static_cast<size_t>(point));
  d.ip.erase(0, std::min(d.ip.find_first_not_of('0'), d.ip.size()));
  if (d.ip.empty()) d.ip = "0";
  while (!d.fp.empty() && d.fp.back() == '0') d.fp.pop_back();
  if (d.ip == "0" && d.fp.empty()) d.neg = false;
  *out = d;
  return true;
}

}  // namespace epd::grammar
