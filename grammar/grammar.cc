#include "grammar/grammar.h"

#include <algorithm>
#include <climits>
#include <nlohmann/json.hpp>
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
    any_object_ = Add(std::move(n));
    return any_object_;
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
    static const std::set<std::string> kKnown = {
        "type",    "properties", "required", "additionalProperties",
        "items",   "minItems",   "maxItems", "enum",
        "const",   "anyOf",      "title",    "description",
        "default", "examples",   "$schema",  "strict",
        "$id",     "$comment"};
    for (auto it = s.begin(); it != s.end(); ++it) {
      if (!kKnown.contains(it.key())) return Unsupported(it.key(), path);
    }
    if (s.contains("const")) return Literal(s["const"].dump());
    if (s.contains("enum")) {
      const ojson& e = s["enum"];
      if (!e.is_array() || e.empty()) return Invalid(path + ".enum", "must be a non-empty array");
      std::vector<int> alts;
      for (const auto& v : e) alts.push_back(Literal(v.dump()));
      return AnyOf(std::move(alts));
    }
    if (s.contains("anyOf")) {
      const ojson& a = s["anyOf"];
      if (!a.is_array() || a.empty()) return Invalid(path + ".anyOf", "must be a non-empty array");
      std::vector<int> alts;
      for (size_t i = 0; i < a.size(); ++i) {
        auto id = Schema(a[i], absl::StrCat(path, ".anyOf[", i, "]"));
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

  absl::StatusOr<int> Typed(const ojson& s, const std::string& type, const std::string& path) {
    if (type == "string") return Leaf(NodeKind::kString, 2);
    if (type == "number") return Leaf(NodeKind::kNumber, 1);
    if (type == "integer") return Leaf(NodeKind::kInteger, 1);
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
      if (s.contains("additionalProperties") && !s["additionalProperties"].is_boolean())
        return Unsupported("additionalProperties (as a schema)", path);
      if (!s.contains("properties")) {
        if (s.value("additionalProperties", true)) return AnyObject();
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
      ojson params = t.value("parameters", ojson::object());
      if (!params.is_object()) return Invalid(path, "must be an object");
      for (auto it = params.begin(); it != params.end(); ++it) {
        static const std::set<std::string> kTop = {
            "type",  "properties",  "required", "additionalProperties",
            "title", "description", "$schema",  "strict"};
        if (!kTop.contains(it.key())) return Unsupported(it.key(), path);
      }
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

  std::shared_ptr<const Grammar> Finish(int root) {
    g_->root_ = root;
    return g_;
  }

 private:
  static constexpr int kMaxSchemaDepth = 32;
  std::shared_ptr<Grammar> g_;
  int any_ = -1, any_object_ = -1;
  int depth_ = 0;  // Schema calls on the stack
};

absl::StatusOr<std::shared_ptr<const Grammar>> Compile(std::string_view constraint_json) {
  const ojson c = ojson::parse(constraint_json, nullptr, /*allow_exceptions=*/false);
  if (c.is_discarded() || !c.is_object() || !c.contains("type") || !c["type"].is_string())
    return absl::InvalidArgumentError("constraint must be a JSON object with a string 'type'");
  const std::string type = c["type"].get<std::string>();
  Builder b;
  absl::StatusOr<int> root;
  if (type == "json_object") {
    root = b.AnyObject();
  } else if (type == "json_schema") {
    if (!c.contains("schema")) return absl::InvalidArgumentError("json_schema without 'schema'");
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
      case NodeKind::kNumber:
      case NodeKind::kInteger: {
        const int next = NumberNext(f.phase, c, n.kind == NodeKind::kInteger);
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
