#include "tokenizer/tokenizer.h"

#include <unicode/locid.h>
#include <unicode/normalizer2.h>
#include <unicode/regex.h>
#include <unicode/unistr.h>

#include <algorithm>
#include <fstream>
#include <functional>
#include <queue>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace epd::model {
namespace {

using json = nlohmann::json;

// ----------------------------------------------------------------------------- UTF-8

enum class SeqKind { kValid, kIncomplete, kInvalid };

// Classifies the sequence starting at bytes[i]. For kValid, *len is its length; for
// kInvalid, *len is the maximal invalid subpart (>= 1); for kIncomplete, the rest of input.
SeqKind ClassifyUtf8(std::string_view s, size_t i, size_t* len) {
  const auto b0 = static_cast<uint8_t>(s[i]);
  if (b0 < 0x80) {
    *len = 1;
    return SeqKind::kValid;
  }
  size_t need = 0;
  uint8_t lo = 0x80, hi = 0xBF;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 1;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 2;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 3;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    *len = 1;
    return SeqKind::kInvalid;
  }
  for (size_t k = 1; k <= need; ++k) {
    if (i + k >= s.size()) {
      *len = s.size() - i;
      return SeqKind::kIncomplete;
    }
    const auto b = static_cast<uint8_t>(s[i + k]);
    const uint8_t l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (b < l || b > h) {
      *len = k;
      return SeqKind::kInvalid;
    }
  }
  *len = need + 1;
  return SeqKind::kValid;
}

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";

bool IsAsciiSpace(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

icu::UnicodeString ToUnicode(std::string_view s) {
  return icu::UnicodeString::fromUTF8(icu::StringPiece(s.data(), static_cast<int32_t>(s.size())));
}

std::string ToUtf8(const icu::UnicodeString& u) {
  std::string out;
  u.toUTF8String(out);
  return out;
}

// ----------------------------------------------------------------------------- steps

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct SplitStep {
  std::unique_ptr<icu::RegexPattern> pattern;
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
};

struct ByteLevelStep {
  bool add_prefix_space = false;
  bool use_regex = false;
};

enum class NormKind { kNfc, kNfd, kNfkc, kNfkd, kLowercase };

// GPT-2 pattern used by ByteLevel(use_regex=true).
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

absl::StatusOr<std::unique_ptr<icu::RegexPattern>> Compile(const std::string& pattern,
                                                           bool literal) {
  UErrorCode status = U_ZERO_ERROR;
  UParseError perr;
  std::unique_ptr<icu::RegexPattern> p(
      icu::RegexPattern::compile(ToUnicode(pattern), literal ? UREGEX_LITERAL : 0, perr, status));
  if (U_FAILURE(status) || p == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("pre_tokenizer regex does not compile (",
                                                   u_errorName(status), " at offset ", perr.offset,
                                                   "): ", pattern));
  }
  return p;
}

}  // namespace

struct Tokenizer::Impl {
  std::vector<NormKind> normalizers;
  // Applied in order; a ByteLevel step is always last (validated at load).
  std::vector<SplitStep> splits;
  ByteLevelStep byte_level;
  // First byte -> indices into added_, longest content first.
  std::array<std::vector<int32_t>, 256> added_by_first_byte;
  std::array<int16_t, 0x180> unicode_to_byte;  // code point (< 0x180) -> byte, or -1

  std::string Normalize(std::string_view text) const {
    if (normalizers.empty()) return std::string(text);
    icu::UnicodeString u = ToUnicode(text);
    for (NormKind k : normalizers) {
      UErrorCode st = U_ZERO_ERROR;
      const icu::Normalizer2* n = nullptr;
      switch (k) {
        case NormKind::kNfc:
          n = icu::Normalizer2::getNFCInstance(st);
          break;
        case NormKind::kNfd:
          n = icu::Normalizer2::getNFDInstance(st);
          break;
        case NormKind::kNfkc:
          n = icu::Normalizer2::getNFKCInstance(st);
          break;
        case NormKind::kNfkd:
          n = icu::Normalizer2::getNFKDInstance(st);
          break;
        case NormKind::kLowercase:
          u.toLower(icu::Locale::getRoot());
          continue;
      }
      if (n != nullptr && U_SUCCESS(st)) u = n->normalize(u, st);
    }
    return ToUtf8(u);
  }

  // Splits every piece by one regex step.
  static void ApplySplit(const SplitStep& step, icu::RegexMatcher& m,
                         std::vector<std::string>& pieces) {
    std::vector<std::string> out;
    out.reserve(pieces.size() * 2);
    for (const std::string& piece : pieces) {
      // UTF-16 index -> byte offset.
      icu::UnicodeString u = ToUnicode(piece);
      std::vector<int32_t> byte_at(static_cast<size_t>(u.length()) + 1, 0);
      {
        int32_t b = 0;
        for (int32_t i = 0; i < u.length();) {
          UChar32 c = u.char32At(i);
          int32_t n16 = U16_LENGTH(c);
          int32_t n8 = U8_LENGTH(c);
          for (int32_t k = 0; k < n16; ++k) byte_at[static_cast<size_t>(i + k)] = b;
          i += n16;
          b += n8;
        }
        byte_at[static_cast<size_t>(u.length())] = b;
      }
      // Re-encoding through UTF-16 is lossless only for valid UTF-8; other pieces are kept.
      if (static_cast<size_t>(byte_at.back()) != piece.size() || !IsValidUtf8(piece)) {
        out.push_back(piece);
        continue;
      }
      struct Seg {
        int32_t b, e;
        bool delim;
      };
      std::vector<Seg> segs;
      UErrorCode st = U_ZERO_ERROR;
      m.reset(u);
      int32_t last = 0;
      while (m.find(st) && U_SUCCESS(st)) {
        int32_t s = m.start(st), e = m.end(st);
        if (e == s) continue;
        if (s > last)
          segs.push_back(
              {byte_at[static_cast<size_t>(last)], byte_at[static_cast<size_t>(s)], step.invert});
        segs.push_back(
            {byte_at[static_cast<size_t>(s)], byte_at[static_cast<size_t>(e)], !step.invert});
        last = e;
      }
      if (last < u.length()) {
        segs.push_back({byte_at[static_cast<size_t>(last)],
                        byte_at[static_cast<size_t>(u.length())], step.invert});
      }
      auto text = [&](const Seg& s) {
        return piece.substr(static_cast<size_t>(s.b), static_cast<size_t>(s.e - s.b));
      };
      switch (step.behavior) {
        case SplitBehavior::kIsolated:
          for (const Seg& s : segs) out.push_back(text(s));
          break;
        case SplitBehavior::kRemoved:
          for (const Seg& s : segs)
            if (!s.delim) out.push_back(text(s));
          break;
        case SplitBehavior::kMergedWithPrevious: {
          bool have_prev = false;
          for (const Seg& s : segs) {
            if (s.delim && have_prev) {
              out.back() += text(s);
            } else {
              out.push_back(text(s));
            }
            have_prev = true;
          }
          break;
        }
        case SplitBehavior::kMergedWithNext: {
          std::string carry;
          for (const Seg& s : segs) {
            if (s.delim) {
              carry += text(s);
            } else {
              out.push_back(carry + text(s));
              carry.clear();
            }
          }
          if (!carry.empty()) out.push_back(carry);
          break;
        }
        case SplitBehavior::kContiguous: {
          bool prev_delim = false;
          for (const Seg& s : segs) {
            if (s.delim && prev_delim) {
              out.back() += text(s);
            } else {
              out.push_back(text(s));
            }
            prev_delim = s.delim;
          }
          break;
        }
      }
    }
    pieces = std::move(out);
  }

  // Text -> raw-byte words (before the byte-level character mapping).
  std::vector<std::string> PreTokenizeRaw(std::string_view text) const {
    std::vector<std::string> pieces;
    if (text.empty()) return pieces;
    pieces.push_back(Normalize(text));
    for (const SplitStep& s : splits) {
      UErrorCode st = U_ZERO_ERROR;
      std::unique_ptr<icu::RegexMatcher> m(s.pattern->matcher(st));
      if (U_FAILURE(st) || !m) continue;
      ApplySplit(s, *m, pieces);
    }
    if (byte_level.add_prefix_space) {
      for (std::string& p : pieces)
        if (p.empty() || p[0] != ' ') p.insert(p.begin(), ' ');
    }
    std::erase_if(pieces, [](const std::string& p) { return p.empty(); });
    return pieces;
  }
};

namespace {

absl::Status ParseNormalizer(const json& n, std::vector<NormKind>& out) {
  if (n.is_null()) return absl::OkStatus();
  if (!n.is_object() || !n.contains("type")) {
    return absl::InvalidArgumentError("normalizer: expected an object with a \"type\"");
  }
  const std::string type = n["type"].get<std::string>();
  if (type == "Sequence") {
    for (const json& c : n.at("normalizers")) RETURN_IF_ERROR(ParseNormalizer(c, out));
  } else if (type == "NFC") {
    out.push_back(NormKind::kNfc);
  } else if (type == "NFD") {
    out.push_back(NormKind::kNfd);
  } else if (type == "NFKC") {
    out.push_back(NormKind::kNfkc);
  } else if (type == "NFKD") {
    out.push_back(NormKind::kNfkd);
  } else if (type == "Lowercase") {
    out.push_back(NormKind::kLowercase);
  } else {
    return absl::UnimplementedError(
        absl::StrCat("normalizer type \"", type, "\" is not supported"));
  }
  return absl::OkStatus();
}

absl::Status ParsePreTokenizer(const json& p, Tokenizer::Impl& impl, bool& saw_byte_level) {
  if (!p.is_object() || !p.contains("type")) {
    return absl::InvalidArgumentError("pre_tokenizer: expected an object with a \"type\"");
  }
  const std::string type = p["type"].get<std::string>();
  if (saw_byte_level) {
    return absl::UnimplementedError(
        absl::StrCat("pre_tokenizer step \"", type, "\" after ByteLevel is not supported"));
  }
  if (type == "Sequence") {
    for (const json& c : p.at("pretokenizers"))
      RETURN_IF_ERROR(ParsePreTokenizer(c, impl, saw_byte_level));
    return absl::OkStatus();
  }
  if (type == "Split") {
    SplitStep step;
    const json& pat = p.at("pattern");
    if (pat.contains("Regex")) {
      ASSIGN_OR_RETURN(step.pattern, Compile(pat["Regex"].get<std::string>(), false));
    } else if (pat.contains("String")) {
      ASSIGN_OR_RETURN(step.pattern, Compile(pat["String"].get<std::string>(), true));
    } else {
      return absl::InvalidArgumentError(
          "pre_tokenizer Split: pattern needs \"Regex\" or \"String\"");
    }
    const std::string b = p.value("behavior", std::string("Isolated"));
    if (b == "Isolated")
      step.behavior = SplitBehavior::kIsolated;
    else if (b == "Removed")
      step.behavior = SplitBehavior::kRemoved;
    else if (b == "MergedWithPrevious")
      step.behavior = SplitBehavior::kMergedWithPrevious;
    else if (b == "MergedWithNext")
      step.behavior = SplitBehavior::kMergedWithNext;
    else if (b == "Contiguous")
      step.behavior = SplitBehavior::kContiguous;
    else
      return absl::InvalidArgumentError(
          absl::StrCat("pre_tokenizer Split: unknown behavior \"", b, "\""));
    step.invert = p.value("invert", false);
    impl.splits.push_back(std::move(step));
    return absl::OkStatus();
  }
  if (type == "ByteLevel") {
    impl.byte_level.add_prefix_space = p.value("add_prefix_space", false);
    impl.byte_level.use_regex = p.value("use_regex", true);
    if (impl.byte_level.use_regex) {
      SplitStep step;
      ASSIGN_OR_RETURN(step.pattern, Compile(kGpt2Pattern, false));
      impl.splits.push_back(std::move(step));
    }
    saw_byte_level = true;
    return absl::OkStatus();
  }
  return absl::UnimplementedError(
      absl::StrCat("pre_tokenizer type \"", type, "\" is not supported"));
}

uint64_t PairKey(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

}  // namespace

const std::array<std::string, 256>& Tokenizer::ByteToUnicode() {
  static const std::array<std::string, 256> table = [] {
    std::array<std::string, 256> t;
    std::array<bool, 256> direct{};
    for (int b = '!'; b <= '~'; ++b) direct[static_cast<size_t>(b)] = true;
    for (int b = 0xA1; b <= 0xAC; ++b) direct[static_cast<size_t>(b)] = true;
    for (int b = 0xAE; b <= 0xFF; ++b) direct[static_cast<size_t>(b)] = true;
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const UChar32 cp = direct[static_cast<size_t>(b)] ? b : 256 + n++;
      t[static_cast<size_t>(b)] = ToUtf8(icu::UnicodeString(cp));
    }
    return t;
  }();
  return table;
}

Tokenizer::Tokenizer() : impl_(std::make_unique<Impl>()) {}
Tokenizer::~Tokenizer() = default;

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("tokenizer file ", path, " cannot be opened"));
  std::stringstream ss;
  ss << in.rdbuf();
  auto t = FromJson(ss.str());
  if (!t.ok()) {
    return absl::Status(t.status().code(), absl::StrCat(path, ": ", t.status().message()));
  }
  return t;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJson(std::string_view json_text) {
  std::unique_ptr<Tokenizer> t(new Tokenizer());
  absl::Status st;
  try {
    st = t->Init(json_text);
  } catch (const json::exception& e) {
    st = absl::InvalidArgumentError(absl::StrCat("malformed tokenizer.json field: ", e.what()));
  }
  if (!st.ok()) return st;
  return t;
}

absl::Status Tokenizer::Init(std::string_view json_text) {
  json j = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError("tokenizer.json is not a JSON object");
  }
  if (!j.contains("model") || !j["model"].is_object()) {
    return absl::InvalidArgumentError("tokenizer.json has no \"model\" object");
  }
  const json& model = j["model"];
  const std::string mtype = model.value("type", std::string("BPE"));
  if (mtype != "BPE") {
    return absl::UnimplementedError(
        absl::StrCat("model.type \"", mtype, "\" is not supported (BPE only)"));
  }
  if (model.value("byte_fallback", false)) {
    return absl::UnimplementedError("model.byte_fallback is not supported (byte-level BPE only)");
  }
  if (model.contains("dropout") && !model["dropout"].is_null()) {
    return absl::UnimplementedError("model.dropout is not supported");
  }
  ignore_merges_ = model.value("ignore_merges", false);
  if (!model.contains("vocab") || !model["vocab"].is_object()) {
    return absl::InvalidArgumentError("model.vocab is missing or not an object");
  }
  auto set_token = [&](int64_t id, const std::string& tok, int8_t kind) -> absl::Status {
    if (id < 0 || id > (1 << 30)) {
      return absl::InvalidArgumentError(absl::StrCat("token \"", tok, "\" has invalid id ", id));
    }
    if (static_cast<size_t>(id) >= id_to_token_.size()) {
      id_to_token_.resize(static_cast<size_t>(id) + 1);
      kind_.resize(static_cast<size_t>(id) + 1, 0);
    }
    id_to_token_[static_cast<size_t>(id)] = tok;
    kind_[static_cast<size_t>(id)] = std::max(kind_[static_cast<size_t>(id)], kind);
    token_to_id_[tok] = static_cast<int32_t>(id);
    return absl::OkStatus();
  };
  for (auto it = model["vocab"].begin(); it != model["vocab"].end(); ++it) {
    if (!it.value().is_number_integer()) {
      return absl::InvalidArgumentError(
          absl::StrCat("model.vocab[\"", it.key(), "\"] is not an integer id"));
    }
    RETURN_IF_ERROR(set_token(it.value().get<int64_t>(), it.key(), 1));
  }
  // Byte tokens: all 256 must exist for byte-level BPE.
  const auto& b2u = ByteToUnicode();
  impl_->unicode_to_byte.fill(-1);
  for (int b = 0; b < 256; ++b) {
    auto it = token_to_id_.find(b2u[static_cast<size_t>(b)]);
    if (it == token_to_id_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("model.vocab lacks the byte-level token for byte ", b, " (\"",
                       b2u[static_cast<size_t>(b)], "\"); only byte-level BPE is supported"));
    }
    byte_token_[static_cast<size_t>(b)] = it->second;
    icu::UnicodeString u = ToUnicode(b2u[static_cast<size_t>(b)]);
    impl_->unicode_to_byte[static_cast<size_t>(u.char32At(0))] = static_cast<int16_t>(b);
  }
  // Merges.
  if (!model.contains("merges") || !model["merges"].is_array()) {
    return absl::InvalidArgumentError("model.merges is missing or not an array");
  }
  int32_t rank = 0;
  for (const json& m : model["merges"]) {
    std::string a, b;
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      const size_t sp = s.find(' ', 1);
      if (sp == std::string::npos) {
        return absl::InvalidArgumentError(
            absl::StrCat("merge ", rank, " \"", s, "\" is not \"a b\""));
      }
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (m.is_array() && m.size() == 2) {
      a = m[0].get<std::string>();
      b = m[1].get<std::string>();
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("merge ", rank, " is neither \"a b\" nor [a, b]"));
    }
    auto ia = token_to_id_.find(a), ib = token_to_id_.find(b), iab = token_to_id_.find(a + b);
    if (ia == token_to_id_.end() || ib == token_to_id_.end() || iab == token_to_id_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("merge ", rank, " (\"", a, "\", \"", b,
                                                     "\") refers to a token not in model.vocab"));
    }
    merges_.try_emplace(PairKey(ia->second, ib->second), rank, iab->second);
    ++rank;
  }
  // Added tokens.
  if (j.contains("added_tokens") && !j["added_tokens"].is_null()) {
    for (const json& a : j["added_tokens"]) {
      AddedToken t;
      t.id = a.at("id").get<int32_t>();
      t.content = a.at("content").get<std::string>();
      t.special = a.value("special", false);
      t.lstrip = a.value("lstrip", false);
      t.rstrip = a.value("rstrip", false);
      t.normalized = a.value("normalized", false);
      if (t.content.empty())
        return absl::InvalidArgumentError(absl::StrCat("added token ", t.id, " is empty"));
      RETURN_IF_ERROR(set_token(t.id, t.content, t.special ? 3 : 2));
      added_.push_back(std::move(t));
    }
  }
  for (size_t i = 0; i < added_.size(); ++i) {
    impl_->added_by_first_byte[static_cast<uint8_t>(added_[i].content[0])].push_back(
        static_cast<int32_t>(i));
  }
  for (auto& v : impl_->added_by_first_byte) {
    std::stable_sort(v.begin(), v.end(), [&](int32_t x, int32_t y) {
      return added_[static_cast<size_t>(x)].content.size() >
             added_[static_cast<size_t>(y)].content.size();
    });
  }
  // Pipeline.
  if (j.contains("normalizer"))
    RETURN_IF_ERROR(ParseNormalizer(j["normalizer"], impl_->normalizers));
  bool saw_byte_level = false;
  if (j.contains("pre_tokenizer") && !j["pre_tokenizer"].is_null()) {
    RETURN_IF_ERROR(ParsePreTokenizer(j["pre_tokenizer"], *impl_, saw_byte_level));
  }
  if (!saw_byte_level) {
    return absl::UnimplementedError(
        "pre_tokenizer has no ByteLevel step; only byte-level BPE is supported");
  }
  if (j.contains("decoder") && !j["decoder"].is_null()) {
    const json& d = j["decoder"];
    const std::string dt = d.value("type", std::string());
    bool ok = dt == "ByteLevel";
    if (dt == "Sequence" && d.contains("decoders")) {
      for (const json& x : d["decoders"]) ok = ok || x.value("type", std::string()) == "ByteLevel";
    }
    if (!ok)
      return absl::UnimplementedError(absl::StrCat("decoder type \"", dt, "\" is not supported"));
  }
  return absl::OkStatus();
}

std::vector<std::string> Tokenizer::PreTokenize(std::string_view text) const {
  std::vector<std::string> words = impl_->PreTokenizeRaw(text);
  const auto& b2u = ByteToUnicode();
  for (std::string& w : words) {
    std::string m;
    for (char c : w) m += b2u[static_cast<uint8_t>(c)];
    w = std::move(m);
  }
  return words;
}

void Tokenizer::BpeWord(const std::string& word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    std::string mapped;
    for (char c : word) mapped += ByteToUnicode()[static_cast<uint8_t>(c)];
    auto it = token_to_id_.find(mapped);
    if (it != token_to_id_.end() && kind_[static_cast<size_t>(it->second)] == 1) {
      out.push_back(it->second);
      return;
    }
  }
  const size_t n = word.size();
  std::vector<int32_t> ids(n), next(n), prev(n);
  std::vector<bool> alive(n, true);
  for (size_t i = 0; i < n; ++i) {
    ids[i] = byte_token_[static_cast<uint8_t>(word[i])];
    next[i] = static_cast<int32_t>(i + 1);
    prev[i] = static_cast<int32_t>(i) - 1;
  }
  if (n > 1) {
    struct Cand {
      int32_t rank, pos, left, right;
      bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
    auto push = [&](int32_t pos) {
      if (pos < 0) return;
      const int32_t nx = next[static_cast<size_t>(pos)];
      if (nx >= static_cast<int32_t>(n)) return;
      auto it = merges_.find(PairKey(ids[static_cast<size_t>(pos)], ids[static_cast<size_t>(nx)]));
      if (it != merges_.end())
        heap.push(
            {it->second.first, pos, ids[static_cast<size_t>(pos)], ids[static_cast<size_t>(nx)]});
    };
    for (size_t i = 0; i + 1 < n; ++i) push(static_cast<int32_t>(i));
    while (!heap.empty()) {
      const Cand c = heap.top();
      heap.pop();
      const auto p = static_cast<size_t>(c.pos);
      if (!alive[p] || ids[p] != c.left) continue;
      const int32_t nx = next[p];
      if (nx >= static_cast<int32_t>(n) || ids[static_cast<size_t>(nx)] != c.right) continue;
      ids[p] = merges_.at(PairKey(c.left, c.right)).second;
      alive[static_cast<size_t>(nx)] = false;
      next[p] = next[static_cast<size_t>(nx)];
      if (next[p] < static_cast<int32_t>(n)) prev[static_cast<size_t>(next[p])] = c.pos;
      push(prev[p]);
      push(c.pos);
    }
  }
  for (size_t i = 0; i < n; i = static_cast<size_t>(next[i])) out.push_back(ids[i]);
}

void Tokenizer::EncodePlain(std::string_view text, std::vector<int32_t>& out) const {
  for (const std::string& w : impl_->PreTokenizeRaw(text)) BpeWord(w, out);
}

std::vector<int32_t> Tokenizer::EncodeOrdinary(std::string_view text) const {
  std::vector<int32_t> out;
  EncodePlain(text, out);
  return out;
}

std::vector<int32_t> Tokenizer::Encode(std::string_view text) const {
  std::vector<int32_t> out;
  size_t seg = 0, i = 0;
  while (i < text.size()) {
    const AddedToken* hit = nullptr;
    for (int32_t k : impl_->added_by_first_byte[static_cast<uint8_t>(text[i])]) {
      const AddedToken& t = added_[static_cast<size_t>(k)];
      if (text.substr(i, t.content.size()) == t.content) {
        hit = &t;
        break;
      }
    }
    if (hit == nullptr) {
      ++i;
      continue;
    }
    size_t seg_end = i;
    if (hit->lstrip) {
      while (seg_end > seg && IsAsciiSpace(text[seg_end - 1])) --seg_end;
    }
    EncodePlain(text.substr(seg, seg_end - seg), out);
    out.push_back(hit->id);
    i += hit->content.size();
    if (hit->rstrip) {
      while (i < text.size() && IsAsciiSpace(text[i])) ++i;
    }
    seg = i;
  }
  EncodePlain(text.substr(seg), out);
  return out;
}

bool Tokenizer::AppendTokenBytes(int32_t id, bool skip_special, std::string& out) const {
  if (id < 0 || id >= vocab_size() || kind_[static_cast<size_t>(id)] == 0) return false;
  const int8_t kind = kind_[static_cast<size_t>(id)];
  const std::string& tok = id_to_token_[static_cast<size_t>(id)];
  if (kind >= 2) {
    if (!(skip_special && kind == 3)) out += tok;
    return true;
  }
  // Byte-level: every character maps back to one byte; a token with any other character
  // is emitted as-is (HF ByteLevel decoder behaviour).
  std::string bytes;
  icu::UnicodeString u = ToUnicode(tok);
  for (int32_t k = 0; k < u.length();) {
    const UChar32 c = u.char32At(k);
    k += U16_LENGTH(c);
    if (c < 0 || c >= 0x180 || impl_->unicode_to_byte[static_cast<size_t>(c)] < 0) {
      out += tok;
      return true;
    }
    bytes.push_back(static_cast<char>(impl_->unicode_to_byte[static_cast<size_t>(c)]));
  }
  out += bytes;
  return true;
}

absl::StatusOr<std::string> Tokenizer::Decode(std::span<const int32_t> ids,
                                              bool skip_special) const {
  std::string out;
  for (int32_t id : ids) {
    if (!AppendTokenBytes(id, skip_special, out)) {
      return absl::InvalidArgumentError(
          absl::StrCat("token id ", id, " is not in the vocabulary (size ", vocab_size(), ")"));
    }
  }
  return out;
}

absl::StatusOr<std::string> Tokenizer::DecodeLossy(std::span<const int32_t> ids,
                                                   bool skip_special) const {
  ASSIGN_OR_RETURN(std::string raw, Decode(ids, skip_special));
  return Utf8Lossy(raw);
}

std::optional<int32_t> Tokenizer::TokenId(std::string_view token) const {
  auto it = token_to_id_.find(std::string(token));
  if (it == token_to_id_.end()) return std::nullopt;
  return it->second;
}

std::string_view Tokenizer::TokenString(int32_t id) const {
  if (id < 0 || id >= vocab_size()) return {};
  return id_to_token_[static_cast<size_t>(id)];
}

bool Tokenizer::IsAddedToken(int32_t id) const {
  return id >= 0 && id < vocab_size() && kind_[static_cast<size_t>(id)] >= 2;
}

bool Tokenizer::IsSpecial(int32_t id) const {
  return id >= 0 && id < vocab_size() && kind_[static_cast<size_t>(id)] == 3;
}

// ----------------------------------------------------------------------------- UTF-8 helpers

size_t CompleteUtf8Prefix(std::string_view bytes) {
  size_t i = 0;
  while (i < bytes.size()) {
    size_t len = 0;
    if (ClassifyUtf8(bytes, i, &len) == SeqKind::kIncomplete) break;
    i += len;
  }
  return i;
}

std::string Utf8Lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t i = 0;
  while (i < bytes.size()) {
    size_t len = 0;
    const SeqKind k = ClassifyUtf8(bytes, i, &len);
    if (k == SeqKind::kValid) {
      out.append(bytes.substr(i, len));
    } else {
      out.append(kReplacement);
    }
    i += len;
  }
  return out;
}

bool IsValidUtf8(std::string_view bytes) {
  size_t i = 0;
  while (i < bytes.size()) {
    size_t len = 0;
    if (ClassifyUtf8(bytes, i, &len) != SeqKind::kValid) return false;
    i += len;
  }
  return true;
}

absl::StatusOr<std::string> IncrementalDetokenizer::Add(int32_t id) {
  ASSIGN_OR_RETURN(std::string bytes,
                   tokenizer_.Decode(std::span<const int32_t>(&id, 1), skip_special_));
  pending_ += bytes;
  const size_t n = CompleteUtf8Prefix(pending_);
  std::string out = Utf8Lossy(std::string_view(pending_).substr(0, n));
  pending_.erase(0, n);
  return out;
}

std::string IncrementalDetokenizer::Flush() {
  std::string out = Utf8Lossy(pending_);
  pending_.clear();
  return out;
}

}  // namespace epd::model
