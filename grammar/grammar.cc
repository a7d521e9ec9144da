#include "grammar/grammar.h"

#include <algorithm>
#include <climits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"

namespace epd::grammar {

using ojson = nlohmann::ordered_json;

namespace {

constexpr char kDsml[] =
    "\xEF\xBD\x9C"
    "DSML\xEF\xBD\x9C";  // ｜DSML｜ (tokenizer/chat_format.h)
constexpr int64_t kInf = INT64_MAX / 4;

int64_t SatAdd(int64_t a, int64_t b) { return std::min(kInf, a + b); }

bool IsDigit(uint8_t c) { return c >= '0' && c <= '9'; }

// JSON number automaton. Phases: 0 start, 1 after '-', 2 after a leading 0, 3 integer digits,
// 4 after '.', 5 fraction digits, 6 after 'e', 7 after the exponent sign, 8 exponent digits.
int NumberNext(int phase, uint8_t c, bool integer) {
  switch (phase) {
    case 0:
      if (c == '-') return 1;
      [[fallthrough]];
    case 1:
      if (c == '0') return 2;
      if (c >= '1' && c <= '9') return 3;
      return -1;
    case 2:
    case 3:
      if (phase == 3 && IsDigit(c)) return 3;
      if (integer) return -1;
      if (c == '.') return 4;
      if (c == 'e' || c == 'E') return 6;
      return -1;
    case 4:
      return IsDigit(c) ? 5 : -1;
    case 5:
      if (IsDigit(c)) return 5;
      if (!integer && (c == 'e' || c == 'E')) return 6;
      return -1;
    case 6:
      if (c == '+' || c == '-') return 7;
      return IsDigit(c) ? 8 : -1;
    case 7:
    case 8:
      return IsDigit(c) ? 8 : -1;
  }
  return -1;
}

bool NumberAccepting(int phase) { return phase == 2 || phase == 3 || phase == 5 || phase == 8; }

constexpr int kMaxIntDigits = 200;
constexpr int kMaxExpDigits = 2;

// JSON string escapes the grammar writes (no \u) and the byte each stands for.
constexpr char kEscapes[] = "\"\\/bfnrt";
uint8_t Unescape(uint8_t e) {
  switch (e) {
    case 'b':
      return '\b';
    case 'f':
      return '\f';
    case 'n':
      return '\n';
    case 'r':
      return '\r';
    case 't':
      return '\t';
    default:
      return e;
  }
}

// Counts a decoded byte of a kText node against its character bounds: false when it would start
// a character past max_chars. The count saturates at min_chars when there is no maximum.
bool CountChar(const Node& n, uint8_t byte, int32_t* count) {
  if ((byte & 0xC0) == 0x80) return true;  // a continuation byte
  if (n.max_chars >= 0) {
    if (*count + 1 > n.max_chars) return false;
    ++*count;
  } else {
    *count = static_cast<int32_t>(std::min<int64_t>(*count + 1, n.min_chars));
  }
  return true;
}

}  // namespace

// Builds a Grammar; node ids are indices into its node list.
class Builder {
 public:
  Builder() : g_(std::make_shared<Grammar>()) {}

  int Add(Node n) {
    g_->nodes_.push_back(std::move(n));
    return static_cast<int>(g_->nodes_.size()) - 1;
  }
  int64_t Len(int id) const { return id < 0 ? 0 : g_->nodes_[static_cast<size_t>(id)].min_len; }
  Node& At(int id) { return g_->nodes_[static_cast<size_t>(id)]; }

  int Literal(std::string text) {
    Node n;
    n.kind = NodeKind::kLiteral;
    n.min_len = static_cast<int64_t>(text.size());
    n.text = std::move(text);
    return Add(std::move(n));
  }
  int Leaf(NodeKind kind, int64_t min_len) {
    Node n;
    n.kind = kind;
    n.min_len = min_len;
    return Add(std::move(n));
  }
  int AnyOf(std::vector<int> alts) {
    if (alts.size() == 1) return alts[0];
    Node n;
    n.kind = NodeKind::kAnyOf;
    n.min_len = kInf;
    for (int a : alts) n.min_len = std::min(n.min_len, Len(a));
    n.children = std::move(alts);
    return Add(std::move(n));
  }
  int Sequence(std::vector<int> parts) {
    Node n;
    n.kind = NodeKind::kSequence;
    for (int p : parts) n.min_len = SatAdd(n.min_len, Len(p));
    n.children = std::move(parts);
    return Add(std::move(n));
  }
  int Until(std::string terminator) {
    Node n;
    n.kind = NodeKind::kUntil;
    n.min_len = static_cast<int64_t>(terminator.size());
    n.text = std::move(terminator);
    return Add(std::move(n));
  }
  // Object over fixed properties (`props` in order).
  int Object(int open, int close, int sep, std::vector<Node::Prop> props) {
    Node n;
    n.kind = NodeKind::kObject;
    n.open = open;
    n.close = close;
    n.sep = sep;
    n.props = std::move(props);
    n.min_len = SatAdd(SatAdd(Len(open), Len(close)), RequiredLen(n, 0, true));
    return Add(std::move(n));
  }
  int64_t RequiredLen(const Node& n, int from, bool first) const {
    int64_t total = 0;
    for (size_t j = static_cast<size_t>(from); j < n.props.size(); ++j) {
      const Node::Prop& p = n.props[j];
      if (!p.required) continue;
      total = SatAdd(total, Len(p.head) + Len(p.value) + Len(p.tail) + (first ? 0 : Len(n.sep)));
      first = false;
    }
    return total;
  }
  int Array(int open, int close, int sep, int item, int min_items, int max_items) {
    Node n;
    n.kind = NodeKind::kArray;
    n.open = open;
    n.close = close;
    n.sep = sep;
    n.item = item;
    n.min_items = min_items;
    n.max_items = max_items;
    n.min_len = SatAdd(Len(open), Len(close));
    if (min_items > 0) {
      n.min_len = SatAdd(n.min_len, min_items * Len(item) + (min_items - 1) * Len(sep));
    }
    return Add(std::move(n));
  }

  // Any JSON value (objects with any keys, arrays of anything): one shared recursive node.
  int AnyValue() {
    if (any_ >= 0) return any_;
    any_ = Add(Node{.kind = NodeKind::kAnyOf});  // alternatives filled below
    const int obj = AnyObject();
    const int arr = Array(Literal("["), Literal("]"), Literal(","), any_, 0, -1);
    std::vector<int> alts = {obj,
                             arr,
                             Leaf(NodeKind::kString, 2),
                             Leaf(NodeKind::kNumber, 1),
                             Literal("true"),
                             Literal("false"),
                             Literal("null")};
    int64_t min_len = kInf;
    for (int a : alts) min_len = std::min(min_len, Len(a));
    At(any_).children = std::move(alts);
    At(any_).min_len = min_len;
    return any_;
  }
  int AnyObject() {
    if (any_object_ >= 0) return any_object_;
    const int value = AnyValue();
    any_object_ = MapObject(value);
    return any_object_;
  }
  // An object with any string keys, each value matching node `value`.
  int MapObject(int value) {
    Node n;
    n.kind = NodeKind::kObject;
    n.open = Literal("{");
    n.close = Literal("}");
    n.sep = Literal(",");
    n.free_keys = true;
    n.key = Leaf(NodeKind::kString, 2);
    n.colon = Literal(":");
    n.value = value;
    n.min_len = 2;
    return Add(std::move(n));
  }

  absl::Status Unsupported(std::string_view keyword, const std::string& path) {
    return absl::InvalidArgumentError(
        absl::StrCat("unsupported JSON schema keyword '", std::string(keyword), "' at ", path));
  }
  absl::Status Invalid(const std::string& path, std::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid JSON schema at ", path, ": ", std::string(why)));
  }

  absl::StatusOr<int> Schema(const ojson& s, const std::string& path) {
    // Nesting is bounded so that compiling (and matching, which walks the grammar) never
    // exhausts the stack on a hostile schema.
    if (depth_ >= kMaxSchemaDepth) {
      return Invalid(path, absl::StrCat("nested deeper than ", kMaxSchemaDepth, " levels"));
    }
    ++depth_;
    absl::StatusOr<int> r = SchemaAt(s, path);
    --depth_;
    return r;
  }

  absl::StatusOr<int> SchemaAt(const ojson& s, const std::string& path) {
    if (s.is_boolean()) {
      if (s.get<bool>()) return AnyValue();
      return Invalid(path, "the schema false matches nothing");
    }
    if (!s.is_object()) return Invalid(path, "a schema must be an object");
    // Keywords that constrain the value (compiled) and annotations (ignored).
    static const std::set<std::string> kKnown = {"type",
                                                 "properties",
                                                 "required",
                                                 "additionalProperties",
                                                 "items",
                                                 "minItems",
                                                 "maxItems",
                                                 "enum",
                                                 "const",
                                                 "anyOf",
                                                 "oneOf",
                                                 "allOf",
                                                 "$ref",
                                                 "$defs",
                                                 "definitions",
                                                 "nullable",
                                                 "minLength",
                                                 "maxLength",
                                                 "pattern",
                                                 "format",
                                                 "minimum",
                                                 "maximum",
                                                 "exclusiveMinimum",
                                                 "exclusiveMaximum",
                                                 "multipleOf"};
    for (auto it = s.begin(); it != s.end(); ++it) {
      if (it.key() == "propertyNames" && it.value() == ojson{{"type", "string"}}) continue;
      if (!kKnown.contains(it.key()) && !kAnnotations.contains(it.key()) && !lenient_)
        return Unsupported(it.key(), path);
    }
    if (s.contains("nullable") && s["nullable"] == true) {
      ojson inner = s;
      inner.erase("nullable");
      auto id = Schema(inner, path);
      if (!id.ok()) return id.status();
      return AnyOf({*id, Literal("null")});
    }
    if (s.contains("$ref")) {
      for (auto it = s.begin(); it != s.end(); ++it) {
        if (it.key() != "$ref" && it.key() != "$defs" && it.key() != "definitions" &&
            !kAnnotations.contains(it.key()) && !lenient_)
          return Unsupported(absl::StrCat(it.key(), "' beside '$ref"), path);
      }
      return Ref(s["$ref"], path + ".$ref");
    }
    if (s.contains("allOf")) {
      const ojson& a = s["allOf"];
      if (!a.is_array() || a.size() != 1) {
        if (!lenient_ || !a.is_array() || a.empty())
          return Unsupported("allOf (of more than one schema)", path);
      }
      return Schema(a[0], path + ".allOf[0]");
    }
    if (s.contains("const")) return Literal(s["const"].dump());
    if (s.contains("enum")) {
      const ojson& e = s["enum"];
      if (!e.is_array() || e.empty()) return Invalid(path + ".enum", "must be a non-empty array");
      if (e.size() > kMaxEnum) {
        return Invalid(path + ".enum",
                       absl::StrCat("has ", e.size(), " values, more than ", kMaxEnum));
      }
      std::vector<std::string> words;
      size_t bytes = 0;
      for (const auto& v : e) {
        words.push_back(v.dump());
        bytes += words.back().size();
      }
      if (bytes > kMaxStates) {  // one automaton state per byte at most
        return Invalid(path + ".enum",
                       absl::StrCat("its values take more than ", kMaxStates, " bytes"));
      }
      return Automaton(NodeKind::kBytes, WordsDfa(words), path + ".enum");
    }
    for (const char* key : {"anyOf", "oneOf"}) {
      if (!s.contains(key)) continue;
      const ojson& a = s[key];
      if (!a.is_array() || a.empty())
        return Invalid(absl::StrCat(path, ".", key), "must be a non-empty array");
      std::vector<int> alts;
      for (size_t i = 0; i < a.size(); ++i) {
        auto id = Schema(a[i], absl::StrCat(path, ".", key, "[", i, "]"));
        if (!id.ok()) return id.status();
        alts.push_back(*id);
      }
      return AnyOf(std::move(alts));
    }
    if (!s.contains("type")) {
      if (s.contains("properties")) return Typed(s, "object", path);
      if (s.contains("items")) return Typed(s, "array", path);
      return AnyValue();
    }
    const ojson& t = s["type"];
    if (t.is_string()) return Typed(s, t.get<std::string>(), path);
    if (!t.is_array() || t.empty()) return Invalid(path + ".type", "must be a string or array");
    std::vector<int> alts;
    for (const auto& e : t) {
      if (!e.is_string()) return Invalid(path + ".type", "must hold strings");
      auto id = Typed(s, e.get<std::string>(), path);
      if (!id.ok()) return id.status();
      alts.push_back(*id);
    }
    return AnyOf(std::move(alts));
  }

  // "$ref": a JSON pointer into the root document ("#", "#/$defs/X", "#/definitions/X", ...).
  // Each target is compiled once; a reference met while its target is being compiled (recursion)
  // points at the same node, filled in when the target is done.
  absl::StatusOr<int> Ref(const ojson& ref, const std::string& path) {
    if (!ref.is_string() || !ref.get<std::string>().starts_with("#"))
      return Unsupported("$ref (other than a '#...' pointer into the schema)", path);
    const std::string target = ref.get<std::string>();
    if (auto it = refs_.find(target); it != refs_.end()) return it->second;
    const std::string pointer = target.substr(1);
    if (!pointer.empty() && pointer[0] != '/') return Invalid(path, "not a JSON pointer");
    const ojson* node = root_;
    try {
      node = &root_->at(ojson::json_pointer(pointer));
    } catch (const std::exception&) {
      return Invalid(path, absl::StrCat("'", target, "' points at nothing"));
    }
    const int fwd = Add(Node{.kind = NodeKind::kSequence});  // forwarding node, filled below
    refs_.emplace(target, fwd);
    auto id = Schema(*node, target);
    if (!id.ok()) return id.status();
    At(fwd).children = {*id};
    return fwd;
  }

  // A kText / kBytes node over `w` (InvalidArgument when nothing fits or the grammar is full).
  absl::StatusOr<int> Automaton(NodeKind kind, const WideDfa& w, const std::string& path,
                                int64_t min_chars = 0, int64_t max_chars = -1) {
    Dfa d = Finalize(w, kind == NodeKind::kText);
    if (d.states() == 0) return Invalid(path, "no value satisfies the constraints");
    total_states_ += d.states();
    if (total_states_ > kMaxTotalStates) {
      return Invalid(path, absl::StrCat("the schema compiles to more than ", kMaxTotalStates,
                                        " automaton states"));
    }
    Node n;
    n.kind = kind;
    n.dfa = static_cast<int>(g_->dfas_.size());
    n.min_chars = min_chars;
    n.max_chars = max_chars;
    n.min_len = kind == NodeKind::kText ? 2 + d.dist[0] + min_chars : d.dist[0];
    g_->dfas_.push_back(std::move(d));
    return Add(std::move(n));
  }

  absl::StatusOr<int> StringSchema(const ojson& s, const std::string& path) {
    int64_t min = 0, max = -1;
    for (const char* k : {"minLength", "maxLength"}) {
      if (!s.contains(k)) continue;
      if (!s[k].is_number_unsigned() || s[k].get<uint64_t>() > 1000000)
        return Invalid(absl::StrCat(path, ".", k), "must be a non-negative integer");
      (std::string_view(k) == "minLength" ? min : max) = s[k].get<int64_t>();
    }
    if (max >= 0 && max < min) return Invalid(path, "maxLength is below minLength");
    std::optional<WideDfa> text;
    auto intersect = [&](absl::StatusOr<WideDfa> d) -> absl::Status {
      if (!d.ok()) return d.status();
      if (!text) {
        text = *std::move(d);
        return absl::OkStatus();
      }
      auto p = Product(*text, *d, ProductOp::kAnd, kMaxStates);
      if (!p.ok()) return p.status();
      text = *std::move(p);
      return absl::OkStatus();
    };
    if (s.contains("format")) {
      const std::string format = s["format"].is_string() ? s["format"].get<std::string>() : "";
      const char* re = FormatRegex(format);
      if (re != nullptr) {
        if (auto st = intersect(CompileRegex(re, kMaxStates)); !st.ok())
          return Invalid(path, std::string(st.message()));
      } else if (!lenient_) {
        return Unsupported(absl::StrCat("format' '", format), path);
      }
    }
    if (s.contains("pattern")) {
      if (!s["pattern"].is_string()) return Invalid(path + ".pattern", "must be a string");
      absl::Status st = intersect(CompileRegex(s["pattern"].get<std::string>(), kMaxStates));
      if (!st.ok() && !lenient_) {
        return absl::InvalidArgumentError(
            absl::StrCat("unsupported JSON schema keyword 'pattern' at ", path, ": ",
                         std::string(st.message())));
      }
    }
    if (!text) {
      if (min == 0 && max < 0) return Leaf(NodeKind::kString, 2);
      return Automaton(NodeKind::kText, AnyText(), path, min, max);  // a character counter
    }
    if (min > 0 || max >= 0) {
      if (std::max(min, max) > static_cast<int64_t>(kMaxStates)) {
        return Invalid(path, absl::StrCat("minLength / maxLength above ", kMaxStates,
                                          " together with a pattern or format"));
      }
      if (auto st = intersect(LengthDfa(min, max)); !st.ok())
        return Invalid(path, std::string(st.message()));
    }
    return Automaton(NodeKind::kText, *text, path);
  }

  static const char* FormatRegex(const std::string& format) {
    // Calendar dates, leap years included (zod's date pattern); RFC 3339 times and offsets.
    static const std::string kDate =
        R"((?:(?:\d\d[2468][048]|\d\d[13579][26]|\d\d0[48]|[02468][048]00|[13579][26]00)-02-29|\d{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]\d|3[01])|(?:0[469]|11)-(?:0[1-9]|[12]\d|30)|02-(?:0[1-9]|1\d|2[0-8]))))";
    static const std::string kTime = R"((?:[01]\d|2[0-3]):[0-5]\d:[0-5]\d(?:\.\d{1,9})?)";
    static const std::string kOffset = R"((?:Z|[+-](?:[01]\d|2[0-3]):[0-5]\d))";
    static const std::map<std::string, std::string> kFormats = {
        {"date-time", absl::StrCat("^", kDate, "T", kTime, kOffset, "$")},
        {"date", absl::StrCat("^", kDate, "$")},
        {"time", absl::StrCat("^", kTime, kOffset, "?$")},
        {"duration",
         R"(^P(?:\d{1,9}Y)?(?:\d{1,9}M)?(?:\d{1,9}W)?(?:\d{1,9}D)?(?:T(?:\d{1,9}H)?(?:\d{1,9}M)?(?:\d{1,9}(?:\.\d{1,9})?S)?)?$)"},
        {"email",
         R"(^[A-Za-z0-9_+-]+(?:\.[A-Za-z0-9_+-]+)*@(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+[A-Za-z]{2,24}$)"},
        {"hostname",
         R"(^[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$)"},
        {"uuid",
         R"(^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$)"},
        {"ipv4",
         R"(^(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)$)"},
        // Full and "::"-compressed forms (no embedded IPv4).
        {"ipv6",
         R"(^(?:(?:[0-9a-fA-F]{1,4}:){7}[0-9a-fA-F]{1,4}|(?:[0-9a-fA-F]{1,4}:){0,6}[0-9a-fA-F]{1,4}::|::(?:[0-9a-fA-F]{1,4}:){0,6}[0-9a-fA-F]{1,4}|::|[0-9a-fA-F]{1,4}::(?:[0-9a-fA-F]{1,4}:){0,5}[0-9a-fA-F]{1,4}|(?:[0-9a-fA-F]{1,4}:){1}[0-9a-fA-F]{1,4}::(?:[0-9a-fA-F]{1,4}:){0,4}[0-9a-fA-F]{1,4}|(?:[0-9a-fA-F]{1,4}:){2}[0-9a-fA-F]{1,4}::(?:[0-9a-fA-F]{1,4}:){0,3}[0-9a-fA-F]{1,4}|(?:[0-9a-fA-F]{1,4}:){3}[0-9a-fA-F]{1,4}::(?:[0-9a-fA-F]{1,4}:){0,2}[0-9a-fA-F]{1,4}|(?:[0-9a-fA-F]{1,4}:){4}[0-9a-fA-F]{1,4}::(?:[0-9a-fA-F]{1,4}:)?[0-9a-fA-F]{1,4}|(?:[0-9a-fA-F]{1,4}:){5}[0-9a-fA-F]{1,4}::[0-9a-fA-F]{1,4})$)"},
        {"uri",
         R"(^[A-Za-z][A-Za-z0-9+.-]*://[A-Za-z0-9._~%!$&'()*+,;=:@-]+(?:/[A-Za-z0-9._~%!$&'()*+,;=:@/-]*)?(?:\?[A-Za-z0-9._~%!$&'()*+,;=:@/?-]*)?(?:#[A-Za-z0-9._~%!$&'()*+,;=:@/?-]*)?$)"},
    };
    auto it = kFormats.find(format);
    return it == kFormats.end() ? nullptr : it->second.c_str();
  }

  // minimum / maximum / exclusive* (numbers or, draft 4, booleans) as one lower and one upper
  // bound, the tighter where two are given.
  absl::StatusOr<std::pair<DecBound, DecBound>> Bounds(const ojson& s, const std::string& path) {
    DecBound lo, hi;
    auto parse = [&](const char* k, DecBound* out) -> absl::Status {
      if (!s[k].is_number()) return Invalid(absl::StrCat(path, ".", k), "must be a number");
      if (!ParseDecimal(s[k].dump(), out))
        return Invalid(absl::StrCat(path, ".", k), "is out of range");
      return absl::OkStatus();
    };
    auto tighter = [](DecBound* cur, const DecBound& b, bool lower) {
      if (!cur->present) {
        *cur = b;
        return;
      }
      const int c = CompareDecimal(b, *cur);
      if ((lower && (c > 0 || (c == 0 && b.exclusive))) ||
          (!lower && (c < 0 || (c == 0 && b.exclusive))))
        *cur = b;
    };
    for (const char* k : {"minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"}) {
      if (!s.contains(k)) continue;
      const bool exclusive = std::string_view(k).starts_with("exclusive");
      const bool lower =
          std::string_view(k) == "minimum" || std::string_view(k) == "exclusiveMinimum";
      if (exclusive && s[k].is_boolean()) continue;  // draft 4: applies to minimum / maximum
      DecBound b;
      if (auto st = parse(k, &b); !st.ok()) return st;
      b.exclusive =
          exclusive || (s.contains(absl::StrCat("exclusive", lower ? "Minimum" : "Maximum")) &&
                        s[absl::StrCat("exclusive", lower ? "Minimum" : "Maximum")] == true);
      tighter(lower ? &lo : &hi, b, lower);
    }
    return std::make_pair(lo, hi);
  }

  absl::StatusOr<int> NumberSchema(const ojson& s, const std::string& path, bool integer) {
    const bool bounded = s.contains("minimum") || s.contains("maximum") ||
                         s.contains("exclusiveMinimum") || s.contains("exclusiveMaximum");
    if (!bounded && !s.contains("multipleOf"))
      return Leaf(integer ? NodeKind::kInteger : NodeKind::kNumber, 1);
    auto b = Bounds(s, path);
    if (!b.ok()) return b.status();
    auto [lo, hi] = *b;
    if (integer) {  // inclusive integer bounds
      if (lo.present) lo = IntegerBound(lo, true);
      if (hi.present) hi = IntegerBound(hi, false);
    }
    const std::string re = NumberRangeRegex(lo, hi, integer, kBoundedIntDigits);
    if (re.empty()) return Invalid(path, "no number satisfies minimum / maximum");
    auto d = CompileRegex(re, kMaxStates);
    if (!d.ok()) return Invalid(path, std::string(d.status().message()));
    if (s.contains("multipleOf")) {
      DecBound m;
      if (!s["multipleOf"].is_number() || !ParseDecimal(s["multipleOf"].dump(), &m) || m.neg ||
          (m.ip == "0" && m.fp.empty()))
        return Invalid(path + ".multipleOf", "must be a number above 0");
      auto mo = MultipleOfDfa(m.ip == "0" ? "" : m.ip, m.fp, kMaxStates);
      if (!mo.ok()) return Invalid(path + ".multipleOf", std::string(mo.status().message()));
      d = Product(*d, *mo, ProductOp::kAnd, kMaxStates);
      if (!d.ok()) return Invalid(path, std::string(d.status().message()));
    }
    return Automaton(NodeKind::kBytes, *d, path);
  }

  absl::StatusOr<int> Typed(const ojson& s, const std::string& type, const std::string& path) {
    if (type == "string") return StringSchema(s, path);
    if (type == "number") return NumberSchema(s, path, false);
    if (type == "integer") return NumberSchema(s, path, true);
    if (type == "boolean") return AnyOf({Literal("true"), Literal("false")});
    if (type == "null") return Literal("null");
    if (type == "array") {
      int item = -1;
      if (s.contains("items")) {
        auto id = Schema(s["items"], path + ".items");
        if (!id.ok()) return id.status();
        item = *id;
      } else {
        item = AnyValue();
      }
      int min_items = 0, max_items = -1;
      for (const char* k : {"minItems", "maxItems"}) {
        if (!s.contains(k)) continue;
        if (!s[k].is_number_unsigned() || s[k].get<uint64_t>() > 1000000)
          return Invalid(absl::StrCat(path, ".", k), "must be a non-negative integer");
        (std::string_view(k) == "minItems" ? min_items : max_items) = s[k].get<int>();
      }
      if (max_items >= 0 && max_items < min_items)
        return Invalid(path, "maxItems is below minItems");
      return Array(Literal("["), Literal("]"), Literal(","), item, min_items, max_items);
    }
    if (type == "object") {
      if (s.contains("additionalProperties") && s["additionalProperties"].is_object()) {
        if (!s.contains("properties")) {  // a map (zod's record): any keys, one value schema
          auto value = Schema(s["additionalProperties"], path + ".additionalProperties");
          if (!value.ok()) return value.status();
          return MapObject(*value);
        }
        if (!lenient_)
          return Unsupported("additionalProperties (as a schema, beside properties)", path);
      } else if (s.contains("additionalProperties") && !s["additionalProperties"].is_boolean()) {
        return Invalid(path + ".additionalProperties", "must be a boolean or a schema");
      }
      if (!s.contains("properties")) {
        if (s.value("additionalProperties", ojson(true)) != false) return AnyObject();
        return Object(Literal("{"), Literal("}"), Literal(","), {});
      }
      auto props = Properties(
          s, path, [](const std::string& key) { return ojson(key).dump() + ":"; }, "");
      if (!props.ok()) return props.status();
      return Object(Literal("{"), Literal("}"), Literal(","), *std::move(props));
    }
    return Invalid(path + ".type", absl::StrCat("unknown type '", type, "'"));
  }

  // The properties of an object schema in schema order, with their head / tail literals.
  template <typename HeadFn>
  absl::StatusOr<std::vector<Node::Prop>> Properties(const ojson& s, const std::string& path,
                                                     HeadFn head, const std::string& tail) {
    const ojson& ps = s["properties"];
    if (!ps.is_object()) return Invalid(path + ".properties", "must be an object");
    std::set<std::string> required;
    if (s.contains("required")) {
      if (!s["required"].is_array()) return Invalid(path + ".required", "must be an array");
      for (const auto& r : s["required"]) {
        if (!r.is_string()) return Invalid(path + ".required", "must hold strings");
        if (!ps.contains(r.get<std::string>()))
          return Invalid(path + ".required",
                         absl::StrCat("'", r.get<std::string>(), "' is not in properties"));
        required.insert(r.get<std::string>());
      }
    }
    std::vector<Node::Prop> props;
    for (auto it = ps.begin(); it != ps.end(); ++it) {
      auto value = Schema(it.value(), path + ".properties." + it.key());
      if (!value.ok()) return value.status();
      Node::Prop p;
      p.head = Literal(head(it.key()));
      p.value = *value;
      p.tail = tail.empty() ? -1 : Literal(tail);
      p.required = required.contains(it.key());
      props.push_back(p);
    }
    return props;
  }

  // A DSML tool-call block (tokenizer/chat_format.h) calling one of `tools` (once, or 1+ times when
  // `parallel`); every parameter is written with string="false" and a JSON value.
  absl::StatusOr<int> ToolCalls(const ojson& tools, bool parallel) {
    if (!tools.is_array() || tools.empty())
      return absl::InvalidArgumentError("tool_calls constraint without tools");
    std::vector<int> invokes;
    for (size_t i = 0; i < tools.size(); ++i) {
      const ojson& t = tools[i];
      const std::string path = absl::StrCat("tools[", i, "].function.parameters");
      if (!t.is_object() || !t.contains("name") || !t["name"].is_string())
        return absl::InvalidArgumentError(absl::StrCat("tools[", i, "] has no name"));
      const std::string name = t["name"].get<std::string>();
      if (t.contains("strict") && !t["strict"].is_boolean())
        return absl::InvalidArgumentError(absl::StrCat("tools[", i, "].strict must be a boolean"));
      lenient_ = top_lenient_ || t.value("strict", ojson(true)) == false;
      ojson params = t.value("parameters", ojson::object());
      if (!params.is_object()) return Invalid(path, "must be an object");
      for (auto it = params.begin(); it != params.end(); ++it) {
        static const std::set<std::string> kTop = {
            "type", "properties", "required", "additionalProperties", "$defs", "definitions"};
        if (!kTop.contains(it.key()) && !kAnnotations.contains(it.key()) && !lenient_)
          return Unsupported(it.key(), path);
      }
      root_ = &params;
      refs_.clear();
      if (params.contains("type") && params["type"] != "object")
        return Invalid(path + ".type", "tool parameters must be an object");
      std::vector<Node::Prop> props;
      if (params.contains("properties")) {
        auto p = Properties(
            params, path,
            [](const std::string& key) {
              return absl::StrCat("<", kDsml, " parameter name=\"", key, "\" string=\"false\">");
            },
            absl::StrCat("</", kDsml, " parameter>\n"));
        if (!p.ok()) return p.status();
        props = *std::move(p);
      }
      const int body = Object(-1, -1, -1, std::move(props));
      invokes.push_back(
          Sequence({Literal(absl::StrCat("<", kDsml, " invoke name=\"", name, "\">\n")), body,
                    Literal(absl::StrCat("</", kDsml, " invoke>\n"))}));
    }
    const int calls = Array(-1, -1, -1, AnyOf(std::move(invokes)), 1, parallel ? -1 : 1);
    return Sequence({Literal(absl::StrCat("<", kDsml, " calls>\n")), calls,
                     Literal(absl::StrCat("</", kDsml, " calls>"))});
  }

  // The shortest match of every node, as a fixpoint (a $ref cycle makes the grammar recursive,
  // so a node may be built before the nodes it refers to are complete).
  void SettleMinLen() {
    for (Node& n : g_->nodes_) n.min_len = kInf;
    bool changed = true;
    while (changed) {
      changed = false;
      for (Node& n : g_->nodes_) {
        const int64_t v = MinLenOf(n);
        if (v < n.min_len) {
          n.min_len = v;
          changed = true;
        }
      }
    }
  }
  int64_t MinLenOf(const Node& n) const {
    switch (n.kind) {
      case NodeKind::kLiteral:
      case NodeKind::kUntil:
        return static_cast<int64_t>(n.text.size());
      case NodeKind::kString:
        return 2;
      case NodeKind::kNumber:
      case NodeKind::kInteger:
        return 1;
      case NodeKind::kText:
        return 2 + g_->dfas_[static_cast<size_t>(n.dfa)].dist[0] + n.min_chars;
      case NodeKind::kBytes:
        return g_->dfas_[static_cast<size_t>(n.dfa)].dist[0];
      case NodeKind::kSequence: {
        int64_t t = 0;
        for (int c : n.children) t = SatAdd(t, Len(c));
        return t;
      }
      case NodeKind::kAnyOf: {
        int64_t t = kInf;
        for (int c : n.children) t = std::min(t, Len(c));
        return t;
      }
      case NodeKind::kObject:
        if (n.free_keys) return SatAdd(Len(n.open), Len(n.close));
        return SatAdd(SatAdd(Len(n.open), Len(n.close)), RequiredLen(n, 0, true));
      case NodeKind::kArray: {
        int64_t t = SatAdd(Len(n.open), Len(n.close));
        if (n.min_items > 0) {
          const int64_t per = SatAdd(Len(n.item), Len(n.sep));
          if (per >= kInf / n.min_items) return kInf;
          t = SatAdd(t, n.min_items * per - Len(n.sep));
        }
        return t;
      }
    }
    return kInf;
  }

  absl::StatusOr<std::shared_ptr<const Grammar>> Finish(int root) {
    if (g_->nodes_.size() > kMaxNodes) {
      return absl::InvalidArgumentError(
          absl::StrCat("the constraint compiles to more than ", kMaxNodes, " grammar nodes"));
    }
    SettleMinLen();
    if (LeftRecursive()) {
      return absl::InvalidArgumentError(
          "invalid JSON schema: a $ref loop reaches itself before any output (e.g. "
          "{\"anyOf\":[{\"$ref\":\"#\"},...]})");
    }
    if (Len(root) >= kInf) {
      return absl::InvalidArgumentError(
          "invalid JSON schema: it admits no finite value "
          "(a required property refers back to itself)");
    }
    g_->root_ = root;
    return std::shared_ptr<const Grammar>(g_);
  }

  // A cycle of nodes entered without consuming a byte ($ref loops through anyOf / forwarding
  // nodes) would send the matcher round forever: found by a depth-first search over the edges
  // to what may come first.
  bool LeftRecursive() const {
    const size_t n = g_->nodes_.size();
    std::vector<uint8_t> color(n, 0);           // 0 new, 1 on the path, 2 done
    std::vector<std::pair<int, size_t>> stack;  // node, next edge
    auto firsts = [&](int id) {
      const Node& x = g_->nodes_[static_cast<size_t>(id)];
      std::vector<int> out;
      if (x.kind == NodeKind::kAnyOf) out = x.children;
      if (x.kind == NodeKind::kSequence) {
        for (int c : x.children) {
          out.push_back(c);
          if (Len(c) > 0) break;
        }
      }
      if (x.kind == NodeKind::kArray && x.open < 0 && x.item >= 0) out.push_back(x.item);
      return out;
    };
    for (size_t start = 0; start < n; ++start) {
      if (color[start]) continue;
      std::vector<std::vector<int>> edges;
      stack.push_back({static_cast<int>(start), 0});
      edges.push_back(firsts(static_cast<int>(start)));
      color[start] = 1;
      while (!stack.empty()) {
        auto& [node, next] = stack.back();
        if (next < edges.back().size()) {
          const int c = edges.back()[next++];
          if (c < 0) continue;
          if (color[static_cast<size_t>(c)] == 1) return true;
          if (color[static_cast<size_t>(c)] == 0) {
            color[static_cast<size_t>(c)] = 1;
            stack.push_back({c, 0});
            edges.push_back(firsts(c));
          }
        } else {
          color[static_cast<size_t>(node)] = 2;
          stack.pop_back();
          edges.pop_back();
        }
      }
    }
    return false;
  }

  void set_lenient(bool v) { lenient_ = top_lenient_ = v; }
  void set_root(const ojson* r) { root_ = r; }

 private:
  static constexpr int kMaxSchemaDepth = 32;
  static constexpr size_t kMaxEnum = 1000;
  static constexpr size_t kMaxStates = 20000;        // one automaton
  static constexpr size_t kMaxTotalStates = 200000;  // all the grammar's automata
  static constexpr size_t kMaxNodes = 100000;
  static constexpr int kBoundedIntDigits = 20;  // integer digits on an unbounded side
  static inline const std::set<std::string> kAnnotations = {"title",
                                                            "description",
                                                            "default",
                                                            "examples",
                                                            "$schema",
                                                            "$id",
                                                            "$comment",
                                                            "$anchor",
                                                            "readOnly",
                                                            "writeOnly",
                                                            "deprecated",
                                                            "strict",
                                                            "contentEncoding",
                                                            "contentMediaType",
                                                            "discriminator",
                                                            "example",
                                                            "externalDocs",
                                                            "xml",
                                                            "propertyOrdering",
                                                            "$vocabulary"};

  // Inclusive integer bound from a decimal one (ceil for lower, floor for upper).
  static DecBound IntegerBound(DecBound b, bool lower) {
    const bool frac = !b.fp.empty();
    b.fp.clear();
    auto up = [](DecBound x) {  // x + 1
      if (!x.neg) {
        x.ip = IncDigits(x.ip);
      } else {
        x.ip = DecDigits(x.ip);
        if (x.ip == "0") x.neg = false;
      }
      return x;
    };
    auto down = [](DecBound x) {  // x - 1
      if (x.neg || x.ip == "0") {
        x.neg = true;
        x.ip = IncDigits(x.ip);
      } else {
        x.ip = DecDigits(x.ip);
      }
      return x;
    };
    if (lower) {
      // ceil(v) for a fraction; v + 1 for an exclusive integer.
      if (frac) {
        if (!b.neg) b.ip = IncDigits(b.ip);
        if (b.neg && b.ip == "0") b.neg = false;
      } else if (b.exclusive) {
        b = up(b);
      }
    } else {
      if (frac) {
        if (b.neg) b.ip = IncDigits(b.ip);
      } else if (b.exclusive) {
        b = down(b);
      }
    }
    b.exclusive = false;
    return b;
  }
  static std::string IncDigits(std::string s) {
    int i = static_cast<int>(s.size()) - 1;
    while (i >= 0 && s[static_cast<size_t>(i)] == '9') s[static_cast<size_t>(i--)] = '0';
    if (i < 0) return "1" + s;
    ++s[static_cast<size_t>(i)];
    return s;
  }
  static std::string DecDigits(std::string s) {
    int i = static_cast<int>(s.size()) - 1;
    while (s[static_cast<size_t>(i)] == '0') s[static_cast<size_t>(i--)] = '9';
    --s[static_cast<size_t>(i)];
    if (s.size() > 1 && s[0] == '0') s.erase(0, 1);
    return s;
  }

  std::shared_ptr<Grammar> g_;
  int any_ = -1, any_object_ = -1;
  int depth_ = 0;                    // Schema calls on the stack
  bool lenient_ = false;             // keywords outside the subset are ignored (strict false)
  bool top_lenient_ = false;         // the constraint's own "strict": false
  const ojson* root_ = nullptr;      // the document $ref pointers resolve in
  std::map<std::string, int> refs_;  // $ref target -> its (forwarding) node
  size_t total_states_ = 0;
};

absl::StatusOr<std::shared_ptr<const Grammar>> Compile(std::string_view constraint_json) {
  const ojson c = ojson::parse(constraint_json, nullptr, /*allow_exceptions=*/false);
  if (c.is_discarded() || !c.is_object() || !c.contains("type") || !c["type"].is_string())
    return absl::InvalidArgumentError("constraint must be a JSON object with a string 'type'");
  const std::string type = c["type"].get<std::string>();
  Builder b;
  if (c.contains("strict") && !c["strict"].is_boolean())
    return absl::InvalidArgumentError("constraint 'strict' must be a boolean");
  b.set_lenient(!c.value("strict", true));
  absl::StatusOr<int> root;
  if (type == "json_object") {
    root = b.AnyObject();
  } else if (type == "json_schema") {
    if (!c.contains("schema")) return absl::InvalidArgumentError("json_schema without 'schema'");
    b.set_root(&c["schema"]);
    root = b.Schema(c["schema"], "$");
  } else if (type == "tool_calls") {
    if (c.contains("parallel") && !c["parallel"].is_boolean())
      return absl::InvalidArgumentError("tool_calls 'parallel' must be a boolean");
    root = b.ToolCalls(c.value("tools", ojson()), c.value("parallel", true));
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown constraint type '", type, "'"));
  }
  if (!root.ok()) return root.status();
  int top = *root;
  if (c.contains("thinking") && !c["thinking"].is_boolean())
    return absl::InvalidArgumentError("constraint 'thinking' must be a boolean");
  if (c.value("thinking", false)) top = b.Sequence({b.Until("</think>"), top});
  return b.Finish(top);
}

// ---------------------------------------------------------------------------------------------

absl::StatusOr<std::shared_ptr<const Grammar>> GrammarCache::Get(
    const std::string& constraint_json) {
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, g] : entries_) {
      if (key == constraint_json) {
        ++hits_;
        return g;
      }
    }
  }
  auto g = Compile(constraint_json);  // outside the lock: compiling may take a while
  absl::MutexLock lock(&mu_);
  ++misses_;
  if (!g.ok()) return g.status();
  if (entries_.size() >= capacity_ && !entries_.empty()) entries_.erase(entries_.begin());
  entries_.emplace_back(constraint_json, *g);
  return *g;
}

int64_t GrammarCache::hits() const {
  absl::MutexLock lock(&mu_);
  return hits_;
}

int64_t GrammarCache::misses() const {
  absl::MutexLock lock(&mu_);
  return misses_;
}

// ---------------------------------------------------------------------------------------------

Matcher::Matcher(std::shared_ptr<const Grammar> grammar) : grammar_(std::move(grammar)) {
  stacks_.push_back(Stack{Frame{.node = grammar_->root()}});
}

bool Matcher::Advance(std::string_view bytes) {
  for (char c : bytes) {
    if (!AdvanceByte(static_cast<uint8_t>(c))) return false;
  }
  return !stacks_.empty();
}

bool Matcher::AdvanceByte(uint8_t c) {
  std::vector<Stack> next;
  for (const Stack& s : stacks_) {
    std::vector<Stack> out;
    Step(s, c, &out);
    for (Stack& t : out) {
      if (std::find(next.begin(), next.end(), t) == next.end()) next.push_back(std::move(t));
    }
  }
  stacks_ = std::move(next);
  return !stacks_.empty();
}

// One byte of the pushdown automaton for stack `s`: every stack `c` can lead to goes to `out`.
// Kept as one function (~170 lines, over the 150-line rule on purpose, issue 48): it is a single
// switch over the top frame's node kind whose cases share one protocol on the loop around it:
// `continue` after popping or pushing frames (the byte is not consumed yet), `out->push_back` +
// `return` when the byte is consumed, bare `return` when it is refused, and a recursive Step per
// alternative (kAnyOf, kArray, kObject). Split per construct, each piece would need that
// three-way outcome as a result and the frame, stack and node passed in, and the cases stop
// reading side by side, which is how they are checked against each other.
void Matcher::Step(Stack s, uint8_t c, std::vector<Stack>* out) const {
  const Grammar& g = *grammar_;
  auto push = [&](Stack& t, int node) {
    if (node >= 0) t.push_back(Frame{.node = node});
  };
  while (!s.empty()) {  // an empty stack is a complete output: nothing more may follow
    Frame& f = s.back();
    const Node& n = g.node(f.node);
    switch (n.kind) {
      case NodeKind::kLiteral:
        if (f.a >= static_cast<int32_t>(n.text.size())) {
          s.pop_back();
          continue;
        }
        if (static_cast<uint8_t>(n.text[static_cast<size_t>(f.a)]) != c) return;
        if (++f.a == static_cast<int32_t>(n.text.size())) s.pop_back();
        out->push_back(std::move(s));
        return;
      case NodeKind::kUntil:
        if (static_cast<uint8_t>(n.text[static_cast<size_t>(f.a)]) == c) {
          if (++f.a == static_cast<int32_t>(n.text.size())) s.pop_back();
        } else {
          f.a = static_cast<uint8_t>(n.text[0]) == c ? 1 : 0;
        }
        out->push_back(std::move(s));
        return;
      case NodeKind::kString:
        // Phases: 0 before '"', 1 body, 2 after '\', 3 inside a UTF-8 character (a bytes left).
        // Only well-formed UTF-8 outside the overlong / surrogate corners (no E0, ED, F0, F4
        // leads) and no \u escapes, so every parser takes the text.
        switch (f.phase) {
          case 0:
            if (c != '"') return;
            f.phase = 1;
            break;
          case 1:
            if (c == '"') {
              s.pop_back();
            } else if (c == '\\') {
              f.phase = 2;
            } else if (c < 0x20) {
              return;
            } else if (c >= 0x80) {
              if (c >= 0xC2 && c <= 0xDF) {
                f.a = 1;
              } else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) {
                f.a = 2;
              } else if (c >= 0xF1 && c <= 0xF3) {
                f.a = 3;
              } else {
                return;
              }
              f.phase = 3;
            }
            break;
          case 2:
            if (std::string_view("\"\\/bfnrt").find(static_cast<char>(c)) == std::string_view::npos)
              return;
            f.phase = 1;
            break;
          case 3:
            if ((c & 0xC0) != 0x80) return;
            if (--f.a == 0) f.phase = 1;
            break;
        }
        out->push_back(std::move(s));
        return;
      case NodeKind::kText: {
        // Phases: 0 before '"', 1 body, 2 after '\'. a: the automaton's state over the decoded
        // bytes, b: characters so far (when the node counts them).
        const Dfa& d = g.dfa(n.dfa);
        switch (f.phase) {
          case 0:
            if (c != '"') return;
            f.phase = 1;
            break;
          case 1:
            if (c == '"') {
              if (!d.accept[static_cast<size_t>(f.a)] || f.b < n.min_chars) return;
              s.pop_back();
            } else if (c == '\\') {
              bool any = false;
              for (char e : std::string_view(kEscapes)) {
                int32_t count = f.b;
                const uint8_t dec = Unescape(static_cast<uint8_t>(e));
                any = any || (d.Next(f.a, dec) >= 0 && CountChar(n, dec, &count));
              }
              if (!any) return;
              f.phase = 2;
            } else {
              if (c < 0x20) return;
              const int32_t t = d.Next(f.a, c);
              if (t < 0 || !CountChar(n, c, &f.b)) return;
              f.a = t;
            }
            break;
          case 2: {
            if (std::string_view(kEscapes).find(static_cast<char>(c)) == std::string_view::npos)
              return;
            const uint8_t dec = Unescape(c);
            const int32_t t = d.Next(f.a, dec);
            if (t < 0 || !CountChar(n, dec, &f.b)) return;
            f.a = t;
            f.phase = 1;
            break;
          }
        }
        out->push_back(std::move(s));
        return;
      }
      case NodeKind::kBytes: {
        const Dfa& d = g.dfa(n.dfa);
        const int32_t t = d.Next(f.a, c);
        if (t >= 0) {
          f.a = t;
          out->push_back(std::move(s));
          return;
        }
        if (!d.accept[static_cast<size_t>(f.a)]) return;
        s.pop_back();  // the value ended; the byte belongs to what follows
        continue;
      }
      case NodeKind::kNumber:
      case NodeKind::kInteger: {
        int next = NumberNext(f.phase, c, n.kind == NodeKind::kInteger);
        // Digit caps keep every number a finite double: at most kMaxIntDigits integer digits
        // and kMaxExpDigits exponent digits (below 10^300). b counts the current digit run.
        if (next == 2 || next == 3) {
          f.b = f.phase == 3 ? f.b + 1 : 1;
          if (f.b > kMaxIntDigits) next = -1;
        } else if (next == 6) {
          f.b = 0;
        } else if (next == 8) {
          f.b = f.phase == 8 ? f.b + 1 : 1;
          if (f.b > kMaxExpDigits) next = -1;
        }
        if (next >= 0) {
          f.phase = next;
          out->push_back(std::move(s));
          return;
        }
        if (!NumberAccepting(f.phase)) return;
        s.pop_back();  // the number ended; the byte belongs to what follows
        continue;
      }
      case NodeKind::kSequence:
        if (f.phase < static_cast<int32_t>(n.children.size())) {
          const int child = n.children[static_cast<size_t>(f.phase++)];
          push(s, child);
        } else {
          s.pop_back();
        }
        continue;
      case NodeKind::kAnyOf:
        if (f.phase == 0) {
          for (int alt : n.children) {
            Stack t = s;
            t.back().phase = 1;
            push(t, alt);
            Step(std::move(t), c, out);
          }
          return;
        }
        s.pop_back();
        continue;
      case NodeKind::kArray:
        if (f.phase == 0) {
          f.phase = 1;
          push(s, n.open);
          continue;
        }
        if (f.phase == 6) {
          s.pop_back();
          continue;
        }
        // Phase 1: after the opening (no item yet); 3: after an item.
        if (n.max_items < 0 || f.b < n.max_items) {
          Stack t = s;
          t.back().b++;
          const bool sep = t.back().phase == 3;
          t.back().phase = 3;
          push(t, n.item);
          if (sep) push(t, n.sep);
          Step(std::move(t), c, out);
        }
        if (f.b >= n.min_items) {
          f.phase = 6;
          push(s, n.close);
          continue;
        }
        return;
      case NodeKind::kObject: {
        if (f.phase == 0) {
          f.phase = 1;
          push(s, n.open);
          continue;
        }
        if (f.phase == 6) {
          s.pop_back();
          continue;
        }
        const bool sep = f.phase == 3;
        if (n.free_keys) {
          Stack t = s;
          t.back().phase = 3;
          push(t, n.value);
          push(t, n.colon);
          push(t, n.key);
          if (sep) push(t, n.sep);
          Step(std::move(t), c, out);
        } else {
          for (int i = f.phase == 1 ? 0 : f.a + 1; i < static_cast<int>(n.props.size()); ++i) {
            const Node::Prop& p = n.props[static_cast<size_t>(i)];
            Stack t = s;
            t.back().phase = 3;
            t.back().a = i;
            push(t, p.tail);
            push(t, p.value);
            push(t, p.head);
            if (sep) push(t, n.sep);
            Step(std::move(t), c, out);
            if (p.required) break;  // a required property cannot be skipped
          }
          const int from = f.phase == 1 ? 0 : f.a + 1;
          for (int j = from; j < static_cast<int>(n.props.size()); ++j) {
            if (n.props[static_cast<size_t>(j)].required) return;  // cannot close yet
          }
        }
        f.phase = 6;
        push(s, n.close);
        continue;
      }
    }
  }
}

int64_t Matcher::RequiredFrom(const Node& n, int from, bool first) const {
  int64_t total = 0;
  auto len = [&](int id) { return id < 0 ? 0 : grammar_->node(id).min_len; };
  for (size_t j = static_cast<size_t>(std::max(0, from)); j < n.props.size(); ++j) {
    const Node::Prop& p = n.props[j];
    if (!p.required) continue;
    total = SatAdd(total, len(p.head) + len(p.value) + len(p.tail) + (first ? 0 : len(n.sep)));
    first = false;
  }
  return total;
}

int64_t Matcher::FrameRemaining(const Frame& f, bool top) const {
  const Node& n = grammar_->node(f.node);
  auto len = [&](int id) { return id < 0 ? 0 : grammar_->node(id).min_len; };
  switch (n.kind) {
    case NodeKind::kLiteral:
    case NodeKind::kUntil:
      return static_cast<int64_t>(n.text.size()) - f.a;
    case NodeKind::kString:
      if (f.phase == 0) return 2;
      if (f.phase == 1) return 1;
      if (f.phase == 2) return 2;
      return f.a + 1;
    case NodeKind::kNumber:
    case NodeKind::kInteger:
      return NumberAccepting(f.phase) ? 0 : 1;
    case NodeKind::kText: {
      const Dfa& d = grammar_->dfa(n.dfa);
      auto after = [&](int32_t state, int32_t count) {
        return SatAdd(d.dist[static_cast<size_t>(state)],
                      std::max<int64_t>(0, n.min_chars - count) + 1);
      };
      if (f.phase == 0) return n.min_len;
      if (f.phase == 1) return after(f.a, f.b);
      int64_t best = kInf;
      for (char e : std::string_view(kEscapes)) {
        const uint8_t dec = Unescape(static_cast<uint8_t>(e));
        int32_t count = f.b;
        const int32_t t = d.Next(f.a, dec);
        if (t >= 0 && CountChar(n, dec, &count)) best = std::min(best, 1 + after(t, count));
      }
      return best;
    }
    case NodeKind::kBytes:
      return grammar_->dfa(n.dfa).dist[static_cast<size_t>(f.a)];
    case NodeKind::kSequence: {
      int64_t total = 0;
      for (size_t i = static_cast<size_t>(f.phase); i < n.children.size(); ++i)
        total = SatAdd(total, len(n.children[i]));
      return total;
    }
    case NodeKind::kAnyOf:
      return f.phase == 0 ? n.min_len : 0;
    case NodeKind::kArray: {
      if (f.phase == 0) return n.min_len;
      if (f.phase == 6) return 0;
      const int64_t need = std::max<int64_t>(0, n.min_items - f.b);
      if (need == 0) return len(n.close);
      const bool first = f.phase == 1;
      return SatAdd(need * len(n.item) + (need - (first ? 1 : 0)) * len(n.sep), len(n.close));
    }
    case NodeKind::kObject:
      if (f.phase == 0) return n.min_len;
      if (f.phase == 6) return 0;
      if (n.free_keys) return len(n.close);
      return SatAdd(RequiredFrom(n, f.phase == 1 ? 0 : f.a + 1, f.phase == 1), len(n.close));
  }
  (void)top;
  return 0;
}

int64_t Matcher::StackRemaining(const Stack& s) const {
  int64_t total = 0;
  for (size_t i = 0; i < s.size(); ++i)
    total = SatAdd(total, FrameRemaining(s[i], i + 1 == s.size()));
  return total;
}

int64_t Matcher::MinRemaining() const {
  int64_t best = INT64_MAX;
  for (const Stack& s : stacks_) best = std::min(best, StackRemaining(s));
  return best;
}

// ---------------------------------------------------------------------------------------------

TokenMasker::TokenMasker(const std::vector<std::string>& token_bytes,
                         const std::vector<int32_t>& excluded, int32_t eos_id)
    : bytes_(token_bytes), vocab_size_(token_bytes.size()), eos_(eos_id) {
  std::vector<char> skip(token_bytes.size(), 0);
  for (int32_t id : excluded) {
    if (id >= 0 && static_cast<size_t>(id) < skip.size()) skip[static_cast<size_t>(id)] = 1;
  }
  trie_.emplace_back();
  for (size_t id = 0; id < token_bytes.size(); ++id) {
    if (skip[id] || token_bytes[id].empty() || static_cast<int32_t>(id) == eos_id) continue;
    int32_t node = 0;
    for (char ch : token_bytes[id]) {
      const uint8_t c = static_cast<uint8_t>(ch);
      auto& next = trie_[static_cast<size_t>(node)].next;
      auto it = std::lower_bound(next.begin(), next.end(), std::make_pair(c, INT32_MIN));
      if (it != next.end() && it->first == c) {
        node = it->second;
      } else {
        const int32_t child = static_cast<int32_t>(trie_.size());
        next.insert(it, {c, child});
        trie_.emplace_back();
        node = child;
      }
    }
    trie_[static_cast<size_t>(node)].ids.push_back(static_cast<int32_t>(id));
  }
}

void TokenMasker::Walk(int32_t node, const Matcher& m, int64_t budget,
                       std::vector<uint8_t>* allowed, int* count) const {
  for (const auto& [c, child] : trie_[static_cast<size_t>(node)].next) {
    Matcher next = m;
    if (!next.AdvanceByte(c)) continue;
    const TrieNode& t = trie_[static_cast<size_t>(child)];
    if (!t.ids.empty() && next.MinRemaining() <= budget) {
      for (int32_t id : t.ids) (*allowed)[static_cast<size_t>(id)] = 1;
      *count += static_cast<int>(t.ids.size());
    }
    Walk(child, next, budget, allowed, count);
  }
}

int TokenMasker::Mask(const Matcher& m, int64_t budget, std::vector<uint8_t>* allowed) const {
  allowed->assign(vocab_size_, 0);
  int count = 0;
  if (!m.dead()) Walk(0, m, budget, allowed, &count);
  if (eos_ >= 0 && static_cast<size_t>(eos_) < vocab_size_ && m.Complete()) {
    (*allowed)[static_cast<size_t>(eos_)] = 1;
    ++count;
  }
  return count;
}

}  // namespace epd::grammar
