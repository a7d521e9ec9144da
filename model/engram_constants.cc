#include "model/engram_constants.h"

#include <unicode/locid.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>

#include <fstream>
#include <limits>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "tokenizer/tokenizer.h"

namespace epd::model {
namespace {

using json = nlohmann::json;
using u128 = unsigned __int128;

// NumPy SeedSequence constants.
constexpr uint32_t kInitA = 0x43b0d7e5, kMultA = 0x931e8875, kInitB = 0x8b51f9dd,
                   kMultB = 0x58f38ded;
constexpr uint32_t kMixMultL = 0xca01f9dd, kMixMultR = 0x4973f715;
constexpr int kXShift = 16;
constexpr int kPoolSize = 4;

uint32_t HashMix(uint32_t value, uint32_t& hash_const) {
  value ^= hash_const;
  hash_const *= kMultA;
  value *= hash_const;
  value ^= value >> kXShift;
  return value;
}

uint32_t Mix(uint32_t x, uint32_t y) {
  uint32_t r = kMixMultL * x - kMixMultR * y;
  r ^= r >> kXShift;
  return r;
}

constexpr u128 kPcgMult =
    (static_cast<u128>(2549297995355413924ULL) << 64) | 4865540595714422341ULL;

bool IsPrime(int64_t n) {
  if (n < 2) return false;
  if (n % 2 == 0) return n == 2;
  for (int64_t f = 3; f * f <= n; f += 2) {
    if (n % f == 0) return false;
  }
  return true;
}

std::string ToUtf8(const icu::UnicodeString& u) {
  std::string out;
  u.toUTF8String(out);
  return out;
}

}  // namespace

// ----------------------------------------------------------------------------- NumPy RNG

std::vector<uint32_t> SeedSequenceState(uint64_t entropy, int n_words) {
  std::vector<uint32_t> ent;
  if (entropy == 0) ent.push_back(0);
  while (entropy > 0) {
    ent.push_back(static_cast<uint32_t>(entropy & 0xFFFFFFFFu));
    entropy >>= 32;
  }
  uint32_t pool[kPoolSize];
  uint32_t hc = kInitA;
  for (int i = 0; i < kPoolSize; ++i)
    pool[i] = HashMix(i < static_cast<int>(ent.size()) ? ent[static_cast<size_t>(i)] : 0, hc);
  for (int s = 0; s < kPoolSize; ++s) {
    for (int d = 0; d < kPoolSize; ++d) {
      if (s != d) pool[d] = Mix(pool[d], HashMix(pool[s], hc));
    }
  }
  for (size_t s = kPoolSize; s < ent.size(); ++s) {
    for (int d = 0; d < kPoolSize; ++d) pool[d] = Mix(pool[d], HashMix(ent[s], hc));
  }
  std::vector<uint32_t> out(static_cast<size_t>(n_words));
  uint32_t hb = kInitB;
  for (int i = 0; i < n_words; ++i) {
    uint32_t v = pool[i % kPoolSize];
    v ^= hb;
    hb *= kMultB;
    v *= hb;
    v ^= v >> kXShift;
    out[static_cast<size_t>(i)] = v;
  }
  return out;
}

NumpyPcg64::NumpyPcg64(uint64_t seed) {
  const std::vector<uint32_t> w = SeedSequenceState(seed, 8);
  uint64_t v[4];
  for (int i = 0; i < 4; ++i)
    v[i] = static_cast<uint64_t>(w[2 * i]) | (static_cast<uint64_t>(w[2 * i + 1]) << 32);
  const u128 initstate = (static_cast<u128>(v[0]) << 64) | v[1];
  const u128 initseq = (static_cast<u128>(v[2]) << 64) | v[3];
  state_ = 0;
  inc_ = (initseq << 1) | 1;
  state_ = state_ * kPcgMult + inc_;
  state_ += initstate;
  state_ = state_ * kPcgMult + inc_;
}

uint64_t NumpyPcg64::NextUint64() {
  state_ = state_ * kPcgMult + inc_;
  const uint64_t hi = static_cast<uint64_t>(state_ >> 64), lo = static_cast<uint64_t>(state_);
  const unsigned rot = static_cast<unsigned>(state_ >> 122);
  const uint64_t x = hi ^ lo;
  return (x >> rot) | (x << ((64 - rot) & 63));
}

uint32_t NumpyPcg64::NextUint32() {
  if (has_uint32_) {
    has_uint32_ = false;
    return uinteger_;
  }
  const uint64_t next = NextUint64();
  has_uint32_ = true;
  uinteger_ = static_cast<uint32_t>(next >> 32);
  return static_cast<uint32_t>(next & 0xFFFFFFFFu);
}

double NumpyPcg64::NextDouble() {
  return static_cast<double>(NextUint64() >> 11) * (1.0 / 9007199254740992.0);
}

int64_t NumpyPcg64::Integers(int64_t high) {
  const uint64_t rng = static_cast<uint64_t>(high) - 1;  // closed range [0, rng]
  if (rng == 0) return 0;
  if (rng <= 0xFFFFFFFFULL) {
    if (rng == 0xFFFFFFFFULL) return NextUint32();
    const uint32_t r32 = static_cast<uint32_t>(rng), excl = r32 + 1;
    uint64_t m = static_cast<uint64_t>(NextUint32()) * excl;
    uint32_t left = static_cast<uint32_t>(m);
    if (left < excl) {
      const uint32_t threshold = (0xFFFFFFFFu - r32) % excl;
      while (left < threshold) {
        m = static_cast<uint64_t>(NextUint32()) * excl;
        left = static_cast<uint32_t>(m);
      }
    }
    return static_cast<int64_t>(m >> 32);
  }
  const uint64_t excl = rng + 1;
  u128 m = static_cast<u128>(NextUint64()) * excl;
  uint64_t left = static_cast<uint64_t>(m);
  if (left < excl) {
    const uint64_t threshold = (std::numeric_limits<uint64_t>::max() - rng) % excl;
    while (left < threshold) {
      m = static_cast<u128>(NextUint64()) * excl;
      left = static_cast<uint64_t>(m);
    }
  }
  return static_cast<int64_t>(m >> 64);
}

// ----------------------------------------------------------------------------- constants

std::vector<std::vector<std::vector<int64_t>>> EngramPrimes(int num_layers, int max_ngram,
                                                            int n_heads,
                                                            int64_t engram_vocab_size) {
  std::unordered_set<int64_t> seen;
  std::vector<std::vector<std::vector<int64_t>>> out;
  for (int l = 0; l < num_layers; ++l) {
    std::vector<std::vector<int64_t>> per_ngram;
    for (int n = 0; n < max_ngram - 1; ++n) {
      int64_t cur = engram_vocab_size - 1;
      std::vector<int64_t> sizes;
      for (int h = 0; h < n_heads; ++h) {
        ++cur;
        while (!IsPrime(cur) || seen.contains(cur)) ++cur;
        seen.insert(cur);
        sizes.push_back(cur);
      }
      per_ngram.push_back(std::move(sizes));
    }
    out.push_back(std::move(per_ngram));
  }
  return out;
}

std::vector<int64_t> EngramMultipliers(int64_t layer_id, int max_ngram,
                                       int64_t compressed_vocab_size) {
  const int64_t bound =
      std::max<int64_t>(1, (std::numeric_limits<int64_t>::max() / compressed_vocab_size) / 2);
  NumpyPcg64 rng(static_cast<uint64_t>(10007 * layer_id));
  std::vector<int64_t> m;
  for (int i = 0; i < max_ngram; ++i) m.push_back(rng.Integers(bound) * 2 + 1);
  return m;
}

std::string EngramNormalize(const std::string& text) {
  UErrorCode st = U_ZERO_ERROR;
  icu::UnicodeString u = icu::UnicodeString::fromUTF8(text);
  u = icu::Normalizer2::getNFKCInstance(st)->normalize(u, st);
  u = icu::Normalizer2::getNFDInstance(st)->normalize(u, st);
  icu::UnicodeString stripped;
  for (int32_t i = 0; i < u.length();) {
    const UChar32 c = u.char32At(i);
    i += U16_LENGTH(c);
    if (u_charType(c) != U_NON_SPACING_MARK) stripped.append(c);
  }
  stripped.toLower(icu::Locale::getRoot());
  // [ \t\r\n]+ -> " ".
  icu::UnicodeString collapsed;
  bool in_ws = false;
  for (int32_t i = 0; i < stripped.length();) {
    const UChar32 c = stripped.char32At(i);
    i += U16_LENGTH(c);
    const bool ws = c == ' ' || c == '\t' || c == '\r' || c == '\n';
    if (ws) {
      if (!in_ws) collapsed.append(static_cast<UChar32>(' '));
    } else {
      collapsed.append(c);
    }
    in_ws = ws;
  }
  if (collapsed == icu::UnicodeString(" ")) return " ";  // the lone-space sentinel survives Strip
  // Strip Unicode whitespace on both sides.
  int32_t b = 0, e = collapsed.length();
  while (b < e && u_isUWhiteSpace(collapsed.char32At(b))) b += U16_LENGTH(collapsed.char32At(b));
  while (e > b) {
    const int32_t prev = collapsed.moveIndex32(e, -1);
    if (!u_isUWhiteSpace(collapsed.char32At(prev))) break;
    e = prev;
  }
  return ToUtf8(collapsed.tempSubStringBetween(b, e));
}

std::vector<int32_t> BuildCompressedTokenMap(const Tokenizer& tokenizer, int64_t* num_classes) {
  std::unordered_map<std::string, int32_t> key_to_class;
  std::vector<int32_t> map(static_cast<size_t>(tokenizer.vocab_size()));
  for (int32_t id = 0; id < tokenizer.vocab_size(); ++id) {
    auto text = tokenizer.DecodeLossy(std::span<const int32_t>(&id, 1));
    const std::string decoded = text.ok() ? *text : std::string();
    std::string key;
    if (decoded.find("\xEF\xBF\xBD") != std::string::npos) {
      key = std::string(tokenizer.TokenString(id));
    } else {
      key = EngramNormalize(decoded);
      if (key.empty()) key = decoded;
    }
    auto [it, inserted] = key_to_class.try_emplace(key, static_cast<int32_t>(key_to_class.size()));
    map[static_cast<size_t>(id)] = it->second;
  }
  if (num_classes != nullptr) *num_classes = static_cast<int64_t>(key_to_class.size());
  return map;
}

absl::StatusOr<EngramConstants> ComputeEngramConstants(const json& tc,
                                                       std::vector<int32_t> token_map,
                                                       int64_t compressed_vocab_size) {
  for (const char* k : {"engram_layer_ids", "engram_max_ngram_size", "engram_vocab_size",
                        "engram_n_heads", "engram_pad_token_id"}) {
    if (!tc.contains(k))
      return absl::InvalidArgumentError(absl::StrCat("text_config lacks \"", k, "\""));
  }
  EngramConstants c;
  try {
    c.layer_ids = tc["engram_layer_ids"].get<std::vector<int32_t>>();
    c.max_ngram_size = tc["engram_max_ngram_size"].get<int32_t>();
    c.engram_vocab_size = tc["engram_vocab_size"].get<int64_t>();
    c.n_heads = tc["engram_n_heads"].get<int32_t>();
    const int32_t pad_token = tc["engram_pad_token_id"].get<int32_t>();
    if (pad_token < 0 || static_cast<size_t>(pad_token) >= token_map.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("engram_pad_token_id ", pad_token, " is outside the token map"));
    }
    if (c.max_ngram_size < 2 || c.n_heads < 1 || c.engram_vocab_size < 2 ||
        compressed_vocab_size < 1) {
      return absl::InvalidArgumentError("engram sizes must be positive (max_ngram >= 2)");
    }
    c.pad_id = token_map[static_cast<size_t>(pad_token)];
    c.compressed_vocab_size = compressed_vocab_size;
    if (tc.contains("engram_compressed_vocab_size") &&
        tc["engram_compressed_vocab_size"].get<int64_t>() != compressed_vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "engram_compressed_vocab_size is ", tc["engram_compressed_vocab_size"].get<int64_t>(),
          " but the token map has ", compressed_vocab_size, " classes"));
    }
    c.token_map = std::move(token_map);
    c.primes = EngramPrimes(static_cast<int>(c.layer_ids.size()), c.max_ngram_size, c.n_heads,
                            c.engram_vocab_size);
    for (size_t l = 0; l < c.layer_ids.size(); ++l) {
      c.multipliers.push_back(
          EngramMultipliers(c.layer_ids[l], c.max_ngram_size, compressed_vocab_size));
      int64_t off = 0;
      std::vector<std::vector<int64_t>> offs;
      for (const auto& per_head : c.primes[l]) {
        std::vector<int64_t> o;
        for (int64_t p : per_head) {
          o.push_back(off);
          off += p;
        }
        offs.push_back(std::move(o));
      }
      c.offsets.push_back(std::move(offs));
      c.num_embeddings.push_back(off);
    }
    if (tc.contains("engram_num_embeddings")) {
      const auto cfg = tc["engram_num_embeddings"].get<std::vector<int64_t>>();
      if (cfg != c.num_embeddings) {
        return absl::InvalidArgumentError(absl::StrCat("engram_num_embeddings ", json(cfg).dump(),
                                                       " disagrees with the primes (",
                                                       json(c.num_embeddings).dump(), ")"));
      }
    }
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("engram config field has the wrong type: ", e.what()));
  }
  return c;
}

json EngramConstants::ToJson() const {
  json j;
  j["max_ngram_size"] = max_ngram_size;
  j["n_heads"] = n_heads;
  j["engram_vocab_size"] = engram_vocab_size;
  j["compressed_vocab_size"] = compressed_vocab_size;
  j["pad_id"] = pad_id;
  j["layer_ids"] = layer_ids;
  j["multipliers"] = multipliers;
  j["primes"] = primes;
  j["offsets"] = offsets;
  j["num_embeddings"] = num_embeddings;
  j["token_map"] = token_map;
  return j;
}

absl::StatusOr<EngramConstants> EngramConstants::FromJson(const json& j) {
  EngramConstants c;
  try {
    c.max_ngram_size = j.at("max_ngram_size").get<int32_t>();
    c.n_heads = j.at("n_heads").get<int32_t>();
    c.engram_vocab_size = j.at("engram_vocab_size").get<int64_t>();
    c.compressed_vocab_size = j.at("compressed_vocab_size").get<int64_t>();
    c.pad_id = j.at("pad_id").get<int32_t>();
    c.layer_ids = j.at("layer_ids").get<std::vector<int32_t>>();
    c.multipliers = j.at("multipliers").get<std::vector<std::vector<int64_t>>>();
    c.primes = j.at("primes").get<std::vector<std::vector<std::vector<int64_t>>>>();
    c.offsets = j.at("offsets").get<std::vector<std::vector<std::vector<int64_t>>>>();
    c.num_embeddings = j.at("num_embeddings").get<std::vector<int64_t>>();
    c.token_map = j.at("token_map").get<std::vector<int32_t>>();
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("engram constants JSON: ", e.what()));
  }
  const size_t n = c.layer_ids.size();
  if (c.multipliers.size() != n || c.primes.size() != n || c.offsets.size() != n ||
      c.num_embeddings.size() != n) {
    return absl::InvalidArgumentError(
        "engram constants JSON: per-layer arrays differ in length from layer_ids");
  }
  for (size_t l = 0; l < n; ++l) {
    if (c.multipliers[l].size() != static_cast<size_t>(c.max_ngram_size) ||
        c.primes[l].size() != static_cast<size_t>(c.max_ngram_size - 1) ||
        c.offsets[l].size() != c.primes[l].size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("engram constants JSON: layer ", l, " has wrong array sizes"));
    }
    for (size_t g = 0; g < c.primes[l].size(); ++g) {
      if (c.primes[l][g].size() != static_cast<size_t>(c.n_heads) ||
          c.offsets[l][g].size() != c.primes[l][g].size()) {
        return absl::InvalidArgumentError(
            absl::StrCat("engram constants JSON: layer ", l, " needs ", c.n_heads, " heads"));
      }
    }
  }
  for (int32_t t : c.token_map) {
    if (t < 0 || t >= c.compressed_vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("engram constants JSON: token_map value ", t, " out of range"));
    }
  }
  return c;
}

absl::Status EngramConstants::Save(const std::string& path) const {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  out << ToJson().dump() << "\n";
  if (!out) return absl::InternalError(absl::StrCat("write failed: ", path));
  return absl::OkStatus();
}

absl::StatusOr<EngramConstants> EngramConstants::Load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    return absl::NotFoundError(absl::StrCat("engram constants file ", path, " cannot be opened"));
  std::stringstream ss;
  ss << in.rdbuf();
  json j = json::parse(ss.str(), nullptr, false);
  if (j.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(path, " is not valid JSON"));
  auto c = FromJson(j);
  if (!c.ok())
    return absl::Status(c.status().code(), absl::StrCat(path, ": ", c.status().message()));
  return c;
}

}  // namespace epd::model
