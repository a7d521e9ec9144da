// grammar/: the JSON Schema keywords agent frameworks send (issue 54), with schemas written the
// way zod v4's toJSONSchema, LangChain (zod-to-json-schema) and the OpenAI Agents SDK (Pydantic,
// strict) generate them: string length / pattern / format, number and integer bounds,
// multipleOf, nullable, enum, $ref recursion. Random walks through the token mask must produce
// text that an independent validator in this file accepts (std::regex for patterns, strtod for
// numbers, inet_pton for IP addresses), every number in it a finite double; known-bad texts are
// refused by the matcher; unsupported features and oversized schemas are named refusals.
#include <arpa/inet.h>
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "grammar/grammar.h"

namespace epd::grammar {
namespace {

using json = nlohmann::ordered_json;

std::shared_ptr<const Grammar> MustCompile(const json& schema, bool strict = true) {
  json c = {{"type", "json_schema"}, {"schema", schema}};
  if (!strict) c["strict"] = false;
  auto g = Compile(c.dump());
  EXPECT_TRUE(g.ok()) << g.status();
  return g.ok() ? *g : nullptr;
}

bool Accepts(const std::shared_ptr<const Grammar>& g, std::string_view text) {
  Matcher m(g);
  return m.Advance(text) && m.Complete();
}

// ---- An independent validator for the subset (on the parsed value; numbers on their text). ----

size_t Chars(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

bool Digits(const std::string& s, size_t at, size_t n) {
  if (at + n > s.size()) return false;
  for (size_t i = at; i < at + n; ++i)
    if (!isdigit(static_cast<unsigned char>(s[i]))) return false;
  return true;
}

bool ValidDate(const std::string& s) {
  if (s.size() != 10 || !Digits(s, 0, 4) || s[4] != '-' || !Digits(s, 5, 2) || s[7] != '-' ||
      !Digits(s, 8, 2))
    return false;
  const int y = std::stoi(s.substr(0, 4)), m = std::stoi(s.substr(5, 2)),
            d = std::stoi(s.substr(8, 2));
  if (m < 1 || m > 12 || d < 1) return false;
  const bool leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
  const int days[] = {31, leap ? 29 : 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
  return d <= days[m - 1];
}

bool ValidTime(const std::string& s) {  // HH:MM:SS[.frac](Z|±HH:MM)?
  if (s.size() < 8 || !Digits(s, 0, 2) || s[2] != ':' || !Digits(s, 3, 2) || s[5] != ':' ||
      !Digits(s, 6, 2))
    return false;
  if (std::stoi(s.substr(0, 2)) > 23 || std::stoi(s.substr(3, 2)) > 59 ||
      std::stoi(s.substr(6, 2)) > 59)
    return false;
  size_t i = 8;
  if (i < s.size() && s[i] == '.') {
    ++i;
    const size_t f = i;
    while (i < s.size() && isdigit(static_cast<unsigned char>(s[i]))) ++i;
    if (i == f) return false;
  }
  if (i == s.size()) return true;
  if (s[i] == 'Z') return i + 1 == s.size();
  return (s[i] == '+' || s[i] == '-') && s.size() == i + 6 && Digits(s, i + 1, 2) &&
         s[i + 3] == ':' && Digits(s, i + 4, 2);
}

bool ValidFormat(const std::string& format, const std::string& s) {
  if (format == "date") return ValidDate(s);
  if (format == "time") return ValidTime(s);
  if (format == "date-time") {
    const size_t t = s.find('T');
    const std::string time = t == std::string::npos ? "" : s.substr(t + 1);
    return t == 10 && ValidDate(s.substr(0, 10)) && ValidTime(time) &&
           (time.back() == 'Z' || time.find_first_of("+-") != std::string::npos);
  }
  if (format == "uuid") {
    if (s.size() != 36) return false;
    for (size_t i = 0; i < 36; ++i) {
      const bool dash = i == 8 || i == 13 || i == 18 || i == 23;
      if (dash != (s[i] == '-')) return false;
      if (!dash && !isxdigit(static_cast<unsigned char>(s[i]))) return false;
    }
    return true;
  }
  if (format == "email") {
    const size_t at = s.find('@');
    return at != std::string::npos && at > 0 && s.find('@', at + 1) == std::string::npos &&
           s.find('.', at) != std::string::npos && s.back() != '.';
  }
  if (format == "ipv4" || format == "ipv6") {
    unsigned char buf[16];
    return inet_pton(format == "ipv4" ? AF_INET : AF_INET6, s.c_str(), buf) == 1;
  }
  if (format == "uri") {
    const size_t colon = s.find("://");
    return colon != std::string::npos && colon > 0 && isalpha(static_cast<unsigned char>(s[0])) &&
           s.size() > colon + 3 && s.find(' ') == std::string::npos;
  }
  return true;
}

// UTF-8 to code points, so that std::wregex sees characters, not bytes.
std::wstring Wide(const std::string& s) {
  std::wstring out;
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    uint32_t cp = n == 1 ? c : c & (0x3F >> (n - 1));
    for (size_t k = 1; k < n && i + k < s.size(); ++k)
      cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    out.push_back(static_cast<wchar_t>(cp));
    i += n;
  }
  return out;
}

class Validator {
 public:
  explicit Validator(const json& root) : root_(root) {}

  // Why `v` is not valid against `s` ("" = valid).
  std::string Check(const json& s, const json& v, const std::string& path) const {
    if (s.contains("$ref")) {
      const std::string ref = s["$ref"].get<std::string>().substr(1);
      return Check(root_.at(json::json_pointer(ref)), v, path);
    }
    if (s.contains("anyOf")) {
      for (const auto& alt : s["anyOf"])
        if (Check(alt, v, path).empty()) return "";
      return path + ": no anyOf alternative";
    }
    if (s.contains("const") && v != s["const"]) return path + ": const";
    if (s.contains("enum")) {
      bool found = false;
      for (const auto& e : s["enum"]) found = found || e == v;
      if (!found) return path + ": enum";
    }
    if (s.contains("type")) {
      std::vector<std::string> types;
      if (s["type"].is_string()) {
        types.push_back(s["type"]);
      } else {
        for (const auto& t : s["type"]) types.push_back(t);
      }
      bool ok = false;
      for (const auto& t : types) {
        ok = ok || (t == "string" && v.is_string()) || (t == "null" && v.is_null()) ||
             (t == "boolean" && v.is_boolean()) || (t == "object" && v.is_object()) ||
             (t == "array" && v.is_array()) || (t == "number" && v.is_number()) ||
             (t == "integer" && v.is_number() &&
              (v.is_number_integer() || v.get<double>() == std::floor(v.get<double>())));
      }
      if (!ok) return path + ": type";
    }
    if (v.is_string()) {
      const std::string str = v.get<std::string>();
      if (s.contains("minLength") && Chars(str) < s["minLength"].get<size_t>())
        return path + ": minLength";
      if (s.contains("maxLength") && Chars(str) > s["maxLength"].get<size_t>())
        return path + ": maxLength";
      if (s.contains("pattern") &&
          !std::regex_search(Wide(str), std::wregex(Wide(s["pattern"].get<std::string>()),
                                                    std::regex::ECMAScript)))
        return path + ": pattern " + str;
      if (s.contains("format") && !ValidFormat(s["format"], str)) return path + ": format " + str;
    }
    if (v.is_number()) {
      const double x = v.get<double>();
      auto num = [&](const char* k) { return s[k].get<double>(); };
      if (!std::isfinite(x)) return path + ": not finite";
      if (s.contains("minimum") && x < num("minimum")) return path + ": minimum";
      if (s.contains("maximum") && x > num("maximum")) return path + ": maximum";
      if (s.contains("exclusiveMinimum") && x <= num("exclusiveMinimum"))
        return path + ": exclusiveMinimum";
      if (s.contains("exclusiveMaximum") && x >= num("exclusiveMaximum"))
        return path + ": exclusiveMaximum";
      if (s.contains("multipleOf")) {
        const double q = x / num("multipleOf");
        if (std::fabs(q - std::round(q)) > 1e-9) return path + ": multipleOf";
      }
    }
    if (v.is_array()) {
      if (s.contains("minItems") && v.size() < s["minItems"].get<size_t>())
        return path + ": minItems";
      if (s.contains("maxItems") && v.size() > s["maxItems"].get<size_t>())
        return path + ": maxItems";
      if (s.contains("items")) {
        for (size_t i = 0; i < v.size(); ++i) {
          std::string e = Check(s["items"], v[i], path + "[" + std::to_string(i) + "]");
          if (!e.empty()) return e;
        }
      }
    }
    if (v.is_object()) {
      const json props = s.value("properties", json::object());
      for (const auto& r : s.value("required", json::array()))
        if (!v.contains(r.get<std::string>())) return path + ": required " + r.get<std::string>();
      for (auto it = v.begin(); it != v.end(); ++it) {
        if (props.contains(it.key())) {
          std::string e = Check(props[it.key()], it.value(), path + "." + it.key());
          if (!e.empty()) return e;
        } else if (s.contains("additionalProperties") && s["additionalProperties"] == false) {
          return path + ": additional property " + it.key();
        } else if (s.contains("additionalProperties") && s["additionalProperties"].is_object()) {
          std::string e = Check(s["additionalProperties"], it.value(), path + "." + it.key());
          if (!e.empty()) return e;
        }
      }
    }
    return "";
  }

 private:
  const json& root_;
};

// Every number token outside strings parses (strtod) to a finite double.
std::string NonFiniteNumber(const std::string& text) {
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;
      if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '-' || isdigit(static_cast<unsigned char>(c))) {
      size_t j = i;
      while (j < text.size() &&
             std::string_view("+-0123456789.eE").find(text[j]) != std::string_view::npos)
        ++j;
      const std::string tok = text.substr(i, j - i);
      if (!std::isfinite(std::strtod(tok.c_str(), nullptr))) return tok;
      i = j - 1;
    }
  }
  return "";
}

// A byte-level vocabulary (every single byte) plus multi-byte pieces like a BPE vocabulary's.
std::vector<std::string> Vocab() {
  std::vector<std::string> vocab;
  for (int b = 1; b < 256; ++b) vocab.push_back(std::string(1, static_cast<char>(b)));
  for (const char* piece :
       {"{\"", "\":",   "\",\"", "name", "age", "true",  "null", "12",     "\"}",
        "]}",  "abc",   "\\n",   "é",    "0.",  "99",    "-1",   "@x.io",  "2024-",
        "e9",  "1e400", "ffff",  "::",   "T12", "\\u00", "..",   "http://"})
    vocab.push_back(piece);
  vocab.push_back("");  // EOS
  return vocab;
}

// `samples` random walks (uniform over allowed tokens, EOS with probability 1/4 when allowed)
// within `max_tokens`; each output must be complete, parse, validate and hold finite numbers.
void RandomWalks(const json& schema, int samples, int max_tokens, uint32_t seed,
                 bool strict = true) {
  auto g = MustCompile(schema, strict);
  ASSERT_NE(g, nullptr);
  const std::vector<std::string> vocab = Vocab();
  const int32_t eos = static_cast<int32_t>(vocab.size()) - 1;
  TokenMasker masker(vocab, {}, eos);
  Validator validator(schema);
  std::mt19937 rng(seed);
  std::vector<uint8_t> allowed;
  for (int sample = 0; sample < samples; ++sample) {
    Matcher m(g);
    std::string out;
    for (int n = 0; n < max_tokens; ++n) {
      const int count = masker.Mask(m, max_tokens - n - 1, &allowed);
      ASSERT_GT(count, 0) << out;
      if (allowed[static_cast<size_t>(eos)] && rng() % 4 == 0) break;
      std::vector<int32_t> ids;
      for (size_t i = 0; i < allowed.size(); ++i)
        if (allowed[i] && static_cast<int32_t>(i) != eos) ids.push_back(static_cast<int32_t>(i));
      if (ids.empty()) break;
      const int32_t id = ids[rng() % ids.size()];
      ASSERT_TRUE(m.Advance(vocab[static_cast<size_t>(id)])) << out;
      out += vocab[static_cast<size_t>(id)];
    }
    ASSERT_TRUE(m.Complete()) << out;
    const json v = json::parse(out, nullptr, false);
    ASSERT_FALSE(v.is_discarded()) << out;
    EXPECT_EQ(validator.Check(schema, v, "$"), "") << out;
    EXPECT_EQ(NonFiniteNumber(out), "") << out;
  }
}

// zod v4: z.object({...}) with .min/.max bounds, z.email(), z.uuid(), .nullable(), z.enum,
// .int() (safe-integer bounds), .multipleOf, .positive().lt(1).
const json kZodPerson = json::parse(R"({
  "$schema": "https://json-schema.org/draft/2020-12/schema",
  "type": "object",
  "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "score": {"type": "number", "minimum": -1.5, "maximum": 2.25},
    "ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    "email": {"type": "string", "format": "email",
      "pattern": "^(?!\\.)(?!.*\\.\\.)([A-Za-z0-9_'+\\-\\.]*)[A-Za-z0-9_+-]@([A-Za-z0-9][A-Za-z0-9\\-]*\\.)+[A-Za-z]{2,}$"},
    "id": {"type": "string", "format": "uuid",
      "pattern": "^([0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[1-8][0-9a-fA-F]{3}-[89abAB][0-9a-fA-F]{3}-[0-9a-fA-F]{12}|00000000-0000-0000-0000-000000000000|ffffffff-ffff-ffff-ffff-ffffffffffff)$"},
    "nickname": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}]},
    "role": {"type": "string", "enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "minLength": 2, "maxLength": 4},
             "minItems": 1, "maxItems": 3},
    "safe": {"type": "integer", "minimum": -9007199254740991, "maximum": 9007199254740991},
    "step": {"type": "number", "multipleOf": 0.25, "minimum": 0, "maximum": 10},
    "count": {"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 40, "multipleOf": 7},
    "code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{3,4}$"}
  },
  "required": ["name", "age", "score", "ratio", "email", "id", "nickname", "role", "tags",
               "safe", "step", "count", "code"],
  "additionalProperties": false
})");

TEST(SchemaKeywordsTest, ZodBoundsRandomWalksValidate) { RandomWalks(kZodPerson, 40, 400, 1); }

TEST(SchemaKeywordsTest, ZodBoundsRefuseKnownBad) {
  auto g = MustCompile(kZodPerson);
  ASSERT_NE(g, nullptr);
  const std::string good =
      R"({"name":"Ann","age":150,"score":-1.5,"ratio":0.999,"email":"a.b@x.io",)"
      R"("id":"123e4567-e89b-12d3-a456-426614174000","nickname":null,"role":"user",)"
      R"("tags":["ab","cde"],"safe":-9007199254740991,"step":9.75,"count":0,"code":"AB-123"})";
  ASSERT_TRUE(Accepts(g, good));
  auto bad = [&](const std::string& from, const std::string& to) {
    std::string t = good;
    const size_t at = t.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    t.replace(at, from.size(), to);
    EXPECT_FALSE(Accepts(g, t)) << t;
  };
  bad(R"("name":"Ann")", R"("name":"")");                  // minLength
  bad(R"("name":"Ann")", R"("name":"abcdefghijklm")");     // maxLength
  bad(R"("age":150)", R"("age":151)");                     // maximum
  bad(R"("age":150)", R"("age":-1)");                      // minimum
  bad(R"("age":150)", R"("age":1e2)");                     // integer, no exponent
  bad(R"("score":-1.5)", R"("score":-1.51)");              // decimal minimum
  bad(R"("score":-1.5)", R"("score":2.2500001)");          // decimal maximum
  bad(R"("ratio":0.999)", R"("ratio":0)");                 // exclusiveMinimum
  bad(R"("ratio":0.999)", R"("ratio":1)");                 // exclusiveMaximum
  bad(R"("ratio":0.999)", R"("ratio":0.000)");             // still 0
  bad(R"("email":"a.b@x.io")", R"("email":".a@x.io")");    // (?!\.)
  bad(R"("email":"a.b@x.io")", R"("email":"a..b@x.io")");  // (?!.*\.\.)
  bad(R"("email":"a.b@x.io")", R"("email":"a@x")");        // TLD
  bad(R"(-426614174000)", R"(-42661417400)");              // uuid length
  bad(R"(12d3-a456)", R"(92d3-a456)");                     // uuid version digit
  bad(R"("nickname":null)", R"("nickname":"abcdef")");     // nullable maxLength
  bad(R"("role":"user")", R"("role":"root")");             // enum
  bad(R"(["ab","cde"])", R"([])");                         // minItems
  bad(R"(["ab","cde"])", R"(["ab","cde","ab","ab"])");     // maxItems
  bad(R"(["ab","cde"])", R"(["a"])");                      // items minLength
  bad(R"("safe":-9007199254740991)", R"("safe":-9007199254740992)");
  bad(R"("step":9.75)", R"("step":9.8)");             // multipleOf 0.25
  bad(R"("step":9.75)", R"("step":10.25)");           // maximum
  bad(R"("count":0)", R"("count":-7)");               // exclusiveMinimum -3
  bad(R"("count":0)", R"("count":8)");                // multipleOf 7
  bad(R"("code":"AB-123")", R"("code":"Ab-123")");    // pattern
  bad(R"("code":"AB-123")", R"("code":"AB-12345")");  // pattern
  bad(R"("age":150)", R"("age":0150)");               // leading zero
  EXPECT_TRUE(
      Accepts(g, std::string(good).replace(good.find("\"step\":9.75"), 11, "\"step\":0.250")));
}

// Verbatim z.toJSONSchema output of zod 4.6 (tests/clients/package-lock.json) for z.email(),
// z.uuid(), z.iso.date(), z.iso.datetime(), .int() and z.record(z.string(), z.number()).
const json kZod46 = json::parse(
    R"({"$schema":"https://json-schema.org/draft/2020-12/schema","type":"object","properties":{"name":{"type":"string","minLength":1,"maxLength":12},"age":{"type":"integer","minimum":0,"maximum":150},"ratio":{"type":"number","exclusiveMinimum":0,"exclusiveMaximum":1},"email":{"type":"string","format":"email","pattern":"^(?:[A-Za-z0-9_'+\\-]+\\.)*[A-Za-z0-9_'+\\-]*[A-Za-z0-9_+-]@(?:[A-Za-z0-9][A-Za-z0-9\\-]*\\.)+[A-Za-z]{2,}$"},"id":{"type":"string","format":"uuid","pattern":"^([0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[1-8][0-9a-fA-F]{3}-[89abAB][0-9a-fA-F]{3}-[0-9a-fA-F]{12}|00000000-0000-0000-0000-000000000000|ffffffff-ffff-ffff-ffff-ffffffffffff)$"},"nickname":{"anyOf":[{"type":"string","maxLength":5},{"type":"null"}]},"when":{"type":"string","format":"date","pattern":"^(?:(?:\\d\\d[2468][048]|\\d\\d[13579][26]|\\d\\d0[48]|[02468][048]00|[13579][26]00)-02-29|\\d{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]\\d|3[01])|(?:0[469]|11)-(?:0[1-9]|[12]\\d|30)|(?:02)-(?:0[1-9]|1\\d|2[0-8])))$"},"at":{"type":"string","format":"date-time","pattern":"^(?:(?:\\d\\d[2468][048]|\\d\\d[13579][26]|\\d\\d0[48]|[02468][048]00|[13579][26]00)-02-29|\\d{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]\\d|3[01])|(?:0[469]|11)-(?:0[1-9]|[12]\\d|30)|(?:02)-(?:0[1-9]|1\\d|2[0-8])))T(?:(?:[01]\\d|2[0-3]):[0-5]\\d:[0-5]\\d(?:\\.\\d+)?(?:Z))$"},"n":{"type":"integer","minimum":-9007199254740991,"maximum":9007199254740991},"rec":{"type":"object","propertyNames":{"type":"string"},"additionalProperties":{"type":"number"}},"opt":{"type":"string"}},"required":["name","age","ratio","email","id","nickname","when","at","n","rec"],"additionalProperties":false})");

TEST(SchemaKeywordsTest, Zod46OutputRandomWalksValidate) {
  RandomWalks(kZod46, 30, 500, 7);
  auto g = MustCompile(kZod46);
  ASSERT_NE(g, nullptr);
  const std::string good =
      R"({"name":"A","age":1,"ratio":0.5,"email":"a@b.co","id":"ffffffff-ffff-ffff-ffff-ffffffffffff",)"
      R"("nickname":"x","when":"2024-02-29","at":"2023-12-31T23:59:59.123Z","n":-1,"rec":{}})";
  EXPECT_TRUE(Accepts(g, good));
  std::string bad = good;
  bad.replace(bad.find("2024-02-29"), 10, "2023-02-29");  // not a leap year
  EXPECT_FALSE(Accepts(g, bad));
}

// z.lazy recursion as zod v4 writes it: a $defs entry referring to itself.
const json kZodTree = json::parse(R"({
  "$schema": "https://json-schema.org/draft/2020-12/schema",
  "$ref": "#/$defs/Node",
  "$defs": {
    "Node": {
      "type": "object",
      "properties": {
        "value": {"type": "integer", "minimum": 1, "maximum": 9},
        "label": {"type": "string", "maxLength": 3},
        "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}, "maxItems": 2}
      },
      "required": ["value", "children"],
      "additionalProperties": false
    }
  }
})");

TEST(SchemaKeywordsTest, RefRecursionRandomWalksValidate) {
  RandomWalks(kZodTree, 30, 300, 2);
  auto g = MustCompile(kZodTree);
  ASSERT_NE(g, nullptr);
  EXPECT_TRUE(Accepts(g, R"({"value":1,"children":[{"value":2,"children":[]}]})"));
  EXPECT_FALSE(Accepts(g, R"({"value":1,"children":[{"value":0,"children":[]}]})"));
  EXPECT_FALSE(Accepts(g, R"({"value":1,"children":[{"value":2}]})"));
  EXPECT_EQ(Matcher(g).MinRemaining(),
            static_cast<int64_t>(std::string(R"({"value":1,"children":[]})").size()));
  // A required self-reference admits no finite value: refused, not a hang.
  auto loop = Compile(
      json{{"type", "json_schema"},
           {"schema",
            {{"type", "object"}, {"properties", {{"x", {{"$ref", "#"}}}}}, {"required", {"x"}}}}}
          .dump());
  EXPECT_FALSE(loop.ok());
  // $ref loops that reach themselves before any byte are refused, not an endless matcher.
  for (const char* s :
       {R"({"$ref":"#"})", R"({"anyOf":[{"$ref":"#"},{"type":"null"}]})",
        R"({"$defs":{"a":{"$ref":"#/$defs/b"},"b":{"$ref":"#/$defs/a"}},"$ref":"#/$defs/a"})"}) {
    auto r = Compile(json{{"type", "json_schema"}, {"schema", json::parse(s)}}.dump());
    EXPECT_FALSE(r.ok()) << s;
  }
  // Recursion through a nullable is fine: it consumes '[' first.
  auto list = MustCompile(json::parse(
      R"({"anyOf":[{"type":"null"},{"type":"array","items":{"$ref":"#"},"maxItems":2}]})"));
  EXPECT_TRUE(Accepts(list, "[[null,[]],null]"));
}

// LangChain's withStructuredOutput (zod v3 through zod-to-json-schema, draft-07): descriptions,
// type lists for nullable, nested arrays of objects.
const json kLangChain = json::parse(R"({
  "type": "object",
  "properties": {
    "setup": {"type": "string", "description": "The setup of the joke", "minLength": 3},
    "rating": {"type": ["number", "null"], "description": "How funny, 1 to 10", "minimum": 1,
               "maximum": 10},
    "people": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "born": {"type": "string", "format": "date"},
        "seen": {"type": "string", "format": "date-time"}},
      "required": ["name", "born"], "additionalProperties": false}, "maxItems": 2}
  },
  "required": ["setup", "rating", "people"],
  "additionalProperties": false,
  "$schema": "http://json-schema.org/draft-07/schema#"
})");

TEST(SchemaKeywordsTest, LangChainRandomWalksValidate) { RandomWalks(kLangChain, 30, 400, 3); }

// The OpenAI Agents SDK (Pydantic models, strict): titles, $defs with refs, enums in anyOf
// with null, formats.
const json kAgentsSdk = json::parse(R"({
  "$defs": {
    "Host": {"properties": {
        "v4": {"format": "ipv4", "title": "V4", "type": "string"},
        "v6": {"format": "ipv6", "title": "V6", "type": "string"},
        "url": {"format": "uri", "title": "Url", "type": "string"},
        "at": {"format": "time", "title": "At", "type": "string"}},
      "required": ["v4", "v6", "url", "at"], "title": "Host", "type": "object",
      "additionalProperties": false}
  },
  "properties": {
    "city": {"title": "City", "type": "string"},
    "units": {"anyOf": [{"enum": ["c", "f"], "type": "string"}, {"type": "null"}],
              "title": "Units"},
    "hosts": {"items": {"$ref": "#/$defs/Host"}, "title": "Hosts", "type": "array",
              "maxItems": 2},
    "days": {"maximum": 14, "minimum": 1, "title": "Days", "type": "integer"}
  },
  "required": ["city", "units", "hosts", "days"],
  "title": "get_weather_args",
  "type": "object",
  "additionalProperties": false
})");

TEST(SchemaKeywordsTest, AgentsSdkRandomWalksValidate) { RandomWalks(kAgentsSdk, 30, 500, 4); }

TEST(SchemaKeywordsTest, FormatsAcceptAndRefuse) {
  auto fmt = [](const char* f) { return MustCompile({{"type", "string"}, {"format", f}}); };
  EXPECT_TRUE(Accepts(fmt("date-time"), R"("2024-02-29T23:59:60Z")") == false);  // second 60
  EXPECT_TRUE(Accepts(fmt("date-time"), R"("2024-02-29T23:59:59.5+01:00")"));
  EXPECT_FALSE(Accepts(fmt("date-time"), R"("2024-13-01T00:00:00Z")"));
  EXPECT_TRUE(Accepts(fmt("date"), R"("1999-12-31")"));
  EXPECT_FALSE(Accepts(fmt("date"), R"("1999-12-32")"));
  EXPECT_FALSE(Accepts(fmt("date"), R"("1999-04-31")"));
  EXPECT_FALSE(Accepts(fmt("date"), R"("1900-02-29")"));
  EXPECT_TRUE(Accepts(fmt("date"), R"("2000-02-29")"));
  EXPECT_TRUE(Accepts(fmt("time"), R"("08:30:00")"));
  EXPECT_FALSE(Accepts(fmt("time"), R"("24:00:00")"));
  EXPECT_TRUE(Accepts(fmt("ipv4"), R"("255.0.10.1")"));
  EXPECT_FALSE(Accepts(fmt("ipv4"), R"("256.0.10.1")"));
  EXPECT_TRUE(Accepts(fmt("ipv6"), R"("fe80::1")"));
  EXPECT_TRUE(Accepts(fmt("ipv6"), R"("::")"));
  EXPECT_FALSE(Accepts(fmt("ipv6"), R"("fe80:::1")"));
  EXPECT_TRUE(Accepts(fmt("uuid"), R"("123e4567-e89b-12d3-a456-426614174000")"));
  EXPECT_TRUE(Accepts(fmt("uri"), R"("https://example.com/a?b=c#d")"));
  EXPECT_FALSE(Accepts(fmt("uri"), R"("not a uri")"));
  EXPECT_TRUE(Accepts(fmt("email"), R"("x_y+z@mail.example.org")"));
  EXPECT_FALSE(Accepts(fmt("email"), R"("x@y")"));
}

// Plain numbers stay finite doubles: at most 200 integer digits and 2 exponent digits.
TEST(SchemaKeywordsTest, NumbersAreFiniteDoubles) {
  auto num = MustCompile({{"type", "number"}});
  EXPECT_TRUE(Accepts(num, "1.5e99"));
  EXPECT_TRUE(Accepts(num, "-2E-07"));
  EXPECT_FALSE(Accepts(num, "5e65302"));
  EXPECT_FALSE(Accepts(num, "1e400"));
  EXPECT_TRUE(Accepts(num, std::string(200, '9')));
  EXPECT_FALSE(Accepts(num, std::string(201, '9')));
  auto any = Compile(R"({"type":"json_object"})");
  ASSERT_TRUE(any.ok());
  EXPECT_FALSE(Accepts(*any, R"({"h":5e65302})"));
  EXPECT_TRUE(Accepts(*any, R"({"h":5e65})"));
  RandomWalks({{"type", "object"},
               {"properties", {{"x", {{"type", "number"}}}, {"y", {{"type", "integer"}}}}},
               {"required", {"x", "y"}},
               {"additionalProperties", false}},
              40, 300, 5);
  // Draft-4 boolean exclusiveMinimum, and integer bounds given as fractions.
  auto d4 = MustCompile(
      {{"type", "integer"}, {"minimum", 2.5}, {"maximum", 5}, {"exclusiveMaximum", true}});
  EXPECT_FALSE(Accepts(d4, "2"));
  EXPECT_TRUE(Accepts(d4, "3"));
  EXPECT_TRUE(Accepts(d4, "4"));
  EXPECT_FALSE(Accepts(d4, "5"));
  auto none = Compile(json{{"type", "json_schema"},
                           {"schema", {{"type", "integer"}, {"minimum", 3}, {"maximum", 2}}}}
                          .dump());
  EXPECT_FALSE(none.ok());
}

TEST(SchemaKeywordsTest, PatternSubsetAndRefusals) {
  auto pat = [](const char* p) { return MustCompile({{"type", "string"}, {"pattern", p}}); };
  EXPECT_TRUE(Accepts(pat("ab"), R"("xxabyy")"));  // unanchored: anywhere
  EXPECT_FALSE(Accepts(pat("ab"), R"("xxayy")"));
  EXPECT_TRUE(Accepts(pat("^a(b|c)*d?$"), R"("abccbd")"));
  EXPECT_FALSE(Accepts(pat("^a(b|c)*d?$"), R"("abx")"));
  EXPECT_TRUE(Accepts(pat(R"(^[^"\\]{2}$)"), R"("é!")"));        // negated class: non-ASCII too
  EXPECT_TRUE(Accepts(pat(R"(^\w+\s\d{2,}$)"), R"("ab\t12")"));  // escaped tab matches \s
  EXPECT_TRUE(Accepts(pat(R"(^(?<y>\d{4})-\x41\u00e9$)"), "\"2024-A\xC3\xA9\""));
  // Non-ASCII classes: code point ranges as UTF-8 byte sequences.
  EXPECT_TRUE(Accepts(pat("^[À-ÿ]+$"), R"("Çé")"));
  EXPECT_FALSE(Accepts(pat("^[À-ÿ]+$"), R"("Ça")"));
  EXPECT_TRUE(Accepts(pat("^[^a-zé]$"), R"("ü")"));
  EXPECT_FALSE(Accepts(pat("^[^a-zé]$"), R"("é")"));
  EXPECT_TRUE(Accepts(pat(R"(^[\u4e00-\u9fff]{2}$)"), R"("中文")"));
  EXPECT_FALSE(Accepts(pat(R"(^[\u4e00-\u9fff]{2}$)"), R"("中a")"));
  RandomWalks({{"type", "string"}, {"pattern", "^[a-zÀ-ÿ\u4e00-\u9fff]{1,6}$"}}, 20, 40, 8);
  for (const char* bad : {R"((a)\1)", "(?<=a)b", "a(?=b)", R"(\bword)", R"(\p{L})", "(a", "a**"}) {
    auto g = Compile(
        json{{"type", "json_schema"}, {"schema", {{"type", "string"}, {"pattern", bad}}}}.dump());
    EXPECT_FALSE(g.ok()) << bad;
    if (!g.ok()) {
      EXPECT_NE(g.status().message().find("'pattern'"), std::string::npos) << g.status();
    }
  }
  // strict false: what the subset lacks is ignored (best effort) instead of refused.
  auto lenient =
      MustCompile({{"type", "object"},
                   {"properties",
                    {{"a", {{"type", "string"}, {"pattern", "(?<=x)y"}, {"not", {{"const", 1}}}}}}},
                   {"required", {"a"}},
                   {"additionalProperties", false}},
                  false);
  EXPECT_TRUE(Accepts(lenient, R"({"a":"zz"})"));
  // The same per tool: function.strict false.
  const json params = {{"type", "object"},
                       {"properties", {{"n", {{"type", "integer"}, {"not", {{"const", 1}}}}}}}};
  EXPECT_FALSE(
      Compile(
          json{{"type", "tool_calls"}, {"tools", {{{"name", "f"}, {"parameters", params}}}}}.dump())
          .ok());
  EXPECT_TRUE(Compile(json{{"type", "tool_calls"},
                           {"tools", {{{"name", "f"}, {"parameters", params}, {"strict", false}}}}}
                          .dump())
                  .ok());
  // Enum text is bounded too (20000 bytes).
  json long_enum = json::array();
  for (int i = 0; i < 30; ++i)
    long_enum.push_back(std::string(1000, static_cast<char>('a' + i % 26)) + std::to_string(i));
  EXPECT_FALSE(
      Compile(json{{"type", "json_schema"}, {"schema", {{"enum", long_enum}}}}.dump()).ok());
}

// Issue 53: a huge schema is a compile-time refusal, not a stalled batch.
TEST(SchemaKeywordsTest, SizeLimitsAreNamedRefusals) {
  json values = json::array();
  for (int i = 0; i < 1001; ++i) values.push_back(i);
  auto e = Compile(json{{"type", "json_schema"}, {"schema", {{"enum", values}}}}.dump());
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("more than 1000"), std::string::npos) << e.status();
  // (a|b)*a(a|b){14}: the DFA needs 2^15 states.
  auto p = Compile(json{{"type", "json_schema"},
                        {"schema", {{"type", "string"}, {"pattern", "^[ab]*a[ab]{14}$"}}}}
                       .dump());
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("states"), std::string::npos) << p.status();
  json many = {{"type", "object"}, {"properties", json::object()}};
  for (int i = 0; i < 210; ++i) {
    many["properties"]["p" + std::to_string(i)] = {{"type", "string"},
                                                   {"pattern", "^[a-z]{1,999}$"}};
  }
  auto m = Compile(json{{"type", "json_schema"}, {"schema", many}}.dump());
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("200000"), std::string::npos) << m.status();
  // 1000 enum values compile to one automaton: the mask stays one stack wide.
  values.erase(values.end() - 1);
  auto ok = MustCompile({{"enum", values}});
  ASSERT_NE(ok, nullptr);
  EXPECT_TRUE(Accepts(ok, "999"));
  EXPECT_FALSE(Accepts(ok, "1000"));
}

// zod's z.record(z.string(), z.number().int().min(0)): additionalProperties as a schema.
TEST(SchemaKeywordsTest, RecordValues) {
  const json rec = {{"type", "object"},
                    {"propertyNames", {{"type", "string"}}},
                    {"additionalProperties", {{"type", "integer"}, {"minimum", 0}}}};
  // propertyNames {"type":"string"} says nothing JSON keys do not already say: accepted; any
  // other propertyNames is outside the subset.
  json named = rec;
  named["propertyNames"]["maxLength"] = 3;
  EXPECT_FALSE(Compile(json{{"type", "json_schema"}, {"schema", named}}.dump()).ok());
  RandomWalks(rec, 20, 200, 6);
  auto r = MustCompile(rec);
  EXPECT_TRUE(Accepts(r, R"({"a":1,"b":0})"));
  EXPECT_FALSE(Accepts(r, R"({"a":-1})"));
}

}  // namespace
}  // namespace epd::grammar
