#pragma once

// Byte automata for the grammar's constrained leaves (grammar.h): JSON Schema string `pattern`
// (a regex subset), string `format`, string length bounds, numeric ranges and `multipleOf`, and
// `enum`, compiled to deterministic automata over bytes that the matcher steps one byte at a time.
//
// Regex subset (ECMA-262 syntax as JSON Schema uses it): literals (UTF-8 included), `.`, classes
// `[...]` / `[^...]` with ranges (any code points, as UTF-8 byte sequences), escapes \d \D \w \W \s
// \S \t \n \r \f \v \xHH \uHHHH (BMP) and escaped punctuation, groups `(...)` `(?:...)`
// `(?<name>...)`, alternation, quantifiers * + ? {n} {n,} {n,m} (lazy forms are the same language),
// anchors ^ and $ at the start / end of a top-level alternative, and lookahead (?=...) / (?!...)
// right after a leading ^ (as zod's email pattern uses). Backreferences, lookbehind, other
// lookaheads, \b, \p{...} are refused by name. Without ^ / $ the pattern matches anywhere (JSON
// Schema semantics).
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace epd::grammar {

// A DFA under construction: full 256-wide rows, -1 = no transition (dead).
struct WideDfa {
  std::vector<std::array<int32_t, 256>> next;
  std::vector<uint8_t> accept;
  int32_t start = 0;
  int32_t Add(bool acc) {
    std::array<int32_t, 256> row;
    row.fill(-1);
    next.push_back(row);
    accept.push_back(acc ? 1 : 0);
    return static_cast<int32_t>(next.size()) - 1;
  }
  size_t size() const { return next.size(); }
};

// The matcher's form: bytes grouped into classes, states that cannot reach acceptance removed,
// start state 0, and `dist`: the fewest output bytes to acceptance (for a JSON string body every
// byte that must be escaped counts 2).
struct Dfa {
  std::array<uint8_t, 256> class_of{};
  int32_t nclasses = 1;
  std::vector<int32_t> next;  // state * nclasses + class; -1 = refused
  std::vector<uint8_t> accept;
  std::vector<int64_t> dist;
  int32_t Next(int32_t s, uint8_t c) const {
    return next[static_cast<size_t>(s) * static_cast<size_t>(nclasses) + class_of[c]];
  }
  size_t states() const { return accept.size(); }
};

enum class ProductOp { kAnd, kOr, kAndNot };

// Compiles a regex (the subset above) to a DFA over the UTF-8 bytes of the matched text.
// `max_states` bounds the DFA (InvalidArgument beyond it).
absl::StatusOr<WideDfa> CompileRegex(std::string_view pattern, size_t max_states);
// Any UTF-8 text (the characters the grammar's strings allow).
WideDfa AnyText();
// Text of `min`..`max` characters (max -1 = unbounded), as a counter over character starts.
WideDfa LengthDfa(int64_t min, int64_t max);
// Exactly one of `words`.
WideDfa WordsDfa(const std::vector<std::string>& words);
// Decimal numbers (syntax checked elsewhere) that are multiples of the decimal `m` (> 0), given
// as integer digits and fraction digits; InvalidArgument when its automaton is too big.
absl::StatusOr<WideDfa> MultipleOfDfa(const std::string& int_digits, const std::string& frac_digits,
                                      size_t max_states);
absl::StatusOr<WideDfa> Product(const WideDfa& a, const WideDfa& b, ProductOp op,
                                size_t max_states);
// Prunes, numbers from the start, computes dist and byte classes. `json_string`: the bytes are
// the decoded content of a JSON string (control bytes other than \b \f \n \r \t cannot be
// written and are dropped; '"', '\' and those controls cost 2 bytes). Empty `states()` when
// nothing is accepted.
Dfa Finalize(const WideDfa& w, bool json_string);

// Regex text for the decimal numbers (no exponent, canonical: no leading zeros, no "-0") within
// the bounds. Bounds are decimal magnitudes split into integer / fraction digits (no leading
// zeros in the integer part, "0" for zero; no trailing zeros in the fraction). `max_int_digits`
// caps the integer part on an unbounded side. Empty string: no number fits.
struct DecBound {
  bool present = false;
  bool neg = false;
  std::string ip = "0", fp;
  bool exclusive = false;
};
std::string NumberRangeRegex(const DecBound& lo, const DecBound& hi, bool integer,
                             int max_int_digits);
// Signed comparison of two bounds' values (-1, 0, 1); `exclusive` is not looked at.
int CompareDecimal(const DecBound& a, const DecBound& b);
// Parses a JSON number's text ("1e+20", "-0.5", "3") to a DecBound (present, not exclusive).
bool ParseDecimal(std::string_view text, DecBound* out);

}  // namespace epd::grammar
